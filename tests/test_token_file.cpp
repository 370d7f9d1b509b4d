// Token file format: roundtrips and every refusal the reader and writer promise (docs/DATA.md).
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <utility>
#include <vector>

#include "core/token_file.h"
#include "core/token_files.h"

namespace {

namespace fs = std::filesystem;
using moeut::DataError;
using moeut::TokenFile;
using moeut::write_token_file;

// A fresh directory per test so that tests cannot see each other's files.
class TokenFileTest : public testing::Test {
 protected:
  void SetUp() override {
    const auto* info = testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::path(testing::TempDir()) /
           ("moeut_token_file_" + std::to_string(::getpid()) + "_" + info->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  std::string file(const std::string& name) const { return (dir_ / name).string(); }

  fs::path dir_;
};

void append_le(std::string& s, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) s.push_back(static_cast<char>(v >> (8 * i)));
}

// Builds a file by hand, so that malformed variants need not go through the writer.
std::string make_header(const char* magic, uint32_t version, uint32_t vocab, uint32_t token_bytes, uint64_t count) {
  std::string s(magic, 8);
  append_le(s, version, 4);
  append_le(s, vocab, 4);
  append_le(s, token_bytes, 4);
  append_le(s, 0, 4);
  append_le(s, count, 8);
  return s;
}

void write_raw(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  ASSERT_TRUE(out) << path;
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  out.close();
  ASSERT_TRUE(out) << path;
}

// Runs f, which must throw DataError whose message names path and contains word.
template <class F>
void expect_data_error(F&& f, const std::string& path, const std::string& word) {
  try {
    f();
    ADD_FAILURE() << "expected DataError mentioning '" << word << "'";
  } catch (const DataError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find(path), std::string::npos) << "message does not name the file: " << msg;
    EXPECT_NE(msg.find(word), std::string::npos) << "message does not say '" << word << "': " << msg;
  }
}

std::string valid_u16_file(uint64_t count) {
  std::string s = make_header("MOEUTTOK", 1, 100, 2, count);
  for (uint64_t i = 0; i < count; ++i) append_le(s, i % 100, 2);
  return s;
}

TEST_F(TokenFileTest, RoundtripUint16) {
  const std::string path = file("u16.bin");
  const std::vector<uint32_t> tokens = {0, 1, 2, 255, 256, 7999, 65535, 42};
  write_token_file(path, 65536, tokens);
  EXPECT_EQ(fs::file_size(path), 32 + tokens.size() * 2);  // 65536 is still the 2-byte width
  EXPECT_FALSE(fs::exists(path + ".tmp"));

  TokenFile f(path);
  EXPECT_EQ(f.path(), path);
  EXPECT_EQ(f.vocab_size(), 65536u);
  ASSERT_EQ(f.size(), tokens.size());
  for (size_t i = 0; i < tokens.size(); ++i) EXPECT_EQ(f.at(i), tokens[i]) << i;
  std::vector<int32_t> out(3);
  f.read(4, out);
  EXPECT_EQ(out, (std::vector<int32_t>{256, 7999, 65535}));
}

TEST_F(TokenFileTest, RoundtripUint32) {
  const std::string path = file("u32.bin");
  const std::vector<uint32_t> tokens = {69999, 0, 65536, 65535, 12345, 2};
  write_token_file(path, 70000, tokens);
  EXPECT_EQ(fs::file_size(path), 32 + tokens.size() * 4);

  TokenFile f(path);
  EXPECT_EQ(f.vocab_size(), 70000u);
  ASSERT_EQ(f.size(), tokens.size());
  std::vector<int32_t> out(tokens.size());
  f.read(0, out);
  for (size_t i = 0; i < tokens.size(); ++i) {
    EXPECT_EQ(f.at(i), tokens[i]) << i;
    EXPECT_EQ(out[i], static_cast<int32_t>(tokens[i])) << i;
  }
}

TEST_F(TokenFileTest, HeaderIsLittleEndianAsDocumented) {
  const std::string path = file("layout.bin");
  write_token_file(path, 300, std::vector<uint32_t>{258, 1});
  std::ifstream in(path, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(bytes, make_header("MOEUTTOK", 1, 300, 2, 2) + std::string("\x02\x01\x01\x00", 4));
}

TEST_F(TokenFileTest, MoveKeepsTheMapping) {
  const std::string path = file("move.bin");
  write_token_file(path, 10, std::vector<uint32_t>{3, 4, 5});
  TokenFile a(path);
  TokenFile b(std::move(a));
  EXPECT_EQ(b.at(2), 5u);
  TokenFile c(path);
  c = std::move(b);
  EXPECT_EQ(c.size(), 3u);
  EXPECT_EQ(c.at(0), 3u);
}

TEST_F(TokenFileTest, RefusesMissingFile) {
  const std::string path = file("nope.bin");
  expect_data_error([&] { TokenFile f(path); }, path, "cannot open");
}

TEST_F(TokenFileTest, RefusesShorterThanHeader) {
  const std::string path = file("short.bin");
  write_raw(path, "MOEUTTOK");
  expect_data_error([&] { TokenFile f(path); }, path, "truncated");
}

TEST_F(TokenFileTest, RefusesBadMagic) {
  const std::string path = file("magic.bin");
  std::string bytes = valid_u16_file(4);
  bytes[0] = 'X';
  write_raw(path, bytes);
  expect_data_error([&] { TokenFile f(path); }, path, "magic");
}

TEST_F(TokenFileTest, RefusesWrongVersion) {
  const std::string path = file("version.bin");
  std::string bytes = make_header("MOEUTTOK", 2, 100, 2, 1);
  append_le(bytes, 7, 2);
  write_raw(path, bytes);
  expect_data_error([&] { TokenFile f(path); }, path, "version");
}

TEST_F(TokenFileTest, RefusesTokenWidthInconsistentWithVocab) {
  const std::string path = file("width.bin");
  std::string bytes = make_header("MOEUTTOK", 1, 100, 4, 1);  // vocab 100 must use 2 bytes
  append_le(bytes, 7, 4);
  write_raw(path, bytes);
  expect_data_error([&] { TokenFile f(path); }, path, "token_bytes");
}

TEST_F(TokenFileTest, RefusesTruncated) {
  const std::string path = file("truncated.bin");
  std::string bytes = valid_u16_file(1000);
  bytes.resize(1500);
  write_raw(path, bytes);
  expect_data_error([&] { TokenFile f(path); }, path, "truncated");
  expect_data_error([&] { TokenFile f(path); }, path, "header says 1000 tokens (2032 bytes) but the file has 1500 bytes");
}

TEST_F(TokenFileTest, RefusesTrailingBytes) {
  const std::string path = file("trailing.bin");
  write_raw(path, valid_u16_file(10) + "x");
  expect_data_error([&] { TokenFile f(path); }, path, "trailing");
}

TEST_F(TokenFileTest, RefusesEmpty) {
  const std::string path = file("empty.bin");
  write_raw(path, make_header("MOEUTTOK", 1, 100, 2, 0));
  expect_data_error([&] { TokenFile f(path); }, path, "empty");
}

TEST_F(TokenFileTest, WriterRefusesTokenNotBelowVocab) {
  const std::string path = file("oov.bin");
  expect_data_error([&] { write_token_file(path, 100, std::vector<uint32_t>{1, 100, 2}); }, path, "vocab");
  EXPECT_FALSE(fs::exists(path));
  EXPECT_FALSE(fs::exists(path + ".tmp"));
}

TEST_F(TokenFileTest, WriterRefusesEmpty) {
  const std::string path = file("empty_write.bin");
  expect_data_error([&] { write_token_file(path, 100, std::vector<uint32_t>{}); }, path, "empty");
}

TEST_F(TokenFileTest, ReadOutOfRange) {
  const std::string path = file("range.bin");
  write_token_file(path, 100, std::vector<uint32_t>{1, 2, 3, 4});
  TokenFile f(path);
  std::vector<int32_t> out(3);
  f.read(1, out);  // [1, 4) is the last valid window
  EXPECT_EQ(out, (std::vector<int32_t>{2, 3, 4}));
  expect_data_error([&] { f.read(2, out); }, path, "out of range");
  expect_data_error([&] { f.read(UINT64_MAX, out); }, path, "out of range");
  expect_data_error([&] { (void)f.at(4); }, path, "out of range");
}

}  // namespace

// A token at or past the vocabulary (a corrupt file) is reported by read() and check_vocabulary()
// with the file, the token's index and byte offset, and its value.
TEST_F(TokenFileTest, ReadNamesTokenOutOfVocabulary) {
  const std::string path = file("bad.bin");
  std::string bytes = valid_u16_file(50);
  bytes[32 + 2 * 37] = char(100);  // token 37: 100, one past the vocabulary of 100
  write_raw(path, bytes);
  TokenFile f(path);
  std::vector<int32_t> out(10);
  f.read(0, out);  // before the bad token: fine
  expect_data_error([&] { f.read(30, out); }, path, "token 37 (byte offset 106) is 100 but vocab_size is 100");
  expect_data_error([&] { f.check_vocabulary(); }, path, "token 37 (byte offset 106) is 100");
  write_raw(file("good.bin"), valid_u16_file(50));
  TokenFile(file("good.bin")).check_vocabulary();
}

// The streaming writer gives the same file as the whole-file writer, piece by piece.
TEST_F(TokenFileTest, WriterInPiecesEqualsWholeFile) {
  const std::vector<uint32_t> tokens = {5, 6, 7, 8, 9, 10, 11};
  write_token_file(file("whole.bin"), 100, tokens);
  moeut::TokenFileWriter out(file("pieces.bin"), 100);
  out.append(std::span(tokens).first(3));
  out.append(std::span(tokens).subspan(3));
  EXPECT_EQ(out.count(), tokens.size());
  out.finish();
  auto bytes = [](const std::string& p) {
    std::ifstream in(p, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  EXPECT_EQ(bytes(file("pieces.bin")), bytes(file("whole.bin")));
}

// A writer given up on (an error before finish) leaves neither the file nor its temporary.
TEST_F(TokenFileTest, WriterDroppedBeforeFinishLeavesNothing) {
  const std::string path = file("dropped.bin");
  {
    moeut::TokenFileWriter out(path, 100);
    out.append(std::vector<uint32_t>{1, 2});
    expect_data_error([&] { out.append(std::vector<uint32_t>{3, 100}); }, path, "token 3 is 100");
  }
  EXPECT_FALSE(fs::exists(path));
  EXPECT_FALSE(fs::exists(path + ".tmp"));
}

// Several files as one stream: a list, a glob (sorted), reads across a boundary; a pattern that
// matches nothing and files of different vocabularies are refused, named.
TEST_F(TokenFileTest, FilesReadAsOneStream) {
  write_token_file(file("s_00001.bin"), 100, std::vector<uint32_t>{4, 5, 6});
  write_token_file(file("s_00000.bin"), 100, std::vector<uint32_t>{1, 2, 3});
  const moeut::TokenFiles glob(file("s_*.bin"));
  ASSERT_EQ(glob.size(), 6u);
  EXPECT_EQ(glob.vocab_size(), 100u);
  std::vector<int32_t> out(4);
  glob.read(1, out);
  EXPECT_EQ(out, (std::vector<int32_t>{2, 3, 4, 5}));
  const moeut::TokenFiles list(file("s_00001.bin") + "," + file("s_00000.bin"));  // the order given
  list.read(1, out);
  EXPECT_EQ(out, (std::vector<int32_t>{5, 6, 1, 2}));
  expect_data_error([&] { list.read(3, out); }, file("s_00001.bin"), "out of range");
  expect_data_error([&] { moeut::TokenFiles none(file("t_*.bin")); }, file("t_*.bin"), "no file matches");
  write_token_file(file("s_00002.bin"), 50, std::vector<uint32_t>{7});
  expect_data_error([&] { moeut::TokenFiles mixed(file("s_*.bin")); }, file("s_00002.bin"),
                    "vocab_size 50 differs from " + file("s_00000.bin") + "'s 100");
}
