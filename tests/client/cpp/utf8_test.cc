// client/cpp/utf8: well-formed UTF-8 per RFC 3629 (against known sequences:
// overlong forms, surrogates, past U+10FFFF, truncated ones), and the
// repair that escapes each stray byte.
#include "client/cpp/utf8.h"

#include <gtest/gtest.h>

#include <string>

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

}  // namespace
}  // namespace muond
