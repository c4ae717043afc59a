// SPDX-License-Identifier: Apache-2.0
// TensorBoard event files: the writer (io/tensorboard.h) read back by the test reader
// (tests/testing/event_file_reader.h), which shares no code with it; and a file written by
// TensorBoard's own writer read by the same reader.
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "io/tensorboard.h"
#include "tests/testing/event_file_reader.h"
#include "tests/testing/process_harness.h"

namespace rp {
namespace {

namespace fs = std::filesystem;

std::vector<std::string> EventFiles(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.path().filename().string().find("tfevents") != std::string::npos)
      out.push_back(e.path().string());
  return out;
}

void WriteLines(const std::string& path, const std::vector<nlohmann::json>& lines) {
  std::ofstream out(path);
  for (const auto& l : lines) out << l.dump() << "\n";
}

nlohmann::json Line(int64_t step) {
  nlohmann::json j = {{"step", step},           {"loss", 5.0 - 0.1 * step},
                      {"lr", 3e-4 * step},      {"grad_norm", 1.25 + step},
                      {"tokens", 512},          {"step_time_s", 0.5},
                      {"tokens_per_s", 1024.0}, {"bubble_ratio", 0.125},
                      {"h2d_bytes", 1000},      {"h2d_gb_per_s", 2e-6},
                      {"host_gib", 0.75},       {"time", 1.7e9 + step + 0.25},
                      {"elapsed_s", 0.5 * step}};
  if (step % 2 == 0) j["eval_loss"] = 4.5 - 0.01 * step;
  return j;
}

TEST(TensorBoardTest, Crc32cMatchesTheRfc3720TestVectors) {
  // RFC 3720, appendix B.4, and the common check value of "123456789".
  std::vector<uint8_t> zeros(32, 0), ones(32, 0xff), up(32), down(32);
  for (int i = 0; i < 32; ++i) {
    up[i] = static_cast<uint8_t>(i);
    down[i] = static_cast<uint8_t>(31 - i);
  }
  const std::string digits = "123456789";
  const struct {
    const void* data;
    size_t bytes;
    uint32_t crc;
  } cases[] = {{zeros.data(), 32, 0x8a9136aa},
               {ones.data(), 32, 0x62a8ab43},
               {up.data(), 32, 0x46dd794e},
               {down.data(), 32, 0x113fdb5c},
               {digits.data(), 9, 0xe3069283}};
  for (const auto& c : cases) {
    EXPECT_EQ(core::Crc32c(c.data, c.bytes), c.crc);
    EXPECT_EQ(testing::ReferenceCrc32c(c.data, c.bytes), c.crc);
  }
}

TEST(TensorBoardTest, EveryScalarOfEveryLineReadsBackWithItsStepAndTime) {
  const std::string dir = testing::MakeTempDir("rp-tb-");
  // Step 3's bubble is 0: a zero must be written as a value, not left out.
  std::vector<nlohmann::json> lines = {Line(1), Line(2), Line(3)};
  lines[2]["bubble_ratio"] = 0.0;
  {
    auto w = core::TensorBoardWriter::Create(dir + "/tb");
    ASSERT_TRUE(w.ok()) << w.status().message();
    for (const auto& l : lines) ASSERT_TRUE(w->Append(l).ok());
  }
  WriteLines(dir + "/metrics.jsonl", lines);
  EXPECT_EQ(testing::EventsMatchMetrics(dir + "/tb", dir + "/metrics.jsonl"), "");
  // A skipped fp16 step: grad_norm null, loss_scale present.
  nlohmann::json skipped = Line(4);
  skipped["grad_norm"] = nullptr;
  skipped["loss_scale"] = 32768.0;
  const auto scalars = core::TensorBoardScalars(skipped);
  bool has_norm = false, has_scale = false;
  for (const auto& [tag, v] : scalars) {
    has_norm |= tag == "train/grad_norm";
    has_scale |= tag == "train/loss_scale" && v == 32768.0f;
  }
  EXPECT_FALSE(has_norm);
  EXPECT_TRUE(has_scale);
  // A line that disagrees is reported.
  std::vector<nlohmann::json> other = lines;
  other[1]["loss"] = 9.0;
  WriteLines(dir + "/other.jsonl", other);
  EXPECT_NE(testing::EventsMatchMetrics(dir + "/tb", dir + "/other.jsonl").find("line 2"),
            std::string::npos);
  fs::remove_all(dir);
}

TEST(TensorBoardTest, AFlippedByteIsReportedAsABadCrc) {
  const std::string dir = testing::MakeTempDir("rp-tb-flip-");
  {
    auto w = core::TensorBoardWriter::Create(dir);
    ASSERT_TRUE(w.ok());
    ASSERT_TRUE(w->Append(Line(1)).ok());
    ASSERT_TRUE(w->Append(Line(2)).ok());
  }
  const auto files = EventFiles(dir);
  ASSERT_EQ(files.size(), 1u);
  const std::string clean = testing::ReadFile(files[0]);
  const auto read = testing::ParseEventFile(clean);
  ASSERT_EQ(read.error, "");
  ASSERT_EQ(read.events.size(), 3u);
  // Record 2 starts after record 1 (12 header bytes, its data, 4 CRC bytes).
  const size_t first_len =
      static_cast<uint8_t>(clean[0]) | (static_cast<size_t>(static_cast<uint8_t>(clean[1])) << 8);
  const size_t second = 12 + first_len + 4;
  std::string data_flip = clean;
  data_flip[second + 12 + 5] ^= 0x10;
  EXPECT_EQ(testing::ParseEventFile(data_flip).error, "record 2: the data's CRC does not match");
  EXPECT_EQ(testing::ParseEventFile(data_flip).events.size(), 1u);
  std::string len_flip = clean;
  len_flip[second + 1] ^= 0x01;
  EXPECT_EQ(testing::ParseEventFile(len_flip).error, "record 2: the length's CRC does not match");
  std::string crc_flip = clean;
  crc_flip[clean.size() - 1] ^= 0x80;
  EXPECT_EQ(testing::ParseEventFile(crc_flip).error, "record 3: the data's CRC does not match");
  EXPECT_EQ(testing::ParseEventFile(clean.substr(0, clean.size() - 3)).error,
            "record 3: the file ends inside the record's data");
  fs::remove_all(dir);
}

TEST(TensorBoardTest, RebuildKeepsTheStepsOfMetricsJsonlOnceAndAppendsAfterThem) {
  // A run stopped after step 5 whose checkpoint is step 3: metrics.jsonl is cut back to 3 by the
  // resume, and the event files must follow it, so the repeated steps 4 and 5 appear once.
  const std::string dir = testing::MakeTempDir("rp-tb-resume-");
  {
    auto w = core::TensorBoardWriter::Create(dir + "/tb");
    ASSERT_TRUE(w.ok());
    for (int s = 1; s <= 5; ++s) ASSERT_TRUE(w->Append(Line(s)).ok());
  }
  WriteLines(dir + "/metrics.jsonl", {Line(1), Line(2), Line(3)});
  {
    auto w = core::TensorBoardWriter::Rebuild(dir + "/tb", dir + "/metrics.jsonl");
    ASSERT_TRUE(w.ok()) << w.status().message();
    ASSERT_TRUE(w->Append(Line(4)).ok());
  }
  WriteLines(dir + "/metrics.jsonl", {Line(1), Line(2), Line(3), Line(4)});
  EXPECT_EQ(testing::EventsMatchMetrics(dir + "/tb", dir + "/metrics.jsonl"), "");
  EXPECT_EQ(EventFiles(dir + "/tb").size(), 1u);
  fs::remove_all(dir);
}

TEST(TensorBoardTest, TheReaderReadsAFileWrittenByTensorBoardItself) {
  // tests/testdata/tensorboard: written by TensorBoard's own EventFileWriter
  // (tools/make_tensorboard_fixture.py), with the values it was given in expected.json.
  const std::string dir = testing::SourceDir() + "/tests/testdata/tensorboard";
  const auto expected = nlohmann::json::parse(testing::ReadFile(dir + "/expected.json"));
  const auto files = EventFiles(dir);
  ASSERT_EQ(files.size(), 1u);
  const auto f = testing::ReadEventFile(files[0]);
  ASSERT_EQ(f.error, "");
  ASSERT_FALSE(f.events.empty());
  EXPECT_EQ(f.events[0].file_version, "brain.Event:2");
  std::vector<testing::EventRecord> with_scalars;
  for (const auto& e : f.events)
    if (!e.scalars.empty()) with_scalars.push_back(e);
  ASSERT_EQ(with_scalars.size(), expected.size());
  for (size_t i = 0; i < expected.size(); ++i) {
    EXPECT_EQ(with_scalars[i].step, expected[i]["step"].get<int64_t>());
    EXPECT_EQ(with_scalars[i].wall_time, expected[i]["wall_time"].get<double>());
    ASSERT_EQ(with_scalars[i].scalars.size(), 1u);
    EXPECT_EQ(with_scalars[i].scalars[0].first, expected[i]["tag"].get<std::string>());
    EXPECT_EQ(with_scalars[i].scalars[0].second, expected[i]["value"].get<float>());
  }
  // And the product's CRC agrees with TensorBoard's on every record.
  const std::string bytes = testing::ReadFile(files[0]);
  size_t at = 0;
  while (at < bytes.size()) {
    uint64_t len = 0;
    for (int i = 7; i >= 0; --i) len = (len << 8) | static_cast<uint8_t>(bytes[at + i]);
    uint32_t stored = 0;
    for (int i = 3; i >= 0; --i)
      stored = (stored << 8) | static_cast<uint8_t>(bytes[at + 12 + len + i]);
    EXPECT_EQ(core::MaskedCrc32c(bytes.data() + at + 12, len), stored);
    at += 12 + len + 4;
  }
}

}  // namespace
}  // namespace rp
