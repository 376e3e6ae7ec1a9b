// Helpers for propagating absl::Status.
//
//   TESSERA_RETURN_IF_ERROR(DoThing());
//   TESSERA_ASSIGN_OR_RETURN(auto value, ComputeValue());
#ifndef TESSERA_COMMON_STATUS_MACROS_H_
#define TESSERA_COMMON_STATUS_MACROS_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define TESSERA_RETURN_IF_ERROR(expr)                  \
  do {                                                 \
    const ::absl::Status _tessera_status = (expr);     \
    if (!_tessera_status.ok()) return _tessera_status; \
  } while (0)

#define TESSERA_STATUS_CONCAT_INNER(a, b) a##b
#define TESSERA_STATUS_CONCAT(a, b) TESSERA_STATUS_CONCAT_INNER(a, b)

#define TESSERA_ASSIGN_OR_RETURN(lhs, expr)                                    \
  TESSERA_ASSIGN_OR_RETURN_IMPL(TESSERA_STATUS_CONCAT(_tessera_or_, __LINE__), \
                                lhs, expr)

#define TESSERA_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                                  \
  if (!tmp.ok()) return std::move(tmp).status();      \
  lhs = std::move(tmp).value()

#endif  // TESSERA_COMMON_STATUS_MACROS_H_
