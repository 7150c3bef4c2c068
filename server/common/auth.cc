#include "server/common/auth.h"

#include <fcntl.h>
#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "glog/logging.h"

namespace muond {
namespace {

bool ConstantTimeEqual(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= a[i] ^ b[i];
  return diff == 0;
}

// gRPC takes PEM text and says nothing useful when it does not parse ("empty
// address list", "is the port in use?"): OpenSSL, which gRPC links, checks
// it first.
int CountPemCertificates(const std::string& pem) {
  BIO* bio = BIO_new_mem_buf(pem.data(), int(pem.size()));
  if (bio == nullptr) return 0;
  int count = 0;
  while (X509* cert = PEM_read_bio_X509(bio, nullptr, nullptr, nullptr)) {
    X509_free(cert);
    ++count;
  }
  BIO_free(bio);
  ERR_clear_error();  // the end of the buffer reads as an error
  return count;
}

// OK when `key_pem` parses and is the private key of `cert_pem`'s first
// certificate.
absl::Status CheckKeyMatchesCertificate(const std::string& cert_pem,
                                        const std::string& key_pem) {
  BIO* cert_bio = BIO_new_mem_buf(cert_pem.data(), int(cert_pem.size()));
  BIO* key_bio = BIO_new_mem_buf(key_pem.data(), int(key_pem.size()));
  X509* cert = cert_bio == nullptr
                   ? nullptr
                   : PEM_read_bio_X509(cert_bio, nullptr, nullptr, nullptr);
  EVP_PKEY* key = key_bio == nullptr ? nullptr
                                     : PEM_read_bio_PrivateKey(
                                           key_bio, nullptr, nullptr, nullptr);
  absl::Status st = absl::OkStatus();
  if (key == nullptr) {
    st = absl::InvalidArgumentError(
        "the private key does not parse (an encrypted key is not supported)");
  } else if (cert == nullptr || X509_check_private_key(cert, key) != 1) {
    st = absl::InvalidArgumentError(
        "the key is not the certificate's private key (a cert/key pair "
        "that does not match)");
  }
  EVP_PKEY_free(key);
  X509_free(cert);
  BIO_free(key_bio);
  BIO_free(cert_bio);
  ERR_clear_error();
  return st;
}

// Opens `path` for reading a secret (a token or a private key): a regular
// file that other users can neither read nor write. Group-readable is
// accepted with a warning (a group may be the job's own service account).
// The fd is owned by the caller.
absl::StatusOr<int> OpenSecretFile(const std::string& path,
                                   const std::string& where) {
  // O_NONBLOCK: a FIFO planted at the path must not block the open.
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    return absl::NotFoundError(
        absl::StrCat(where, ": cannot open: ", std::strerror(errno)));
  }
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    close(fd);
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": not a regular file"));
  }
  if (st.st_mode & (S_IROTH | S_IWOTH)) {
    close(fd);
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": readable or writable by other users (mode ",
        absl::StrFormat("%04o", st.st_mode & 07777), "); chmod 600 it"));
  }
  if (st.st_mode & S_IRGRP) {
    LOG(WARNING) << where << " is group-readable; chmod 600 keeps it to its "
                 << "owner";
  }
  return fd;
}

// Up to `limit` + 1 bytes of `fd` (one more than allowed shows it is too
// long).
absl::StatusOr<std::string> ReadAtMost(int fd, size_t limit,
                                       const std::string& where) {
  std::string content(limit + 1, '\0');
  size_t got = 0;
  while (got < content.size()) {
    const ssize_t n = read(fd, content.data() + got, content.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": read failed: ", std::strerror(errno)));
    }
    if (n == 0) break;
    got += size_t(n);
  }
  content.resize(got);
  return content;
}

// PEM files are small: a certificate chain or a key fits in 1 MiB.
constexpr size_t kMaxPemBytes = size_t{1} << 20;

absl::StatusOr<std::string> ReadPublicPem(const std::string& path,
                                          const std::string& flag) {
  const std::string where = absl::StrCat(flag, "='", path, "'");
  std::ifstream in(path);
  if (!in) {
    return absl::NotFoundError(
        absl::StrCat(where, ": cannot read: ", std::strerror(errno)));
  }
  std::string pem(std::istreambuf_iterator<char>(in), {});
  if (!absl::StrContains(pem, "-----BEGIN CERTIFICATE-----")) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": holds no PEM certificate (-----BEGIN CERTIFICATE-----)"));
  }
  if (CountPemCertificates(pem) == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": its PEM certificate does not parse"));
  }
  return pem;
}

absl::StatusOr<std::string> ReadPrivateKeyPem(const std::string& path,
                                              const std::string& flag) {
  const std::string where = absl::StrCat(flag, "='", path, "'");
  absl::StatusOr<int> fd = OpenSecretFile(path, where);
  if (!fd.ok()) return fd.status();
  absl::Cleanup close_fd = [fd = *fd] { close(fd); };
  absl::StatusOr<std::string> pem = ReadAtMost(*fd, kMaxPemBytes, where);
  if (!pem.ok()) return pem.status();
  if (!absl::StrContains(*pem, "PRIVATE KEY-----")) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": holds no PEM private key"));
  }
  return pem;
}

}  // namespace

grpc::Status CheckToken(const grpc::ServerContext& context,
                        const std::string& expected) {
  if (expected.empty()) return grpc::Status::OK;
  const auto& md = context.client_metadata();
  for (auto it = md.lower_bound(kTokenMetadataKey); it != md.end(); ++it) {
    if (it->first != kTokenMetadataKey) break;
    if (ConstantTimeEqual({it->second.data(), it->second.size()}, expected))
      return grpc::Status::OK;
  }
  const std::string bearer = "Bearer " + expected;
  for (auto it = md.lower_bound("authorization"); it != md.end(); ++it) {
    if (it->first != "authorization") break;
    if (ConstantTimeEqual({it->second.data(), it->second.size()}, bearer))
      return grpc::Status::OK;
  }
  return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                      "missing or wrong token: send metadata 'authorization: "
                      "Bearer <token>' or 'x-muond-token: <token>'");
}

std::string PresentedToken(const grpc::ServerContext& context) {
  const auto& md = context.client_metadata();
  auto it = md.find(kTokenMetadataKey);
  if (it != md.end()) return std::string(it->second.data(), it->second.size());
  it = md.find("authorization");
  if (it != md.end()) {
    std::string value(it->second.data(), it->second.size());
    if (absl::StartsWith(value, "Bearer ")) return value.substr(7);
  }
  return "";
}

absl::Status CheckTokenText(const std::string& where,
                            const std::string& token) {
  if (token.size() > kMaxTokenBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": more than ", kMaxTokenBytes, " bytes"));
  }
  for (char c : token) {
    if (c < 0x21 || c > 0x7e) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": the token must be printable ASCII without spaces"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReadTokenFile(const std::string& path,
                                          const std::string& flag) {
  const std::string where = absl::StrCat(flag, "='", path, "'");
  absl::StatusOr<int> fd = OpenSecretFile(path, where);
  if (!fd.ok()) return fd.status();
  absl::Cleanup close_fd = [fd = *fd] { close(fd); };
  struct stat st;
  if (fstat(*fd, &st) == 0 && st.st_size > off_t(kMaxTokenBytes)) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": ", st.st_size, " bytes, more than ", kMaxTokenBytes));
  }
  absl::StatusOr<std::string> content = ReadAtMost(*fd, kMaxTokenBytes, where);
  if (!content.ok()) return content.status();
  if (content->size() > kMaxTokenBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": more than ", kMaxTokenBytes, " bytes"));
  }
  const std::string token(absl::StripAsciiWhitespace(*content));
  if (token.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": the file is empty; it must hold the token"));
  }
  if (absl::Status text = CheckTokenText(where, token); !text.ok()) {
    return text;
  }
  return token;
}

absl::StatusOr<std::string> TokenFromFlags(const std::string& token,
                                           const std::string& token_file) {
  if (!token.empty() && !token_file.empty()) {
    return absl::InvalidArgumentError(
        "--token and --token_file: give one of them (prefer --token_file: "
        "a command line is visible in ps)");
  }
  if (token_file.empty()) {
    // The rule of a token file's content: a command-line token travels in
    // the same metadata.
    if (absl::Status text = CheckTokenText("--token", token); !text.ok()) {
      return text;
    }
    return token;
  }
  return ReadTokenFile(token_file, "--token_file");
}

void AttachToken(grpc::ClientContext* context, const std::string& token) {
  if (!token.empty()) context->AddMetadata(kTokenMetadataKey, token);
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentials(
    const std::string& cert_path, const std::string& key_path) {
  if (cert_path.empty() && key_path.empty())
    return grpc::InsecureServerCredentials();
  if (cert_path.empty() || key_path.empty()) {
    return absl::InvalidArgumentError(
        "--tls_cert and --tls_key must be given together");
  }
  absl::StatusOr<std::string> cert = ReadPublicPem(cert_path, "--tls_cert");
  if (!cert.ok()) return cert.status();
  absl::StatusOr<std::string> key = ReadPrivateKeyPem(key_path, "--tls_key");
  if (!key.ok()) return key.status();
  if (absl::Status pair = CheckKeyMatchesCertificate(*cert, *key); !pair.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tls_cert='", cert_path, "' and --tls_key='", key_path,
                     "': ", pair.message()));
  }
  grpc::SslServerCredentialsOptions options;
  options.pem_key_cert_pairs.push_back({*key, *cert});
  return grpc::SslServerCredentials(options);
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentials(
    const std::string& root_cert_path, const std::string& flag) {
  if (root_cert_path.empty()) return grpc::InsecureChannelCredentials();
  absl::StatusOr<std::string> root = ReadPublicPem(root_cert_path, flag);
  if (!root.ok()) return root.status();
  grpc::SslCredentialsOptions options;
  options.pem_root_certs = *root;
  return grpc::SslCredentials(options);
}

}  // namespace muond
