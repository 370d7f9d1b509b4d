// A strict reader for one line of a JSON-lines corpus: the line must be one JSON object
// (RFC 8259), and the text of one of its fields, a JSON string, is what is wanted.
#pragma once
#include <stdexcept>
#include <string>
#include <string_view>

namespace moeut {

// Thrown with the problem (malformed JSON and the column where it was met, a missing field, a
// field that is not a string); the caller adds the file and line number.
struct JsonLineError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The decoded UTF-8 text of string field `field` of the object on `line`. Every value of the
// object is checked, nested objects and arrays included (depth 256 at most); escapes \" \\ \/ \b
// \f \n \r \t and \uXXXX (surrogate pairs joined) are decoded. A field named twice is an error.
std::string json_string_field(std::string_view line, std::string_view field);

}  // namespace moeut
