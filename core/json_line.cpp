// The JSON-lines field reader (core/json_line.h): a recursive-descent parser over one line.
#include "core/json_line.h"

#include <cstdint>

namespace moeut {
namespace {

constexpr int kMaxDepth = 256;  // nested objects and arrays; deeper would risk the stack

class Parser {
 public:
  explicit Parser(std::string_view s) : s_(s) {}

  // The line's object; the field's text goes to `found` when it is a string.
  void line(std::string_view field, std::string& found) {
    space();
    if (!eat('{')) fail("expected '{' (each line must be one JSON object)");
    bool seen = false;
    space();
    if (!eat('}')) {
      do {
        space();
        const std::string key = string();
        space();
        if (!eat(':')) fail("expected ':' after a field name");
        space();
        if (key != field) {
          value(1);
        } else if (seen) {
          fail("field \"" + key + "\" given twice");
        } else {
          seen = true;
          if (peek() != '"') {
            const std::string what = kind();
            value(1);  // a malformed value is reported as such
            throw JsonLineError("field \"" + key + "\" is " + what + ", not a string");
          }
          found = string();
        }
        space();
      } while (eat(','));
      if (!eat('}')) fail("expected ',' or '}' in an object");
    }
    space();
    if (pos_ != s_.size()) fail("unexpected text after the object");
    if (!seen) throw JsonLineError("no field \"" + std::string(field) + "\"");
  }

 private:
  std::string_view s_;
  size_t pos_ = 0;

  [[noreturn]] void fail(const std::string& problem) const {
    throw JsonLineError("malformed JSON at column " + std::to_string(pos_ + 1) + ": " + problem);
  }
  char peek() const { return pos_ < s_.size() ? s_[pos_] : '\0'; }
  bool eat(char c) {
    if (peek() != c || pos_ >= s_.size()) return false;
    ++pos_;
    return true;
  }
  void space() {
    while (pos_ < s_.size() && (s_[pos_] == ' ' || s_[pos_] == '\t' || s_[pos_] == '\r' || s_[pos_] == '\n')) ++pos_;
  }
  bool is_digit() const { return peek() >= '0' && peek() <= '9'; }

  // What the value at pos_ is, for the message about a field that is not a string (value()
  // checks it is one).
  std::string kind() const {
    switch (peek()) {
      case '{': return "an object";
      case '[': return "an array";
      case 't': case 'f': return "a boolean";
      case 'n': return "null";
      default: return "a number";
    }
  }

  void value(int depth) {
    if (depth > kMaxDepth) fail("nested deeper than " + std::to_string(kMaxDepth));
    switch (peek()) {
      case '"': (void)string(); return;
      case '{': return container('}', depth);
      case '[': return container(']', depth);
      case 't': return literal("true");
      case 'f': return literal("false");
      case 'n': return literal("null");
      default: return number();
    }
  }

  // An object (close '}') or an array (close ']') whose values are checked and dropped.
  void container(char close, int depth) {
    ++pos_;
    space();
    if (eat(close)) return;
    do {
      space();
      if (close == '}') {
        (void)string();
        space();
        if (!eat(':')) fail("expected ':' after a field name");
        space();
      }
      value(depth + 1);
      space();
    } while (eat(','));
    if (!eat(close)) fail(std::string("expected ',' or '") + close + "'");
  }

  void literal(std::string_view word) {
    if (s_.substr(pos_, word.size()) != word) fail("expected a JSON value");
    pos_ += word.size();
  }

  void digits() {
    if (!is_digit()) fail("expected a digit");
    while (is_digit()) ++pos_;
  }

  // -?(0|[1-9][0-9]*)(.[0-9]+)?([eE][+-]?[0-9]+)?
  void number() {
    eat('-');
    if (!is_digit()) fail("expected a JSON value");
    if (!eat('0')) digits();
    if (eat('.')) digits();
    if (eat('e') || eat('E')) {
      if (!eat('+')) eat('-');
      digits();
    }
  }

  uint32_t hex4() {
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i, ++pos_) {
      const char c = peek();
      const int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
      if (d < 0) fail("\\u must be followed by 4 hexadecimal digits");
      v = v << 4 | uint32_t(d);
    }
    return v;
  }

  // The code point of a \u escape (pos_ after the 'u'), a surrogate pair joined.
  uint32_t unicode_escape() {
    const uint32_t hi = hex4();
    if (hi >= 0xDC00 && hi <= 0xDFFF) fail("\\u escape is a low surrogate without a high one before it");
    if (hi < 0xD800 || hi > 0xDBFF) return hi;
    if (s_.substr(pos_, 2) != "\\u") fail("\\u escape is a high surrogate without a low one after it");
    pos_ += 2;
    const uint32_t lo = hex4();
    if (lo < 0xDC00 || lo > 0xDFFF) fail("\\u escape is a high surrogate without a low one after it");
    return 0x10000 + ((hi - 0xD800) << 10) + (lo - 0xDC00);
  }

  static void append_utf8(std::string& out, uint32_t cp) {
    if (cp < 0x80) {
      out += char(cp);
    } else if (cp < 0x800) {
      out += char(0xC0 | cp >> 6);
      out += char(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      out += char(0xE0 | cp >> 12);
      out += char(0x80 | (cp >> 6 & 0x3F));
      out += char(0x80 | (cp & 0x3F));
    } else {
      out += char(0xF0 | cp >> 18);
      out += char(0x80 | (cp >> 12 & 0x3F));
      out += char(0x80 | (cp >> 6 & 0x3F));
      out += char(0x80 | (cp & 0x3F));
    }
  }

  // A string at pos_, decoded; raw bytes other than control characters are copied as they are.
  std::string string() {
    if (!eat('"')) fail("expected a string");
    std::string out;
    while (true) {
      if (pos_ >= s_.size()) fail("unterminated string");
      const char c = s_[pos_++];
      if (c == '"') return out;
      if (static_cast<unsigned char>(c) < 0x20) fail("control character in a string (must be escaped)");
      if (c != '\\') {
        out += c;
        continue;
      }
      const char e = peek();
      ++pos_;
      switch (e) {
        case '"': case '\\': case '/': out += e; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': append_utf8(out, unicode_escape()); break;
        default: --pos_; fail("invalid escape in a string");
      }
    }
  }
};

}  // namespace

std::string json_string_field(std::string_view line, std::string_view field) {
  std::string found;
  Parser(line).line(field, found);
  return found;
}

}  // namespace moeut
