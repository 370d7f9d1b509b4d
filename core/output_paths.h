// Checks, before a run trains, that the files it writes can be written, so that a mistyped path
// is refused at start-up rather than after the last step. Each refusal is a ConfigError naming
// the option, the path and the problem.
#pragma once
#include <string>

namespace moeut {

// A file written whole at some later point (a weights file, the metrics file): its parent
// directories are created, as its writer would, the parent must be a directory this process can
// create files in, and the path must not name a directory.
void check_output_file(const char* option, const std::string& path);

// A directory files are written into (checkpoint_dir): created when missing; it must be a
// directory this process can create files in.
void check_output_directory(const char* option, const std::string& path);

}  // namespace moeut
