#include "checkpoints/hdf5_common.h"

#include <zlib.h>

#include <algorithm>
#include <bit>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <sstream>

namespace moeut::h5 {
namespace {

// HDF5 1.10 keeps the identifier of a file whose close failed (its last flush met a full disk)
// and closes it again in its atexit clean-up, which then crashes. Every file here is closed by
// its Handle, so that clean-up has nothing left to do: it is not installed (before HDF5 starts).
[[maybe_unused]] const bool kNoAtexitCleanup = H5dont_atexit() >= 0;

// The system error of the failed HDF5 call whose error stack this thread holds, as strerror
// gives it; "" when that failure was not a system call's. HDF5's file drivers record it as
// "errno = <n>" in their messages.
herr_t find_errno(unsigned, const H5E_error2_t* e, void* out) {
  const char* at = e->desc ? std::strstr(e->desc, "errno = ") : nullptr;
  if (at && *static_cast<int*>(out) == 0) *static_cast<int*>(out) = std::atoi(at + 8);
  return 0;
}

std::string system_reason() {
  int err = 0;
  if (H5Ewalk2(H5E_DEFAULT, H5E_WALK_DOWNWARD, find_errno, &err) < 0 || err <= 0) return "";
  return std::strerror(err);
}

struct IntAttr { const char* name; int64_t ModelConfig::*field; };
struct RealAttr { const char* name; double ModelConfig::*field; };
constexpr IntAttr kIntAttrs[] = {
    {"n_tokens", &ModelConfig::n_tokens},       {"d_model", &ModelConfig::d_model},
    {"n_layers", &ModelConfig::n_layers},       {"n_heads", &ModelConfig::n_heads},
    {"ff_n_experts", &ModelConfig::ff_n_experts}, {"att_n_experts", &ModelConfig::att_n_experts},
    {"d_head", &ModelConfig::d_head},           {"group_size", &ModelConfig::group_size},
    {"ff_k", &ModelConfig::ff_k},               {"att_k", &ModelConfig::att_k},
    {"ff_expert_size", &ModelConfig::ff_expert_size}};
constexpr RealAttr kRealAttrs[] = {{"entropy_reg", &ModelConfig::entropy_reg},
                                   {"att_entropy_reg", &ModelConfig::att_entropy_reg}};

void write_attr(hid_t obj, const char* name, hid_t file_type, hid_t mem_type, hid_t space, const void* value,
                const std::string& path) {
  Handle attr(H5Acreate2(obj, name, file_type, space, H5P_DEFAULT, H5P_DEFAULT), H5Aclose);
  check(attr.ok() && H5Awrite(attr.get(), mem_type, value) >= 0, path, std::string("cannot write attribute '") + name + "'");
}

void write_scalar_attr(hid_t obj, const char* name, hid_t file_type, hid_t mem_type, const void* value,
                       const std::string& path) {
  Handle space(H5Screate(H5S_SCALAR), H5Sclose);
  write_attr(obj, name, file_type, mem_type, space.get(), value, path);
}

Handle open_attr(hid_t obj, const char* name, const std::string& path) {
  check(H5Aexists(obj, name) > 0, path, std::string("missing attribute '") + name + "'");
  Handle attr(H5Aopen(obj, name, H5P_DEFAULT), H5Aclose);
  check(attr.ok(), path, std::string("cannot open attribute '") + name + "'");
  return attr;
}

void read_scalar_attr(hid_t obj, const char* name, hid_t mem_type, void* value, const std::string& path) {
  Handle attr = open_attr(obj, name, path);
  Handle space(H5Aget_space(attr.get()), H5Sclose);
  check(space.ok() && H5Sget_simple_extent_npoints(space.get()) == 1, path,
        std::string("attribute '") + name + "' is not a scalar");
  check(H5Aread(attr.get(), mem_type, value) >= 0, path, std::string("cannot read attribute '") + name + "'");
}

Handle string_type(size_t size) {
  Handle type(H5Tcopy(H5T_C_S1), H5Tclose);
  H5Tset_size(type.get(), std::max<size_t>(size, 1));
  H5Tset_strpad(type.get(), H5T_STR_NULLPAD);
  return type;
}

Handle open_dataset(hid_t loc, const char* name, const std::string& path) {
  check(H5Lexists(loc, name, H5P_DEFAULT) > 0, path, std::string("missing dataset '") + name + "'");
  Handle dset(H5Dopen2(loc, name, H5P_DEFAULT), H5Dclose);
  check(dset.ok(), path, std::string("cannot open dataset '") + name + "'");
  return dset;
}

int64_t column_length(hid_t dset, const char* name, const std::string& path) {
  const std::vector<int64_t> shape = dataset_shape(dset, std::string("dataset '") + name + "'", path);
  check(shape.size() == 1, path, std::string("dataset '") + name + "' is not one-dimensional");
  return shape[0];
}

std::string number(double v) {
  std::ostringstream s;
  s << v;
  return s.str();
}

}  // namespace

void silence_errors() { H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr); }

void check(bool ok, const std::string& path, const std::string& what) {
  if (ok) return;
  const std::string reason = system_reason();
  throw FileError(path + ": " + what + (reason.empty() ? "" : ": " + reason));
}

Handle create_file(const std::string& path, hsize_t userblock) {
  silence_errors();
  Handle fapl(H5Pcreate(H5P_FILE_ACCESS), H5Pclose), fcpl(H5Pcreate(H5P_FILE_CREATE), H5Pclose);
  check(fapl.ok() && fcpl.ok() && H5Pset_libver_bounds(fapl.get(), H5F_LIBVER_V18, H5F_LIBVER_LATEST) >= 0 &&
            H5Pset_userblock(fcpl.get(), userblock) >= 0,
        path, "cannot set up the file's properties");
  check(!std::filesystem::exists(path), path, "cannot create file: exists already");
  Handle file(H5Fcreate(path.c_str(), H5F_ACC_EXCL, fcpl.get(), fapl.get()), H5Fclose);
  check(file.ok(), path, "cannot create file");
  return file;
}

void close_file(Handle& file, const std::string& path) {
  check(file.close() >= 0, path, "cannot close (its last metadata was not written)");
}

Handle open_float_dataset(hid_t loc, const std::string& name, const std::string& path) {
  const std::string what = "dataset '" + name + "'";
  for (size_t end = name.find('/');; end = name.find('/', end + 1)) {
    const std::string link = name.substr(0, end);
    H5L_info_t info;
    check(H5Lexists(loc, link.c_str(), H5P_DEFAULT) > 0, path, "missing " + what);
    check(H5Lget_info(loc, link.c_str(), &info, H5P_DEFAULT) >= 0 && info.type == H5L_TYPE_HARD, path,
          what + ": '" + link + "' is a soft or external link; only objects stored in this file are read");
    if (end == std::string::npos) break;
  }
  Handle dset(H5Dopen2(loc, name.c_str(), H5P_DEFAULT), H5Dclose);
  check(dset.ok(), path, "cannot open " + what);
  Handle dcpl(H5Dget_create_plist(dset.get()), H5Pclose);
  check(dcpl.ok(), path, "cannot read the storage of " + what);
  check(H5Pget_layout(dcpl.get()) != H5D_VIRTUAL && H5Pget_external_count(dcpl.get()) == 0, path,
        what + " keeps its data in other files (virtual or external storage); only data stored in this file is read");
  Handle type(H5Dget_type(dset.get()), H5Tclose);
  check(type.ok() && H5Tget_class(type.get()) == H5T_FLOAT && H5Tget_size(type.get()) == 4, path,
        what + " does not hold 32-bit floats");
  return dset;
}

Handle open_file(const std::string& path) {
  silence_errors();
  check(std::filesystem::exists(path), path, "no such file");
  check(H5Fis_hdf5(path.c_str()) > 0, path, "not an HDF5 file (or truncated)");
  Handle file(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose);
  check(file.ok(), path, "cannot open (truncated or corrupt?)");
  return file;
}

void write_int_attr(hid_t obj, const char* name, int64_t value, const std::string& path) {
  write_scalar_attr(obj, name, H5T_STD_I64LE, H5T_NATIVE_INT64, &value, path);
}

void write_real_attr(hid_t obj, const char* name, double value, const std::string& path) {
  write_scalar_attr(obj, name, H5T_IEEE_F64LE, H5T_NATIVE_DOUBLE, &value, path);
}

void write_string_attr(hid_t obj, const char* name, const std::string& value, const std::string& path) {
  Handle type = string_type(value.size());
  write_scalar_attr(obj, name, type.get(), type.get(), value.c_str(), path);
}

void write_ints_attr(hid_t obj, const char* name, const std::vector<int64_t>& values, const std::string& path) {
  const hsize_t n = values.size();
  Handle space(H5Screate_simple(1, &n, nullptr), H5Sclose);
  write_attr(obj, name, H5T_STD_I64LE, H5T_NATIVE_INT64, space.get(), values.data(), path);
}

int64_t read_int_attr(hid_t obj, const char* name, const std::string& path) {
  int64_t v = 0;
  read_scalar_attr(obj, name, H5T_NATIVE_INT64, &v, path);
  return v;
}

double read_real_attr(hid_t obj, const char* name, const std::string& path) {
  double v = 0;
  read_scalar_attr(obj, name, H5T_NATIVE_DOUBLE, &v, path);
  return v;
}

std::string read_string_attr(hid_t obj, const char* name, const std::string& path) {
  Handle attr = open_attr(obj, name, path);
  Handle type(H5Aget_type(attr.get()), H5Tclose);
  check(type.ok() && H5Tget_class(type.get()) == H5T_STRING && H5Tis_variable_str(type.get()) == 0, path,
        std::string("attribute '") + name + "' is not a fixed-length string");
  std::string value(H5Tget_size(type.get()), '\0');
  Handle mem = string_type(value.size());
  check(H5Aread(attr.get(), mem.get(), value.data()) >= 0, path, std::string("cannot read attribute '") + name + "'");
  value.resize(std::strlen(value.c_str()));
  return value;
}

void write_ints(hid_t loc, const char* name, const std::vector<int64_t>& values, const std::string& path) {
  const hsize_t n = values.size();
  Handle space(H5Screate_simple(1, &n, nullptr), H5Sclose);
  Handle dset(H5Dcreate2(loc, name, H5T_STD_I64LE, space.get(), H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT), H5Dclose);
  check(dset.ok() && (n == 0 || H5Dwrite(dset.get(), H5T_NATIVE_INT64, H5S_ALL, H5S_ALL, H5P_DEFAULT,
                                         values.data()) >= 0),
        path, std::string("cannot write dataset '") + name + "'");
}

void write_strings(hid_t loc, const char* name, const std::vector<std::string>& values, const std::string& path) {
  // Fixed-length, null-padded: every HDF5 reader takes them without variable-length memory rules.
  size_t width = 1;
  for (const std::string& v : values) width = std::max(width, v.size());
  std::vector<char> packed(width * values.size(), '\0');
  for (size_t i = 0; i < values.size(); ++i) std::memcpy(packed.data() + i * width, values[i].data(), values[i].size());
  Handle type = string_type(width);
  const hsize_t n = values.size();
  Handle space(H5Screate_simple(1, &n, nullptr), H5Sclose);
  Handle dset(H5Dcreate2(loc, name, type.get(), space.get(), H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT), H5Dclose);
  check(dset.ok() && (n == 0 || H5Dwrite(dset.get(), type.get(), H5S_ALL, H5S_ALL, H5P_DEFAULT, packed.data()) >= 0),
        path, std::string("cannot write dataset '") + name + "'");
}

std::vector<int64_t> read_ints(hid_t loc, const char* name, const std::string& path) {
  Handle dset = open_dataset(loc, name, path);
  std::vector<int64_t> values(size_t(column_length(dset.get(), name, path)));
  check(values.empty() || H5Dread(dset.get(), H5T_NATIVE_INT64, H5S_ALL, H5S_ALL, H5P_DEFAULT, values.data()) >= 0,
        path, std::string("cannot read dataset '") + name + "'");
  return values;
}

std::vector<std::string> read_strings(hid_t loc, const char* name, const std::string& path) {
  Handle dset = open_dataset(loc, name, path);
  const size_t n = size_t(column_length(dset.get(), name, path));
  Handle type(H5Dget_type(dset.get()), H5Tclose);
  check(type.ok() && H5Tget_class(type.get()) == H5T_STRING && H5Tis_variable_str(type.get()) == 0, path,
        std::string("dataset '") + name + "' does not hold fixed-length strings");
  const size_t width = H5Tget_size(type.get());
  std::vector<char> packed(width * n + 1, '\0');
  Handle mem = string_type(width);
  check(n == 0 || H5Dread(dset.get(), mem.get(), H5S_ALL, H5S_ALL, H5P_DEFAULT, packed.data()) >= 0, path,
        std::string("cannot read dataset '") + name + "'");
  std::vector<std::string> values(n);
  for (size_t i = 0; i < n; ++i) values[i].assign(packed.data() + i * width, strnlen(packed.data() + i * width, width));
  return values;
}

void write_floats(hid_t loc, const std::string& name, const std::vector<int64_t>& shape, const float* data,
                  const std::string& path) {
  const std::vector<hsize_t> dims(shape.begin(), shape.end());
  Handle space(H5Screate_simple(int(dims.size()), dims.data(), nullptr), H5Sclose);
  Handle dset(H5Dcreate2(loc, name.c_str(), H5T_IEEE_F32LE, space.get(), H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT),
              H5Dclose);
  check(dset.ok() && H5Dwrite(dset.get(), H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, data) >= 0, path,
        "cannot write dataset '" + name + "'");
}

std::vector<int64_t> dataset_shape(hid_t dset, const std::string& what, const std::string& path) {
  Handle space(H5Dget_space(dset), H5Sclose);
  const int ndims = space.ok() ? H5Sget_simple_extent_ndims(space.get()) : -1;
  check(ndims >= 0, path, "cannot read the shape of " + what);
  std::vector<hsize_t> dims(static_cast<size_t>(ndims));
  H5Sget_simple_extent_dims(space.get(), dims.data(), nullptr);
  return {dims.begin(), dims.end()};
}

uint32_t crc32_of(const float* data, int64_t n) {
  static_assert(std::endian::native == std::endian::little, "checksums are over little-endian fp32 bytes");
  return uint32_t(crc32_z(0, reinterpret_cast<const Bytef*>(data), size_t(n) * sizeof(float)));
}

void write_model_attrs(hid_t obj, const ModelConfig& m, const std::string& path) {
  for (const IntAttr& a : kIntAttrs) write_int_attr(obj, a.name, m.*a.field, path);
  for (const RealAttr& a : kRealAttrs) write_real_attr(obj, a.name, m.*a.field, path);
}

ModelConfig read_model_attrs(hid_t obj, const std::string& path) {
  ModelConfig m;
  for (const IntAttr& a : kIntAttrs) m.*a.field = read_int_attr(obj, a.name, path);
  for (const RealAttr& a : kRealAttrs) m.*a.field = read_real_attr(obj, a.name, path);
  return m;
}

std::string model_difference(const ModelConfig& a, const char* a_name, const ModelConfig& b, const char* b_name) {
  auto differs = [&](const char* field, const std::string& x, const std::string& y) {
    return std::string(field) + " is " + x + " in " + a_name + ", " + y + " in " + b_name;
  };
  for (const IntAttr& f : kIntAttrs)
    if (a.*f.field != b.*f.field) return differs(f.name, std::to_string(a.*f.field), std::to_string(b.*f.field));
  for (const RealAttr& f : kRealAttrs)
    if (a.*f.field != b.*f.field) return differs(f.name, number(a.*f.field), number(b.*f.field));
  if (a.context != b.context) return differs("context", std::to_string(a.context), std::to_string(b.context));
  return "";
}

}  // namespace moeut::h5
