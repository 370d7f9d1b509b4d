// moeut-prepare-data's input: plain-text or JSON-lines files read one document at a time, so that
// a corpus of any size streams through (docs/DATA.md).
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

namespace moeut {

struct InputSpec {
  std::vector<std::string> paths;
  std::string format;      // "text", "jsonl", or "" to choose by file: .jsonl is JSON lines
  std::string text_field;  // the field of each JSON line that holds its text
};

// Whether s holds only whitespace (such a line or document carries no text).
bool is_blank(std::string_view s);

// Calls use(doc, index) for each non-blank document of the inputs in order, index counting them
// from 0 across all files: a line of a text file (a trailing CR removed), or the text field of a
// line of a JSON-lines file (blank lines skipped). Warns on stderr about a file without text.
// Throws DataError naming the file (and line) for an unreadable file or a bad JSON line.
void for_each_document(const InputSpec& in, const std::function<void(const std::string& doc, uint64_t index)>& use);

}  // namespace moeut
