// SPDX-License-Identifier: Apache-2.0
// The eval split through real processes: the pipeline's periodic eval loss against rp-train-ref.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <string>
#include <vector>

#include "tests/integration/launch_fixture.h"
#include "tests/testing/process_harness.h"

namespace rp {
namespace {

using testing::BinDir;
using testing::Losses;

class EvalTest : public LaunchTest {
 protected:
  // Runs rp-train-ref and rp-launch (N workers) with `sets`; expects both eval_loss series (and
  // the training losses) to agree within 1e-5, evaluations exactly at `eval_steps`.
  void ExpectMatch(int n, const std::string& name, const std::vector<std::string>& sets,
                   const std::vector<int>& eval_steps) {
    SCOPED_TRACE(name);
    auto ref = Ref(tmp_ + "/ref-" + name, sets);
    ASSERT_EQ(ref.code, 0) << ref.output;
    auto run = Launch(n, tmp_ + "/" + name, sets);
    ASSERT_EQ(run.code, 0) << run.output;
    for (const std::string field : {"loss", "eval_loss"}) {
      const auto expected = Losses(tmp_ + "/ref-" + name + "/metrics.jsonl", field);
      const auto got = Losses(tmp_ + "/" + name + "/metrics.jsonl", field);
      ASSERT_EQ(got.size(), expected.size()) << field;
      std::vector<int> evaluated;
      for (size_t s = 0; s < got.size(); ++s) {
        if (field == "eval_loss" && got[s] >= 0) evaluated.push_back(static_cast<int>(s) + 1);
        if (expected[s] < 0) {
          EXPECT_LT(got[s], 0) << field << " at step " << s + 1 << " only in the pipeline";
          continue;
        }
        EXPECT_LE(std::abs(got[s] - expected[s]) / expected[s], 1e-5)
            << field << " at step " << s + 1 << ": " << got[s] << " vs reference " << expected[s];
      }
      if (field == "eval_loss") {
        EXPECT_EQ(evaluated, eval_steps);
      }
    }
  }
};

TEST_F(EvalTest, HeldOutFractionExactMode) {
  ExpectMatch(2, "fraction",
              {"train.eval_every=4", "data.eval_fraction=0.1", "train.eval_microbatches=3"},
              {4, 8, 12, 16, 20});
  const auto eval = Losses(tmp_ + "/fraction/metrics.jsonl", "eval_loss");
  EXPECT_LT(eval[19], eval[3]);  // the model generalizes to text it never trained on
  // rp-report draws the eval losses over the training curve, one marker per evaluation.
  auto report = testing::RunProcess({BinDir() + "/rp-report", tmp_ + "/fraction"}, 60);
  ASSERT_EQ(report.code, 0) << report.output;
  const std::string svg = testing::ReadFile(tmp_ + "/fraction/report/loss.svg");
  EXPECT_NE(svg.find("eval loss"), std::string::npos);
  size_t markers = 0;
  for (size_t at = svg.find("<circle"); at != std::string::npos; at = svg.find("<circle", at + 1))
    ++markers;
  EXPECT_EQ(markers, 5u);
}

TEST_F(EvalTest, SeparateFileStale1ModeThreeWorkers) {
  const std::string file = tmp_ + "/eval.txt";
  {
    std::ofstream f(file);
    for (int i = 0; i < 40; ++i)
      f << "Held-out text that the training corpus does not contain, line " << i << ".\n";
  }
  ExpectMatch(3, "file", {"train.eval_every=3", "data.eval_path=" + file, "optimizer.mode=stale1"},
              {3, 6, 9, 12, 15, 18, 20});
}

TEST_F(EvalTest, EveryStepWithLoraDropout) {
  // An eval after every step holds back each next update until it is done; LoRA dropout must be
  // off in evaluation (the reference computes without it).
  ExpectMatch(2, "lora",
              {"train.eval_every=1", "data.eval_fraction=0.05", "train.eval_microbatches=2",
               "lora.rank=4", "lora.dropout=0.3", "lora.target_modules=[\"q_proj\",\"up_proj\"]"},
              {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20});
}

TEST_F(EvalTest, AFailedEvalJobIsReRunByTheReplacementWorker) {
  // One call per step: a worker that dies mid-way through an accumulating commit stops the run.
  const std::vector<std::string> job = {"train.steps=8", "train.accum_calls=1",
                                        "train.eval_every=2", "data.eval_fraction=0.1",
                                        "train.eval_microbatches=3"};
  auto clean = Launch(2, tmp_ + "/clean", job);
  ASSERT_EQ(clean.code, 0) << clean.output;
  auto faulty =
      testing::RunProcess(LaunchArgs(2, tmp_ + "/faulty", job), 240,
                          With(Env(), {"RP_TEST_FAIL_EVAL_ONCE=" + tmp_ + "/eval-fault-marker"}));
  ASSERT_EQ(faulty.code, 0) << faulty.output;
  EXPECT_NE(faulty.output.find("failing an eval job on purpose"), std::string::npos)
      << faulty.output;
  EXPECT_GE(Summary(tmp_ + "/faulty")["jobs_redispatched"].get<int>(), 1);
  EXPECT_EQ(Losses(tmp_ + "/faulty/metrics.jsonl", "eval_loss"),
            Losses(tmp_ + "/clean/metrics.jsonl", "eval_loss"));
  EXPECT_EQ(Losses(tmp_ + "/faulty/metrics.jsonl"), Losses(tmp_ + "/clean/metrics.jsonl"));
}

}  // namespace
}  // namespace rp
