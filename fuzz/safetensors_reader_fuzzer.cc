// libFuzzer target: the state-file reader (bounded, validated loads).
//
// The input is the content of a state file. It is written to a temporary
// file and read with ReadSafetensors (the daemon's LoadState path). Nothing
// may crash, leak, throw or trip a sanitizer; an error must be a proper
// status (not UNKNOWN, with a message). A file that reads back is written
// again with WriteSafetensors and must read back bitwise equal (the reader
// accepts what the writer writes, and nothing it reads is lost).
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "server/common/safetensors.h"

namespace muond {
namespace {

[[noreturn]] void Fail(const std::string& what) {
  fprintf(stderr, "invariant violated: %s\n", what.c_str());
  abort();
}

const std::string& TempDir() {
  static const std::string dir = [] {
    const char* base = getenv("TEST_TMPDIR");
    std::string tmpl = std::string(base ? base : "/tmp") + "/st-fuzz-XXXXXX";
    if (mkdtemp(tmpl.data()) == nullptr) Fail("mkdtemp");
    return tmpl;
  }();
  return dir;
}

void WriteBytes(const std::string& path, const uint8_t* data, size_t size) {
  FILE* f = fopen(path.c_str(), "wb");
  if (f == nullptr) Fail("cannot create " + path);
  if (size > 0 && fwrite(data, 1, size, f) != size) Fail("short write");
  fclose(f);
}

bool SameTensors(const SafetensorsFile& a, const SafetensorsFile& b) {
  if (a.metadata != b.metadata || a.tensors.size() != b.tensors.size())
    return false;
  for (const auto& [name, t] : a.tensors) {
    auto it = b.tensors.find(name);
    if (it == b.tensors.end() || it->second.shape != t.shape ||
        it->second.data.size() != t.data.size())
      return false;
    if (!t.data.empty() && memcmp(t.data.data(), it->second.data.data(),
                                  t.data.size() * sizeof(float)) != 0)
      return false;
  }
  return true;
}

void CheckStatus(const absl::Status& status, const char* call) {
  if (status.ok()) return;
  if (status.code() == absl::StatusCode::kUnknown || status.message().empty())
    Fail(std::string(call) +
         " returned an improper error: " + status.ToString());
}

void ReadAndRoundTrip(const uint8_t* data, size_t size) {
  const std::string path = TempDir() + "/in.safetensors";
  WriteBytes(path, data, size);
  absl::StatusOr<SafetensorsFile> file = ReadSafetensors(path);
  CheckStatus(file.status(), "ReadSafetensors");
  if (!file.ok()) return;
  const std::string again = TempDir() + "/again.safetensors";
  unlink(again.c_str());
  absl::StatusOr<int64_t> written = WriteSafetensors(again, *file);
  CheckStatus(written.status(), "WriteSafetensors");
  if (!written.ok()) Fail("a file that reads cannot be written back");
  absl::StatusOr<SafetensorsFile> reread = ReadSafetensors(again);
  if (!reread.ok())
    Fail("written file does not read: " + reread.status().ToString());
  if (!SameTensors(*file, *reread)) Fail("round trip changed the state");
}

}  // namespace
}  // namespace muond

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  muond::ReadAndRoundTrip(data, size);
  return 0;
}
