#include "server/common/operator_id.h"

#include <openssl/evp.h>
#include <openssl/hmac.h>

#include <cstring>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace muond {

std::string OperatorClientId(absl::string_view token) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int size = 0;
  // An empty key is a valid HMAC key (the tokenless daemon's public id).
  static const unsigned char kNoKey = 0;
  HMAC(EVP_sha256(),
       token.empty() ? &kNoKey : reinterpret_cast<const void*>(token.data()),
       int(token.size()),
       reinterpret_cast<const unsigned char*>(kOperatorIdLabel),
       std::strlen(kOperatorIdLabel), digest, &size);
  return absl::StrCat(kOperatorIdPrefix,
                      absl::BytesToHexString(absl::string_view(
                          reinterpret_cast<const char*>(digest), size)));
}

}  // namespace muond
