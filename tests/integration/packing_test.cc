// SPDX-License-Identifier: Apache-2.0
// Document-isolated packing through real processes: the pipeline on 1-3 CPU workers against
// rp-train-ref, and packed windows against the same records one per window.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <string>
#include <vector>

#include "tests/integration/launch_fixture.h"
#include "tests/testing/process_harness.h"

namespace rp {
namespace {

using testing::Losses;

class PackingTest : public LaunchTest {
 protected:
  // Twelve chat-sized records whose lengths fill four windows of 32 tokens exactly when packed
  // whole in file order (10 12 10 | 8 8 16 | 20 12 | 5 7 9 11), so "stream" packing makes the
  // same windows and differs from "documents" only in what each token sees.
  std::string WriteRecords() {
    const std::string path = tmp_ + "/records.jsonl";
    std::ofstream f(path);
    const int lengths[] = {10, 12, 10, 8, 8, 16, 20, 12, 5, 7, 9, 11};
    int k = 0;
    for (int n : lengths) {
      f << "{\"input_ids\": [";
      for (int i = 0; i < n; ++i) f << (i ? ", " : "") << (37 * k++ + 11 * n) % 256;
      // The first two tokens are a prompt: no loss on predicting them.
      f << "], \"loss_mask\": [0, 0";
      for (int i = 2; i < n; ++i) f << ", 1";
      f << "]}\n";
    }
    return path;
  }
  std::vector<std::string> Job(const std::string& packing) {
    return {"data.format=jsonl", "data.path=" + WriteRecords(), "data.shuffle=false",
            "data.packing=" + packing, "train.steps=6"};
  }
  // Every window of the file in each step: 4 packed windows (2 microbatches of 2), or 12 windows
  // of one record each (2 calls of 3 microbatches of 2).
  std::vector<std::string> Packed() {
    return With(Job("documents"),
                {"train.microbatch_size=2", "train.microbatches=2", "train.accum_calls=1"});
  }
  std::vector<std::string> OnePerWindow() {
    return With(Job("pad"),
                {"train.microbatch_size=2", "train.microbatches=3", "train.accum_calls=2"});
  }

  static void ExpectClose(const std::vector<double>& got, const std::vector<double>& expected,
                          double tol, const std::string& what) {
    ASSERT_EQ(got.size(), expected.size()) << what;
    for (size_t s = 0; s < got.size(); ++s)
      EXPECT_LE(std::abs(got[s] - expected[s]), tol * std::abs(expected[s]))
          << what << " at step " << s + 1 << ": " << got[s] << " vs " << expected[s];
  }
};

TEST_F(PackingTest, PackedDocumentsTrainAsTheSameRecordsOnePerWindow) {
  auto packed = Ref(tmp_ + "/packed", Packed());
  ASSERT_EQ(packed.code, 0) << packed.output;
  EXPECT_NE(
      packed.output.find("12 records, 128 tokens, 4 windows of 32 tokens (documents packing)"),
      std::string::npos)
      << packed.output;
  auto alone = Ref(tmp_ + "/alone", OnePerWindow());
  ASSERT_EQ(alone.code, 0) << alone.output;
  for (const std::string field : {"loss", "grad_norm"})
    ExpectClose(Losses(tmp_ + "/packed/metrics.jsonl", field),
                Losses(tmp_ + "/alone/metrics.jsonl", field), 1e-6,
                "documents packing against one record per window, " + field);
  // The same windows without isolation train differently from the first step on.
  auto stream = Ref(tmp_ + "/stream", With(Packed(), {"data.packing=stream"}));
  ASSERT_EQ(stream.code, 0) << stream.output;
  const auto crossing = Losses(tmp_ + "/stream/metrics.jsonl"),
             isolated = Losses(tmp_ + "/packed/metrics.jsonl");
  ASSERT_FALSE(crossing.empty());
  EXPECT_GT(std::abs(crossing[0] - isolated[0]), 1e-4 * isolated[0]);
}

TEST_F(PackingTest, PipelineMatchesTheReferenceOnOneToThreeWorkers) {
  // Stages split the blocks (forward, fused tail, backward with recompute) across the workers.
  auto ref = Ref(tmp_ + "/ref", Packed());
  ASSERT_EQ(ref.code, 0) << ref.output;
  for (int n = 1; n <= 3; ++n) {
    const std::string out = tmp_ + "/run" + std::to_string(n);
    auto run = Launch(n, out, Packed());
    ASSERT_EQ(run.code, 0) << run.output;
    for (const std::string field : {"loss", "grad_norm"})
      ExpectClose(Losses(out + "/metrics.jsonl", field), Losses(tmp_ + "/ref/metrics.jsonl", field),
                  1e-6, std::to_string(n) + " workers, " + field);
  }
  // Evaluation sees the documents too: one record per window held out, the pipeline's eval loss
  // against the reference's.
  const auto eval = With(OnePerWindow(), {"data.eval_fraction=0.25", "train.eval_every=3",
                                          "train.eval_microbatches=2"});
  auto ref_eval = Ref(tmp_ + "/ref-eval", eval);
  ASSERT_EQ(ref_eval.code, 0) << ref_eval.output;
  auto run_eval = Launch(2, tmp_ + "/run-eval", eval);
  ASSERT_EQ(run_eval.code, 0) << run_eval.output;
  ExpectClose(Losses(tmp_ + "/run-eval/metrics.jsonl", "eval_loss"),
              Losses(tmp_ + "/ref-eval/metrics.jsonl", "eval_loss"), 1e-6, "eval loss");
}

TEST_F(PackingTest, PackingNeedsRecords) {
  auto r = Launch(1, tmp_ + "/bytes", {"data.packing=documents"});
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("data.packing: \"documents\" needs records"), std::string::npos)
      << r.output;
}

}  // namespace
}  // namespace rp
