#include "core/output_paths.h"

#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <system_error>
#include <vector>

#include "core/config.h"

namespace fs = std::filesystem;

namespace moeut {
namespace {

[[noreturn]] void refuse(const char* option, const std::string& path, const std::string& problem) {
  throw ConfigError("invalid configuration: " + std::string(option) + ": '" + shown(path) + "' " + problem);
}

// Creates `dir` when missing and checks it is a directory a file can be created in: by creating
// one, which also catches read-only file systems and permissions that access() would not.
void check_writable_directory(const char* option, const std::string& path, const fs::path& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) refuse(option, path, "cannot be written: cannot create the directory '" + shown(dir.string()) + "': " + ec.message());
  if (!fs::is_directory(dir, ec))
    refuse(option, path, "cannot be written: '" + shown(dir.string()) + "' is not a directory");
  std::string probe = (dir / ".moeut-write-check-XXXXXX").string();
  std::vector<char> name(probe.begin(), probe.end());
  name.push_back('\0');
  const int fd = ::mkstemp(name.data());
  if (fd < 0)
    refuse(option, path, "cannot be written: cannot create a file in '" + shown(dir.string()) + "': " + std::strerror(errno));
  ::close(fd);
  if (::unlink(name.data()) != 0)
    refuse(option, path, "cannot be written: cannot remove the test file '" + std::string(name.data()) +
                             "': " + std::strerror(errno));
}

}  // namespace

void check_output_file(const char* option, const std::string& path) {
  const fs::path target(path);
  std::error_code ec;
  if (fs::is_directory(target, ec)) refuse(option, path, "is a directory; give the path of a file");
  if (!target.has_filename()) refuse(option, path, "names no file (it ends in a separator)");
  check_writable_directory(option, path, target.has_parent_path() ? target.parent_path() : fs::path("."));
}

void check_output_directory(const char* option, const std::string& path) {
  std::error_code ec;
  if (fs::exists(path, ec) && !fs::is_directory(path, ec)) refuse(option, path, "exists and is not a directory");
  check_writable_directory(option, path, fs::path(path));
}

}  // namespace moeut
