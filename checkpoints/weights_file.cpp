#include "checkpoints/weights_file.h"

#include <algorithm>
#include <cmath>
#include <filesystem>

#include "checkpoints/hdf5_common.h"
#include "core/write_error.h"

namespace moeut {
namespace {

using h5::check;
using h5::Handle;

std::string shape_string(const std::vector<int64_t>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

void write_file(const std::string& path, const ModelConfig& m, const float* params) {
  const std::filesystem::path target(path);
  if (target.has_parent_path()) std::filesystem::create_directories(target.parent_path());
  const std::string tmp = path + ".tmp";
  std::filesystem::remove(tmp);  // left by an interrupted write
  {
    Handle file = h5::create_file(tmp);
    h5::write_model_attrs(file.get(), m, tmp);
    const ParamLayout layout(m);
    for (const TensorSpec& t : layout.tensors()) {
      h5::write_floats(file.get(), t.name, t.shape, params + t.offset, tmp);
      Handle dset(H5Dopen2(file.get(), t.name.c_str(), H5P_DEFAULT), H5Dclose);
      check(dset.ok(), tmp, "cannot open dataset '" + t.name + "'");
      h5::write_int_attr(dset.get(), "crc32", h5::crc32_of(params + t.offset, t.numel), tmp);
    }
    check(H5Fflush(file.get(), H5F_SCOPE_GLOBAL) >= 0, tmp, "cannot flush");
    h5::close_file(file, tmp);
  }
  std::error_code ec;
  std::filesystem::rename(tmp, target, ec);
  check(!ec, path, "cannot rename " + tmp + " into place: " + ec.message());
}

Weights read_file(const std::string& path) {
  Handle file = h5::open_file(path);
  Handle root(H5Gopen2(file.get(), "/", H5P_DEFAULT), H5Gclose);
  Weights w;
  w.config = h5::read_model_attrs(root.get(), path);
  try {
    validate(w.config);
  } catch (const ConfigError& e) {
    throw WeightsError(path + ": attributes describe an " + e.what());
  }
  const ParamLayout layout(w.config);
  w.params.assign(size_t(layout.total()), 0.f);

  H5G_info_t info;
  check(H5Gget_info(root.get(), &info) >= 0, path, "cannot list datasets");
  check(info.nlinks == hsize_t(layout.tensors().size()), path,
        "holds " + std::to_string(info.nlinks) + " objects, the configuration has " +
            std::to_string(layout.tensors().size()) + " parameters");
  for (const TensorSpec& t : layout.tensors()) {
    check(H5Lexists(root.get(), t.name.c_str(), H5P_DEFAULT) > 0, path, "missing dataset '" + t.name + "'");
    Handle dset = h5::open_float_dataset(root.get(), t.name, path);
    const std::vector<int64_t> shape = h5::dataset_shape(dset.get(), "dataset '" + t.name + "'", path);
    check(shape == t.shape, path,
          "dataset '" + t.name + "' has shape " + shape_string(shape) + ", expected " + shape_string(t.shape));
    check(H5Dread(dset.get(), H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, w.params.data() + t.offset) >= 0,
          path, "cannot read dataset '" + t.name + "' (truncated or corrupt?)");
    const float* values = w.params.data() + t.offset;
    const auto bad = std::find_if(values, values + t.numel, [](float x) { return !std::isfinite(x); });
    check(bad == values + t.numel, path,
          "dataset '" + t.name + "' holds " + std::to_string(*bad) + " at element " + std::to_string(bad - values) +
              ": weights must be finite");
    // Files of this project carry a checksum per dataset; interchange files from elsewhere may not.
    const htri_t has_crc = H5Aexists(dset.get(), "crc32");
    check(has_crc >= 0, path, "cannot read the attributes of dataset '" + t.name + "'");
    if (has_crc > 0) {
      const int64_t saved = h5::read_int_attr(dset.get(), "crc32", path);
      const uint32_t crc = h5::crc32_of(values, t.numel);
      check(int64_t(crc) == saved, path,
            "dataset '" + t.name + "': checksum mismatch (crc32 " + std::to_string(crc) + ", its attribute says " +
                std::to_string(saved) + ")");
    }
  }
  return w;
}

}  // namespace

void write_weights(const std::string& path, const ModelConfig& m, const float* params) {
  try {
    write_file(path, m, params);
  } catch (const std::exception& e) {
    std::error_code ignored;  // what is left of the temporary file goes; the message says why
    std::filesystem::remove(path + ".tmp", ignored);
    throw WriteError(e.what());
  }
}

Weights read_weights(const std::string& path) {
  try {
    return read_file(path);
  } catch (const h5::FileError& e) {
    throw WeightsError(e.what());
  }
}

}  // namespace moeut
