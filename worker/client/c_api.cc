// The C API (include/tessera/c_api.h) over tessera::KVWorker and the 2-bit
// codec.
#include "tessera/c_api.h"

#include <memory>
#include <string>

#include "common/compression/two_bit.h"
#include "tessera/kv_worker.h"

struct TesseraKV {
  std::unique_ptr<tessera::KVWorker> worker;
};

struct TesseraPulled {
  tessera::PulledValue value;
};

// The codes c_api.h promises are absl::StatusCode's.
static_assert(TESSERA_OK == static_cast<int>(absl::StatusCode::kOk));
static_assert(TESSERA_CANCELLED ==
              static_cast<int>(absl::StatusCode::kCancelled));
static_assert(TESSERA_UNKNOWN == static_cast<int>(absl::StatusCode::kUnknown));
static_assert(TESSERA_INVALID_ARGUMENT ==
              static_cast<int>(absl::StatusCode::kInvalidArgument));
static_assert(TESSERA_DEADLINE_EXCEEDED ==
              static_cast<int>(absl::StatusCode::kDeadlineExceeded));
static_assert(TESSERA_NOT_FOUND ==
              static_cast<int>(absl::StatusCode::kNotFound));
static_assert(TESSERA_ALREADY_EXISTS ==
              static_cast<int>(absl::StatusCode::kAlreadyExists));
static_assert(TESSERA_PERMISSION_DENIED ==
              static_cast<int>(absl::StatusCode::kPermissionDenied));
static_assert(TESSERA_RESOURCE_EXHAUSTED ==
              static_cast<int>(absl::StatusCode::kResourceExhausted));
static_assert(TESSERA_FAILED_PRECONDITION ==
              static_cast<int>(absl::StatusCode::kFailedPrecondition));
static_assert(TESSERA_ABORTED == static_cast<int>(absl::StatusCode::kAborted));
static_assert(TESSERA_OUT_OF_RANGE ==
              static_cast<int>(absl::StatusCode::kOutOfRange));
static_assert(TESSERA_UNIMPLEMENTED ==
              static_cast<int>(absl::StatusCode::kUnimplemented));
static_assert(TESSERA_INTERNAL ==
              static_cast<int>(absl::StatusCode::kInternal));
static_assert(TESSERA_UNAVAILABLE ==
              static_cast<int>(absl::StatusCode::kUnavailable));
static_assert(TESSERA_DATA_LOSS ==
              static_cast<int>(absl::StatusCode::kDataLoss));
static_assert(TESSERA_UNAUTHENTICATED ==
              static_cast<int>(absl::StatusCode::kUnauthenticated));

namespace {

thread_local std::string last_error;

// Records the failure for tessera_last_error and returns its code.
int Fail(const absl::Status& status) {
  last_error = std::string(absl::StatusCodeToString(status.code())) + ": " +
               std::string(status.message());
  const int code = static_cast<int>(status.code());
  return code != TESSERA_OK ? code : TESSERA_UNKNOWN;  // never 0 on failure
}

int Result(const absl::Status& status) {
  return status.ok() ? 0 : Fail(status);
}

int Started(const absl::StatusOr<tessera::OpHandle>& op, uint64_t* handle) {
  if (!op.ok()) return Fail(op.status());
  *handle = *op;
  return 0;
}

int NullArgument(const char* what) {
  return Fail(absl::InvalidArgumentError(std::string(what) + " is NULL"));
}

// The values num_ids rows of a row-sparse key hold (the C calls take no
// length: the key's row length sets it).
absl::StatusOr<size_t> RowValues(TesseraKV* kv, uint64_t key, size_t num_ids) {
  absl::StatusOr<uint64_t> row_length = kv->worker->RowLength(key);
  if (!row_length.ok()) return row_length.status();
  return num_ids * *row_length;
}

}  // namespace

extern "C" {

const char* tessera_version(void) { return TESSERA_VERSION_STRING; }

int tessera_kv_create(const char* type, TesseraKV** out) {
  if (type == nullptr) return NullArgument("type");
  if (out == nullptr) return NullArgument("out");
  absl::StatusOr<std::unique_ptr<tessera::KVWorker>> worker =
      tessera::KVWorker::Create(type);
  if (!worker.ok()) return Fail(worker.status());
  *out = new TesseraKV{*std::move(worker)};
  return 0;
}

int tessera_kv_rank(const TesseraKV* kv, int* rank) {
  if (kv == nullptr) return NullArgument("kv");
  if (rank == nullptr) return NullArgument("rank");
  *rank = kv->worker->rank();
  return 0;
}

int tessera_kv_num_workers(const TesseraKV* kv, int* num_workers) {
  if (kv == nullptr) return NullArgument("kv");
  if (num_workers == nullptr) return NullArgument("num_workers");
  *num_workers = kv->worker->num_workers();
  return 0;
}

int tessera_kv_num_servers(const TesseraKV* kv, int* num_servers) {
  if (kv == nullptr) return NullArgument("kv");
  if (num_servers == nullptr) return NullArgument("num_servers");
  *num_servers = kv->worker->num_servers();
  return 0;
}

int tessera_kv_resume_round(TesseraKV* kv, uint64_t* round) {
  if (kv == nullptr) return NullArgument("kv");
  if (round == nullptr) return NullArgument("round");
  *round = kv->worker->ResumeRound();
  return 0;
}

int tessera_kv_init(TesseraKV* kv, uint64_t key, const float* value,
                    size_t len) {
  if (kv == nullptr) return NullArgument("kv");
  if (value == nullptr && len > 0) return NullArgument("value");
  return Result(kv->worker->Init(key, absl::MakeConstSpan(value, len)));
}

int tessera_kv_push(TesseraKV* kv, uint64_t key, const float* grad,
                    size_t len) {
  if (kv == nullptr) return NullArgument("kv");
  if (grad == nullptr && len > 0) return NullArgument("grad");
  return Result(kv->worker->Push(key, absl::MakeConstSpan(grad, len)));
}

int tessera_kv_pull(TesseraKV* kv, uint64_t key, float* out, size_t len) {
  if (kv == nullptr) return NullArgument("kv");
  if (out == nullptr && len > 0) return NullArgument("out");
  return Result(kv->worker->Pull(key, absl::MakeSpan(out, len)));
}

int tessera_kv_pull_view(TesseraKV* kv, uint64_t key, TesseraPulled** out) {
  if (kv == nullptr) return NullArgument("kv");
  if (out == nullptr) return NullArgument("out");
  absl::StatusOr<tessera::PulledValue> value = kv->worker->PullView(key);
  if (!value.ok()) return Fail(value.status());
  *out = new TesseraPulled{*std::move(value)};
  return 0;
}

size_t tessera_pulled_size(const TesseraPulled* pulled) {
  return pulled == nullptr ? 0 : pulled->value.size();
}

size_t tessera_pulled_num_parts(const TesseraPulled* pulled) {
  return pulled == nullptr ? 0 : pulled->value.num_parts();
}

const float* tessera_pulled_part(const TesseraPulled* pulled, size_t i,
                                 size_t* offset, size_t* len) {
  if (pulled == nullptr || i >= pulled->value.num_parts()) return nullptr;
  absl::Span<const float> part = pulled->value.part(i);
  if (offset != nullptr) *offset = pulled->value.offset(i);
  if (len != nullptr) *len = part.size();
  return part.data();
}

void tessera_pulled_free(TesseraPulled* pulled) { delete pulled; }

int tessera_kv_pushpull(TesseraKV* kv, uint64_t key, const float* grad,
                        float* out, size_t len) {
  if (kv == nullptr) return NullArgument("kv");
  if ((grad == nullptr || out == nullptr) && len > 0)
    return NullArgument("grad or out");
  return Result(kv->worker->PushPull(key, absl::MakeConstSpan(grad, len),
                                     absl::MakeSpan(out, len)));
}

int tessera_kv_push_async(TesseraKV* kv, uint64_t key, const float* grad,
                          size_t len, uint64_t* handle) {
  if (kv == nullptr) return NullArgument("kv");
  if (grad == nullptr && len > 0) return NullArgument("grad");
  if (handle == nullptr) return NullArgument("handle");
  return Started(kv->worker->PushAsync(key, absl::MakeConstSpan(grad, len)),
                 handle);
}

int tessera_kv_pull_async(TesseraKV* kv, uint64_t key, float* out, size_t len,
                          uint64_t* handle) {
  if (kv == nullptr) return NullArgument("kv");
  if (out == nullptr && len > 0) return NullArgument("out");
  if (handle == nullptr) return NullArgument("handle");
  return Started(kv->worker->PullAsync(key, absl::MakeSpan(out, len)), handle);
}

int tessera_kv_pushpull_async(TesseraKV* kv, uint64_t key, const float* grad,
                              float* out, size_t len, uint64_t* handle) {
  if (kv == nullptr) return NullArgument("kv");
  if ((grad == nullptr || out == nullptr) && len > 0)
    return NullArgument("grad or out");
  if (handle == nullptr) return NullArgument("handle");
  return Started(kv->worker->PushPullAsync(key, absl::MakeConstSpan(grad, len),
                                           absl::MakeSpan(out, len)),
                 handle);
}

int tessera_kv_wait(TesseraKV* kv, uint64_t handle) {
  if (kv == nullptr) return NullArgument("kv");
  return Result(kv->worker->Wait(handle));
}

int tessera_kv_barrier(TesseraKV* kv) {
  if (kv == nullptr) return NullArgument("kv");
  return Result(kv->worker->Barrier());
}

int tessera_kv_set_optimizer(TesseraKV* kv, const char* spec) {
  if (kv == nullptr) return NullArgument("kv");
  if (spec == nullptr) return NullArgument("spec");
  return Result(kv->worker->SetOptimizer(spec));
}

int tessera_kv_set_staleness(TesseraKV* kv, int64_t staleness) {
  if (kv == nullptr) return NullArgument("kv");
  return Result(kv->worker->SetStaleness(staleness));
}

int tessera_kv_set_priority(TesseraKV* kv, uint64_t key, int64_t priority) {
  if (kv == nullptr) return NullArgument("kv");
  return Result(kv->worker->SetPriority(key, priority));
}

int tessera_kv_priority(TesseraKV* kv, uint64_t key, int64_t* priority) {
  if (kv == nullptr) return NullArgument("kv");
  if (priority == nullptr) return NullArgument("priority");
  absl::StatusOr<int64_t> p = kv->worker->Priority(key);
  if (p.ok()) *priority = *p;
  return Result(p.status());
}

int tessera_kv_set_gradient_compression(TesseraKV* kv, const char* type,
                                        float threshold) {
  if (kv == nullptr) return NullArgument("kv");
  if (type == nullptr) return NullArgument("type");
  return Result(kv->worker->SetGradientCompression(type, threshold));
}

int tessera_kv_set_pull_compression(TesseraKV* kv, const char* type) {
  if (kv == nullptr) return NullArgument("kv");
  if (type == nullptr) return NullArgument("type");
  return Result(kv->worker->SetPullCompression(type));
}

int tessera_kv_init_rows(TesseraKV* kv, uint64_t key, const float* value,
                         size_t num_rows, size_t row_length) {
  if (kv == nullptr) return NullArgument("kv");
  return Result(kv->worker->InitRows(key, value, num_rows, row_length));
}

int tessera_kv_init_hashed(TesseraKV* kv, uint64_t key, size_t row_length,
                           const char* options) {
  if (kv == nullptr) return NullArgument("kv");
  if (options == nullptr) return NullArgument("options");
  return Result(kv->worker->InitHashed(key, row_length, options));
}

int tessera_kv_push_rows(TesseraKV* kv, uint64_t key, const uint64_t* row_ids,
                         size_t num_ids, const float* rows) {
  if (kv == nullptr) return NullArgument("kv");
  if (num_ids > 0 && (row_ids == nullptr || rows == nullptr))
    return NullArgument(row_ids == nullptr ? "row_ids" : "rows");
  // The row length is the key's: the span below is checked against it.
  absl::StatusOr<size_t> values = RowValues(kv, key, num_ids);
  if (!values.ok()) return Fail(values.status());
  return Result(kv->worker->PushRows(key, absl::MakeConstSpan(row_ids, num_ids),
                                     absl::MakeConstSpan(rows, *values)));
}

int tessera_kv_pull_rows(TesseraKV* kv, uint64_t key, const uint64_t* row_ids,
                         size_t num_ids, float* out) {
  if (kv == nullptr) return NullArgument("kv");
  if (num_ids > 0 && (row_ids == nullptr || out == nullptr))
    return NullArgument(row_ids == nullptr ? "row_ids" : "out");
  absl::StatusOr<size_t> values = RowValues(kv, key, num_ids);
  if (!values.ok()) return Fail(values.status());
  return Result(kv->worker->PullRows(key, absl::MakeConstSpan(row_ids, num_ids),
                                     absl::MakeSpan(out, *values)));
}

int tessera_kv_close(TesseraKV* kv) {
  if (kv == nullptr) return NullArgument("kv");
  const absl::Status status = kv->worker->Close();
  delete kv;
  return Result(status);
}

int tessera_kv_leave(TesseraKV* kv) {
  if (kv == nullptr) return NullArgument("kv");
  const absl::Status status = kv->worker->Leave();
  delete kv;
  return Result(status);
}

const char* tessera_last_error(void) { return last_error.c_str(); }

size_t tessera_2bit_compressed_bytes(size_t len) {
  return tessera::compression::TwoBitCompressedBytes(len);
}

int tessera_2bit_quantize(const float* grad, float* residual, size_t len,
                          float threshold, uint8_t* out) {
  return Result(tessera::compression::TwoBitQuantize(grad, residual, len,
                                                     threshold, out));
}

int tessera_2bit_dequantize(const uint8_t* in, size_t len, float threshold,
                            float* out) {
  if (in == nullptr && len > 0) return NullArgument("in");
  return Result(tessera::compression::TwoBitDequantize(
      in, tessera::compression::TwoBitCompressedBytes(len), len, threshold,
      out));
}

}  // extern "C"
