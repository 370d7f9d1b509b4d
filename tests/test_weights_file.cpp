// The interchange weights file, read back through the HDF5 API itself: exactly the spec's
// dataset names, shapes and fp32 type, and exactly the constructor-argument attributes.
#include <gtest/gtest.h>
#include <hdf5.h>

#include <cmath>
#include <filesystem>
#include <functional>
#include <fstream>
#include <map>
#include <cstring>

#include "checkpoints/weights_file.h"
#include "core/model.h"
#include "small_config.h"

namespace moeut {
namespace {

ModelConfig small_config() {
  return test::small_model({.d_model = 12, .n_layers = 4, .group_size = 2, .ff_n_experts = 6, .ff_k = 2,
                            .ff_expert_size = 5, .n_tokens = 50});
}

// The spec's "Interchange names" with the shapes of its "Parameters" section.
std::map<std::string, std::vector<hsize_t>> spec_datasets(const ModelConfig& m) {
  const hsize_t d = m.d_model, V = m.n_tokens, hd = m.n_heads * m.d_head, he = m.n_heads * m.att_n_experts;
  const hsize_t E = m.ff_n_experts, es = m.ff_expert_size, dh = m.d_head;
  std::map<std::string, std::vector<hsize_t>> out = {{"embedding.weight", {V, d}}, {"out_norm.weight", {d}},
                                                     {"out_norm.bias", {d}}, {"lm_head.weight", {V, d}},
                                                     {"lm_head.bias", {V}}};
  for (int g = 0; g < m.group_size; ++g) {
    const std::string p = "transformer.layers." + std::to_string(g) + ".";
    for (const char* ln : {"ln1", "ln2"}) {
      out[p + ln + ".weight"] = {d};
      out[p + ln + ".bias"] = {d};
    }
    out[p + "attention.q.weight"] = {hd, d};
    out[p + "attention.k.weight"] = {hd, d};
    out[p + "attention.v"] = {he, d, dh};
    out[p + "attention.o"] = {he, dh, d};
    out[p + "attention.sel_v"] = {he, d};
    out[p + "attention.sel_o"] = {he, d};
    out[p + "ffn.keys"] = {E, d, es};
    out[p + "ffn.values"] = {E, es, d};
    out[p + "ffn.expert_sel"] = {E, d};
  }
  return out;
}

std::string temp_path(const std::string& name) {
  return (std::filesystem::path(testing::TempDir()) / ("moeut_" + name)).string();
}

TEST(WeightsFile, HasExactlyTheSpecNamesShapesTypesAndAttributes) {
  const ModelConfig m = small_config();
  Model<float> model(m);
  model.init(1);
  const std::string path = temp_path("weights.h5");
  write_weights(path, m, model.params.data());

  hid_t file = H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  ASSERT_GE(file, 0);
  const auto expected = spec_datasets(m);
  H5G_info_t info;
  ASSERT_GE(H5Gget_info(file, &info), 0);
  EXPECT_EQ(info.nlinks, expected.size());
  for (hsize_t i = 0; i < info.nlinks; ++i) {
    char name[256];
    H5Lget_name_by_idx(file, ".", H5_INDEX_NAME, H5_ITER_INC, i, name, sizeof name, H5P_DEFAULT);
    ASSERT_TRUE(expected.count(name)) << "unexpected dataset " << name;
    hid_t dset = H5Dopen2(file, name, H5P_DEFAULT);
    hid_t space = H5Dget_space(dset), type = H5Dget_type(dset);
    std::vector<hsize_t> dims(size_t(H5Sget_simple_extent_ndims(space)));
    H5Sget_simple_extent_dims(space, dims.data(), nullptr);
    EXPECT_EQ(dims, expected.at(name)) << name;
    EXPECT_GT(H5Tequal(type, H5T_IEEE_F32LE), 0) << name << " is not fp32";
    // Values: the model's tensor, element order preserved.
    std::vector<float> data(model.layout().at(name).numel);
    H5Dread(dset, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, data.data());
    EXPECT_EQ(0, std::memcmp(data.data(), model.param(name), data.size() * sizeof(float))) << name;
    H5Tclose(type);
    H5Sclose(space);
    H5Dclose(dset);
  }
  const std::map<std::string, double> attrs = {
      {"d_model", 12}, {"n_layers", 4}, {"n_heads", 2}, {"ff_n_experts", 6}, {"att_n_experts", 3},
      {"d_head", 8}, {"group_size", 2}, {"ff_k", 2}, {"att_k", 2}, {"ff_expert_size", 5},
      {"entropy_reg", 0.01}, {"att_entropy_reg", 0.001}, {"n_tokens", 50}};
  H5O_info_t oinfo;
  ASSERT_GE(H5Oget_info(file, &oinfo), 0);
  EXPECT_EQ(oinfo.num_attrs, attrs.size());
  for (const auto& [name, value] : attrs) {
    ASSERT_GT(H5Aexists(file, name.c_str()), 0) << name;
    hid_t a = H5Aopen(file, name.c_str(), H5P_DEFAULT);
    double v = 0;
    H5Aread(a, H5T_NATIVE_DOUBLE, &v);
    EXPECT_DOUBLE_EQ(v, value) << name;
    H5Aclose(a);
  }
  H5Fclose(file);
  EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));

  const Weights back = read_weights(path);
  EXPECT_EQ(back.params, model.params);
  EXPECT_EQ(back.config.ff_expert_size, 5);
}

void expect_refused(const std::string& path, const std::string& words) {
  try {
    read_weights(path);
    ADD_FAILURE() << path << " was accepted";
  } catch (const WeightsError& e) {
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
  }
}

TEST(WeightsFile, RefusesMissingTruncatedForeignAndMismatchingFiles) {
  expect_refused(temp_path("absent.h5"), "no such file");
  const std::string text = temp_path("text.h5");
  std::ofstream(text) << "not hdf5";
  expect_refused(text, "not an HDF5 file");

  const ModelConfig m = small_config();
  Model<float> model(m);
  const std::string good = temp_path("good.h5");
  write_weights(good, m, model.params.data());
  const std::string cut = temp_path("cut.h5");
  std::filesystem::copy_file(good, cut, std::filesystem::copy_options::overwrite_existing);
  std::filesystem::resize_file(cut, std::filesystem::file_size(good) / 2);
  try {
    read_weights(cut);
    ADD_FAILURE() << "truncated file accepted";
  } catch (const WeightsError& e) {
    EXPECT_NE(std::string(e.what()).find(cut), std::string::npos) << e.what();
  }

  // A dataset with the wrong shape: rewrite one as [1].
  const std::string bad = temp_path("badshape.h5");
  std::filesystem::copy_file(good, bad, std::filesystem::copy_options::overwrite_existing);
  hid_t f = H5Fopen(bad.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
  H5Ldelete(f, "lm_head.bias", H5P_DEFAULT);
  const hsize_t one = 1;
  hid_t space = H5Screate_simple(1, &one, nullptr);
  hid_t d = H5Dcreate2(f, "lm_head.bias", H5T_IEEE_F32LE, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
  H5Dclose(d);
  H5Sclose(space);
  H5Fclose(f);
  expect_refused(bad, "'lm_head.bias' has shape [1], expected [50]");
}

// Replaces dataset `name` of a weights file by what `make` creates under that name.
void replace_dataset(const std::string& path, const std::string& name, const std::function<void(hid_t file)>& make) {
  hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
  ASSERT_GE(f, 0);
  ASSERT_GE(H5Ldelete(f, name.c_str(), H5P_DEFAULT), 0);
  make(f);
  H5Fclose(f);
}

// What an untrusted weights file may hold instead of its own finite fp32 data: each refused,
// naming the dataset.
TEST(WeightsFile, RefusesNonFiniteIntegerLinkedAndExternalData) {
  const ModelConfig m = small_config();
  Model<float> model(m);
  model.init(1);
  const std::string good = temp_path("trusted.h5");
  write_weights(good, m, model.params.data());
  auto copy = [&](const std::string& name) {
    const std::string path = temp_path(name);
    std::filesystem::copy_file(good, path, std::filesystem::copy_options::overwrite_existing);
    return path;
  };
  const hsize_t n = hsize_t(m.n_tokens);
  const std::string nan = copy("nan.h5");
  {
    std::vector<float> values(n, 0.5f);
    values[7] = std::nanf("");
    hid_t f = H5Fopen(nan.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
    hid_t d = H5Dopen2(f, "lm_head.bias", H5P_DEFAULT);
    H5Dwrite(d, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, values.data());
    H5Dclose(d);
    H5Fclose(f);
  }
  expect_refused(nan, "dataset 'lm_head.bias' holds nan at element 7: weights must be finite");

  const std::string ints = copy("ints.h5");
  replace_dataset(ints, "lm_head.bias", [&](hid_t f) {
    hid_t space = H5Screate_simple(1, &n, nullptr);
    H5Dclose(H5Dcreate2(f, "lm_head.bias", H5T_STD_I32LE, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT));
    H5Sclose(space);
  });
  expect_refused(ints, "dataset 'lm_head.bias' does not hold 32-bit floats");

  const std::string linked = copy("linked.h5");
  replace_dataset(linked, "lm_head.bias", [&](hid_t f) {
    H5Lcreate_external(good.c_str(), "lm_head.bias", f, "lm_head.bias", H5P_DEFAULT, H5P_DEFAULT);
  });
  expect_refused(linked, "'lm_head.bias' is a soft or external link");

  const std::string external = copy("external.h5");
  const std::string raw = temp_path("external.raw");
  std::ofstream(raw, std::ios::binary).write(std::string(n * 4, '\0').data(), std::streamsize(n * 4));
  replace_dataset(external, "lm_head.bias", [&](hid_t f) {
    hid_t space = H5Screate_simple(1, &n, nullptr), dcpl = H5Pcreate(H5P_DATASET_CREATE);
    H5Pset_external(dcpl, raw.c_str(), 0, n * 4);
    H5Dclose(H5Dcreate2(f, "lm_head.bias", H5T_IEEE_F32LE, space, H5P_DEFAULT, dcpl, H5P_DEFAULT));
    H5Pclose(dcpl);
    H5Sclose(space);
  });
  expect_refused(external, "dataset 'lm_head.bias' keeps its data in other files");
}

}  // namespace
}  // namespace moeut
