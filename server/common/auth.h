#pragma once
// Access control for TCP listeners (docs/ARCHITECTURE.md "Security and state"):
// a shared token carried in request metadata, and TLS server credentials from
// PEM files.
//
// Token: a client sends either `authorization: Bearer <token>` or
// `x-muond-token: <token>`. With an empty configured token every request is
// accepted (Unix sockets rely on the 0600 socket in a private directory).
#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace muond {

// PublishManifest metadata between muond and muond-coordinator: the daemon's
// registration id (request; new for every RegisterParams, repeated when it
// re-publishes after a coordinator restart) and the lowest plan version of
// that registration's round (the response's trailing metadata).
inline constexpr char kRegistrationMetadata[] = "x-muond-registration";
inline constexpr char kRoundPlanVersionMetadata[] =
    "x-muond-round-plan-version";

inline constexpr char kTokenMetadataKey[] = "x-muond-token";

// OK when `expected` is empty or the request carries it (compared in
// constant time); UNAUTHENTICATED naming the metadata keys otherwise.
grpc::Status CheckToken(const grpc::ServerContext& context,
                        const std::string& expected);

// The token a request carries ('x-muond-token', else the Bearer value of
// 'authorization'); empty when none.
std::string PresentedToken(const grpc::ServerContext& context);

// The one home for reading a token file (--token_file of muond,
// muond-coordinator and muonctl). Prefer it to --token: a command line is
// visible to every user in `ps` and /proc/<pid>/cmdline, a 0600 file is not.
// The file is read once; surrounding whitespace (a trailing newline) is
// dropped. InvalidArgument naming `flag` and the path: not a regular file,
// readable or writable by others (chmod 600; the rule of every secret file,
// the TLS private key's too), larger than kMaxTokenBytes, empty, or holding
// a token CheckTokenText refuses. NotFound: cannot be opened. Group-readable
// files are accepted with a warning (a group may be the job's own service
// account).
inline constexpr size_t kMaxTokenBytes = 4096;
absl::StatusOr<std::string> ReadTokenFile(const std::string& path,
                                          const std::string& flag);

// A token's text, wherever it comes from: at most kMaxTokenBytes of
// printable ASCII without spaces (it travels as gRPC metadata).
// InvalidArgument naming `where`.
absl::Status CheckTokenText(const std::string& where, const std::string& token);

// The token given as `--token` (`token`, checked by CheckTokenText) or
// `--token_file` (`token_file`): at most one of them; empty when neither.
// InvalidArgument when both.
absl::StatusOr<std::string> TokenFromFlags(const std::string& token,
                                           const std::string& token_file);

// Adds `token` (when non-empty) to an outgoing call.
void AttachToken(grpc::ClientContext* context, const std::string& token);

// TLS credentials from PEM files when both paths are set, insecure ones when
// both are empty. InvalidArgument naming the flags when only one is set, the
// certificate does not parse, the key file breaks the secret-file rule
// (ReadTokenFile's: not readable by others) or holds no key, or the key is
// not the certificate's; NotFound naming a file that cannot be read.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentials(
    const std::string& cert_path, const std::string& key_path);

// Client-side: TLS with `root_cert_path` (PEM, given as `flag`, e.g.
// "--coordinator_tls_ca") when set, else insecure. NotFound / InvalidArgument
// naming `flag` and the path when it cannot be read or holds no certificate
// that parses.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentials(
    const std::string& root_cert_path, const std::string& flag);

}  // namespace muond
