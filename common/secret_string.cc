#include "common/secret_string.h"

#include <sodium.h>

namespace tessera {

void WipeBytes(void* p, size_t n) {
  if (n != 0) sodium_memzero(p, n);
}

void WipeString(std::string* s) {
  // resize writes the characters between size and capacity: all of them
  // are then the string's, and zeroed here.
  s->resize(s->capacity());
  WipeBytes(s->data(), s->size());
  s->clear();
}

}  // namespace tessera
