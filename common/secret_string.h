// SecretString: a std::string for secret key text, whose characters are
// overwritten with zeros before its memory goes back (destroyed, assigned
// over, or emptied by Wipe), so that a freed copy of a key is not left in
// the heap for a core dump or a later reader of the memory.
//
// It is a std::string (every reader of one takes it); only its own
// assignments and its destructor wipe. Grow one with append or += and the
// storage it outgrows is freed unwiped: give it the whole text at once. A
// copy into a plain std::string (or a move out of it into one) is not wiped
// either: keep secrets in SecretStrings.
//
//   SecretString secret(text_from_file);  // ... used, then destroyed: wiped
#ifndef TESSERA_COMMON_SECRET_STRING_H_
#define TESSERA_COMMON_SECRET_STRING_H_

#include <cstddef>
#include <string>
#include <string_view>
#include <utility>

namespace tessera {

// Overwrites every character `s` can hold (its capacity, not only its size)
// with zeros and leaves it empty.
void WipeString(std::string* s);
// Overwrites `n` bytes at `p` with zeros (not optimised away).
void WipeBytes(void* p, size_t n);

class SecretString : public std::string {
 public:
  SecretString() = default;
  explicit SecretString(std::string_view text) : std::string(text) {}
  SecretString(const char* text, size_t n) : std::string(text, n) {}
  // Takes the string's storage (absl::StrCat's result, say) and wipes what
  // a short one leaves behind in `text`.
  explicit SecretString(std::string&& text) : std::string(std::move(text)) {
    WipeString(&text);
  }
  SecretString(const SecretString&) = default;
  // A short moved-from string keeps its characters in place: wiped here.
  SecretString(SecretString&& other) noexcept : std::string(std::move(other)) {
    other.Wipe();
  }
  SecretString& operator=(const SecretString& other) {
    if (this != &other) {
      Wipe();
      std::string::operator=(other);
    }
    return *this;
  }
  SecretString& operator=(SecretString&& other) noexcept {
    if (this != &other) {
      Wipe();
      std::string::operator=(std::move(other));
      other.Wipe();
    }
    return *this;
  }
  SecretString& operator=(std::string_view text) {
    Wipe();
    std::string::assign(text);
    return *this;
  }
  // Takes the string's storage, and wipes what a short one leaves in it.
  SecretString& operator=(std::string&& text) {
    Wipe();
    std::string::operator=(std::move(text));
    WipeString(&text);
    return *this;
  }
  ~SecretString() { Wipe(); }

  void Wipe() { WipeString(this); }
};

}  // namespace tessera

#endif  // TESSERA_COMMON_SECRET_STRING_H_
