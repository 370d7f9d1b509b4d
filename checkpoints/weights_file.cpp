#include "checkpoints/weights_file.h"

#include <hdf5.h>

#include <cstdio>
#include <filesystem>
#include <algorithm>

namespace moeut {
namespace {

// Owns one HDF5 identifier; closes it with the matching function.
class Handle {
 public:
  Handle(hid_t id, herr_t (*close)(hid_t)) : id_(id), close_(close) {}
  ~Handle() { if (id_ >= 0) close_(id_); }
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;
  hid_t get() const { return id_; }
  bool ok() const { return id_ >= 0; }

 private:
  hid_t id_;
  herr_t (*close_)(hid_t);
};

// HDF5 prints its own error stack by default; this project reports errors itself.
void silence_hdf5() { H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr); }

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

void check(bool ok, const std::string& path, const std::string& what) {
  if (!ok) throw WeightsError(path + ": " + what);
}

void write_scalar_attr(hid_t obj, const char* name, hid_t file_type, hid_t mem_type, const void* value,
                       const std::string& path) {
  Handle space(H5Screate(H5S_SCALAR), H5Sclose);
  Handle attr(H5Acreate2(obj, name, file_type, space.get(), H5P_DEFAULT, H5P_DEFAULT), H5Aclose);
  check(attr.ok() && H5Awrite(attr.get(), mem_type, value) >= 0, path, std::string("cannot write attribute ") + name);
}

void read_scalar_attr(hid_t obj, const char* name, hid_t mem_type, void* value, const std::string& path) {
  check(H5Aexists(obj, name) > 0, path, std::string("missing attribute '") + name + "'");
  Handle attr(H5Aopen(obj, name, H5P_DEFAULT), H5Aclose);
  Handle space(H5Aget_space(attr.get()), H5Sclose);
  check(attr.ok() && H5Sget_simple_extent_npoints(space.get()) == 1, path,
        std::string("attribute '") + name + "' is not a scalar");
  check(H5Aread(attr.get(), mem_type, value) >= 0, path, std::string("cannot read attribute '") + name + "'");
}

}  // namespace

void write_weights(const std::string& path, const ModelConfig& m, const float* params) {
  silence_hdf5();
  const std::filesystem::path target(path);
  if (target.has_parent_path()) std::filesystem::create_directories(target.parent_path());
  const std::string tmp = path + ".tmp";
  {
    Handle file(H5Fcreate(tmp.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT), H5Fclose);
    check(file.ok(), tmp, "cannot create file");
    Handle root(H5Gopen2(file.get(), "/", H5P_DEFAULT), H5Gclose);
    for (const IntAttr& a : kIntAttrs)
      write_scalar_attr(root.get(), a.name, H5T_STD_I64LE, H5T_NATIVE_INT64, &(m.*a.field), tmp);
    for (const RealAttr& a : kRealAttrs)
      write_scalar_attr(root.get(), a.name, H5T_IEEE_F64LE, H5T_NATIVE_DOUBLE, &(m.*a.field), tmp);
    const ParamLayout layout(m);
    for (const TensorSpec& t : layout.tensors()) {
      std::vector<hsize_t> dims(t.shape.begin(), t.shape.end());
      Handle space(H5Screate_simple(int(dims.size()), dims.data(), nullptr), H5Sclose);
      Handle dset(H5Dcreate2(file.get(), t.name.c_str(), H5T_IEEE_F32LE, space.get(), H5P_DEFAULT,
                             H5P_DEFAULT, H5P_DEFAULT), H5Dclose);
      check(dset.ok() && H5Dwrite(dset.get(), H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT,
                                  params + t.offset) >= 0, tmp, "cannot write dataset " + t.name);
    }
    check(H5Fflush(file.get(), H5F_SCOPE_GLOBAL) >= 0, tmp, "cannot flush");
  }
  std::error_code ec;
  std::filesystem::rename(tmp, target, ec);
  check(!ec, path, "cannot rename " + tmp + " into place: " + ec.message());
}

Weights read_weights(const std::string& path) {
  silence_hdf5();
  check(std::filesystem::exists(path), path, "no such file");
  check(H5Fis_hdf5(path.c_str()) > 0, path, "not an HDF5 file (or truncated)");
  Handle file(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose);
  check(file.ok(), path, "cannot open");
  Handle root(H5Gopen2(file.get(), "/", H5P_DEFAULT), H5Gclose);

  Weights w;
  for (const IntAttr& a : kIntAttrs) read_scalar_attr(root.get(), a.name, H5T_NATIVE_INT64, &(w.config.*a.field), path);
  for (const RealAttr& a : kRealAttrs) read_scalar_attr(root.get(), a.name, H5T_NATIVE_DOUBLE, &(w.config.*a.field), path);
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
    Handle dset(H5Dopen2(file.get(), t.name.c_str(), H5P_DEFAULT), H5Dclose);
    Handle space(H5Dget_space(dset.get()), H5Sclose);
    check(dset.ok() && space.ok(), path, "cannot open dataset '" + t.name + "'");
    std::vector<hsize_t> dims(size_t(std::max(0, H5Sget_simple_extent_ndims(space.get()))));
    H5Sget_simple_extent_dims(space.get(), dims.data(), nullptr);
    const std::vector<hsize_t> want(t.shape.begin(), t.shape.end());
    if (dims != want) {
      auto str = [](const std::vector<hsize_t>& v) {
        std::string s = "[";
        for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
        return s + "]";
      };
      throw WeightsError(path + ": dataset '" + t.name + "' has shape " + str(dims) + ", expected " + str(want));
    }
    check(H5Dread(dset.get(), H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, w.params.data() + t.offset) >= 0,
          path, "cannot read dataset '" + t.name + "' (truncated or corrupt?)");
  }
  return w;
}

}  // namespace moeut
