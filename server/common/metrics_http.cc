#include "server/common/metrics_http.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <microhttpd.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <thread>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "glog/logging.h"

ABSL_FLAG(int, metrics_port, 0,
          "Serve Prometheus metrics (text format) on http://ADDRESS:PORT/"
          "metrics; 0 = off (the default). See --metrics_address");
ABSL_FLAG(std::string, metrics_address, "127.0.0.1",
          "IPv4 or IPv6 literal address the metrics endpoint binds to (with "
          "--metrics_port); 0.0.0.0 or :: lets a scraper on another host in");

namespace muond {
namespace {

// glibc puts the process's static TLS on every thread's stack (cuBLASLt,
// OpenBLAS and glog need ~190 KB in the daemon): the HTTP thread asks for
// 1 MiB explicitly rather than trust a library default. Address space
// only; the pages are committed as used.
constexpr size_t kThreadStackBytes = size_t{1} << 20;
// A scraper needs one or two connections: the rest of the limit is slack
// for restarts; more are refused, and cost no thread (one polling thread).
constexpr unsigned kConnectionLimit = 16;
constexpr unsigned kPerIpConnectionLimit = 8;
// libmicrohttpd's own timeout is one of inactivity: a client trickling a
// byte a second would keep its slot forever. Every connection is closed
// this long after it was accepted, however busy (ConnectionDeadlines).
constexpr unsigned kConnectionTimeoutSeconds = 5;
// Per connection: request line and headers; the body is allocated apart.
constexpr size_t kConnectionMemoryBytes = 32 * 1024;

// libmicrohttpd says why a start failed only through its logger, on the
// starting thread: Start collects those lines here.
thread_local std::string* start_log = nullptr;

void LogMessage(void* /*cls*/, const char* format, va_list args) {
  char line[512];
  std::vsnprintf(line, sizeof(line), format, args);
  std::string text(line);
  while (!text.empty() && text.back() == '\n') text.pop_back();
  if (start_log != nullptr) {
    absl::StrAppend(start_log, start_log->empty() ? "" : "; ", text);
  } else {
    // Every 100th: a flood of refused connections must not flood the log.
    LOG_EVERY_N(WARNING, 100) << "metrics endpoint: " << text;
  }
}

MHD_Result Respond(MHD_Connection* conn, unsigned code,
                   const char* content_type, const std::string& body) {
  MHD_Response* response = MHD_create_response_from_buffer(
      body.size(), const_cast<char*>(body.data()), MHD_RESPMEM_MUST_COPY);
  if (response == nullptr) return MHD_NO;  // closes the connection
  MHD_add_response_header(response, MHD_HTTP_HEADER_CONTENT_TYPE, content_type);
  if (code == MHD_HTTP_METHOD_NOT_ALLOWED) {
    MHD_add_response_header(response, MHD_HTTP_HEADER_ALLOW, "GET, HEAD");
  }
  const MHD_Result queued = MHD_queue_response(conn, code, response);
  MHD_destroy_response(response);
  return queued;
}

// The listening address of `address`:`port` (an IPv4 or IPv6 literal).
bool ParseAddress(const std::string& address, int port, sockaddr_storage* out) {
  std::memset(out, 0, sizeof(*out));
  auto* v4 = reinterpret_cast<sockaddr_in*>(out);
  if (inet_pton(AF_INET, address.c_str(), &v4->sin_addr) == 1) {
    v4->sin_family = AF_INET;
    v4->sin_port = htons(port);
    return true;
  }
  auto* v6 = reinterpret_cast<sockaddr_in6*>(out);
  if (inet_pton(AF_INET6, address.c_str(), &v6->sin6_addr) == 1) {
    v6->sin6_family = AF_INET6;
    v6->sin6_port = htons(port);
    return true;
  }
  return false;
}

// "A:P", or "[A]:P" for IPv6.
std::string HostPort(const std::string& address, int port) {
  return address.find(':') == std::string::npos
             ? absl::StrCat(address, ":", port)
             : absl::StrCat("[", address, "]:", port);
}

// The access handler; `registry` is the MetricsRegistry served.
MHD_Result Handle(void* registry, MHD_Connection* conn, const char* url,
                  const char* method, const char* /*version*/,
                  const char* /*upload_data*/, size_t* /*upload_data_size*/,
                  void** /*request_state*/) {
  // Answered on the first call (headers only): a request body, if any, is
  // never read; libmicrohttpd then closes the connection.
  if (std::strcmp(url, "/metrics") != 0) {
    return Respond(conn, MHD_HTTP_NOT_FOUND, "text/plain; charset=utf-8",
                   "not found: the metrics are at /metrics\n");
  }
  // HEAD: libmicrohttpd sends GET's headers without the body.
  if (std::strcmp(method, MHD_HTTP_METHOD_GET) != 0 &&
      std::strcmp(method, MHD_HTTP_METHOD_HEAD) != 0) {
    return Respond(conn, MHD_HTTP_METHOD_NOT_ALLOWED,
                   "text/plain; charset=utf-8",
                   "only GET (and HEAD) /metrics\n");
  }
  return Respond(conn, MHD_HTTP_OK, kMetricsContentType,
                 static_cast<MetricsRegistry*>(registry)->Render());
}

}  // namespace

// Closes connections older than kConnectionTimeoutSeconds from a thread of
// its own. Each tracked connection holds a dup of its socket: shutdown() on
// it ends the connection (libmicrohttpd's poll sees EOF and closes it) and
// can never hit an unrelated socket that reused a number libmicrohttpd
// already closed.
class MetricsHttpServer::ConnectionDeadlines {
 public:
  ConnectionDeadlines() : thread_([this] { Run(); }) {}
  ~ConnectionDeadlines() {
    {
      absl::MutexLock lock(&mu_);
      stopping_ = true;
    }
    thread_.join();
    for (auto& [connection, fd] : open_) close(fd.fd);
  }

  // libmicrohttpd's MHD_OPTION_NOTIFY_CONNECTION callback (its thread).
  static void Notify(void* self, MHD_Connection* connection,
                     void** /*socket_context*/,
                     MHD_ConnectionNotificationCode code) {
    auto* deadlines = static_cast<ConnectionDeadlines*>(self);
    if (code == MHD_CONNECTION_NOTIFY_STARTED) {
      deadlines->Started(connection);
    } else {
      deadlines->Closed(connection);
    }
  }

 private:
  struct Tracked {
    int fd;
    absl::Time deadline;
  };

  void Started(MHD_Connection* connection) {
    const MHD_ConnectionInfo* info =
        MHD_get_connection_info(connection, MHD_CONNECTION_INFO_CONNECTION_FD);
    if (info == nullptr) return;
    const int fd = fcntl(info->connect_fd, F_DUPFD_CLOEXEC, 0);
    if (fd < 0) return;  // out of descriptors: the idle timeout still holds
    absl::MutexLock lock(&mu_);
    open_[connection] = {
        fd, absl::Now() + absl::Seconds(kConnectionTimeoutSeconds)};
  }

  void Closed(MHD_Connection* connection) {
    absl::MutexLock lock(&mu_);
    auto it = open_.find(connection);
    if (it == open_.end()) return;
    close(it->second.fd);
    open_.erase(it);
  }

  void Run() {
    absl::MutexLock lock(&mu_);
    while (!stopping_) {
      mu_.AwaitWithTimeout(absl::Condition(&stopping_), absl::Seconds(0.5));
      const absl::Time now = absl::Now();
      for (auto& [connection, tracked] : open_) {
        if (tracked.deadline <= now) shutdown(tracked.fd, SHUT_RDWR);
      }
    }
  }

  absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  absl::flat_hash_map<MHD_Connection*, Tracked> open_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;
};

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(
    const std::string& address, int port, MetricsRegistry* registry) {
  if (port < 0 || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--metrics_port=", port, " must be in [1, 65535] (0 = off)"));
  }
  sockaddr_storage bind_to;
  if (!ParseAddress(address, port, &bind_to)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--metrics_address='", address,
        "' must be an IPv4 or IPv6 literal address (e.g. 127.0.0.1 or ::1; "
        "0.0.0.0 or :: for every interface)"));
  }
  const bool ipv6 = bind_to.ss_family == AF_INET6;
  // One internal thread polls every connection (epoll): a scrape never runs
  // on, nor waits for, a gRPC or step thread, and connections cost no thread.
  const unsigned flags = MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_EPOLL |
                         MHD_USE_ITC | MHD_USE_ERROR_LOG |
                         (ipv6 ? MHD_USE_IPv6 : 0);
  auto server = std::unique_ptr<MetricsHttpServer>(new MetricsHttpServer());
  server->deadlines_ = std::make_unique<ConnectionDeadlines>();
  std::string log;
  start_log = &log;
  server->daemon_ = MHD_start_daemon(
      flags, static_cast<uint16_t>(port), nullptr, nullptr, &Handle,
      registry,                                                     //
      MHD_OPTION_SOCK_ADDR, reinterpret_cast<sockaddr*>(&bind_to),  //
      MHD_OPTION_THREAD_STACK_SIZE, kThreadStackBytes,              //
      MHD_OPTION_CONNECTION_LIMIT, kConnectionLimit,                //
      MHD_OPTION_PER_IP_CONNECTION_LIMIT, kPerIpConnectionLimit,    //
      MHD_OPTION_CONNECTION_TIMEOUT, kConnectionTimeoutSeconds,     //
      MHD_OPTION_CONNECTION_MEMORY_LIMIT, kConnectionMemoryBytes,   //
      MHD_OPTION_NOTIFY_CONNECTION, &ConnectionDeadlines::Notify,   //
      server->deadlines_.get(),                                     //
      MHD_OPTION_EXTERNAL_LOGGER, &LogMessage, nullptr,             //
      MHD_OPTION_END);
  start_log = nullptr;
  const std::string listening = HostPort(address, port);
  if (server->daemon_ == nullptr) {
    return absl::UnavailableError(absl::StrCat(
        "cannot serve metrics on ", listening,
        " (--metrics_address/--metrics_port): ",
        log.empty() ? "libmicrohttpd could not start" : log,
        "; is the port in use, or the address not one of this host?"));
  }
  const MHD_DaemonInfo* bound =
      MHD_get_daemon_info(server->daemon_, MHD_DAEMON_INFO_BIND_PORT);
  server->port_ = bound != nullptr ? bound->port : port;
  return server;
}

MetricsHttpServer::MetricsHttpServer() = default;

MetricsHttpServer::~MetricsHttpServer() {
  // Wakes the polling thread, closes every connection (idle ones too) and
  // joins it: prompt at shutdown.
  if (daemon_ != nullptr) MHD_stop_daemon(daemon_);
}

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> StartMetricsHttpFromFlags(
    MetricsRegistry* registry) {
  const int port = absl::GetFlag(FLAGS_metrics_port);
  if (port == 0) return std::unique_ptr<MetricsHttpServer>();
  absl::StatusOr<std::unique_ptr<MetricsHttpServer>> server =
      MetricsHttpServer::Start(absl::GetFlag(FLAGS_metrics_address), port,
                               registry);
  if (server.ok()) {
    LOG(INFO) << "metrics on http://"
              << HostPort(absl::GetFlag(FLAGS_metrics_address),
                          (*server)->port())
              << "/metrics";
  }
  return server;
}

}  // namespace muond
