#include "checkpoints/checkpoint_dir.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>

#include "checkpoints/checkpoint.h"

namespace fs = std::filesystem;

namespace moeut {
namespace {

[[noreturn]] void fail(const std::string& path, const std::string& what) { throw CheckpointError(path + ": " + what); }

std::string system_reason() { return std::strerror(errno); }

// Step of a complete checkpoint directory name (step_<digits> holding a manifest), or -1.
int64_t checkpoint_step(const fs::directory_entry& e) {
  const std::string name = e.path().filename().string();
  if (name.size() <= 5 || name.size() > 23 || name.compare(0, 5, "step_") != 0 ||
      !std::all_of(name.begin() + 5, name.end(), [](char c) { return c >= '0' && c <= '9'; }))
    return -1;
  if (!e.is_directory() || !fs::exists(e.path() / "manifest.h5")) return -1;
  return std::stoll(name.substr(5));
}

std::string this_host() {
  char host[256] = {};
  if (::gethostname(host, sizeof host - 1) != 0) return "unknown-host";
  return host;
}

// Writes "<host> <pid>\n" to a file of this process, then links it to `path`: the lock appears
// whole or not at all. False when `path` exists.
bool create_lock(const std::string& path, const std::string& owner) {
  const std::string mine = path + "." + std::to_string(::getpid());
  const int fd = ::open(mine.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail(mine, "cannot create the lock: " + system_reason());
  const std::string text = owner + "\n";
  const bool written = ::write(fd, text.data(), text.size()) == ssize_t(text.size()) && ::fsync(fd) == 0;
  const std::string reason = system_reason();
  if (::close(fd) != 0 || !written) {
    ::unlink(mine.c_str());
    fail(mine, "cannot write the lock: " + reason);
  }
  const bool linked = ::link(mine.c_str(), path.c_str()) == 0;
  const int err = errno;
  if (::unlink(mine.c_str()) != 0) fail(mine, "cannot remove: " + system_reason());
  if (!linked && err != EEXIST) fail(path, std::string("cannot create the lock: ") + std::strerror(err));
  return linked;
}

}  // namespace

std::string step_directory(const std::string& checkpoint_dir, int64_t step) {
  char name[32];
  std::snprintf(name, sizeof name, "step_%08lld", (long long)step);
  return (fs::path(checkpoint_dir) / name).string();
}

std::map<int64_t, fs::path> complete_checkpoints(const std::string& dir) {
  std::map<int64_t, fs::path> out;
  if (!fs::is_directory(dir)) return out;
  for (const fs::directory_entry& e : fs::directory_iterator(dir))
    if (const int64_t step = checkpoint_step(e); step >= 0) out[step] = e.path();
  return out;
}

std::string latest_checkpoint(const std::string& checkpoint_dir) {
  const std::map<int64_t, fs::path> all = complete_checkpoints(checkpoint_dir);
  return all.empty() ? "" : all.rbegin()->second.string();
}

fs::path hidden(const fs::path& step_dir, const char* what) {
  std::string name = ".";
  name += step_dir.filename().string();
  name += '.';
  name += what;
  return step_dir.parent_path() / name;
}

void discard_checkpoint(const fs::path& step_dir) {
  const fs::path doomed = hidden(step_dir, "deleting");
  fs::remove_all(doomed);
  fs::rename(step_dir, doomed);
  fs::remove_all(doomed);
}

std::vector<std::string> remove_stale_directories(const std::string& checkpoint_dir) {
  std::vector<std::string> removed;
  for (const fs::directory_entry& e : fs::directory_iterator(checkpoint_dir)) {
    const std::string name = e.path().filename().string();
    const auto ends_with = [&](const std::string& tail) {
      return name.size() > tail.size() && name.compare(name.size() - tail.size(), tail.size(), tail) == 0;
    };
    if (name.rfind(".step_", 0) == 0 && (ends_with(".tmp") || ends_with(".deleting"))) removed.push_back(e.path());
  }
  for (const std::string& path : removed) fs::remove_all(path);
  return removed;
}

CheckpointLock::CheckpointLock(const std::string& checkpoint_dir, const std::function<void(const std::string&)>& note)
    : path_((fs::path(checkpoint_dir) / file_name()).string()),
      owner_(this_host() + " " + std::to_string(::getpid())) {
  // Processes of this host that find the same stale lock take it over one at a time.
  const int dir = ::open(checkpoint_dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir < 0) fail(checkpoint_dir, "cannot open: " + system_reason());
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }  // also releases the flock
  } closer{dir};
  // Filesystems without flock (some Lustre mounts) leave the takeover unserialised.
  if (::flock(dir, LOCK_EX) != 0 && errno != ENOLCK && errno != EOPNOTSUPP)
    fail(checkpoint_dir, "cannot flock: " + system_reason());
  while (!create_lock(path_, owner_)) {
    std::ifstream in(path_);
    std::string host;
    long long pid = 0;
    if (!(in >> host >> pid) || pid <= 0)
      fail(path_, "is a lock file that names no process: if no run uses " + checkpoint_dir + ", remove it");
    const bool gone = host == this_host() && ::kill(pid_t(pid), 0) != 0 && errno == ESRCH;
    if (!gone)
      fail(checkpoint_dir, "is in use by process " + std::to_string(pid) + " on host " + host + " (lock file " + path_ +
                               "): two runs saving into one directory would lose each other's checkpoints; if that "
                               "process is gone, remove the lock file");
    note("taking over the lock of " + checkpoint_dir + " from process " + std::to_string(pid) + " on this host (" +
         host + "), which is gone");
    if (::unlink(path_.c_str()) != 0 && errno != ENOENT) fail(path_, "cannot remove the stale lock: " + system_reason());
  }
}

CheckpointLock::~CheckpointLock() {
  // Only this run's lock: nothing else removes it while the run lives.
  std::ifstream in(path_);
  std::string text;
  std::getline(in, text);
  if (text == owner_ && ::unlink(path_.c_str()) != 0)
    std::fprintf(stderr, "warning: %s: cannot remove this run's lock: %s\n", path_.c_str(), std::strerror(errno));
}

}  // namespace moeut
