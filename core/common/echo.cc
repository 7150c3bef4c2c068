#include "core/common/echo.h"

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace muond {

std::string Echo(std::string_view text) {
  if (text.size() <= kMaxEchoBytes) {
    return absl::Utf8SafeCEscape(absl::string_view(text.data(), text.size()));
  }
  size_t cut = kMaxEchoBytes;
  // Back up over UTF-8 continuation bytes (10xxxxxx): never split a
  // character.
  while (cut > 0 && (static_cast<unsigned char>(text[cut]) & 0xC0) == 0x80) {
    --cut;
  }
  return absl::StrCat(
      absl::Utf8SafeCEscape(absl::string_view(text.data(), cut)), "...(",
      text.size(), " bytes)");
}

}  // namespace muond
