// The JSON-lines field reader: decoding of every escape, and each malformed line refused with
// where and what (core/json_line.h).
#include <gtest/gtest.h>

#include <string>

#include "core/json_line.h"

namespace {

using moeut::json_string_field;

// f must throw JsonLineError whose message contains word.
void expect_refused(const std::string& line, const std::string& word) {
  try {
    (void)json_string_field(line, "text");
    ADD_FAILURE() << "accepted: " << line;
  } catch (const moeut::JsonLineError& e) {
    EXPECT_NE(std::string(e.what()).find(word), std::string::npos) << line << " -> " << e.what();
  }
}

TEST(JsonLine, DecodesEscapes) {
  EXPECT_EQ(json_string_field(R"({"text": "a\nb\tc\"d\\e\/f\b\f\r"})", "text"), "a\nb\tc\"d\\e/f\b\f\r");
  EXPECT_EQ(json_string_field(R"({"text":"\u00e9\u20AC"})", "text"), "\xC3\xA9\xE2\x82\xAC");  // é €
  EXPECT_EQ(json_string_field(R"({"text":"\ud83d\ude00"})", "text"), "\xF0\x9F\x98\x80");      // U+1F600
  EXPECT_EQ(json_string_field("{\"text\":\"h\xC3\xA9\"}", "text"), "h\xC3\xA9");               // raw UTF-8 kept
}

TEST(JsonLine, ChecksTheOtherFieldsAndPicksTheNamedOne) {
  const std::string line =
      R"( {"id": -1.5e+3, "meta": {"a": [1, true, null, {"b": "x"}], "c": false}, "body": "B", "text": "T"} )";
  EXPECT_EQ(json_string_field(line, "text"), "T");
  EXPECT_EQ(json_string_field(line, "body"), "B");
}

TEST(JsonLine, RefusesMalformedLines) {
  expect_refused(R"(["text", "a"])", "expected '{'");
  expect_refused(R"({"text": "a")", "expected ',' or '}'");
  expect_refused(R"({"text": "a"} x)", "after the object");
  expect_refused(R"({"text": "a\q"})", "invalid escape");
  expect_refused(R"({"text": "a\u12G4"})", "4 hexadecimal digits");
  expect_refused(R"({"text": "\ud83d x"})", "high surrogate");
  expect_refused(R"({"text": "\ude00"})", "low surrogate");
  expect_refused("{\"text\": \"a\tb\"}", "control character");
  expect_refused(R"({"text": "a", "n": 01})", "column 21");
  expect_refused(R"({"n": tru, "text": "a"})", "expected a JSON value");
  expect_refused(R"({"text": "a", "text": "b"})", "given twice");
  expect_refused(std::string(300, '[') + std::string(300, ']'), "expected '{'");
  expect_refused("{\"a\":" + std::string(300, '[') + std::string(300, ']') + "}", "nested deeper");
}

TEST(JsonLine, RefusesMissingOrNonStringField) {
  expect_refused(R"({"body": "a"})", "no field \"text\"");
  expect_refused(R"({"text": 3})", "field \"text\" is a number, not a string");
  expect_refused(R"({"text": null})", "is null");
  expect_refused(R"({"text": ["a"]})", "is an array");
  expect_refused(R"({"text": {"a": "b"}})", "is an object");
}

}  // namespace
