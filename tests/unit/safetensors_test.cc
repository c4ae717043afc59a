// SPDX-License-Identifier: Apache-2.0
#include "io/safetensors.h"

#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

#include "common/mapped_file.h"
#include "tests/testing/process_harness.h"

namespace rp::core {
namespace {

namespace fs = std::filesystem;

std::string Slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

void Spit(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// A file made of an explicit header text and `data_bytes` zero bytes of data.
std::string FileWith(const std::string& header, size_t data_bytes,
                     uint64_t announced = UINT64_MAX) {
  std::string out(8, '\0');
  const uint64_t n = announced == UINT64_MAX ? header.size() : announced;
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + header + std::string(data_bytes, '\0');
}

class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = testing::MakeTempDir("rp-st-"); }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  std::string dir_;
};

// The fixture was written by tests/testdata/make_safetensors_fixture.py (Python's struct and json
// only), so a mistake shared by this reader and this writer cannot hide here.
TEST_F(SafetensorsTest, ReadsAFileWrittenByAnIndependentTool) {
  auto f = SafetensorsFile::Open(testing::SourceDir() + "/tests/testdata/fixture.safetensors");
  ASSERT_TRUE(f.ok()) << f.status().message();
  ASSERT_EQ(f->tensors().size(), 4u);
  EXPECT_EQ(f->metadata().at("format"), "pt");
  const auto* a = f->Find("a.weight");
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->dtype, "F32");
  EXPECT_EQ(a->shape, (std::vector<int64_t>{2, 3}));
  std::vector<float> v(6);
  ASSERT_TRUE(f->ReadAsFloat(*a, v.data()).ok());
  for (int i = 0; i < 6; ++i) EXPECT_EQ(v[i], i * 0.5f - 1.0f);
  const auto* b = f->Find("b.bias");
  ASSERT_NE(b, nullptr);
  std::vector<float> bv(4);
  ASSERT_TRUE(f->ReadAsFloat(*b, bv.data()).ok());
  EXPECT_EQ(bv, (std::vector<float>{1.0f, -2.5f, 0.15625f, 65536.0f}));
  const auto* c = f->Find("c.half");
  ASSERT_NE(c, nullptr);
  std::vector<float> cv(3);
  ASSERT_TRUE(f->ReadAsFloat(*c, cv.data()).ok());
  EXPECT_EQ(cv, (std::vector<float>{0.5f, -1.25f, std::ldexp(1.0f, -24)}));  // incl. a subnormal
  const auto* d = f->Find("d.ids");
  ASSERT_NE(d, nullptr);
  int64_t ids[2];
  std::memcpy(ids, f->Data(*d), 16);
  EXPECT_EQ(ids[0], 7);
  EXPECT_EQ(ids[1], -3);
  EXPECT_FALSE(f->ReadAsFloat(*d, cv.data()).ok());
}

// Tensors of millions of elements are converted by every core in chunks: the same values as
// converting one element after another (BF16 widened by its bits, F16 as a small tensor of the
// same halves reads, F32 copied), an odd tail included.
TEST_F(SafetensorsTest, LargeTensorsReadTheSameOnEveryCore) {
  const int64_t n = (int64_t{5} << 20) + 3;
  std::mt19937 rng(9);
  std::vector<uint16_t> halves(n);
  for (auto& x : halves) x = static_cast<uint16_t>(rng());
  std::vector<float> floats(n);
  for (auto& x : floats) x = std::normal_distribution<float>()(rng);
  const int64_t piece = 1000;
  const std::string path = dir_ + "/large.safetensors";
  ASSERT_TRUE(
      WriteSafetensors(path, {{"bf16", "BF16", {n}, halves.data(), static_cast<uint64_t>(n) * 2},
                              {"f16", "F16", {n}, halves.data(), static_cast<uint64_t>(n) * 2},
                              {"f16_tail", "F16", {piece}, halves.data() + n - piece, piece * 2},
                              {"f32", "F32", {n}, floats.data(), static_cast<uint64_t>(n) * 4}})
          .ok());
  auto f = SafetensorsFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status().message();
  std::vector<float> out(n);
  ASSERT_TRUE(f->ReadAsFloat(*f->Find("bf16"), out.data()).ok());
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, &out[i], 4);
    ASSERT_EQ(bits, static_cast<uint32_t>(halves[i]) << 16) << "element " << i;
  }
  ASSERT_TRUE(f->ReadAsFloat(*f->Find("f16"), out.data()).ok());
  std::vector<float> tail(piece);
  ASSERT_TRUE(f->ReadAsFloat(*f->Find("f16_tail"), tail.data()).ok());
  EXPECT_EQ(std::memcmp(out.data() + n - piece, tail.data(), piece * 4), 0);
  ASSERT_TRUE(f->ReadAsFloat(*f->Find("f32"), out.data()).ok());
  EXPECT_EQ(std::memcmp(out.data(), floats.data(), static_cast<size_t>(n) * 4), 0);
}

TEST_F(SafetensorsTest, WriteThenReadRoundTripsBitForBit) {
  std::mt19937 rng(5);
  std::vector<float> w(37);
  for (auto& x : w) x = std::normal_distribution<float>()(rng);
  std::vector<uint16_t> h(10);
  for (auto& x : h) x = static_cast<uint16_t>(rng());
  std::vector<int64_t> ids = {1, 2, 3};
  const std::string path = dir_ + "/rt.safetensors";
  ASSERT_TRUE(WriteSafetensors(path,
                               {{"model.layers.0.w", "F32", {37}, w.data(), w.size() * 4},
                                {"model.norm.weight", "BF16", {2, 5}, h.data(), h.size() * 2},
                                {"ids", "I64", {3}, ids.data(), 24},
                                {"empty", "F32", {0, 4}, nullptr, 0}},
                               {{"format", "pt"}})
                  .ok());
  auto f = SafetensorsFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status().message();
  EXPECT_EQ(f->metadata().at("format"), "pt");
  const auto* t = f->Find("model.layers.0.w");
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(std::memcmp(f->Data(*t), w.data(), w.size() * 4), 0);
  t = f->Find("model.norm.weight");
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->shape, (std::vector<int64_t>{2, 5}));
  EXPECT_EQ(std::memcmp(f->Data(*t), h.data(), h.size() * 2), 0);
  ASSERT_NE(f->Find("empty"), nullptr);
  EXPECT_EQ(f->Find("missing"), nullptr);
  // The header is padded to 8 bytes, so the data starts aligned.
  const std::string bytes = Slurp(path);
  uint64_t n;
  std::memcpy(&n, bytes.data(), 8);
  EXPECT_EQ(n % 8, 0u);
}

TEST_F(SafetensorsTest, RejectsEveryMalformedClassNamingFileAndProblem) {
  const std::string ok_entry = R"("t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
  struct Case {
    std::string name, bytes, expect;
  };
  const std::vector<Case> cases = {
      {"tiny", std::string(5, '\0'), "shorter than the 8-byte header length"},
      {"truncated_header", FileWith("{" + ok_entry + "}", 8, 4096), "runs past the end"},
      {"huge_header", FileWith("{}", 0, uint64_t{1} << 40), "exceeds the 100 MiB limit"},
      {"not_json", FileWith("{\"t\":", 0), "not valid JSON"},
      {"not_object", FileWith("[1,2]", 0), "not a JSON object"},
      {"bad_dtype", FileWith(R"({"t":{"dtype":"F7","shape":[2],"data_offsets":[0,8]}})", 8),
       "unknown dtype"},
      {"size_mismatch", FileWith(R"({"t":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8),
       "span 8"},
      {"out_of_range", FileWith(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 4),
       "outside the 4-byte data region"},
      {"truncated_data", FileWith("{" + ok_entry + "}", 7), "outside"},
      {"overlap",
       FileWith(
           R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
           8),
       "overlaps"},
      {"hole", FileWith(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", 8),
       "belong to no tensor"},
      {"trailing", FileWith("{" + ok_entry + "}", 12), "trailing bytes"},
      {"negative_dim", FileWith(R"({"t":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8),
       "negative"},
      {"reversed", FileWith(R"({"t":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}})", 8),
       "outside"},
      {"overflow",
       FileWith(R"({"t":{"dtype":"F64","shape":[4294967296,4294967296],"data_offsets":[0,8]}})", 8),
       "overflows"},
      {"bad_metadata", FileWith(R"({"__metadata__":{"k":1}})", 0), "__metadata__"},
  };
  for (const auto& c : cases) {
    const std::string path = dir_ + "/" + c.name + ".safetensors";
    Spit(path, c.bytes);
    auto f = SafetensorsFile::Open(path);
    ASSERT_FALSE(f.ok()) << c.name << " was accepted";
    EXPECT_NE(f.status().message().find(path), std::string::npos)
        << c.name << ": " << f.status().message();
    EXPECT_NE(f.status().message().find(c.expect), std::string::npos)
        << c.name << ": " << f.status().message();
  }
}

// Randomized corpus (bounded, so it runs in CI): mutations of a valid file (byte flips, header
// length changes, truncation, appended bytes) never crash the reader; what it accepts is
// readable within the file's bounds.
TEST_F(SafetensorsTest, FuzzedFilesAreRejectedOrReadSafely) {
  std::vector<float> w(24, 1.5f);
  std::vector<uint16_t> h(6, 0x3f80);
  const std::string seed_path = dir_ + "/seed.safetensors";
  ASSERT_TRUE(WriteSafetensors(
                  seed_path, {{"a", "F32", {4, 6}, w.data(), 96}, {"b", "BF16", {6}, h.data(), 12}})
                  .ok());
  const std::string seed = Slurp(seed_path);
  std::mt19937 rng(1234);
  int accepted = 0;
  uint64_t checksum = 0;  // reads every accepted byte; printed so the loop is not optimized away
  for (int iter = 0; iter < 3000; ++iter) {
    std::string bytes = seed;
    const int kind = static_cast<int>(rng() % 4);
    if (kind == 0) {
      for (int k = 0; k < 1 + static_cast<int>(rng() % 4); ++k)
        bytes[rng() % bytes.size()] = static_cast<char>(rng());
    } else if (kind == 1) {
      const uint64_t n =
          rng() % 2 ? rng() % (bytes.size() + 16) : (static_cast<uint64_t>(rng()) << 32 | rng());
      for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>((n >> (8 * i)) & 0xff);
    } else if (kind == 2) {
      bytes.resize(rng() % bytes.size());
    } else {
      bytes += std::string(1 + rng() % 9, static_cast<char>(rng()));
    }
    const std::string path = dir_ + "/fuzz.safetensors";
    Spit(path, bytes);
    auto f = SafetensorsFile::Open(path);
    if (!f.ok()) {
      EXPECT_EQ(f.status().code(), StatusCode::kInvalidArgument) << f.status().ToString();
      continue;
    }
    accepted++;
    for (const auto& t : f->tensors()) {
      ASSERT_LE(t.end, bytes.size());
      uint8_t sum = 0;
      for (uint64_t i = t.begin; i < t.end; ++i)
        sum = static_cast<uint8_t>(sum ^ f->Data(t)[i - t.begin]);
      checksum += sum;
    }
  }
  std::printf("fuzz: 3000 mutated files, %d accepted (valid after mutation), checksum %llu\n",
              accepted, static_cast<unsigned long long>(checksum));
}

// The mapping underneath every reader: a regular file maps whole (an empty one to nothing); a FIFO
// or a directory in a file's place is refused at once instead of blocking or failing later, and a
// missing file is named.
TEST(MappedFile, MapsRegularFilesAndRefusesEverythingElse) {
  const std::string dir = testing::MakeTempDir("rp-map-");
  std::ofstream(dir + "/bytes") << "abcdef";
  std::ofstream(dir + "/empty");
  auto f = MappedFile::Open(dir + "/bytes", "probe");
  ASSERT_TRUE(f.ok()) << f.status().message();
  ASSERT_EQ(f->size(), 6u);
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(f->data()), 6), "abcdef");
  MappedFile moved = std::move(*f);  // the bytes stay where they were mapped
  EXPECT_EQ(moved.data()[5], 'f');
  auto empty = MappedFile::Open(dir + "/empty", "probe");
  ASSERT_TRUE(empty.ok());
  EXPECT_EQ(empty->size(), 0u);
  ASSERT_EQ(::mkfifo((dir + "/fifo").c_str(), 0600), 0);
  auto fifo = MappedFile::Open(dir + "/fifo", "probe");
  EXPECT_NE(fifo.status().message().find("not a regular file"), std::string::npos)
      << fifo.status().message();
  auto st = SafetensorsFile::Open(dir + "/fifo");
  EXPECT_NE(st.status().message().find("fifo"), std::string::npos);
  EXPECT_FALSE(MappedFile::Open(dir, "probe").ok());
  auto missing = MappedFile::Open(dir + "/nothing", "probe");
  EXPECT_NE(missing.status().message().find(dir + "/nothing"), std::string::npos);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace rp::core
