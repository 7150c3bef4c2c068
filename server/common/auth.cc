#include "server/common/auth.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

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

absl::StatusOr<std::string> ReadPem(const std::string& path, const char* flag) {
  std::ifstream in(path);
  if (!in) {
    return absl::NotFoundError(
        absl::StrCat(flag, ": cannot read '", path, "'"));
  }
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
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

absl::StatusOr<std::string> ReadTokenFile(const std::string& path,
                                          const std::string& flag) {
  const std::string where = absl::StrCat(flag, "='", path, "'");
  // O_NONBLOCK: a FIFO planted at the path must not block the open.
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    return absl::NotFoundError(
        absl::StrCat(where, ": cannot open: ", std::strerror(errno)));
  }
  absl::Cleanup close_fd = [fd] { close(fd); };
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": not a regular file"));
  }
  if (st.st_mode & (S_IROTH | S_IWOTH)) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": readable or writable by other users (mode ",
        absl::StrFormat("%04o", st.st_mode & 07777), "); chmod 600 it"));
  }
  if (st.st_mode & S_IRGRP) {
    LOG(WARNING) << where << " is group-readable; chmod 600 keeps the token "
                 << "to its owner";
  }
  if (st.st_size > off_t(kMaxTokenBytes)) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": ", st.st_size, " bytes, more than ", kMaxTokenBytes));
  }
  std::string content(kMaxTokenBytes + 1, '\0');
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
  const std::string token(absl::StripAsciiWhitespace(content));
  if (got > kMaxTokenBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": more than ", kMaxTokenBytes, " bytes"));
  }
  if (token.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": the file is empty; it must hold the token"));
  }
  for (char c : token) {
    if (c < 0x21 || c > 0x7e) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": the token must be printable ASCII without spaces"));
    }
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
  if (token_file.empty()) return token;
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
  absl::StatusOr<std::string> cert = ReadPem(cert_path, "--tls_cert");
  if (!cert.ok()) return cert.status();
  absl::StatusOr<std::string> key = ReadPem(key_path, "--tls_key");
  if (!key.ok()) return key.status();
  grpc::SslServerCredentialsOptions options;
  options.pem_key_cert_pairs.push_back({*key, *cert});
  return grpc::SslServerCredentials(options);
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentials(
    const std::string& root_cert_path) {
  if (root_cert_path.empty()) return grpc::InsecureChannelCredentials();
  absl::StatusOr<std::string> root = ReadPem(root_cert_path, "--tls_ca");
  if (!root.ok()) return root.status();
  grpc::SslCredentialsOptions options;
  options.pem_root_certs = *root;
  return grpc::SslCredentials(options);
}

}  // namespace muond
