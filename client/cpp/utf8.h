#pragma once
// UTF-8 checks for the strings a client puts in proto3 `string` fields: a
// request holding malformed UTF-8 in one does not parse on the daemon (the
// Step RPC answers INTERNAL with no message, the step channel "not a
// muond.v1.StepRequest"), so the client checks or repairs them first.
#include <string>
#include <string_view>

namespace muond {

// Whether `text` is well-formed UTF-8 (RFC 3629: no overlong forms, no
// surrogates, nothing past U+10FFFF).
bool IsValidUtf8(std::string_view text);

// `text` with each byte that is not part of a well-formed UTF-8 sequence
// written as the four characters \xNN; well-formed text is unchanged.
std::string ToValidUtf8(std::string_view text);

}  // namespace muond
