// client/cpp/utf8: well-formed UTF-8 per RFC 3629 (against known sequences:
// overlong forms, surrogates, past U+10FFFF, truncated ones), and the
// repair that escapes each stray byte; and, against the daemon's own parser
// (protobuf's proto3 string check), the same verdict on every string of up
// to two bytes and every lead byte's three- and four-byte forms.
#include "client/cpp/utf8.h"

#include <google/protobuf/stubs/logging.h>
#include <google/protobuf/wrappers.pb.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"

namespace muond {
namespace {

TEST(Utf8, WellFormedSequencesPass) {
  for (const std::string text :
       {std::string(""), std::string("ascii"), std::string("\0x", 2),
        std::string("\xc3\xa9"), std::string("\xe2\x82\xac"),
        std::string("\xef\xbf\xbf"), std::string("\xf0\x90\x80\x80"),
        std::string("\xf4\x8f\xbf\xbf")}) {
    EXPECT_TRUE(IsValidUtf8(text)) << text;
    EXPECT_EQ(ToValidUtf8(text), text);
  }
}

TEST(Utf8, MalformedSequencesFailAndTheirBytesAreEscaped) {
  for (const std::string text :
       {std::string("\xff"), std::string("\x80"), std::string("\xc0\xaf"),
        std::string("\xc3"), std::string("\xe0\x80\xaf"),
        std::string("\xed\xa0\x80"), std::string("\xf0\x80\x80\x80"),
        std::string("\xf4\x90\x80\x80"), std::string("\xf5\x80\x80\x80"),
        std::string("\xe2\x82")}) {
    EXPECT_FALSE(IsValidUtf8(text)) << text;
    EXPECT_TRUE(IsValidUtf8(ToValidUtf8(text))) << text;
  }
  EXPECT_EQ(ToValidUtf8("w\xff.\xc3\xa9\xe2\x82"), "w\\xff.\xc3\xa9\\xe2\\x82");
}

// Whether protobuf parses `text` in a proto3 string field (StringValue.value,
// field 1): what the daemon's parser does with a request's strings.
bool ProtobufParses(const std::string& text) {
  std::string wire = "\x0a";
  for (size_t n = text.size();; n >>= 7) {  // the length as a varint
    const uint8_t low = n & 0x7f;
    if (n < 0x80) {
      wire.push_back(char(low));
      break;
    }
    wire.push_back(char(low | 0x80));
  }
  wire += text;
  google::protobuf::StringValue value;
  return value.ParseFromString(wire);
}

// Every string: one, two bytes; three and four with every lead byte that
// starts such a sequence, every second byte and a few continuations.
std::vector<std::string> Candidates() {
  std::vector<std::string> out;
  for (int a = 0; a < 256; ++a) {
    out.push_back(std::string(1, char(a)));
    for (int b = 0; b < 256; ++b) out.push_back({char(a), char(b)});
  }
  for (int a = 0xE0; a <= 0xF7; ++a) {
    for (int b = 0; b < 256; ++b) {
      for (int c : {0x00, 0x7F, 0x80, 0x9F, 0xA0, 0xBF, 0xC0, 0xFF}) {
        out.push_back({char(a), char(b), char(c)});
        for (int d : {0x41, 0x80, 0xBF, 0xC0}) {
          out.push_back({char(a), char(b), char(c), char(d)});
        }
      }
    }
  }
  return out;
}

TEST(Utf8, AgreesWithTheDaemonsParser) {
  google::protobuf::LogSilencer quiet;  // each refused parse would log
  int refused = 0;
  for (const std::string& text : Candidates()) {
    const bool parses = ProtobufParses(text);
    refused += !parses;
    ASSERT_EQ(IsValidUtf8(text), parses) << absl::CEscape(text);
    ASSERT_TRUE(ProtobufParses(ToValidUtf8(text))) << absl::CEscape(text);
  }
  EXPECT_GT(refused, 10000)
      << refused;  // the candidates do hold malformed ones
}

}  // namespace
}  // namespace muond
