#include "server/common/auth.h"

#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace muond {
namespace {

bool ConstantTimeEqual(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= a[i] ^ b[i];
  return diff == 0;
}

absl::StatusOr<std::string> ReadPem(const std::string& path,
                                    const char* flag) {
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
