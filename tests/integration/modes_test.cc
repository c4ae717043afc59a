// SPDX-License-Identifier: Apache-2.0
// Every mode against rp-train-ref, table-driven: each pair of values of any two modes (the job
// keys that choose an execution, the bench switches, the worker count) runs together in at least
// one pipeline run on CPU workers (all-pairs, built greedily below), and each run must match
// rp-train-ref within 1e-5 relative at every step. Where the docs promise the same bits
// (activation transports, layer-major forward order, the fp32 embedding lookup from host memory),
// the run is repeated with those three at their defaults and must give identical losses.
#include <gtest/gtest.h>

#include <cmath>
#include <set>
#include <string>
#include <vector>

#include "tests/integration/launch_fixture.h"
#include "tests/testing/process_harness.h"

namespace rp {
namespace {

using testing::Losses;

struct Factor {
  std::string name;                 // for messages
  std::vector<std::string> values;  // "key=value" overrides (RP_* = environment); "" = default
};

// The factors; index kWorkers holds the worker count, kActivations the transports.
enum {
  kMode,
  kOptimizer,
  kActivations,
  kWeights,
  kLookup,
  kPartition,
  kLora,
  kMerge,
  kInterleave,
  kLayerMajor,
  kWorkers
};

const std::vector<Factor>& Factors() {
  static const std::vector<Factor> f = {
      {"optimizer.mode", {"optimizer.mode=\"exact\"", "optimizer.mode=\"stale1\""}},
      {"optimizer.name", {"optimizer.name=\"adamw\"", "optimizer.name=\"sgd\""}},
      {"schedule.activations",
       {"schedule.activations=\"host\"", "schedule.activations=\"worker\"",
        "schedule.activations=\"cuda_ipc\""}},
      {"schedule.weights_source",
       {"schedule.weights_source=\"auto\"", "schedule.weights_source=\"compute_copy\""}},
      {"schedule.embedding_lookup",
       {"schedule.embedding_lookup=\"auto\"", "schedule.embedding_lookup=\"copy\""}},
      {"schedule.partition", {"schedule.partition=\"equal\"", "schedule.partition=\"auto\""}},
      {"lora.rank", {"lora.rank=0", "lora.rank=4"}},
      {"RP_MERGE_CALLS", {"RP_MERGE_CALLS=auto", "RP_MERGE_CALLS=always", "RP_MERGE_CALLS=never"}},
      {"RP_INTERLEAVE_CALLS", {"RP_INTERLEAVE_CALLS=1", "RP_INTERLEAVE_CALLS=0"}},
      {"RP_LAYER_MAJOR_FORWARD",
       {"RP_LAYER_MAJOR_FORWARD=auto", "RP_LAYER_MAJOR_FORWARD=always",
        "RP_LAYER_MAJOR_FORWARD=never"}},
      {"workers", {"1", "2", "3"}},
  };
  return f;
}

// A row is one value index per factor. The one constraint: activations in the worker needs a
// single worker (several are refused before anything starts).
bool Allowed(const std::vector<int>& row) { return row[kActivations] != 1 || row[kWorkers] == 0; }

// Greedy all-pairs: keep adding the allowed row that covers the most uncovered pairs (ties: the
// first found, scanning rows in lexicographic order), until every allowed pair is covered.
std::vector<std::vector<int>> AllPairs() {
  const auto& f = Factors();
  const size_t n = f.size();
  std::set<std::vector<int>> uncovered;  // {i, a, j, b}
  for (size_t i = 0; i < n; ++i)
    for (size_t j = i + 1; j < n; ++j)
      for (int a = 0; a < static_cast<int>(f[i].values.size()); ++a)
        for (int b = 0; b < static_cast<int>(f[j].values.size()); ++b) {
          if (i == kActivations && a == 1 && j == kWorkers && b != 0) continue;
          uncovered.insert({static_cast<int>(i), a, static_cast<int>(j), b});
        }
  std::vector<std::vector<int>> rows;
  while (!uncovered.empty()) {
    std::vector<int> best, row(n, 0);
    size_t best_gain = 0;
    // All 3^4 x 2^7 = 10,368 rows are scanned each round: cheap next to one run.
    while (true) {
      if (Allowed(row)) {
        size_t gain = 0;
        for (size_t i = 0; i < n; ++i)
          for (size_t j = i + 1; j < n; ++j)
            gain += uncovered.count({static_cast<int>(i), row[i], static_cast<int>(j), row[j]});
        if (gain > best_gain) {
          best_gain = gain;
          best = row;
        }
      }
      size_t k = 0;
      while (k < n && ++row[k] == static_cast<int>(f[k].values.size())) row[k++] = 0;
      if (k == n) break;
    }
    if (best_gain == 0) break;
    for (size_t i = 0; i < n; ++i)
      for (size_t j = i + 1; j < n; ++j)
        uncovered.erase({static_cast<int>(i), best[i], static_cast<int>(j), best[j]});
    rows.push_back(best);
  }
  EXPECT_TRUE(uncovered.empty()) << uncovered.size() << " pairs no allowed row covers";
  return rows;
}

class ModesTest : public LaunchTest {
 protected:
  // The job's overrides for a row (the worker count aside): 6 steps, 2 calls of 2 microbatches,
  // clipping on, LoRA targets with dropout so the adapters' masks are exercised too; no
  // re-planning, so `auto` keeps its cost-model plan and a row and its plain twin run one plan.
  static std::vector<std::string> Sets(const std::vector<int>& row) {
    std::vector<std::string> s = {"train.steps=6",
                                  "train.accum_calls=2",
                                  "train.microbatches=2",
                                  "schedule.replan_gain=0",
                                  "lora.target_modules=[\"q_proj\",\"down_proj\"]",
                                  "lora.dropout=0.1"};
    for (size_t i = 0; i < Factors().size(); ++i)
      if (i != kWorkers) s.push_back(Factors()[i].values[row[i]]);
    return s;
  }
  static std::string Describe(const std::vector<int>& row) {
    std::string d;
    for (size_t i = 0; i < Factors().size(); ++i)
      d += (d.empty() ? "" : " ") + Factors()[i].values[row[i]];
    return d;
  }
};

TEST_F(ModesTest, EveryPairOfModesMatchesTheReference) {
  const auto rows = AllPairs();
  ASSERT_GE(rows.size(), 9u);  // at least 3 x 3 for the two largest factors
  int bitwise_checks = 0;
  for (size_t r = 0; r < rows.size(); ++r) {
    const auto& row = rows[r];
    SCOPED_TRACE("row " + std::to_string(r) + ": " + Describe(row));
    const std::string tag = std::to_string(r);
    const std::vector<std::string> sets = Sets(row);
    const int workers = row[kWorkers] + 1;
    auto ref = Ref(tmp_ + "/ref-" + tag, sets);
    ASSERT_EQ(ref.code, 0) << ref.output;
    auto run = Launch(workers, tmp_ + "/run-" + tag, sets);
    ASSERT_EQ(run.code, 0) << run.output;
    const auto want = Losses(tmp_ + "/ref-" + tag + "/metrics.jsonl");
    const auto got = Losses(tmp_ + "/run-" + tag + "/metrics.jsonl");
    ASSERT_EQ(want.size(), 6u);
    ASSERT_EQ(got.size(), want.size());
    for (size_t s = 0; s < got.size(); ++s)
      EXPECT_LE(std::abs(got[s] - want[s]) / want[s], 1e-5) << "step " << s + 1;
    // The same bits with the transport, the forward order and the lookup at their defaults.
    if (row[kActivations] == 0 && row[kLayerMajor] == 0 && row[kLookup] == 0) continue;
    std::vector<int> plain = row;
    plain[kActivations] = plain[kLayerMajor] = plain[kLookup] = 0;
    auto base = Launch(workers, tmp_ + "/plain-" + tag, Sets(plain));
    ASSERT_EQ(base.code, 0) << base.output;
    EXPECT_EQ(Losses(tmp_ + "/plain-" + tag + "/metrics.jsonl"), got)
        << "not bit-identical to " << Describe(plain);
    ++bitwise_checks;
  }
  EXPECT_GE(bitwise_checks, 3);
  RecordProperty("rows", static_cast<int>(rows.size()));
  RecordProperty("bitwise_checks", bitwise_checks);
}

}  // namespace
}  // namespace rp
