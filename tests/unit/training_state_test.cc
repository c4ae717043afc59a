// SPDX-License-Identifier: Apache-2.0
// Training-state checkpoints in-process: checksums catch damage anywhere in a section, appended
// or cut bytes are refused, and files written before checksums existed still load.
#include "optim/training_state.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include <nlohmann/json.hpp>

#include "io/run_output.h"
#include "tests/testing/process_harness.h"

namespace rp::coord {
namespace {

namespace fs = std::filesystem;

class TrainingStateTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing::MakeTempDir("rp-state-");
    std::mt19937 rng(5);
    for (auto& b : optim_) b = static_cast<uint8_t>(rng());
    for (auto& b : compute_) b = static_cast<uint8_t>(rng());
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::vector<StateSection> Sections(std::vector<uint8_t>& a, std::vector<uint8_t>& b) {
    return {{"optim", a.data(), a.size()}, {"compute", b.data(), b.size()}};
  }
  Status Read(const std::string& path) {
    std::vector<uint8_t> a(optim_.size()), b(compute_.size());
    return ReadTrainingState({path, 2, {}}, 77, false, Sections(a, b));
  }
  std::string dir_;
  std::vector<uint8_t> optim_ = std::vector<uint8_t>(300000), compute_ = std::vector<uint8_t>(1000);
};

TEST_F(TrainingStateTest, AFlippedByteOrExtraBytesAreRefusedNamingTheSection) {
  ASSERT_TRUE(WriteTrainingState(dir_, 2, 77, false, {}, Sections(optim_, compute_), 2).ok());
  const std::string path = dir_ + "/step-00000002.rpstate";
  std::vector<uint8_t> a(optim_.size()), b(compute_.size());
  ASSERT_TRUE(ReadTrainingState({path, 2, {}}, 77, false, Sections(a, b)).ok());
  EXPECT_EQ(a, optim_);
  EXPECT_EQ(b, compute_);
  // Where the sections are, from the header.
  std::ifstream in(path, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  uint64_t len = 0;
  std::memcpy(&len, bytes.data() + 8, 8);
  const auto header = nlohmann::json::parse(bytes.substr(16, len));
  for (const auto& s : header["sections"]) {
    for (const uint64_t at :
         {uint64_t{0}, s["bytes"].get<uint64_t>() / 2, s["bytes"].get<uint64_t>() - 1}) {
      std::string damaged = bytes;
      damaged[s["offset"].get<uint64_t>() + at] ^= 0x10;
      std::ofstream(path, std::ios::binary | std::ios::trunc) << damaged;
      const Status st = Read(path);
      EXPECT_NE(st.message().find("section \"" + s["name"].get<std::string>() +
                                  "\" do not match their checksum"),
                std::string::npos)
          << st.message();
    }
  }
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes << "extra";
  EXPECT_NE(Read(path).message().find("bytes were appended or cut"), std::string::npos);
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
  EXPECT_TRUE(Read(path).ok());
}

// The header grows with the state: one checksum per 64 MiB chunk (a 98 GB state lists about
// 1,500 of them, 16 KB of header) and the run's recorded keys. However long it is, the sections
// start after it, so every byte of both reads back.
TEST_F(TrainingStateTest, AHeaderLongerThanAPageIsNotOverwrittenByTheSections) {
  core::RunRecord run;
  for (int i = 0; i < 400; ++i)
    run["key." + std::to_string(i)] = std::string(60, static_cast<char>('a' + i % 26));
  ASSERT_TRUE(WriteTrainingState(dir_, 2, 77, false, run, Sections(optim_, compute_), 2).ok());
  const std::string path = dir_ + "/step-00000002.rpstate";
  auto file = FindLatestTrainingState(dir_);
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  auto read_run = ReadRunRecord(*file);
  ASSERT_TRUE(read_run.ok()) << read_run.status().ToString();
  EXPECT_EQ(*read_run, run);
  std::vector<uint8_t> a(optim_.size()), b(compute_.size());
  ASSERT_TRUE(ReadTrainingState(*file, 77, false, Sections(a, b)).ok());
  EXPECT_EQ(a, optim_);
  EXPECT_EQ(b, compute_);
}

// Extents in any order, from any sources, make the same file as the sections written whole; a
// group's source may change as soon as it is reported written, and extents that leave a gap or
// overlap are refused naming the section.
TEST_F(TrainingStateTest, ExtentsInAnyOrderMakeTheSameFileAndReportEachGroupOnceWritten) {
  ASSERT_TRUE(WriteTrainingState(dir_, 2, 77, false, {}, Sections(optim_, compute_), 2).ok());
  const std::string whole = testing::ReadFile(dir_ + "/step-00000002.rpstate");
  fs::remove(dir_ + "/step-00000002.rpstate");
  // Copies of the state as the sources: group g's bytes are scribbled over once reported.
  std::vector<uint8_t> optim = optim_, compute = compute_;
  const std::vector<SectionShape> shapes = {{"optim", optim.size()}, {"compute", compute.size()}};
  std::vector<SourcedExtent> extents = {{1, 0, 1000, compute.data(), 0},
                                        {0, 200000, 100000, optim.data() + 200000, 1},
                                        {0, 0, 70000, optim.data(), -1},
                                        {0, 70000, 130000, optim.data() + 70000, 1}};
  std::vector<int> reported;
  auto scribble = [&](int group) {
    reported.push_back(group);
    for (const auto& e : extents)
      if (e.group == group) std::memset(const_cast<uint8_t*>(e.src), 0xAB, e.bytes);
  };
  ASSERT_TRUE(WriteTrainingStateExtents(dir_, 2, 77, false, {}, shapes, extents, 2, 3, nullptr, {},
                                        scribble)
                  .ok());
  EXPECT_EQ(reported, (std::vector<int>{0, 1}));
  EXPECT_TRUE(testing::ReadFile(dir_ + "/step-00000002.rpstate") == whole);
  extents.pop_back();
  const Status gap = WriteTrainingStateExtents(dir_, 3, 77, false, {}, shapes, extents, 2);
  EXPECT_NE(gap.message().find("section \"optim\" cover bytes [0, 70000)"), std::string::npos)
      << gap.message();
  EXPECT_FALSE(fs::exists(dir_ + "/step-00000003.rpstate"));
}

TEST_F(TrainingStateTest, FilesWithoutChecksumsStillLoad) {
  // The layout before checksums: the same header without them.
  const uint64_t off = 4096, end = 4096 * ((off + optim_.size() + 4095) / 4096);
  const uint64_t off2 = end, end2 = 4096 * ((off2 + compute_.size() + 4095) / 4096);
  const std::string text =
      nlohmann::json{{"version", 1},
                     {"steps_done", 2},
                     {"state_hash", "77"},
                     {"sections",
                      {{{"name", "optim"}, {"offset", off}, {"bytes", optim_.size()}},
                       {{"name", "compute"}, {"offset", off2}, {"bytes", compute_.size()}}}}}
          .dump();
  std::string file(end2, '\0');
  std::memcpy(file.data(), "RPSTATE1", 8);
  const uint64_t len = text.size();
  std::memcpy(file.data() + 8, &len, 8);
  std::memcpy(file.data() + 16, text.data(), len);
  std::memcpy(file.data() + off, optim_.data(), optim_.size());
  std::memcpy(file.data() + off2, compute_.data(), compute_.size());
  const std::string path = dir_ + "/step-00000002.rpstate";
  std::ofstream(path, std::ios::binary) << file;
  std::vector<uint8_t> a(optim_.size()), b(compute_.size());
  const Status st = ReadTrainingState({path, 2, {}}, 77, false, Sections(a, b));
  ASSERT_TRUE(st.ok()) << st.message();
  EXPECT_EQ(a, optim_);
}

// Sharded state: each node writes its own file of a checkpoint; a step counts only once every
// shard is there, and a shard's writer never removes a file of the newest complete checkpoint,
// whatever the other nodes have written.
TEST_F(TrainingStateTest, ShardFilesMakeACheckpointOnlyTogetherAndArePrunedPerShard) {
  auto write = [&](int64_t step, int rank) {
    return WriteTrainingState(dir_, step, 77, false, {}, Sections(optim_, compute_), /*keep=*/1, 0,
                              nullptr, ShardId{rank, 2});
  };
  auto shard = [&](int64_t step, int rank) {
    char name[64];
    std::snprintf(name, sizeof(name), "/step-%08lld.shard-%d-of-2.rpstate",
                  static_cast<long long>(step), rank);
    return dir_ + name;
  };
  ASSERT_TRUE(write(1, 0).ok());
  EXPECT_EQ(FindLatestTrainingState(dir_).status().code(), StatusCode::kNotFound);
  ASSERT_TRUE(write(1, 1).ok());
  auto found = FindLatestTrainingState(dir_);
  ASSERT_TRUE(found.ok()) << found.status().message();
  EXPECT_EQ(found->steps_done, 1);
  EXPECT_EQ(found->paths, (std::vector<std::string>{shard(1, 0), shard(1, 1)}));
  // Node 0 runs ahead: with keep = 1 it keeps step 1, the only complete checkpoint.
  ASSERT_TRUE(write(2, 0).ok());
  ASSERT_TRUE(write(3, 0).ok());
  EXPECT_TRUE(fs::exists(shard(1, 0)));
  EXPECT_EQ(FindLatestTrainingState(dir_)->steps_done, 1);
  // Node 1 completes step 3: step 1 is no longer needed, and node 1 removes its own file of it.
  ASSERT_TRUE(write(3, 1).ok());
  EXPECT_EQ(FindLatestTrainingState(dir_)->steps_done, 3);
  EXPECT_FALSE(fs::exists(shard(1, 1)));
  EXPECT_TRUE(fs::exists(shard(1, 0)));  // node 0's, for node 0's next write to remove
}

// A resumed run's node first removes its own parts of steps after the one it resumes from, so a
// part of a step that never completed cannot complete one with the new run's files.
TEST_F(TrainingStateTest, AResumedNodeRemovesItsOwnLaterShardFilesOnly) {
  for (int64_t step : {1, 2, 3})
    for (int rank : {0, 1})
      ASSERT_TRUE(WriteTrainingState(dir_, step, 77, false, {}, Sections(optim_, compute_), 0, 0,
                                     nullptr, ShardId{rank, 2})
                      .ok());
  ASSERT_TRUE(RemoveLaterShardFiles(dir_, 1, ShardId{0, 2}).ok());
  EXPECT_TRUE(fs::exists(dir_ + "/step-00000001.shard-0-of-2.rpstate"));
  EXPECT_FALSE(fs::exists(dir_ + "/step-00000002.shard-0-of-2.rpstate"));
  EXPECT_FALSE(fs::exists(dir_ + "/step-00000003.shard-0-of-2.rpstate"));
  EXPECT_TRUE(fs::exists(dir_ + "/step-00000003.shard-1-of-2.rpstate"));
  EXPECT_EQ(FindLatestTrainingState(dir_)->steps_done, 1);
}

TEST(ShardOf, SharesCoverEachParameterOnceInAlignedRuns) {
  for (int64_t numel : {1, 15, 16, 17, 1000, 4096, 1 << 20}) {
    for (int64_t nodes : {1, 2, 3, 5}) {
      int64_t next = 0;
      for (int64_t r = 0; r < nodes; ++r) {
        const core::ElemRange s = core::ShardOf(numel, nodes, r);
        EXPECT_EQ(s.begin, next) << numel << " over " << nodes;
        EXPECT_GE(s.end, s.begin);
        if (s.end < numel) {
          EXPECT_EQ(s.size() % 16, 0) << numel << " over " << nodes << ", node " << r;
        }
        EXPECT_LE(s.size(), (numel + nodes - 1) / nodes + 15);
        next = s.end;
      }
      EXPECT_EQ(next, numel) << numel << " over " << nodes;
    }
  }
}

// metrics.jsonl lines carry the wall clock and an elapsed clock that a resumed run continues.
TEST(MetricsWriter, LinesCarryWallTimeAndAnElapsedClockThatResumeContinues) {
  const std::string dir = testing::MakeTempDir("rp-metrics-"), path = dir + "/metrics.jsonl";
  auto now = [] {
    return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch())
        .count();
  };
  const double before = now();
  {
    auto w = core::MetricsWriter::Open(path);
    ASSERT_TRUE(w.ok()) << w.status().message();
    core::StepMetrics m;
    m.step = 1;
    ASSERT_TRUE(w->Append(m).ok());
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
    m.step = 2;
    ASSERT_TRUE(w->Append(m).ok());
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  {
    auto w = core::MetricsWriter::OpenForAppend(path);
    ASSERT_TRUE(w.ok()) << w.status().message();
    core::StepMetrics m;
    m.step = 3;
    ASSERT_TRUE(w->Append(m).ok());
  }
  const double after = now();
  std::ifstream in(path);
  std::vector<nlohmann::json> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(nlohmann::json::parse(line));
  ASSERT_EQ(lines.size(), 3u);
  for (const auto& j : lines) {
    EXPECT_GE(j["time"].get<double>(), before - 0.01);
    EXPECT_LE(j["time"].get<double>(), after + 0.01);
  }
  EXPECT_GE(lines[1]["elapsed_s"].get<double>() - lines[0]["elapsed_s"].get<double>(), 0.025);
  // The resumed writer starts from the last line's clock, not from zero (nor counts the pause).
  EXPECT_GE(lines[2]["elapsed_s"].get<double>(), lines[1]["elapsed_s"].get<double>());
  EXPECT_LT(lines[2]["elapsed_s"].get<double>(), lines[1]["elapsed_s"].get<double>() + 0.025);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace rp::coord
