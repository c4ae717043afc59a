// SPDX-License-Identifier: Apache-2.0
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>

#include <nlohmann/json.hpp>

#include "io/data.h"
#include "config/lr_schedule.h"
#include "config/model_spec.h"
#include "tests/testing/process_harness.h"

namespace rp::core {
namespace {

JobConfig BytesConfig() {
  JobConfig c;
  c.data.path = testing::SourceDir() + "/data/tiny_corpus.txt";
  c.data.seq_len = 32;
  c.train.microbatch_size = 2;
  return c;
}

TEST(Dataset, DeterministicShiftedAndCoordinateKeyed) {
  auto c = BytesConfig();
  auto d1 = Dataset::Open(c);
  auto d2 = Dataset::Open(c);
  ASSERT_TRUE(d1.ok() && d2.ok());
  std::vector<int64_t> t1(64), l1(64), t2(64), l2(64);
  d1->Fill(3, 1, 2, t1.data(), l1.data());
  d2->Fill(0, 0, 0, t2.data(), l2.data());  // a different draw first must not matter
  d2->Fill(3, 1, 2, t2.data(), l2.data());
  EXPECT_EQ(t1, t2);
  EXPECT_EQ(l1, l2);
  for (int i = 0; i + 1 < 32; ++i) EXPECT_EQ(l1[i], t1[i + 1]);
  d1->Fill(3, 1, 1, t2.data(), l2.data());
  EXPECT_NE(t1, t2);
  EXPECT_EQ(d1->CountStepTargets(0), c.train.accum_calls * c.train.microbatches * 64);
}

// One window per step: step s reads the s-th window of the epoch's order.
JobConfig OneWindowPerStep() {
  auto c = BytesConfig();
  c.train.microbatch_size = 1;
  c.train.microbatches = 1;
  c.train.accum_calls = 1;
  return c;
}

TEST(Dataset, EpochVisitsEveryWindowOnce) {
  auto c = OneWindowPerStep();
  auto d = Dataset::Open(c);
  ASSERT_TRUE(d.ok());
  std::set<std::vector<int64_t>> seen;
  std::vector<int64_t> t(32), l(32);
  for (int64_t s = 0; s < d->NumWindows(); ++s) {
    d->Fill(s, 0, 0, t.data(), l.data());
    seen.insert(t);
  }
  EXPECT_EQ(static_cast<int64_t>(seen.size()), d->NumWindows());
}

TEST(Dataset, HeldOutEvalWindowsAreNeverTrainedOn) {
  auto c = OneWindowPerStep();
  auto all = Dataset::Open(c);
  ASSERT_TRUE(all.ok());
  c.data.eval_fraction = 0.2;
  c.train.eval_every = 1;
  auto train = Dataset::Open(c);
  auto eval = Dataset::OpenEval(c);
  ASSERT_TRUE(train.ok() && eval.ok()) << eval.status().ToString();
  const int64_t held = all->NumWindows() / 5;
  EXPECT_EQ(train->NumWindows(), all->NumWindows() - held);
  EXPECT_EQ(eval->NumWindows(), held);
  std::vector<int64_t> t(32), l(32);
  std::set<std::vector<int64_t>> trained, evaluated;
  for (int64_t s = 0; s < 3 * train->NumWindows(); ++s) {  // three epochs
    train->Fill(s, 0, 0, t.data(), l.data());
    trained.insert(t);
  }
  // The eval set is the last windows in file order, the same at every call, and disjoint.
  for (int64_t k = 0; k < held; ++k) {
    eval->FillEval(k, t.data(), l.data());
    evaluated.insert(t);
    EXPECT_EQ(trained.count(t), 0u) << "eval window " << k << " was trained on";
    EXPECT_EQ(t[0], static_cast<unsigned char>(
                        testing::ReadFile(c.data.path)[(all->NumWindows() - held + k) * 32]));
  }
  EXPECT_EQ(static_cast<int64_t>(evaluated.size()), held);
  std::vector<int64_t> again(32), again_l(32);
  eval->FillEval(held, again.data(), again_l.data());  // wraps around to the first eval window
  eval->FillEval(0, t.data(), l.data());
  EXPECT_EQ(again, t);
  // Too large a fraction of too small a file is named.
  c.data.eval_fraction = 0.5;
  c.data.seq_len = static_cast<int64_t>(testing::ReadFile(c.data.path).size()) - 1;  // one window
  auto none = Dataset::Open(c);
  ASSERT_FALSE(none.ok());
  EXPECT_NE(none.status().message().find("data.eval_fraction"), std::string::npos)
      << none.status().message();
}

TEST(Dataset, RandomFormatEvaluatesOnItsOwnStream) {
  JobConfig c;
  c.data.format = core::DataFormat::kRandom;
  c.train.eval_every = 1;
  auto train = Dataset::Open(c);
  auto eval = Dataset::OpenEval(c);
  ASSERT_TRUE(train.ok() && eval.ok());
  const int64_t n = c.train.microbatch_size * c.data.seq_len;
  std::vector<int64_t> t(n), l(n), e(n), el(n);
  eval->FillEval(0, e.data(), el.data());
  for (int64_t s = 0; s < 4; ++s)
    for (int64_t mb = 0; mb < c.train.microbatches; ++mb) {
      train->Fill(s, 0, mb, t.data(), l.data());
      EXPECT_NE(t, e);
    }
}

// Flat token files: uint16 and uint32 ids with a JSON sidecar, memory-mapped, windows of
// seq_len + 1 with shifted labels; every malformed input is named.
TEST(Dataset, TokenFilesWithASidecar) {
  const std::string dir = testing::MakeTempDir("rp-tokens-");
  auto write = [&](const std::string& name, const std::string& bytes, const std::string& sidecar) {
    std::ofstream(dir + "/" + name, std::ios::binary)
        .write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    if (!sidecar.empty()) std::ofstream(dir + "/" + name + ".json") << sidecar;
    return dir + "/" + name;
  };
  auto ids = [](int n, int width, int vocab) {
    std::string out;
    for (int i = 0; i < n; ++i) {
      const uint32_t v = static_cast<uint32_t>(i % vocab);
      out.append(reinterpret_cast<const char*>(&v), width);  // little-endian host
    }
    return out;
  };
  JobConfig c;
  c.model.vocab_size = 300;
  c.data.format = core::DataFormat::kTokens;
  c.data.seq_len = 8;
  c.train.microbatch_size = 2;
  for (int width : {2, 4}) {
    std::string name = "t";  // (appended: GCC 12 warns falsely on "t" + std::string)
    name += std::to_string(width);
    name += ".bin";
    c.data.path = write(name, ids(1000, width, 300),
                        std::string("{\"dtype\": \"") + (width == 2 ? "uint16" : "uint32") +
                            "\", \"vocab_size\": 300}");
    auto d = Dataset::Open(c);
    ASSERT_TRUE(d.ok()) << d.status().message();
    EXPECT_EQ(d->NumWindows(), (1000 - 1) / 8);
    std::vector<int64_t> tok(16), lab(16);
    d->Fill(2, 1, 0, tok.data(), lab.data());
    for (int r = 0; r < 2; ++r)
      for (int j = 0; j < 8; ++j) {
        EXPECT_EQ(lab[r * 8 + j], (tok[r * 8 + j] + 1) % 300);  // the next token in the file
        if (j > 0) {
          EXPECT_EQ(tok[r * 8 + j], lab[r * 8 + j - 1]);
        }
      }
  }
  struct Bad {
    std::string file, bytes, sidecar, expect;
  };
  const std::vector<Bad> bad = {
      {"nosidecar.bin", ids(100, 2, 300), "", "sidecar"},
      {"dtype.bin", ids(100, 2, 300), R"({"dtype": "int8", "vocab_size": 300})",
       "not uint16 or uint32"},
      {"odd.bin", ids(100, 2, 300) + "x", R"({"dtype": "uint16", "vocab_size": 300})",
       "not a whole number"},
      {"big.bin", ids(100, 2, 300), R"({"dtype": "uint16", "vocab_size": 5000})",
       "more than model.vocab_size"},
      {"id.bin", ids(400, 2, 301), R"({"dtype": "uint16", "vocab_size": 300})", "at position 300"},
      {"short.bin", ids(5, 2, 300), R"({"dtype": "uint16", "vocab_size": 300})",
       "fewer than seq_len + 1"},
      // The sidecar and the file must agree: ids up to 255 with a vocabulary of 100, and no
      // vocabulary.
      {"sidecar-vocab.bin", ids(400, 2, 256), R"({"dtype": "uint16", "vocab_size": 100})",
       "token 100 at position 100 is not below the vocab_size 100 that"},
      {"negative-vocab.bin", ids(100, 2, 300), R"({"dtype": "uint16", "vocab_size": -5})",
       "says vocab_size -5; a vocabulary has at least one token"},
  };
  for (const auto& b : bad) {
    c.data.path = write(b.file, b.bytes, b.sidecar);
    auto d = Dataset::Open(c);
    ASSERT_FALSE(d.ok()) << b.file;
    EXPECT_NE(d.status().message().find(b.expect), std::string::npos)
        << b.file << ": " << d.status().message();
  }
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
}

// JSONL records: packed back to back, targets are the next token of the same record (or its
// label / masked), never across a record boundary; malformed lines are named with file:line.
TEST(Dataset, JsonlRecordsPackWithoutCrossRecordTargets) {
  const std::string dir = testing::MakeTempDir("rp-jsonl-");
  JobConfig c;
  c.model.vocab_size = 50;
  c.data.format = core::DataFormat::kJsonl;
  c.data.seq_len = 4;
  c.data.shuffle = false;
  c.train.microbatch_size = 1;
  c.data.packing = core::DataPacking::kStream;
  c.data.path = dir + "/d.jsonl";
  std::ofstream(c.data.path) << R"({"input_ids": [1, 2, 3]})"
                             << "\n"
                             << R"({"input_ids": [4, 5, 6], "loss_mask": [1, 0, 1]})"
                             << "\n\n"
                             << R"({"input_ids": [7, 8], "labels": [-100, 9]})"
                             << "\n";
  auto d = Dataset::Open(c);
  ASSERT_TRUE(d.ok()) << d.status().message();
  EXPECT_EQ(d->NumWindows(), 2);  // 8 tokens
  std::vector<int64_t> tok(4), lab(4);
  d->Fill(0, 0, 0, tok.data(), lab.data());
  EXPECT_EQ(tok, (std::vector<int64_t>{1, 2, 3, 4}));
  EXPECT_EQ(lab, (std::vector<int64_t>{2, 3, kIgnoreIndex, kIgnoreIndex}));  // 4 predicts masked 5
  std::vector<int64_t> pos(4);
  d->Fill(0, 0, 1, tok.data(), lab.data(), pos.data());
  EXPECT_EQ(tok, (std::vector<int64_t>{5, 6, 7, 8}));
  EXPECT_EQ(lab, (std::vector<int64_t>{6, kIgnoreIndex, 9, kIgnoreIndex}));
  EXPECT_EQ(pos, (std::vector<int64_t>{0, 1, 2, 3}));  // stream: one sequence per window
  struct Bad {
    std::string text, expect;
  };
  for (const auto& b :
       std::vector<Bad>{{"[1,2]", ":1: not a JSON object"},
                        {R"({"input_ids": [1, 99]})", "input_ids[1]"},
                        {R"({"input_ids": [1, 2], "labels": [1]})", "as long as"},
                        {R"({"input_ids": [1, 2], "loss_mask": [1, 2]})", "loss_mask[1]"},
                        {R"({"ids": [1]})", "no non-empty"}}) {
    std::ofstream(c.data.path, std::ios::trunc) << b.text << "\n";
    auto bad = Dataset::Open(c);
    ASSERT_FALSE(bad.ok()) << b.text;
    EXPECT_NE(bad.status().message().find(b.expect), std::string::npos) << bad.status().message();
  }
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
}

// The packed stream of a file of records, window by window: tokens, labels, positions.
struct Packed {
  std::vector<std::vector<int64_t>> tokens, labels, positions;
  Dataset::PackingStats stats;
  std::string summary;
};
StatusOr<Packed> PackWindows(const JobConfig& c);

StatusOr<Packed> PackRecords(DataPacking packing, LongRecords long_records, int64_t seq_len,
                             const std::string& text) {
  const std::string dir = testing::MakeTempDir("rp-packing-");
  JobConfig c;
  c.model.vocab_size = 50;
  c.data.format = core::DataFormat::kJsonl;
  c.data.packing = packing;
  c.data.long_records = long_records;
  c.data.seq_len = seq_len;
  c.data.shuffle = false;
  c.train.microbatch_size = 1;
  c.train.microbatches = 1;
  c.train.accum_calls = 1;
  c.data.path = dir + "/d.jsonl";
  std::ofstream(c.data.path) << text;
  auto p = PackWindows(c);
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  return p;
}

// Every window of `c`'s data in file order.
StatusOr<Packed> PackWindows(const JobConfig& c) {
  const int64_t seq_len = c.data.seq_len;
  auto d = Dataset::Open(c);
  if (!d.ok()) return d.status();
  Packed p;
  for (int64_t w = 0; w < d->NumWindows(); ++w) {
    std::vector<int64_t> tok(seq_len), lab(seq_len), pos(seq_len);
    d->Fill(w, 0, 0, tok.data(), lab.data(), pos.data());
    p.tokens.push_back(tok);
    p.labels.push_back(lab);
    p.positions.push_back(pos);
  }
  p.stats = d->stats();
  p.summary = d->PackingSummary();
  return p;
}

constexpr int64_t X = kIgnoreIndex;
using Rows = std::vector<std::vector<int64_t>>;

TEST(Dataset, DocumentPackingKeepsRecordsWholeWithTheirOwnPositions) {
  const std::string records = R"({"input_ids": [1, 2, 3]})"
                              "\n"
                              R"({"input_ids": [4, 5]})"
                              "\n"
                              R"({"input_ids": [6, 7, 8, 9], "loss_mask": [1, 1, 0, 1]})"
                              "\n"
                              R"({"input_ids": [10]})"
                              "\n";
  auto p = PackRecords(DataPacking::kDocuments, LongRecords::kSplit, 6, records);
  ASSERT_TRUE(p.ok()) << p.status().message();
  // [1 2 3][4 5] fit one window; [6 7 8 9] does not fit the one token left, so it starts the
  // next, and [10] fills after it; padding (token 0, no target, positions from 0) ends each.
  EXPECT_EQ(p->tokens, (Rows{{1, 2, 3, 4, 5, 0}, {6, 7, 8, 9, 10, 0}}));
  EXPECT_EQ(p->labels, (Rows{{2, 3, X, 5, X, X}, {7, X, 9, X, X, X}}));
  EXPECT_EQ(p->positions, (Rows{{0, 1, 2, 0, 1, 0}, {0, 1, 2, 3, 0, 0}}));
  EXPECT_EQ(p->stats.records, 4);
  EXPECT_EQ(p->stats.tokens, 10);
  EXPECT_EQ(p->stats.padding, 2);
  EXPECT_NE(
      p->summary.find("4 records, 10 tokens, 2 windows of 6 tokens (documents packing, 83.3%"),
      std::string::npos)
      << p->summary;

  auto pad = PackRecords(DataPacking::kPad, LongRecords::kSplit, 6, records);
  ASSERT_TRUE(pad.ok()) << pad.status().message();
  EXPECT_EQ(
      pad->tokens,
      (Rows{{1, 2, 3, 0, 0, 0}, {4, 5, 0, 0, 0, 0}, {6, 7, 8, 9, 0, 0}, {10, 0, 0, 0, 0, 0}}));
  EXPECT_EQ(pad->positions[1], (std::vector<int64_t>{0, 1, 0, 1, 2, 3}));
}

TEST(Dataset, RecordsLongerThanAWindowAreSplitTruncatedOrDropped) {
  const std::string records = R"({"input_ids": [1, 2]})"
                              "\n"
                              R"({"input_ids": [3, 4, 5, 6, 7, 8, 9]})"
                              "\n"
                              R"({"input_ids": [10, 11]})"
                              "\n";
  auto split = PackRecords(DataPacking::kDocuments, LongRecords::kSplit, 3, records);
  ASSERT_TRUE(split.ok()) << split.status().message();
  // Each piece starts a window, positions continue across the pieces, and a piece's last
  // position still predicts the record's next token.
  EXPECT_EQ(split->tokens, (Rows{{1, 2, 0}, {3, 4, 5}, {6, 7, 8}, {9, 10, 11}}));
  EXPECT_EQ(split->labels, (Rows{{2, X, X}, {4, 5, 6}, {7, 8, 9}, {X, 11, X}}));
  EXPECT_EQ(split->positions, (Rows{{0, 1, 0}, {0, 1, 2}, {3, 4, 5}, {6, 0, 1}}));
  EXPECT_EQ(split->stats.split, 1);

  auto truncated = PackRecords(DataPacking::kDocuments, LongRecords::kTruncate, 3, records);
  ASSERT_TRUE(truncated.ok()) << truncated.status().message();
  EXPECT_EQ(truncated->tokens, (Rows{{1, 2, 0}, {3, 4, 5}, {10, 11, 0}}));
  EXPECT_EQ(
      truncated->labels,
      (Rows{{2, X, X}, {4, 5, X}, {11, X, X}}));  // a truncated record's last predicts nothing
  EXPECT_EQ(truncated->stats.truncated, 1);
  EXPECT_NE(truncated->summary.find("0 split, 1 truncated, 0 dropped"), std::string::npos)
      << truncated->summary;

  auto dropped = PackRecords(DataPacking::kDocuments, LongRecords::kDrop, 3, records);
  ASSERT_TRUE(dropped.ok()) << dropped.status().message();
  EXPECT_EQ(dropped->tokens, (Rows{{1, 2, 0}, {10, 11, 0}}));
  EXPECT_EQ(dropped->stats.dropped, 1);

  auto nothing_left = PackRecords(DataPacking::kDocuments, LongRecords::kDrop, 3,
                                  R"({"input_ids": [1, 2, 3, 4]})"
                                  "\n");
  ASSERT_FALSE(nothing_left.ok());
  EXPECT_NE(nothing_left.status().message().find("after dropping 1 records longer than seq_len"),
            std::string::npos)
      << nothing_left.status().message();
}

// A token file with a document index and a loss mask (tools/prepare_data.py's output) is the
// same records as JSONL with loss masks: the same windows in every packing; a broken index, mask
// or sidecar is refused naming what is wrong.
TEST(Dataset, IndexedTokenFilesAreTheSameRecordsAsJsonl) {
  const std::string dir = testing::MakeTempDir("rp-indexed-");
  const std::vector<std::vector<uint32_t>> records = {
      {1, 2, 3}, {4, 5, 6, 7, 8}, {9, 10}, {11, 12, 13, 14, 15, 16, 17}};
  const std::vector<std::vector<uint8_t>> masks = {
      {0, 1, 1}, {0, 0, 1, 1, 1}, {1, 1}, {0, 1, 0, 1, 1, 1, 1}};
  std::string jsonl, tokens, mask, index;
  auto put64 = [&index](uint64_t v) { index.append(reinterpret_cast<const char*>(&v), 8); };
  put64(0);
  uint64_t n = 0;
  for (size_t r = 0; r < records.size(); ++r) {
    jsonl += "{\"input_ids\": [";
    std::string m = "], \"loss_mask\": [";
    for (size_t i = 0; i < records[r].size(); ++i) {
      jsonl += (i ? ", " : "") + std::to_string(records[r][i]);
      m += (i ? ", " : "") + std::to_string(masks[r][i]);
      tokens.append(reinterpret_cast<const char*>(&records[r][i]), 2);
      mask.push_back(static_cast<char>(masks[r][i]));
    }
    jsonl += m + "]}\n";
    n += records[r].size();
    put64(n);
  }
  auto write = [&](const std::string& name, const std::string& bytes) {
    std::ofstream(dir + "/" + name, std::ios::binary)
        .write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  };
  write("d.jsonl", jsonl);
  write("d.bin", tokens);
  write("d.bin.docs", index);
  write("d.bin.mask", mask);
  const std::string sidecar =
      R"({"dtype": "uint16", "vocab_size": 50, "documents": 4, "loss_mask": true, "tokens": 17)";
  write("d.bin.json", sidecar + "}");
  JobConfig c;
  c.model.vocab_size = 50;
  c.data.seq_len = 6;
  c.data.shuffle = false;
  c.train.microbatch_size = 1;
  c.train.microbatches = 1;
  c.train.accum_calls = 1;
  for (DataPacking packing : {DataPacking::kDocuments, DataPacking::kPad, DataPacking::kStream}) {
    c.data.packing = packing;
    c.data.format = core::DataFormat::kJsonl;
    c.data.path = dir + "/d.jsonl";
    auto from_jsonl = PackWindows(c);
    c.data.format = core::DataFormat::kTokens;
    c.data.path = dir + "/d.bin";
    auto from_tokens = PackWindows(c);
    ASSERT_TRUE(from_jsonl.ok() && from_tokens.ok()) << from_tokens.status().message();
    EXPECT_EQ(from_tokens->tokens, from_jsonl->tokens) << EnumName(packing);
    EXPECT_EQ(from_tokens->labels, from_jsonl->labels) << EnumName(packing);
    EXPECT_EQ(from_tokens->positions, from_jsonl->positions) << EnumName(packing);
    EXPECT_EQ(from_tokens->stats.records, 4);
  }
  // The job file's default packing for such a file is "documents".
  write("job.toml",
        "[data]\nformat = \"tokens\"\npath = \"d.bin\"\nseq_len = 6\n[model]\nvocab_size = 50\n");
  auto job = LoadJobConfig(dir + "/job.toml", {});
  ASSERT_TRUE(job.ok()) << job.status().message();
  EXPECT_EQ(job->data.packing, DataPacking::kDocuments);

  c.data.packing = DataPacking::kDocuments;
  struct Bad {
    std::string what, file, bytes, expect;
  };
  std::string backwards = index;
  std::memcpy(&backwards[16], &backwards[8], 8);  // document 1 empty
  std::string past =
      index;  // document 0 ends at 1000, past the 17 tokens (read before the next is checked)
  const uint64_t far = 1000;
  std::memcpy(&past[8], &far, 8);
  const std::vector<Bad> bad = {
      {"an index too short", "d.bin.docs", index.substr(8), "4 documents need 40"},
      {"an index not ending at the token count", "d.bin.docs",
       index.substr(0, 32) + std::string(8, '\0'), "from 0 to the token count 17"},
      {"an empty document", "d.bin.docs", backwards, "document 1 is empty"},
      {"a document past the end", "d.bin.docs", past, "document 0 ends past the token count 17"},
      {"a mask byte of 2", "d.bin.mask", std::string(16, '\1') + "\2", "byte 16 is 2"},
      {"a mask too short", "d.bin.mask", mask.substr(1), "one per token would be 17"},
      {"an unknown sidecar key", "d.bin.json", sidecar + R"(, "bos": true})",
       "unknown key \"bos\""},
      {"a wrong token count", "d.bin.json",
       R"({"dtype": "uint16", "vocab_size": 50, "documents": 4, "tokens": 18})", "says tokens 18"},
  };
  for (const auto& b : bad) {
    write(b.file, b.bytes);
    c.data.path = dir + "/d.bin";
    auto d = Dataset::Open(c);
    ASSERT_FALSE(d.ok()) << b.what;
    EXPECT_NE(d.status().message().find(b.expect), std::string::npos)
        << b.what << ": " << d.status().message();
    write("d.bin.docs", index);
    write("d.bin.mask", mask);
    write("d.bin.json", sidecar + "}");
  }
  // Without an index a token file is one stream: documents packing is refused, a mask still
  // applies.
  write("d.bin.json", R"({"dtype": "uint16", "vocab_size": 50, "loss_mask": true})");
  auto unindexed = Dataset::Open(c);
  ASSERT_FALSE(unindexed.ok());
  EXPECT_NE(unindexed.status().message().find("names no document index"), std::string::npos)
      << unindexed.status().message();
  c.data.packing = DataPacking::kStream;
  auto stream = PackWindows(c);
  ASSERT_TRUE(stream.ok()) << stream.status().message();
  EXPECT_EQ(stream->tokens[0], (std::vector<int64_t>{1, 2, 3, 4, 5, 6}));
  EXPECT_EQ(stream->labels[0], (std::vector<int64_t>{2, 3, X, X, 6, 7}));  // mask of the next token
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
}

// tests/testdata/chat: tools/prepare_data.py's output for chats.jsonl with the fixture tokenizer
// (tools/make_chat_fixtures.py, which checked it against transformers there). Read one record
// per window, each window is the conversation's tokens as transformers renders them, and the
// targets are exactly the tokens of transformers' assistant mask.
TEST(Dataset, PreparedChatsAreTransformersTokensAndAssistantMasks) {
  const std::string dir = testing::SourceDir() + "/tests/testdata/chat";
  const auto expected = nlohmann::json::parse(testing::ReadFile(dir + "/expected.json"))["chatml"];
  JobConfig c;
  c.model.vocab_size = 383;
  c.data.format = core::DataFormat::kTokens;
  c.data.path = dir + "/chatml.bin";
  c.data.packing = DataPacking::kPad;
  c.data.seq_len = 128;
  c.data.shuffle = false;
  c.train.microbatch_size = 1;
  c.train.microbatches = 1;
  c.train.accum_calls = 1;
  auto windows = PackWindows(c);
  ASSERT_TRUE(windows.ok()) << windows.status().message();
  ASSERT_EQ(windows->tokens.size(), expected.size());
  for (size_t r = 0; r < expected.size(); ++r) {
    const auto ids = expected[r]["input_ids"].get<std::vector<int64_t>>();
    const auto mask = expected[r]["assistant_masks"].get<std::vector<int64_t>>();
    ASSERT_LE(ids.size(), 128u);
    std::vector<int64_t> want_tokens(128, 0), want_labels(128, X);
    for (size_t j = 0; j < ids.size(); ++j) {
      want_tokens[j] = ids[j];
      if (j + 1 < ids.size() && mask[j + 1] == 1) want_labels[j] = ids[j + 1];
    }
    EXPECT_EQ(windows->tokens[r], want_tokens) << "conversation " << r;
    EXPECT_EQ(windows->labels[r], want_labels) << "conversation " << r;
  }
  // The same file in a model with a smaller vocabulary is refused by its sidecar.
  c.model.vocab_size = 300;
  auto small = Dataset::Open(c);
  ASSERT_FALSE(small.ok());
  EXPECT_NE(small.status().message().find("vocab_size 383"), std::string::npos)
      << small.status().message();
}

TEST(LearningRate, WarmupThenCosineToMin) {
  OptimizerConfig o;
  o.lr = 1.0;
  o.min_lr = 0.1;
  o.warmup_steps = 4;
  EXPECT_DOUBLE_EQ(LearningRate(o, 0, 20), 0.25);
  EXPECT_DOUBLE_EQ(LearningRate(o, 3, 20), 1.0);
  EXPECT_DOUBLE_EQ(LearningRate(o, 4, 20), 1.0);
  EXPECT_NEAR(LearningRate(o, 19, 20), 0.1, 1e-12);
  for (int s = 5; s < 20; ++s) EXPECT_LE(LearningRate(o, s, 20), LearningRate(o, s - 1, 20));
}

TEST(LearningRate, LinearAndConstantAfterWarmup) {
  OptimizerConfig o;
  o.lr = 1.0;
  o.min_lr = 0.2;
  o.warmup_steps = 2;
  o.lr_schedule = LrSchedule::kLinear;
  EXPECT_DOUBLE_EQ(LearningRate(o, 0, 7), 0.5);
  EXPECT_DOUBLE_EQ(LearningRate(o, 1, 7), 1.0);
  EXPECT_DOUBLE_EQ(LearningRate(o, 2, 7), 1.0);    // the first step after warmup runs at lr
  EXPECT_NEAR(LearningRate(o, 4, 7), 0.6, 1e-12);  // halfway along the line
  EXPECT_NEAR(LearningRate(o, 6, 7), 0.2, 1e-12);  // the last step at min_lr
  o.lr_schedule = LrSchedule::kConstant;
  EXPECT_DOUBLE_EQ(LearningRate(o, 0, 7), 0.5);
  for (int s = 1; s < 7; ++s) EXPECT_DOUBLE_EQ(LearningRate(o, s, 7), 1.0);
  o.lr_schedule = LrSchedule::kCosine;
  EXPECT_NEAR(LearningRate(o, 4, 7), 0.6, 1e-12);      // a cosine's middle is the line's
  EXPECT_GT(LearningRate(o, 3, 7), 0.6 + 0.2 * 0.25);  // and above it before
}

// train.epochs derives the steps from the data's windows (and a warmup ratio its steps); a job
// that says the same thing two ways is refused.
TEST(TrainingLength, EpochsDeriveTheStepsFromTheWindows) {
  const std::string base = testing::SourceDir() + "/data";
  const std::string job =
      "[data]\npath = \"tiny_corpus.txt\"\nseq_len = 32\n"
      "[train]\nmicrobatch_size = 2\nmicrobatches = 3\naccum_calls = 2\n";
  auto plain = ParseJobConfig(job, base, {});
  ASSERT_TRUE(plain.ok()) << plain.status().message();
  auto windows = Dataset::Open(*plain);
  ASSERT_TRUE(windows.ok());
  const int64_t w = windows->NumWindows();  // 5127 bytes in windows of 33: 155
  ASSERT_GT(w, 100);

  auto c = ParseJobConfig(job, base, {"train.epochs=2.5", "optimizer.warmup_ratio=0.1"});
  ASSERT_TRUE(c.ok()) << c.status().message();
  ASSERT_TRUE(ResolveTrainingLength(&*c).ok());
  const int64_t steps = (5 * w + 23) / 24;  // ceil(2.5 w / 12 sequences per step)
  EXPECT_EQ(c->train.steps, steps);
  EXPECT_EQ(c->optimizer.warmup_steps, (steps + 9) / 10);
  auto d = Dataset::Open(*c);
  ASSERT_TRUE(d.ok());
  EXPECT_NE(d->LengthSummary().find(std::to_string(steps) + " steps = 2.5"), std::string::npos)
      << d->LengthSummary();

  // One epoch of whole steps covers every window; the step before the last leaves some unread.
  auto one = ParseJobConfig(job, base, {"train.epochs=1"});
  ASSERT_TRUE(one.ok() && ResolveTrainingLength(&*one).ok());
  EXPECT_GE(one->train.steps * 12, w);
  EXPECT_LT((one->train.steps - 1) * 12, w);

  // Without epochs a warmup ratio counts train.steps at parse time.
  auto ratio = ParseJobConfig(job, base, {"train.steps=30", "optimizer.warmup_ratio=0.05"});
  ASSERT_TRUE(ratio.ok());
  EXPECT_EQ(ratio->optimizer.warmup_steps, 2);

  auto refused = [&](std::vector<std::string> sets, const std::string& words) {
    auto r = ParseJobConfig(job, base, sets);
    if (r.ok()) {
      const Status s = ResolveTrainingLength(&*r);
      ASSERT_FALSE(s.ok()) << words;
      EXPECT_NE(s.message().find(words), std::string::npos) << s.message();
      return;
    }
    EXPECT_NE(r.status().message().find(words), std::string::npos) << r.status().message();
  };
  refused({"train.epochs=1", "train.steps=5"}, "train.epochs and train.steps: both given");
  refused({"optimizer.warmup_ratio=0.1", "optimizer.warmup_steps=3"},
          "warmup_ratio and optimizer.warmup_steps");
  refused({"train.epochs=1", "data.format=\"random\""}, "endless synthetic stream");
  refused({"train.epochs=0.1", "train.stop_after=100"}, "train.stop_after: 100 is past the");
}

TEST(Init, DeterministicAndScaled) {
  ModelConfig m;
  auto spec = BuildModelSpec(m);
  std::vector<float> b(spec.params[1].numel);
  std::vector<float> a2(spec.params[0].numel), b2(spec.params[0].numel);
  InitParam(spec, 0, 7, a2.data());
  InitParam(spec, 0, 7, b2.data());
  EXPECT_EQ(a2, b2);
  double sum = 0, sq = 0;
  for (float x : a2) sum += x, sq += x * x;
  const double n = static_cast<double>(a2.size());
  EXPECT_NEAR(sum / n, 0.0, 0.002);
  EXPECT_NEAR(std::sqrt(sq / n), m.init_std, 0.002);
  // Normal in shape, not only in its first two moments (over a 1M-value embedding): the share
  // within one and two standard deviations, and tails neither cut short nor too long.
  ModelConfig wide = m;
  wide.vocab_size = 8192;
  const auto wide_spec = BuildModelSpec(wide);
  std::vector<float> w(wide_spec.params[0].numel);
  InitParam(wide_spec, 0, 7, w.data());
  int64_t within1 = 0, within2 = 0;
  float largest = 0.0f;
  for (float x : w) {
    const double z = std::fabs(x) / m.init_std;
    within1 += z < 1.0;
    within2 += z < 2.0;
    largest = std::max(largest, static_cast<float>(z));
  }
  const double wn = static_cast<double>(w.size());
  EXPECT_NEAR(within1 / wn, 0.6827, 0.002);
  EXPECT_NEAR(within2 / wn, 0.9545, 0.001);
  EXPECT_LT(largest, 6.5f);
  EXPECT_GT(largest, 4.0f);
  // A count that ends inside a chunk: the same values as the longer tensor's.
  ParamSpec odd = wide_spec.params[0];
  odd.numel -= 1;
  std::vector<float> shorter(odd.numel);
  InitParam(odd, wide, 7, shorter.data());
  EXPECT_TRUE(std::equal(shorter.begin(), shorter.end(), w.begin()));
  InitParam(spec, 0, 8, b2.data());
  EXPECT_NE(a2, b2);
  InitParam(spec, 1, 7, b.data());  // input_layernorm: ones
  for (float x : b) EXPECT_EQ(x, 1.0f);
}

TEST(ModelSpec, HuggingFaceNamesAndTiedHead) {
  ModelConfig m;
  m.num_layers = 2;
  auto spec = BuildModelSpec(m);
  EXPECT_EQ(spec.params[0].name, "model.embed_tokens.weight");
  EXPECT_EQ(spec.params[2].name, "model.layers.0.self_attn.q_proj.weight");
  EXPECT_EQ(spec.NumLayers(), 4);
  EXPECT_EQ(spec.layer_uses[3].back().role, "lm_head");
  EXPECT_EQ(spec.layer_uses[3].back().param, 0);
  m.tie_embeddings = false;
  auto untied = BuildModelSpec(m);
  EXPECT_EQ(untied.params.back().name, "lm_head.weight");
}

// Expert adapters carry PEFT's names (its wrappers nest in transformers' registration order,
// the first innermost) and shapes (A [r x E, in], B [out, r x E]), each B right after its A and
// both pointing at the frozen tensor they adapt.
TEST(ModelSpec, ExpertAdaptersHavePeftsNamesAndShapes) {
  ModelConfig m;
  m.num_layers = 1;
  m.hidden_size = 32;
  m.moe.num_experts = 4;
  m.moe.experts_per_token = 2;
  m.moe.expert_intermediate_size = 16;
  LoraConfig lora;
  lora.rank = 2;
  lora.target_modules = {"q_proj"};
  lora.target_parameters = {"mlp.experts.down_proj", "mlp.experts.gate_up_proj"};
  const ModelSpec spec = BuildModelSpec(m, lora);
  std::map<std::string, const ParamSpec*> by_name;
  for (const auto& p : spec.params) by_name[p.name] = &p;
  const std::string pre = "model.layers.0.mlp.experts.";
  ASSERT_TRUE(by_name.count(pre + "base_layer.lora_A.weight"));
  ASSERT_TRUE(by_name.count(pre + "lora_B.weight"));
  const ParamSpec& gate_up_a = *by_name.at(pre + "base_layer.lora_A.weight");
  EXPECT_EQ(gate_up_a.shape, (std::vector<int64_t>{8, 32}));
  EXPECT_EQ(by_name.at(pre + "base_layer.lora_B.weight")->shape, (std::vector<int64_t>{32, 8}));
  EXPECT_EQ(by_name.at(pre + "lora_A.weight")->shape, (std::vector<int64_t>{8, 16}));
  EXPECT_EQ(by_name.at(pre + "lora_B.weight")->shape, (std::vector<int64_t>{32, 8}));
  EXPECT_EQ(spec.frozen.at(static_cast<size_t>(gate_up_a.adapts)).name, pre + "gate_up_proj");
  EXPECT_EQ(spec.frozen.at(static_cast<size_t>(by_name.at(pre + "lora_A.weight")->adapts)).name,
            pre + "down_proj");
  EXPECT_EQ(gate_up_a.experts, 4);
  for (size_t p = 0; p < spec.params.size(); ++p)
    if (spec.params[p].name.find("lora_A") != std::string::npos) {
      ASSERT_LT(p + 1, spec.params.size());
      EXPECT_EQ(spec.params[p + 1].adapts, spec.params[p].adapts) << spec.params[p].name;
    }
  // One expert tensor targeted: no wrapper around it, so no base_layer.
  lora.target_parameters = {"mlp.experts.gate_up_proj"};
  const ModelSpec one = BuildModelSpec(m, lora);
  bool found = false;
  for (const auto& p : one.params)
    found |= p.name == pre + "lora_A.weight" && p.shape == std::vector<int64_t>{8, 32};
  EXPECT_TRUE(found);
}

}  // namespace
}  // namespace rp::core
