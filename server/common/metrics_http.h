#pragma once
// The servers' Prometheus endpoint: GET /metrics answers
// MetricsRegistry::Render() (kMetricsContentType), any other path 404, any
// other method 405. HTTP is GNU libmicrohttpd's (Debian libmicrohttpd), on
// one polling thread of its own: a scrape never runs on, nor waits for, a
// gRPC or step thread. Connections are few, short-lived and bounded
// (metrics_http.cc): each is closed 5 s after it was accepted, idle or not.
//
// Off by default: --metrics_port (0 = off) and --metrics_address (default
// 127.0.0.1; 0.0.0.0 for a scraper on another host), defined here for both
// servers (server/README.md "Metrics").
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "server/common/metrics.h"

struct MHD_Daemon;

namespace muond {

class MetricsHttpServer {
 public:
  // Serves `registry` (not owned; must outlive the server) on
  // address:port (IPv4 or IPv6 literal; port 0 picks a free one, see
  // port()).
  // InvalidArgument naming the flag for a malformed address or port;
  // Unavailable "cannot serve metrics on A:P (--metrics_address/
  // --metrics_port): <why>" when it cannot be bound (in use, or not an
  // address of this host).
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(
      const std::string& address, int port, MetricsRegistry* registry);
  // Stops serving: closes every connection, idle ones too, and joins the
  // HTTP thread.
  ~MetricsHttpServer();
  MetricsHttpServer(const MetricsHttpServer&) = delete;
  MetricsHttpServer& operator=(const MetricsHttpServer&) = delete;

  int port() const { return port_; }

 private:
  class ConnectionDeadlines;

  MetricsHttpServer();

  // Declared first: destroyed after daemon_ is stopped (it is notified of
  // every connection's close until then).
  std::unique_ptr<ConnectionDeadlines> deadlines_;
  ::MHD_Daemon* daemon_ = nullptr;
  int port_ = 0;
};

// The endpoint of the --metrics_port/--metrics_address flags: nullptr when
// --metrics_port is 0 (off), else Start's result (errors name the flags).
absl::StatusOr<std::unique_ptr<MetricsHttpServer>> StartMetricsHttpFromFlags(
    MetricsRegistry* registry);

}  // namespace muond
