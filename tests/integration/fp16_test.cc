// SPDX-License-Identifier: Apache-2.0
// train.dtype = "fp16" on CPU workers (emulated: fp32 arithmetic on fp16-rounded weights and stage
// boundaries) with dynamic loss scaling: overflows injected at chosen steps (the test hook
// RP_TEST_OVERFLOW_AT_STEPS) must skip exactly those steps, leave the weights as they were, and
// move the scale as torch.amp.GradScaler's rule does (computed here on its own, from the rule as
// torch documents it); the results must not depend on the worker count, and a resume must be exact.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <fstream>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "tests/integration/launch_fixture.h"
#include "tests/testing/process_harness.h"

namespace rp {
namespace {

struct StepLine {
  double loss = 0.0;
  std::optional<double> grad_norm;  // null on a skipped step
  double loss_scale = 0.0;
  bool skipped = false;
  double eval_loss = -1.0;
  bool operator==(const StepLine& o) const {
    return loss == o.loss && grad_norm == o.grad_norm && loss_scale == o.loss_scale &&
           skipped == o.skipped && eval_loss == o.eval_loss;
  }
};

std::vector<StepLine> ReadSteps(const std::string& out) {
  std::vector<StepLine> steps;
  std::ifstream in(out + "/metrics.jsonl");
  std::string line;
  while (std::getline(in, line)) {
    const auto j = nlohmann::json::parse(line);
    StepLine s;
    s.loss = j.at("loss").get<double>();
    if (!j.at("grad_norm").is_null()) s.grad_norm = j.at("grad_norm").get<double>();
    s.loss_scale = j.at("loss_scale").get<double>();
    s.skipped = j.at("skipped").get<bool>();
    s.eval_loss = j.value("eval_loss", -1.0);
    steps.push_back(s);
  }
  return steps;
}

// GradScaler's scale for each of `steps` steps given which overflow, from its documented rule:
// an overflow multiplies the scale by the backoff factor and restarts the count of good steps;
// `interval` good steps in a row multiply it by the growth factor. `lag`: stale1 computes step s
// with the scale after step s - 2 (its weights are a step older too), exact with the one after s
// - 1.
std::vector<double> ExpectedScales(int steps, const std::set<int>& overflow, double init,
                                   int interval, int lag) {
  std::vector<double> after;  // after[t]: the scale after step t
  double scale = init;
  int good = 0;
  for (int t = 0; t < steps; ++t) {
    if (overflow.count(t)) {
      scale *= 0.5;
      good = 0;
    } else if (++good == interval) {
      scale *= 2.0;
      good = 0;
    }
    after.push_back(scale);
  }
  std::vector<double> used;
  for (int s = 0; s < steps; ++s) used.push_back(s - 1 - lag < 0 ? init : after[s - 1 - lag]);
  return used;
}

class Fp16Test : public LaunchTest {
 protected:
  // The fp16 job with overflows at 0-based steps 2, 3 and 6 and the scale growing every 2 good
  // steps.
  std::vector<std::string> Sets(const std::string& mode) const {
    return {"train.dtype=\"fp16\"", "train.steps=10", "train.loss_scale_growth_interval=2",
            "optimizer.mode=\"" + mode + "\"", "RP_TEST_OVERFLOW_AT_STEPS=2,3,6"};
  }
  const std::set<int> overflow_ = {2, 3, 6};
};

TEST_F(Fp16Test, InjectedOverflowsSkipExactlyThoseStepsAndMoveTheScaleAsGradScaler) {
  for (const std::string mode : {"exact", "stale1"}) {
    const std::string out = tmp_ + "/" + mode;
    // Evaluations after every step: a skipped step's weights are the step before's, so its eval
    // loss is that step's to the bit.
    auto r = Launch(2, out,
                    With(Sets(mode), {"train.eval_every=1", "data.eval_fraction=0.1",
                                      "train.eval_microbatches=2"}));
    ASSERT_EQ(r.code, 0) << r.output;
    const auto steps = ReadSteps(out);
    ASSERT_EQ(steps.size(), 10u);
    const auto scales = ExpectedScales(10, overflow_, 65536.0, 2, mode == "stale1" ? 1 : 0);
    for (int s = 0; s < 10; ++s) {
      SCOPED_TRACE(mode + " step " + std::to_string(s + 1));
      EXPECT_EQ(steps[s].skipped, overflow_.count(s) == 1);
      EXPECT_EQ(steps[s].grad_norm.has_value(), overflow_.count(s) == 0);
      EXPECT_EQ(steps[s].loss_scale, scales[s]);
      EXPECT_TRUE(std::isfinite(steps[s].loss));
      if (s > 0 && overflow_.count(s)) {
        EXPECT_EQ(steps[s].eval_loss, steps[s - 1].eval_loss);
      } else if (s > 0) {
        EXPECT_NE(steps[s].eval_loss, steps[s - 1].eval_loss);
      }
    }
    EXPECT_EQ(Summary(out)["skipped_steps"], 3);
  }
}

TEST_F(Fp16Test, WorkerCountsAgreeAndAResumeIsExact) {
  for (const std::string mode : {"exact", "stale1"}) {
    auto base = Launch(2, tmp_ + "/two-" + mode, Sets(mode));
    ASSERT_EQ(base.code, 0) << base.output;
    const auto two = ReadSteps(tmp_ + "/two-" + mode);
    ASSERT_EQ(two.size(), 10u) << mode;
    for (int n : {1, 3}) {
      const std::string out = tmp_ + "/" + std::to_string(n) + "-" + mode;
      auto r = Launch(n, out, Sets(mode));
      ASSERT_EQ(r.code, 0) << r.output;
      EXPECT_TRUE(ReadSteps(out) == two) << mode << " with " << n << " workers";
    }
    // Stopped after step 4 (itself skipped, as step 3 was), resumed: the same steps.
    const std::string out = tmp_ + "/resumed-" + mode;
    auto first = Launch(2, out, With(Sets(mode), {"train.stop_after=4"}));
    ASSERT_EQ(first.code, 0) << first.output;
    auto args = LaunchArgs(2, out, Sets(mode));
    args.insert(args.begin() + 1, "--resume");
    auto resumed = testing::RunProcess(args, 240, EnvWith(Sets(mode)));
    ASSERT_EQ(resumed.code, 0) << resumed.output;
    EXPECT_TRUE(ReadSteps(out) == two) << mode << " resumed after step 4";
  }
}

TEST_F(Fp16Test, UnscaledNormsTrackTheFp32Run) {
  // Without overflows the fp16 run is the fp32 run up to fp16 rounding: the norms it reports are
  // of the unscaled gradients, and the clipping and updates use those.
  auto fp32 = Launch(2, tmp_ + "/fp32", {"train.steps=10"});
  ASSERT_EQ(fp32.code, 0) << fp32.output;
  auto fp16 = Launch(2, tmp_ + "/fp16", {"train.steps=10", "train.dtype=\"fp16\""});
  ASSERT_EQ(fp16.code, 0) << fp16.output;
  const auto a = testing::Losses(tmp_ + "/fp32/metrics.jsonl");
  const auto an = testing::Losses(tmp_ + "/fp32/metrics.jsonl", "grad_norm");
  const auto b = ReadSteps(tmp_ + "/fp16");
  ASSERT_EQ(a.size(), b.size());
  for (size_t s = 0; s < a.size(); ++s) {
    ASSERT_TRUE(b[s].grad_norm.has_value()) << "step " << s + 1;
    EXPECT_NEAR(b[s].loss, a[s], 0.01 * a[s]) << "step " << s + 1;
    EXPECT_NEAR(*b[s].grad_norm, an[s], 0.03 * an[s]) << "step " << s + 1;
    EXPECT_NE(b[s].loss, a[s]) << "step " << s + 1 << ": fp16 rounding changed nothing";
  }
}

TEST_F(Fp16Test, Bf16OnCpuWorkersIsEmulatedNearTheFp32Run) {
  // CPU workers emulate bf16 as they do fp16 (fp32 arithmetic on values rounded to bf16): close to
  // the fp32 run, not equal to it, and the same whether the workers round the masters or read a
  // bf16 compute copy.
  auto fp32 = Launch(2, tmp_ + "/fp32", {"train.steps=6"});
  ASSERT_EQ(fp32.code, 0) << fp32.output;
  const std::vector<std::string> job = {"train.steps=6", "train.dtype=\"bf16\""};
  auto bf16 = Launch(2, tmp_ + "/bf16", job);
  ASSERT_EQ(bf16.code, 0) << bf16.output;
  auto copy = Launch(2, tmp_ + "/copy", With(job, {"schedule.weights_source=\"compute_copy\""}));
  ASSERT_EQ(copy.code, 0) << copy.output;
  const auto a = testing::Losses(tmp_ + "/fp32/metrics.jsonl"),
             b = testing::Losses(tmp_ + "/bf16/metrics.jsonl");
  ASSERT_EQ(a.size(), b.size());
  for (size_t s = 0; s < a.size(); ++s) {
    EXPECT_NEAR(b[s], a[s], 0.02 * a[s]) << "step " << s + 1;
    EXPECT_NE(b[s], a[s]) << "step " << s + 1 << ": bf16 rounding changed nothing";
  }
  EXPECT_EQ(testing::Losses(tmp_ + "/copy/metrics.jsonl"), b);
}

TEST_F(Fp16Test, EmulatedWeightsFromTheMastersAreTheFp16CopysValues) {
  // Exact mode's workers read the fp32 masters (the embedding's rows in place) and round them;
  // with a compute copy the optimizer rounds them into fp16. The same values either way: the same
  // losses and norms, step for step.
  const std::vector<std::string> job = {"train.dtype=\"fp16\"", "train.steps=6"};
  auto masters = Launch(2, tmp_ + "/masters", job);
  ASSERT_EQ(masters.code, 0) << masters.output;
  auto copy = Launch(2, tmp_ + "/copy", With(job, {"schedule.weights_source=\"compute_copy\""}));
  ASSERT_EQ(copy.code, 0) << copy.output;
  EXPECT_TRUE(ReadSteps(tmp_ + "/masters") == ReadSteps(tmp_ + "/copy"));
}

TEST_F(Fp16Test, AScaleDrivenBelowFp16sRangeEndsTheRunAsDiverged) {
  // Every step overflows: the scale halves each step until no gradient could overflow at it.
  auto r = Launch(2, tmp_ + "/out",
                  {"train.dtype=\"fp16\"", "train.steps=10", "train.loss_scale_init=2.4e-7",
                   "RP_TEST_OVERFLOW_AT_STEPS=0,1,2,3,4,5,6,7,8,9"});
  EXPECT_EQ(r.code, 5) << r.output;  // kExitDiverged
  EXPECT_NE(r.output.find("step 3: the gradient norm is"), std::string::npos) << r.output;
  EXPECT_EQ(testing::Losses(tmp_ + "/out/metrics.jsonl").size(), 2u);
}

}  // namespace
}  // namespace rp
