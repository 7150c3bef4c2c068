#pragma once
// Client input quoted in error messages, bounded: a status message travels in
// gRPC metadata (grpc-message, a few KiB by default), so a 60 MB param name
// echoed whole makes the error itself fail to arrive. Every name, path or
// value a server repeats from a request goes through Echo.
#include <cstddef>
#include <string>
#include <string_view>

namespace muond {

// Bytes of input an error message repeats.
inline constexpr size_t kMaxEchoBytes = 128;

// `text` C-escaped (control bytes and quotes visible, so a name cannot forge
// log lines; UTF-8 kept), cut after kMaxEchoBytes bytes of input (at a UTF-8 character
// boundary) with "...(N bytes)" appended when longer.
std::string Echo(std::string_view text);

}  // namespace muond
