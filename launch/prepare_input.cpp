// Streaming reader of text and JSON-lines inputs (launch/prepare_input.h).
#include "launch/prepare_input.h"

#include <filesystem>
#include <fstream>
#include <iostream>

#include "core/json_line.h"
#include "core/token_file.h"

namespace moeut {
namespace {

namespace fs = std::filesystem;

bool is_jsonl(const InputSpec& in, const std::string& path) {
  return in.format.empty() ? fs::path(path).extension() == ".jsonl" : in.format == "jsonl";
}

std::ifstream open_input(const std::string& path) {
  std::error_code ec;
  const auto status = fs::status(path, ec);
  if (!fs::exists(status)) throw DataError(path + ": cannot read: no such file");
  if (!fs::is_regular_file(status)) throw DataError(path + ": cannot read: not a regular file");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw DataError(path + ": cannot open for reading");
  return in;
}

// The documents of one file; returns how many were not blank.
uint64_t read_file(const InputSpec& in, const std::string& path, uint64_t first,
                   const std::function<void(const std::string&, uint64_t)>& use) {
  const bool jsonl = is_jsonl(in, path);
  std::ifstream file = open_input(path);
  uint64_t kept = 0, line_number = 0;
  std::string doc;
  for (std::string line; std::getline(file, line);) {
    ++line_number;
    if (!line.empty() && line.back() == '\r') line.pop_back();  // tolerate CRLF text
    if (is_blank(line)) continue;
    if (jsonl) {
      try {
        doc = json_string_field(line, in.text_field);
      } catch (const JsonLineError& e) {
        throw DataError(path + ":" + std::to_string(line_number) + ": " + e.what());
      }
    } else {
      doc.swap(line);
    }
    if (is_blank(doc)) continue;
    use(doc, first + kept++);
  }
  if (file.bad()) throw DataError(path + ": read error");
  return kept;
}

}  // namespace

bool is_blank(std::string_view s) { return s.find_first_not_of(" \t\r\n\v\f") == std::string_view::npos; }

void for_each_document(const InputSpec& in, const std::function<void(const std::string&, uint64_t)>& use) {
  uint64_t count = 0;
  for (const std::string& path : in.paths) {
    const uint64_t kept = read_file(in, path, count, use);
    if (kept == 0) std::cerr << "warning: " << path << ": no non-blank text\n";
    count += kept;
  }
  if (count == 0) {
    std::string names;
    for (const auto& p : in.paths) names += (names.empty() ? "" : ", ") + p;
    throw DataError(names + ": no non-blank text in the input");
  }
}

}  // namespace moeut
