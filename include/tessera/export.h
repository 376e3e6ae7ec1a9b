/* TESSERA_EXPORT: marks what libtessera.so exports, its public C and C++ API.
 *
 * The library is built with hidden visibility (-fvisibility=hidden), so a
 * symbol is exported only when its declaration carries this macro:
 *
 *   TESSERA_EXPORT int tessera_kv_barrier(TesseraKV* kv);
 *   class TESSERA_EXPORT KVWorker { ... };
 *
 * Everything else in the library (Node, KVClient, RequestTracker, the protobuf
 * messages, the static libraries linked in) stays internal, so programs cannot
 * come to depend on it and it can change without breaking them.
 * tests/install/visibility_test.sh checks the list. C and C++.
 */
#ifndef TESSERA_EXPORT_H_
#define TESSERA_EXPORT_H_

#if defined(__GNUC__) || defined(__clang__)
#define TESSERA_EXPORT __attribute__((visibility("default")))
#else
#define TESSERA_EXPORT
#endif

#endif /* TESSERA_EXPORT_H_ */
