// Token files as one stream (core/token_files.h).
#include "core/token_files.h"

#include <glob.h>

#include <algorithm>
#include <filesystem>

namespace moeut {
namespace {

bool is_pattern(const std::string& item) { return item.find_first_of("*?[") != std::string::npos; }

// The matches of one glob pattern, sorted by name (glob's own order follows the locale).
std::vector<std::string> glob_sorted(const std::string& pattern) {
  glob_t g{};
  const int rc = ::glob(pattern.c_str(), 0, nullptr, &g);
  std::vector<std::string> found(g.gl_pathv, g.gl_pathv + (rc == 0 ? g.gl_pathc : 0));
  ::globfree(&g);
  if (rc == GLOB_NOMATCH) throw DataError(pattern + ": no file matches this pattern");
  if (rc != 0) throw DataError(pattern + ": cannot expand this pattern (a directory on its path cannot be read)");
  std::sort(found.begin(), found.end());
  return found;
}

}  // namespace

std::vector<std::string> expand_token_paths(const std::string& spec) {
  std::error_code ec;
  if (std::filesystem::exists(spec, ec)) return {spec};
  std::vector<std::string> paths;
  size_t begin = 0;
  while (begin <= spec.size()) {
    const size_t end = std::min(spec.find(',', begin), spec.size());
    const std::string item = spec.substr(begin, end - begin);
    begin = end + 1;
    if (item.empty()) continue;  // a trailing or doubled comma
    if (!is_pattern(item)) {
      paths.push_back(item);
      continue;
    }
    for (auto& p : glob_sorted(item)) paths.push_back(std::move(p));
  }
  if (paths.empty()) throw DataError("'" + spec + "': names no token file");
  return paths;
}

TokenFiles::TokenFiles(const std::string& spec) : spec_(spec), starts_{0} {
  for (const std::string& path : expand_token_paths(spec)) {
    TokenFile f(path);
    if (!files_.empty() && f.vocab_size() != vocab_size())
      throw DataError(path + ": vocab_size " + std::to_string(f.vocab_size()) + " differs from " +
                      files_.front().path() + "'s " + std::to_string(vocab_size()) +
                      " (the files of one data option must share a vocabulary)");
    starts_.push_back(starts_.back() + f.size());
    files_.push_back(std::move(f));
  }
}

void TokenFiles::read(uint64_t begin, std::span<int32_t> out) const {
  if (begin > size() || out.size() > size() - begin)
    throw DataError(spec_ + ": read out of range: tokens [" + std::to_string(begin) + ", " +
                    std::to_string(begin + out.size()) + ") of " + std::to_string(size()));
  // The file holding `begin`: the last whose first token is not past it.
  size_t i = size_t(std::upper_bound(starts_.begin(), starts_.end(), begin) - starts_.begin()) - 1;
  for (size_t done = 0; done < out.size(); ++i) {
    const uint64_t at = begin + done - starts_[i];
    const size_t n = size_t(std::min<uint64_t>(out.size() - done, files_[i].size() - at));
    files_[i].read(at, out.subspan(done, n));
    done += n;
  }
}

void TokenFiles::check_vocabulary() const {
  for (const TokenFile& f : files_) f.check_vocabulary();
}

}  // namespace moeut
