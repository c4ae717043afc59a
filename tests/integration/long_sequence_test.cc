// SPDX-License-Identifier: Apache-2.0
// Long sequences through real processes: a job whose dense MLPs run in tiles of tokens
// (train.mlp_tile_tokens, each tile recomputed in the backward) trains as rp-train-ref, which
// never tiles, does; one whose backward rebuilds a layer's graph at a time (train.layer_recompute)
// trains as the stage-at-once graph does.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <string>
#include <vector>

#include "config/job_config.h"
#include "planning/profile.h"
#include "tests/integration/launch_fixture.h"
#include "tests/testing/process_harness.h"

namespace rp {
namespace {

using testing::Losses;

void ExpectClose(const std::vector<double>& got, const std::vector<double>& want,
                 const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t s = 0; s < got.size(); ++s)
    EXPECT_LE(std::abs(got[s] - want[s]) / want[s], 1e-5) << what << ", step " << s + 1;
}

// 512-token sequences, MLP tiles of 300 tokens (2 x 512 tokens per microbatch: tiles that do not
// divide it), on 1 to 3 CPU workers, and LoRA with dropout on every projection on 2.
TEST_F(LaunchTest, TiledMlpsMatchTheUntiledReferenceOnOneToThreeWorkers) {
  const std::vector<std::string> job = {"data.format=\"random\"", "data.seq_len=512",
                                        "train.steps=3",          "train.microbatches=3",
                                        "train.accum_calls=1",    "train.microbatch_size=2"};
  const std::vector<std::vector<std::string>> variants = {
      {},
      {"lora.rank=4", "lora.dropout=0.1",
       "lora.target_modules=[\"q_proj\",\"k_proj\",\"v_proj\",\"o_proj\",\"gate_proj\",\"up_proj\","
       "\"down_proj\"]"}};
  for (size_t v = 0; v < variants.size(); ++v) {
    const auto sets = With(job, variants[v]);
    const std::string tag = v == 0 ? "full" : "lora";
    auto ref = Ref(tmp_ + "/ref-" + tag, sets);
    ASSERT_EQ(ref.code, 0) << ref.output;
    const auto want = Losses(tmp_ + "/ref-" + tag + "/metrics.jsonl");
    ASSERT_EQ(want.size(), 3u);
    for (int n : v == 0 ? std::vector<int>{1, 2, 3} : std::vector<int>{2}) {
      const std::string out = tmp_ + "/tiled-" + tag + "-" + std::to_string(n);
      auto run = Launch(n, out, With(sets, {"train.mlp_tile_tokens=300"}));
      ASSERT_EQ(run.code, 0) << run.output;
      ExpectClose(Losses(out + "/metrics.jsonl"), want,
                  tag + " on " + std::to_string(n) + " workers");
      // The norm counts every weight's gradient, the norms' inside the tiles too.
      ExpectClose(Losses(out + "/metrics.jsonl", "grad_norm"),
                  Losses(tmp_ + "/ref-" + tag + "/metrics.jsonl", "grad_norm"),
                  tag + " gradient norms on " + std::to_string(n) + " workers");
    }
  }
}

// train.mlp_tile_tokens = -1: rp-launch chooses the tile once from schedule.gpu_memory_gb (the
// dry run names it) and the run is the run with that tile given: the same losses bit for bit.
// A limit no tile meets is refused before anything starts, naming the key.
TEST_F(LaunchTest, AnAutoMlpTileIsChosenOnceAndRunsAsThatTile) {
  // Wide MLPs, so that their intermediates decide the estimate.
  const std::vector<std::string> job = {"data.format=\"random\"", "data.seq_len=2048",
                                        "train.steps=2",          "model.intermediate_size=2048",
                                        "train.microbatches=2",   "train.accum_calls=1",
                                        "train.microbatch_size=1"};
  // The limit: between the estimates of 1024-token and untiled MLPs of this job's plan (0.33 and
  // 0.45 GB by the planner's estimate, 0.28 of it the CPU workers' attention scores).
  const auto auto_tile = With(job, {"train.mlp_tile_tokens=-1", "schedule.gpu_memory_gb=0.37"});
  auto args = LaunchArgs(2, tmp_ + "/dry", auto_tile);
  args.insert(args.begin() + 1, "--dry-run");
  auto dry = testing::RunProcess(args, 60, Env());
  ASSERT_EQ(dry.code, 0) << dry.output;
  const std::string said = "dense MLPs in tiles of ";
  const auto at = dry.output.find(said);
  ASSERT_NE(at, std::string::npos) << "the limit should need a tile:\n" << dry.output;
  const int64_t tile = std::stoll(dry.output.substr(at + said.size()));
  EXPECT_GE(tile, 512);
  EXPECT_LT(tile, 2048);
  auto chosen = Launch(2, tmp_ + "/auto", auto_tile);
  ASSERT_EQ(chosen.code, 0) << chosen.output;
  auto given =
      Launch(2, tmp_ + "/given", With(job, {"train.mlp_tile_tokens=" + std::to_string(tile)}));
  ASSERT_EQ(given.code, 0) << given.output;
  EXPECT_EQ(Losses(tmp_ + "/auto/metrics.jsonl"), Losses(tmp_ + "/given/metrics.jsonl"));
  auto none = Launch(2, tmp_ + "/none",
                     With(job, {"train.mlp_tile_tokens=-1", "schedule.gpu_memory_gb=0.02"}), 30);
  EXPECT_EQ(none.code, 2) << none.output;
  EXPECT_NE(none.output.find("train.mlp_tile_tokens = -1"), std::string::npos) << none.output;
}

// train.layer_recompute: backward stages and the tail's blocks rebuild one layer's graph at a time
// from inputs kept without autograd. The same operations on the same inputs: the same bits as the
// stage-at-once graph (losses, gradient norms, exported weights) on 1 to 3 workers, in both modes,
// with LoRA dropout, tiled MLPs, and a mixture of experts with the routers' loss.
TEST_F(LaunchTest, LayerRecomputeGivesTheStageGraphsBitsEverywhere) {
  const std::vector<std::string> job = {"train.steps=4", "train.accum_calls=1",
                                        "train.microbatches=4", "schedule.tail_blocks=2",
                                        "checkpoint.export_hf=hf"};
  struct Variant {
    std::string tag;
    std::vector<std::string> sets;
    std::vector<int> workers;
  };
  const std::vector<Variant> variants = {
      {"exact",
       {"schedule.backward_stages=1"},
       {1, 2, 3}},  // B[0,3): three layers rebuilt one by one
      {"stale1", {"optimizer.mode=\"stale1\""}, {2}},
      {"lora",
       {"lora.rank=4", "lora.dropout=0.1",
        "lora.target_modules=[\"q_proj\",\"v_proj\",\"down_proj\"]"},
       {2}},
      {"tiled", {"data.format=\"random\"", "data.seq_len=256", "train.mlp_tile_tokens=100"}, {2}},
      {"moe",
       {"model.num_experts=4", "model.experts_per_token=2", "model.expert_intermediate_size=32",
        "model.router_aux_loss_coef=0.05"},
       {2}}};
  for (const auto& v : variants) {
    const auto sets = With(job, v.sets);
    const std::string base = tmp_ + "/" + v.tag;
    auto plain = Launch(2, base, sets);
    ASSERT_EQ(plain.code, 0) << plain.output;
    for (int n : v.workers) {
      const std::string out = base + "-layers-" + std::to_string(n);
      auto r = Launch(n, out, With(sets, {"train.layer_recompute=true"}));
      ASSERT_EQ(r.code, 0) << r.output;
      SCOPED_TRACE(v.tag + " on " + std::to_string(n) + " workers");
      EXPECT_EQ(Losses(out + "/metrics.jsonl"), Losses(base + "/metrics.jsonl"));
      EXPECT_EQ(Losses(out + "/metrics.jsonl", "grad_norm"),
                Losses(base + "/metrics.jsonl", "grad_norm"));
      if (v.tag != "lora") {
        EXPECT_TRUE(ReadBytes(out + "/hf/model.safetensors") ==
                    ReadBytes(base + "/hf/model.safetensors"));
      }
    }
  }
}

// Where a block's checkpoint lives follows from the backward cuts: a backward stage that starts at
// a block reads that block's input from a host activation slot, which the forward stage wrote
// while it ran; inside a longer backward stage the block's input is recomputed and held by the
// worker. One block per backward stage (every checkpoint in host memory) gives the same bits as
// one stage recomputing every block (every checkpoint in the worker) on 1 to 3 workers, exact and
// stale1. Poisoning a host checkpoint after the forward changes the run from that step's
// gradients on; the same poison has nothing to hit when the worker holds the checkpoints.
TEST_F(LaunchTest, HostCheckpointsGiveTheWorkersCheckpointsBitsAndAreRead) {
  const std::vector<std::string> job = {"train.steps=6", "schedule.forward_stages=1",
                                        "checkpoint.export_hf=hf"};
  const std::vector<std::string> in_worker = {"schedule.backward_stages=1"};    // F[0,4) .. B[0,4)
  const std::vector<std::string> in_host = {"schedule.backward_cuts=[1,2,3]"};  // B[3,4) .. B[0,1)
  for (const std::string mode : {"exact", "stale1"}) {
    const auto sets = With(job, {"optimizer.mode=\"" + mode + "\""});
    const std::string worker_out = tmp_ + "/" + mode + "-worker";
    auto worker = Launch(2, worker_out, With(sets, in_worker));
    ASSERT_EQ(worker.code, 0) << worker.output;
    for (int n = 1; n <= 3; ++n) {
      const std::string out = tmp_ + "/" + mode + "-host-" + std::to_string(n);
      auto r = Launch(n, out, With(sets, in_host));
      ASSERT_EQ(r.code, 0) << r.output;
      SCOPED_TRACE(mode + " on " + std::to_string(n) + " workers");
      EXPECT_EQ(Summary(out)["plan"], "F[0,4) T[4,6) B[3,4) B[2,3) B[1,2) B[0,1)");
      EXPECT_EQ(Losses(out + "/metrics.jsonl"), Losses(worker_out + "/metrics.jsonl"));
      EXPECT_EQ(Losses(out + "/metrics.jsonl", "grad_norm"),
                Losses(worker_out + "/metrics.jsonl", "grad_norm"));
      EXPECT_TRUE(ReadBytes(out + "/hf/model.safetensors") ==
                  ReadBytes(worker_out + "/hf/model.safetensors"));
    }
  }
  // Step 2's checkpoint of block 2 (pipeline layer 2), exact mode on 2 workers: that step's loss
  // comes from the forward, before the backward reads it, so it stays; its gradient norm and every
  // later loss change.
  const auto exact = With(job, {"optimizer.mode=\"exact\""});
  const std::string clean = tmp_ + "/exact-host-2";
  const std::string poisoned = tmp_ + "/poisoned";
  auto p = Launch(2, poisoned,
                  With(exact, {"schedule.backward_cuts=[1,2,3]", "RP_TEST_POISON_CHECKPOINT=2:2"}));
  ASSERT_EQ(p.code, 0) << p.output;
  const auto want = Losses(clean + "/metrics.jsonl"), got = Losses(poisoned + "/metrics.jsonl");
  ASSERT_EQ(got.size(), 6u);
  ASSERT_EQ(want.size(), 6u);
  for (size_t s = 0; s <= 2; ++s) EXPECT_EQ(got[s], want[s]) << "step " << s;
  for (size_t s = 3; s < 6; ++s) EXPECT_NE(got[s], want[s]) << "step " << s;
  EXPECT_NE(Losses(poisoned + "/metrics.jsonl", "grad_norm")[2],
            Losses(clean + "/metrics.jsonl", "grad_norm")[2]);
  const std::string held = tmp_ + "/poison-missed";
  auto q = Launch(2, held, With(exact, With(in_worker, {"RP_TEST_POISON_CHECKPOINT=2:2"})));
  ASSERT_EQ(q.code, 0) << q.output;
  EXPECT_EQ(Losses(held + "/metrics.jsonl"), Losses(tmp_ + "/exact-worker/metrics.jsonl"));
}

// A stage that computes for longer than job.worker_timeout_s on a CPU worker (a long sequence
// through many layers) is not taken for a hung worker: the worker beats between layers. No
// restarts are allowed, so a worker killed as hung would stop the run.
TEST_F(LaunchTest, AStageLongerThanTheHangTimeoutIsNotAHang) {
  const double timeout_s = 10.0;
  const std::vector<std::string> job = {"data.format=\"random\"",
                                        "data.seq_len=4096",
                                        "train.steps=1",
                                        "train.microbatches=1",
                                        "train.accum_calls=1",
                                        "train.microbatch_size=1",
                                        "model.num_layers=12",
                                        "schedule.forward_stages=1",
                                        "schedule.backward_stages=1",
                                        "job.worker_timeout_s=" + std::to_string(timeout_s),
                                        "job.max_worker_restarts=0"};
  auto r = Launch(1, tmp_ + "/long", job, 300);
  ASSERT_EQ(r.code, 0) << r.output;
  // The test means something only where the stages outlast the timeout: each of the step's
  // forward and backward stages runs eleven of the twelve layers, about a second each here.
  const auto step_s = Losses(tmp_ + "/long/metrics.jsonl", "step_time_s");
  ASSERT_EQ(step_s.size(), 1u);
  if (step_s[0] < 2 * timeout_s)
    GTEST_SKIP() << "a step of " << step_s[0] << " s: too fast a machine for this test";
}

// CPU workers keep attention scores for every pair of positions: a sequence whose scores cannot
// fit the host's memory is refused before anything starts, naming data.seq_len and the estimate,
// instead of swapping until the worker is taken for a hung one. The dry run prints the estimate
// and says so.
TEST_F(LaunchTest, ACpuSequenceWhoseAttentionScoresDoNotFitTheHostIsRefused) {
  const std::vector<std::string> job = {"data.format=\"random\"", "train.microbatches=2",
                                        "train.accum_calls=1", "train.microbatch_size=1"};
  auto dry_args = LaunchArgs(2, tmp_ + "/dry", With(job, {"data.seq_len=8192"}));
  dry_args.insert(dry_args.begin() + 1, "--dry-run");
  auto dry = testing::RunProcess(dry_args, 60, Env());
  ASSERT_EQ(dry.code, 0) << dry.output;
  EXPECT_NE(dry.output.find("estimated memory per CPU worker"), std::string::npos) << dry.output;
  auto dry_long_args = LaunchArgs(2, tmp_ + "/dry-long", With(job, {"data.seq_len=131072"}));
  dry_long_args.insert(dry_long_args.begin() + 1, "--dry-run");
  auto dry_long = testing::RunProcess(dry_long_args, 60, Env());
  EXPECT_EQ(dry_long.code, 2) << dry_long.output;  // refused as the launch is
  EXPECT_NE(dry_long.output.find("attention scores"), std::string::npos) << dry_long.output;
  // 4 heads x 131072^2 fp32 scores: 256 GiB for one block's.
  auto r = Launch(2, tmp_ + "/long", With(job, {"data.seq_len=131072"}), 60);
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("data.seq_len = 131072"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("attention scores"), std::string::npos) << r.output;
  EXPECT_FALSE(std::filesystem::exists(tmp_ + "/long/metrics.jsonl"));
}

}  // namespace
}  // namespace rp

namespace rp {
namespace {

// schedule.keep_attention: forward stages keep blocks' attention outputs and log-sum-exps and the
// backward stages' recomputes take them instead of running the attention forward again. The run
// trains as rp-train-ref with the same kernels does, and as the job without the key does up to
// the kernels' rounding, in both modes and with a layer-by-layer recompute. The profile shows the
// records were used: a backward stage's block whose attention came from a record has no measured
// recompute (it is timed apart), so its recompute is filled from the other layers'; with a count
// of one, only the block below the tail.
TEST_F(LaunchTest, KeptAttentionTrainsAsItsReferenceAndStandsInForTheForward) {
  const std::vector<std::string> job = {
      "train.steps=5",          "train.accum_calls=1",        "train.microbatches=3",
      "schedule.tail_blocks=1", "schedule.backward_stages=2", "schedule.drift=0"};
  const std::vector<std::pair<std::string, std::vector<std::string>>> variants = {
      {"exact", {}},
      {"stale1", {"optimizer.mode=\"stale1\""}},
      {"layers", {"train.layer_recompute=true"}}};
  // -1: as many as fit the budget, decided once and printed by the dry run (here all three
  // blocks below the one in the tail).
  auto args = LaunchArgs(1, tmp_ + "/dry",
                         With(job, {"schedule.keep_attention=-1", "schedule.gpu_memory_gb=50"}));
  args.insert(args.begin() + 1, "--dry-run");
  auto dry = testing::RunProcess(args, 60, Env());
  ASSERT_EQ(dry.code, 0) << dry.output;
  EXPECT_NE(dry.output.find("attention kept from the forward for blocks 0..2"), std::string::npos)
      << dry.output;
  for (const auto& [tag, extra] : variants) {
    SCOPED_TRACE(tag);
    const auto sets = With(job, extra);
    const auto kept = With(sets, {"schedule.keep_attention=100"});  // every recomputed block
    auto ref = Ref(tmp_ + "/ref-" + tag, kept);
    ASSERT_EQ(ref.code, 0) << ref.output;
    const std::string out = tmp_ + "/kept-" + tag, base = tmp_ + "/plain-" + tag;
    auto run = Launch(1, out, kept);
    ASSERT_EQ(run.code, 0) << run.output;
    auto plain = Launch(1, base, sets);
    ASSERT_EQ(plain.code, 0) << plain.output;
    ExpectClose(Losses(out + "/metrics.jsonl"), Losses(tmp_ + "/ref-" + tag + "/metrics.jsonl"),
                "against rp-train-ref");
    ExpectClose(Losses(out + "/metrics.jsonl", "grad_norm"),
                Losses(tmp_ + "/ref-" + tag + "/metrics.jsonl", "grad_norm"),
                "gradient norms against rp-train-ref");
    ExpectClose(Losses(out + "/metrics.jsonl"), Losses(base + "/metrics.jsonl"),
                "against the job without the key");
    if (tag == "layers") continue;  // its layer-by-layer rebuild is timed as a whole
    auto cfg = core::LoadJobConfig(Job(), With(kept, {"job.output_dir=" + out}));
    ASSERT_TRUE(cfg.ok());
    auto with = core::LoadProfile(out + "/profile.json", *cfg);
    ASSERT_TRUE(with.ok()) << with.status().ToString();
    auto plain_cfg = core::LoadJobConfig(Job(), With(sets, {"job.output_dir=" + base}));
    ASSERT_TRUE(plain_cfg.ok());
    auto without = core::LoadProfile(base + "/profile.json", *plain_cfg);
    ASSERT_TRUE(without.ok()) << without.status().ToString();
    const int tail_start = static_cast<int>(with->layers.size()) - 2;  // one block in the tail
    for (int l = 1; l < tail_start; ++l) {
      EXPECT_TRUE(with->layers[l].filled) << "block " << l << " was recomputed";
      EXPECT_FALSE(without->layers[l].filled) << "block " << l;
    }
    if (tag != "exact") continue;
    // A count: the blocks just below the tail keep theirs, the ones below recompute.
    const std::string one = tmp_ + "/one-" + tag;
    auto partial = Launch(1, one, With(sets, {"schedule.keep_attention=1"}));
    ASSERT_EQ(partial.code, 0) << partial.output;
    ExpectClose(Losses(one + "/metrics.jsonl"), Losses(out + "/metrics.jsonl"), "one block's");
    auto some = core::LoadProfile(one + "/profile.json", *cfg);
    ASSERT_TRUE(some.ok()) << some.status().ToString();
    for (int l = 1; l < tail_start; ++l)
      EXPECT_EQ(some->layers[l].filled, l == tail_start - 1) << "block " << l;
  }
}

}  // namespace
}  // namespace rp
