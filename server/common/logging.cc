#include "server/common/logging.h"

#include <execinfo.h>
#include <grpc/support/log.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdlib>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/debugging/symbolize.h"
#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "glog/logging.h"
#include "google/protobuf/stubs/logging.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(muond::LogFormat, log_format, muond::LogFormat::kText,
          "Log line format on stderr: text (glog's lines) or json (one JSON "
          "object per line: time, severity, file, line, thread, message, "
          "server, job, rank)");

namespace muond {

bool AbslParseFlag(absl::string_view text, LogFormat* format,
                   std::string* error) {
  if (text == "text") {
    *format = LogFormat::kText;
    return true;
  }
  if (text == "json") {
    *format = LogFormat::kJson;
    return true;
  }
  *error = "allowed values: text, json";
  return false;
}

std::string AbslUnparseFlag(LogFormat format) {
  return format == LogFormat::kJson ? "json" : "text";
}

namespace {

// What every JSON line names besides the message.
struct LogContext {
  absl::Mutex mu;
  std::string server ABSL_GUARDED_BY(mu);
  std::string job ABSL_GUARDED_BY(mu);
  int rank ABSL_GUARDED_BY(mu) = -1;
  // One write per line, one line at a time: glog calls sinks from several
  // threads at once, and gRPC logs from its own.
  absl::Mutex write_mu ABSL_ACQUIRED_AFTER(mu);
};

LogContext& Context() {
  static LogContext* context = new LogContext;  // never destroyed: logs at exit
  return *context;
}

absl::string_view BaseName(absl::string_view path) {
  const size_t slash = path.rfind('/');
  return slash == absl::string_view::npos ? path : path.substr(slash + 1);
}

// The frames of the calling thread (this logging code's included),
// symbolized where possible.
nlohmann::ordered_json StackTrace() {
  // glibc's backtrace unwinds by the unwind tables, so it also crosses
  // libraries built without frame pointers (glog's), where absl's stops.
  void* frames[64];
  const int depth = backtrace(frames, 64);
  nlohmann::ordered_json stack = nlohmann::ordered_json::array();
  for (int i = 0; i < depth; ++i) {
    char symbol[512];
    stack.push_back(absl::StrCat(
        absl::Hex(reinterpret_cast<uintptr_t>(frames[i])), " ",
        absl::Symbolize(frames[i], symbol, sizeof(symbol)) ? symbol : "?"));
  }
  return stack;
}

// Writes one JSON line to stderr; a FATAL line carries the stack and ends
// the process (glog would add its own plain-text trace otherwise).
void WriteJsonLine(absl::string_view severity, absl::string_view file, int line,
                   absl::Time time, absl::string_view message) {
  LogContext& context = Context();
  nlohmann::ordered_json j;
  j["time"] =
      absl::FormatTime("%Y-%m-%dT%H:%M:%E6SZ", time, absl::UTCTimeZone());
  j["severity"] = severity;
  j["file"] = BaseName(file);
  j["line"] = line;
  j["thread"] = static_cast<int64_t>(syscall(SYS_gettid));
  j["message"] = message;
  {
    absl::MutexLock lock(&context.mu);
    j["server"] = context.server;
    if (!context.job.empty()) j["job"] = context.job;
    if (context.rank >= 0) j["rank"] = context.rank;
  }
  const bool fatal = severity == "FATAL";
  if (fatal) j["stack"] = StackTrace();
  // Invalid UTF-8 in a message (a peer's bytes) becomes U+FFFD instead of
  // throwing.
  const std::string out =
      j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
  {
    absl::MutexLock lock(&context.write_mu);
    for (size_t done = 0; done < out.size();) {
      const ssize_t n =
          write(STDERR_FILENO, out.data() + done, out.size() - done);
      if (n <= 0) break;  // stderr is gone: nothing to tell it
      done += size_t(n);
    }
  }
  if (fatal) abort();
}

class JsonSink : public google::LogSink {
 public:
  void send(google::LogSeverity severity, const char* /*full_filename*/,
            const char* base_filename, int line,
            const google::LogMessageTime& time, const char* message,
            size_t message_len) override {
    WriteJsonLine(
        google::GetLogSeverityName(severity), base_filename, line,
        absl::FromTimeT(time.timestamp()) + absl::Microseconds(time.usec()),
        absl::string_view(message, message_len));
  }
};

void GprToJson(gpr_log_func_args* args) {
  // gpr_log_severity_string says "D"/"I"/"E": spell them as glog does.
  const char* severity = args->severity == GPR_LOG_SEVERITY_ERROR  ? "ERROR"
                         : args->severity == GPR_LOG_SEVERITY_INFO ? "INFO"
                                                                   : "DEBUG";
  WriteJsonLine(severity, args->file, args->line, absl::Now(), args->message);
}

void ProtobufToJson(google::protobuf::LogLevel level, const char* filename,
                    int line, const std::string& message) {
  static constexpr const char* kNames[] = {"INFO", "WARNING", "ERROR", "FATAL",
                                           "ERROR"};  // DFATAL
  const int i = int(level);
  // protobuf aborts after a FATAL itself; WriteJsonLine does it first.
  WriteJsonLine(i >= 0 && i < 5 ? kNames[i] : "ERROR", filename, line,
                absl::Now(), message);
}

// glog's own stderr output and log files off, every line to the JSON sink;
// gRPC core and protobuf, which write to stderr themselves, through it too.
void StartJsonLogging(const char* argv0) {
  absl::InitializeSymbolizer(argv0);
  FLAGS_logtostderr = false;
  FLAGS_alsologtostderr = false;
  FLAGS_stderrthreshold = google::NUM_SEVERITIES;  // above FATAL: never
  for (int s = 0; s < google::NUM_SEVERITIES; ++s) {
    google::SetLogDestination(s, "");  // "": no log file
  }
  google::InitGoogleLogging(argv0);
  google::AddLogSink(new JsonSink);  // lives as long as the process logs
  gpr_set_log_function(&GprToJson);
  google::protobuf::SetLogHandler(&ProtobufToJson);
}

}  // namespace

void InitServerLogging(const char* argv0, absl::string_view server) {
  {
    LogContext& context = Context();
    absl::MutexLock lock(&context.mu);
    context.server = std::string(server);
  }
  FLAGS_v = VerbosityFlag();
  if (absl::GetFlag(FLAGS_log_format) == LogFormat::kJson) {
    StartJsonLogging(argv0);
    return;
  }
  FLAGS_logtostderr = true;
  google::InitGoogleLogging(argv0);
}

void SetLogJob(absl::string_view job, int rank) {
  LogContext& context = Context();
  absl::MutexLock lock(&context.mu);
  context.job = std::string(job);
  context.rank = rank;
}

}  // namespace muond
