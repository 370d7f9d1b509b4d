// What the HDF5 files of this project share: owned identifiers, checked attribute and dataset
// I/O whose errors name the file, and the model configuration as attributes named like the
// official constructor's arguments (the interchange file's root attributes).
#pragma once
#include <hdf5.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/config.h"

namespace moeut::h5 {

// A missing, unreadable or malformed HDF5 file; what() names the file and the problem.
struct FileError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Owns one HDF5 identifier; closes it with the matching function.
class Handle {
 public:
  Handle(hid_t id, herr_t (*close)(hid_t)) : id_(id), close_(close) {}
  ~Handle() { if (id_ >= 0) close_(id_); }
  Handle(Handle&& o) noexcept : id_(o.id_), close_(o.close_) { o.id_ = -1; }
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;
  Handle& operator=(Handle&&) = delete;
  hid_t get() const { return id_; }
  bool ok() const { return id_ >= 0; }
  // Closes now, with the close function's result. The identifier is given up even when that
  // fails: HDF5 must not be asked to close it twice.
  herr_t close() {
    const herr_t result = id_ >= 0 ? close_(id_) : 0;
    id_ = -1;
    return result;
  }

 private:
  hid_t id_;
  herr_t (*close_)(hid_t);
};

// HDF5 prints its own error stack by default; this project reports errors itself.
void silence_errors();

// Throws FileError("<path>: <what>") unless ok. When the HDF5 call that failed met a system
// error (a full disk, an I/O error), the message ends with the system's reason.
void check(bool ok, const std::string& path, const std::string& what);

// Fails if the file exists. The file is written in the HDF5 1.8 format or later, whose
// metadata (superblock, object headers, attributes) carries checksums that HDF5 verifies on
// reading. A userblock of `userblock` bytes (0, or a power of two >= 512) is left at its start.
Handle create_file(const std::string& path, hsize_t userblock = 0);
Handle open_file(const std::string& path);    // read-only; refuses what is not HDF5
// Closes a file written through `file`, and checks that its last metadata reached the disk.
void close_file(Handle& file, const std::string& path);
// The dataset `name` (a path below loc) as stored in this file alone: every link on the path a
// hard link (no external or soft link), its data in the file (not external storage, not
// virtual), and of 32-bit floats. Refuses anything else, naming the dataset.
Handle open_float_dataset(hid_t loc, const std::string& name, const std::string& path);

void write_int_attr(hid_t obj, const char* name, int64_t value, const std::string& path);
void write_real_attr(hid_t obj, const char* name, double value, const std::string& path);
void write_string_attr(hid_t obj, const char* name, const std::string& value, const std::string& path);
void write_ints_attr(hid_t obj, const char* name, const std::vector<int64_t>& values, const std::string& path);
int64_t read_int_attr(hid_t obj, const char* name, const std::string& path);
double read_real_attr(hid_t obj, const char* name, const std::string& path);
std::string read_string_attr(hid_t obj, const char* name, const std::string& path);

// One-dimensional datasets (columns of a table), and a float dataset of any shape.
void write_ints(hid_t loc, const char* name, const std::vector<int64_t>& values, const std::string& path);
void write_strings(hid_t loc, const char* name, const std::vector<std::string>& values, const std::string& path);
std::vector<int64_t> read_ints(hid_t loc, const char* name, const std::string& path);
std::vector<std::string> read_strings(hid_t loc, const char* name, const std::string& path);
void write_floats(hid_t loc, const std::string& name, const std::vector<int64_t>& shape, const float* data,
                  const std::string& path);
std::vector<int64_t> dataset_shape(hid_t dset, const std::string& what, const std::string& path);

// zlib's CRC-32 of n floats' little-endian bytes (a dataset's checksum attribute, crc32).
uint32_t crc32_of(const float* data, int64_t n);

// The interchange attributes (n_tokens, d_model, ... att_entropy_reg); context is not among
// them. read_model_attrs leaves context at its default and does not validate.
void write_model_attrs(hid_t obj, const ModelConfig& m, const std::string& path);
ModelConfig read_model_attrs(hid_t obj, const std::string& path);
// The first field (interchange attributes, then context) in which a and b differ, as
// "<field> is <a> in <a_name>, <b> in <b_name>"; empty when they are the same model.
std::string model_difference(const ModelConfig& a, const char* a_name, const ModelConfig& b, const char* b_name);

}  // namespace moeut::h5
