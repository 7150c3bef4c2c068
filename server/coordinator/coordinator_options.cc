#include "server/coordinator/coordinator_options.h"

#include <arpa/inet.h>

#include <cmath>
#include <cstring>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/common/status_macros.h"

namespace muond {

absl::Status CoordinatorOptions::Validate() const {
  RETURN_IF_ERROR(ValidatePlansKept("plans_kept", plans_kept));
  if (!std::isfinite(rebalance_threshold) || rebalance_threshold < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("rebalance_threshold: ", rebalance_threshold,
                     " must be finite and >= 0 (0 = off)"));
  }
  for (const auto& [field, value] :
       {std::pair<const char*, int64_t>{"rebalance_interval_steps",
                                        rebalance_interval_steps},
        {"rebalance_activate_margin", rebalance_activate_margin}}) {
    if (value < 1 || value > kMaxRebalanceSteps) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ": ", value, " must be in [1, ", kMaxRebalanceSteps, "]"));
    }
  }
  for (const auto& [field, value] :
       {std::pair<const char*, absl::Duration>{"max_wait", max_wait},
        {"job_idle_expiry_s", job_idle_expiry},
        {"join_grace_s", join_grace}}) {
    if (value <= absl::ZeroDuration() || value == absl::InfiniteDuration()) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ": ", absl::FormatDuration(value), " must be > 0 and finite"));
    }
  }
  for (const auto& [field, value] :
       {std::pair<const char*, int64_t>{"max_jobs", max_jobs},
        {"kv_max_key_bytes", kv.max_key_bytes},
        {"kv_max_value_bytes", kv.max_value_bytes},
        {"kv_max_keys_per_job", kv.max_keys_per_job},
        {"kv_max_total_bytes", kv.max_total_bytes}}) {
    if (value < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": ", value, " must be >= 1"));
    }
  }
  return absl::OkStatus();
}

bool IsThisHostOnly(absl::string_view listen) {
  if (absl::StartsWith(listen, "unix:")) return true;
  const size_t colon = listen.rfind(':');
  if (colon == absl::string_view::npos) return false;
  const std::string host(listen.substr(0, colon));
  if (absl::EqualsIgnoreCase(host, "localhost")) return true;
  in_addr v4;
  if (inet_pton(AF_INET, host.c_str(), &v4) == 1) {
    return (ntohl(v4.s_addr) >> 24) == 127;
  }
  in6_addr v6;
  if (host.size() > 2 && host.front() == '[' && host.back() == ']' &&
      inet_pton(AF_INET6, host.substr(1, host.size() - 2).c_str(), &v6) == 1) {
    return std::memcmp(&v6, &in6addr_loopback, sizeof(v6)) == 0;
  }
  return false;
}

absl::Status CheckUntokenedListen(absl::string_view listen, bool has_token,
                                  bool insecure_allow_untokened_tcp) {
  if (has_token || insecure_allow_untokened_tcp || IsThisHostOnly(listen)) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "--listen=", listen,
      " is reachable from other hosts and no token is given: without one "
      "every caller may join and lock this coordinator's jobs (TLS alone "
      "authenticates nobody). Give --token_file=FILE, made with `(umask 077; "
      "head -c 32 /dev/urandom | base64 > FILE)` and given to every daemon "
      "(--token_file) and muonctl; or listen on 127.0.0.1 or a unix: socket; "
      "or, on a trusted network only, --insecure_allow_untokened_tcp"));
}

}  // namespace muond
