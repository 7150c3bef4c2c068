#include "server/common/metrics_http.h"

#include <arpa/inet.h>
#include <civetweb.h>
#include <dlfcn.h>
#include <pthread.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <mutex>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "glog/logging.h"

ABSL_FLAG(int, metrics_port, 0,
          "Serve Prometheus metrics (text format) on http://ADDRESS:PORT/"
          "metrics; 0 = off (the default). See --metrics_address");
ABSL_FLAG(std::string, metrics_address, "127.0.0.1",
          "IPv4 address the metrics endpoint binds to (with --metrics_port); "
          "0.0.0.0 lets a scraper on another host in");

// Debian's civetweb creates its threads with a fixed 100 KiB stack
// (pthread_attr_setstacksize(attr, 102400), a build-time setting). glibc puts
// the process's static TLS on every thread's stack and refuses a stack that
// cannot hold it (EINVAL): muond's libraries (cuBLASLt 94 KB, OpenBLAS 61 KB,
// glog 30 KB) need more than 100 KiB, so civetweb could not start a thread
// ("Cannot create threads"). The binary's definition interposes the one
// libc exports and raises a request below kMinThreadStackBytes to it: only
// virtual address space (the pages are committed as used), and a request at
// or above it passes unchanged.
namespace {
constexpr size_t kMinThreadStackBytes = size_t{1} << 20;
}  // namespace

extern "C" int pthread_attr_setstacksize(pthread_attr_t* attr, size_t size) {
  using SetStackSize = int (*)(pthread_attr_t*, size_t);
  static const SetStackSize libc_set = reinterpret_cast<SetStackSize>(
      dlsym(RTLD_NEXT, "pthread_attr_setstacksize"));
  if (libc_set == nullptr) return ENOSYS;
  return libc_set(attr, std::max(size, kMinThreadStackBytes));
}

namespace muond {
namespace {

// civetweb reports why a start failed only through its log callback, on
// the starting thread: Start collects those lines here.
thread_local std::string* start_log = nullptr;

int LogMessage(const mg_connection* /*conn*/, const char* message) {
  if (start_log != nullptr) {
    absl::StrAppend(start_log, start_log->empty() ? "" : "; ", message);
  } else {
    LOG(WARNING) << "metrics endpoint: " << message;
  }
  return 1;  // logged: civetweb prints nothing itself
}

void Respond(mg_connection* conn, int code, const char* reason,
             const char* content_type, const std::string& body,
             bool head_only) {
  mg_printf(conn,
            "HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %zu\r\n"
            "Connection: close\r\n\r\n",
            code, reason, content_type, body.size());
  if (!head_only) mg_write(conn, body.data(), body.size());
}

}  // namespace

int MetricsHttpServer::Handle(mg_connection* conn, void* self) {
  const mg_request_info* request = mg_get_request_info(conn);
  const bool get = std::strcmp(request->request_method, "GET") == 0;
  const bool head = std::strcmp(request->request_method, "HEAD") == 0;
  if (std::strcmp(request->local_uri, "/metrics") != 0) {
    Respond(conn, 404, "Not Found", "text/plain; charset=utf-8",
            "not found: the metrics are at /metrics\n", head);
    return 404;
  }
  if (!get && !head) {
    Respond(conn, 405, "Method Not Allowed", "text/plain; charset=utf-8",
            "only GET (and HEAD) /metrics\n", false);
    return 405;
  }
  const std::string body =
      static_cast<MetricsHttpServer*>(self)->registry_->Render();
  Respond(conn, 200, "OK", kMetricsContentType, body, head);
  return 200;
}

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(
    const std::string& address, int port, MetricsRegistry* registry) {
  in_addr parsed;
  if (inet_pton(AF_INET, address.c_str(), &parsed) != 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--metrics_address='", address,
        "' must be an IPv4 address (e.g. 127.0.0.1, or 0.0.0.0 for every "
        "interface)"));
  }
  if (port < 0 || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--metrics_port=", port, " must be in [1, 65535] (0 = off)"));
  }
  static std::once_flag library;
  std::call_once(library, [] { mg_init_library(0); });
  const std::string listening = absl::StrCat(address, ":", port);
  // Two threads: a scrape is one short request; a slow scraper cannot hold
  // more of the process than that.
  const char* options[] = {
      "listening_ports",    listening.c_str(), "num_threads", "2",
      "request_timeout_ms", "10000",           nullptr};
  mg_callbacks callbacks;
  std::memset(&callbacks, 0, sizeof(callbacks));
  callbacks.log_message = LogMessage;
  auto server =
      std::unique_ptr<MetricsHttpServer>(new MetricsHttpServer(registry));
  mg_init_data init = {&callbacks, server.get(), options};
  char error_text[256] = "";
  unsigned error_code = 0;
  mg_error_data error = {&error_code, error_text, sizeof(error_text)};
  std::string log;
  start_log = &log;
  server->context_ = mg_start2(&init, &error);
  start_log = nullptr;
  if (server->context_ == nullptr) {
    return absl::UnavailableError(absl::StrCat(
        "cannot serve metrics on ", listening,
        " (--metrics_address/--metrics_port): ",
        log.empty() ? std::string(error_text) : log,
        "; is the port in use, or the address not one of this host?"));
  }
  mg_set_request_handler(server->context_, "**", &MetricsHttpServer::Handle,
                         server.get());
  mg_server_port ports[1];
  if (mg_get_server_ports(server->context_, 1, ports) == 1) {
    server->port_ = ports[0].port;
  }
  return server;
}

MetricsHttpServer::~MetricsHttpServer() {
  if (context_ != nullptr) mg_stop(context_);
}

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> StartMetricsHttpFromFlags(
    MetricsRegistry* registry) {
  const int port = absl::GetFlag(FLAGS_metrics_port);
  if (port == 0) return std::unique_ptr<MetricsHttpServer>();
  if (port < 0 || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--metrics_port=", port, " must be in [1, 65535] (0 = off)"));
  }
  absl::StatusOr<std::unique_ptr<MetricsHttpServer>> server =
      MetricsHttpServer::Start(absl::GetFlag(FLAGS_metrics_address), port,
                               registry);
  if (server.ok()) {
    LOG(INFO) << "metrics on http://" << absl::GetFlag(FLAGS_metrics_address)
              << ":" << (*server)->port() << "/metrics";
  }
  return server;
}

}  // namespace muond
