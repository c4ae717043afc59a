// SPDX-License-Identifier: Apache-2.0
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include "config/job_config.h"
#include "io/data.h"
#include "config/model_spec.h"
#include "planning/partitioner.h"
#include "planning/plan.h"
#include "shm/layout.h"
#include "tests/testing/process_harness.h"

namespace rp::core {
namespace {

// Sets one environment variable ("NAME=value"; "" = nothing) for a scope: the bench switches
// (BenchKnobs) are read from the environment.
class ScopedEnv {
 public:
  explicit ScopedEnv(const std::string& entry) {
    const auto eq = entry.find('=');
    if (eq == std::string::npos) return;
    name_ = entry.substr(0, eq);
    ::setenv(name_.c_str(), entry.substr(eq + 1).c_str(), 1);
  }
  ~ScopedEnv() {
    if (!name_.empty()) ::unsetenv(name_.c_str());
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  std::string name_;
};

std::string CorpusDir() { return testing::SourceDir() + "/data"; }

// A valid job relative to data/, so data.path resolves.
const char* kValid = R"(
[data]
path = "tiny_corpus.txt"
seq_len = 16
[train]
steps = 3
)";

StatusOr<JobConfig> Parse(const std::string& text, std::vector<std::string> overrides = {}) {
  return ParseJobConfig(text, CorpusDir(), overrides);
}

void ExpectError(const std::string& text, const std::string& key_prefix,
                 std::vector<std::string> overrides = {}) {
  auto c = Parse(text, overrides);
  ASSERT_FALSE(c.ok()) << "accepted: " << text;
  EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument);
  // A key given by --set is named as such.
  const std::string& message = c.status().message();
  EXPECT_TRUE(message.rfind(key_prefix, 0) == 0 || message.rfind("--set " + key_prefix, 0) == 0)
      << "message should start with '" << key_prefix << "': " << message;
}

TEST(JobConfig, ValidJobParsesWithDefaults) {
  auto c = Parse(kValid);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->train.steps, 3);
  EXPECT_EQ(c->data.seq_len, 16);
  EXPECT_EQ(core::ResolveExecution(*c).weight_version_lag, 0);  // exact mode
  EXPECT_EQ(c->TotalLayers(), c->model.num_layers + 2);
  EXPECT_EQ(c->data.path,
            std::filesystem::path(CorpusDir() + "/tiny_corpus.txt").lexically_normal().string());
}

TEST(JobConfig, UnknownSectionAndKey) {
  ExpectError(std::string(kValid) + "[trian]\nsteps = 1\n", "trian: unknown section");
  ExpectError(std::string(kValid) + "[model]\nhiden_size = 1\n", "model.hiden_size: unknown key");
}

TEST(JobConfig, WrongTypes) {
  ExpectError(std::string(kValid) + "[model]\nhidden_size = \"big\"\n",
              "model.hidden_size: expected an integer");
  ExpectError(std::string(kValid) + "[model]\nqk_norm = 1\n",
              "model.qk_norm: expected true or false");
  ExpectError(std::string(kValid) + "[optimizer]\nlr = \"fast\"\n",
              "optimizer.lr: expected a number");
  ExpectError(std::string(kValid) + "[schedule]\nforward_cuts = [1, \"x\"]\n",
              "schedule.forward_cuts[1]");
  ExpectError("model = 3\n", "model: must be a [model] table");
}

TEST(JobConfig, OutOfRange) {
  ExpectError(std::string(kValid) + "[model]\nnum_layers = 0\n",
              "model.num_layers: must be in [1,");
  ExpectError(std::string(kValid) + "[optimizer]\nbeta2 = 1.5\n", "optimizer.beta2: must be in");
  ExpectError(std::string(kValid) + "[job]\ndevice = \"tpu\"\n", "job.device: must be one of");
}

TEST(JobConfig, CrossFieldChecks) {
  ExpectError(std::string(kValid) + "[model]\nnum_heads = 4\nnum_kv_heads = 3\n",
              "model.num_kv_heads");
  ExpectError(std::string(kValid) + "[model]\nhead_dim = 7\n", "model.head_dim");
  ExpectError(std::string(kValid) + "[schedule]\nforward_cuts = [3, 2]\n", "schedule.forward_cuts");
  ExpectError(std::string(kValid) + "[schedule]\nbackward_cuts = [99]\n",
              "schedule.backward_cuts[0]");
  ExpectError(std::string(kValid) + "[schedule]\nforward_stages = 50\n", "schedule.forward_stages");
  ExpectError(std::string(kValid) + "[schedule]\ntail_blocks = 9\n", "schedule.tail_blocks");
  ExpectError(std::string(kValid) + "[model]\npath = \"/models/qwen\"\n", "model.path");
  // Values and keys that duplicated another are gone, and refused by name: "master" was auto
  // where accepted, "host" the lookup auto picks, activation_transport one key for activations'
  // choice.
  ExpectError(std::string(kValid) + "[schedule]\nweights_source = \"master\"\n",
              "schedule.weights_source");
  ExpectError(std::string(kValid) + "[schedule]\nembedding_lookup = \"host\"\n",
              "schedule.embedding_lookup");
  ExpectError(std::string(kValid) + "[schedule]\nactivation_transport = \"cuda_ipc\"\n",
              "schedule.activation_transport: unknown key");
  // An empty output directory would put the run's files at the filesystem's root.
  ExpectError(std::string(kValid), "job.output_dir: empty", {"job.output_dir=\"\""});
  // A LoRA rank above a target's rank bound (the default model: hidden 128, kv heads 2 x 32).
  ExpectError(std::string(kValid), "lora.rank: 80 exceeds k_proj's 64 x 128",
              {"lora.rank=80", "lora.target_modules=[\"q_proj\",\"k_proj\"]"});
  EXPECT_TRUE(Parse(kValid, {"lora.rank=64", "lora.target_modules=[\"q_proj\",\"k_proj\"]"}).ok());
  for (const char* knob : {"merge_calls", "layer_major_forward", "interleave_calls"})
    ExpectError(std::string(kValid) + "[schedule]\n" + knob + " = \"auto\"\n",
                std::string("schedule.") + knob);
  auto ipc = Parse(std::string(kValid) + "[schedule]\nactivations = \"cuda_ipc\"\n");
  ASSERT_TRUE(ipc.ok()) << ipc.status().ToString();
  EXPECT_TRUE(ResolveExecution(*ipc).ActivationsInPools());
  auto stale = Parse(std::string(kValid) + "[optimizer]\nmode = \"stale1\"\n");
  ASSERT_TRUE(stale.ok()) << stale.status().ToString();
  EXPECT_FALSE(ResolveExecution(*stale).workers_fetch_masters);
  auto exact = Parse(kValid);
  ASSERT_TRUE(exact.ok());
  EXPECT_TRUE(ResolveExecution(*exact).workers_fetch_masters);  // auto, exact mode
  EXPECT_TRUE(ResolveExecution(*exact).lookup_from_host);  // auto, with the masters as the source
  exact->schedule.weights_source = core::WeightsSource::kComputeCopy;
  EXPECT_FALSE(ResolveExecution(*exact).workers_fetch_masters);
  EXPECT_FALSE(ResolveExecution(*exact).lookup_from_host);
  EXPECT_FALSE(ResolveExecution(*stale).lookup_from_host);
}

// The mode keys resolve once into the execution plan: stale1 lags one version, cannot fetch the
// masters and so cannot look up from them, and keeps two activation slot sets; exact mode with
// one call has one set unless gradients wait in the workers.
TEST(ExecutionPlan, EachModeKeyResolvesIntoItsDecisions) {
  auto exact = Parse(kValid, {"train.accum_calls=1"});
  ASSERT_TRUE(exact.ok()) << exact.status().message();
  const ExecutionPlan x = ResolveExecution(*exact);
  EXPECT_EQ(x.weight_version_lag, 0);
  EXPECT_TRUE(x.NextStepWaitsForUpdate());
  EXPECT_TRUE(x.workers_fetch_masters);
  EXPECT_TRUE(x.lookup_from_host);
  EXPECT_EQ(x.activation_parities, 1);
  EXPECT_EQ(x.activations, Activations::kHost);
  EXPECT_FALSE(x.ActivationsInWorkers());
  EXPECT_FALSE(x.planner_chooses_partition);
  EXPECT_FALSE(x.sharded_state);  // one node: sharding changes nothing

  auto stale = Parse(kValid, {"train.accum_calls=1", "optimizer.mode=stale1"});
  ASSERT_TRUE(stale.ok()) << stale.status().message();
  const ExecutionPlan y = ResolveExecution(*stale);
  EXPECT_EQ(y.weight_version_lag, 1);
  EXPECT_FALSE(y.workers_fetch_masters);
  EXPECT_FALSE(y.lookup_from_host);
  EXPECT_EQ(y.activation_parities, 2);
  EXPECT_FALSE(y.interleave_calls);
  EXPECT_TRUE(x != y);

  auto other = Parse(kValid, {"schedule.activations=cuda_ipc", "schedule.partition=auto",
                              "schedule.embedding_lookup=copy", "train.grad_clip=1.0"});
  ASSERT_TRUE(other.ok()) << other.status().message();
  const ExecutionPlan z = ResolveExecution(*other);
  EXPECT_TRUE(z.ActivationsInPools());
  EXPECT_TRUE(z.ActivationsInWorkers());
  EXPECT_TRUE(z.planner_chooses_partition);
  EXPECT_TRUE(z.workers_fetch_masters);
  EXPECT_FALSE(z.lookup_from_host);
  EXPECT_TRUE(z.updates_wait_for_norm);
  // Resolving is pure: the same job gives the same plan.
  EXPECT_TRUE(ResolveExecution(*other) == z);
}

TEST(JobConfig, LossScalingKeysAreCheckedAndBelongToFp16) {
  auto c = Parse(kValid, {"train.dtype=fp16", "train.loss_scale_init=1024",
                          "train.loss_scale_growth_interval=50"});
  ASSERT_TRUE(c.ok()) << c.status().message();
  EXPECT_EQ(c->train.loss_scaling.init, 1024.0);
  EXPECT_EQ(c->train.loss_scaling.growth_interval, 50);
  EXPECT_TRUE(ScalesLoss(*c));
  EXPECT_TRUE(ResolveExecution(*c).updates_wait_for_norm);
  c = Parse(kValid, {"train.dtype=fp16", "train.grad_clip=0"});
  ASSERT_TRUE(c.ok()) << c.status().message();
  EXPECT_TRUE(ResolveExecution(*c)
                  .updates_wait_for_norm);  // an overflow must be known before anything is updated
  ExpectError(kValid, "train.loss_scale_*", {"train.loss_scale_init=1024"});
  ExpectError(kValid, "train.loss_scale_*",
              {"train.dtype=bf16", "job.device=cuda", "train.loss_scale_growth_interval=5"});
  ExpectError(kValid, "train.loss_scale_growth_factor",
              {"train.dtype=fp16", "train.loss_scale_growth_factor=1"});
  ExpectError(kValid, "train.loss_scale_backoff_factor",
              {"train.dtype=fp16", "train.loss_scale_backoff_factor=1"});
  ExpectError(kValid, "train.loss_scale_init", {"train.dtype=fp16", "train.loss_scale_init=0"});
}

TEST(JobConfig, Fp8IsBf16WithE4m3ProductsOnCudaWorkers) {
  auto c = Parse(kValid, {"train.dtype=fp8", "job.device=cuda"});
  ASSERT_TRUE(c.ok()) << c.status().message();
  EXPECT_TRUE(Fp8Matmuls(*c));
  EXPECT_EQ(ComputeElemBytes(*c), 2);  // weights and activations are bf16
  EXPECT_TRUE(FusedKernelsApply(*c));
  EXPECT_FALSE(ScalesLoss(*c));
  c = Parse(kValid, {"train.dtype=bf16", "job.device=cuda"});
  ASSERT_TRUE(c.ok()) << c.status().message();
  EXPECT_FALSE(Fp8Matmuls(*c));
  ExpectError(kValid, "train.dtype: \"fp8\" needs job.device",
              {"train.dtype=fp8", "job.device=cpu"});
  ScopedEnv no_fused("RP_FUSED_KERNELS=0");
  ExpectError(kValid, "train.dtype: \"fp8\" multiplies", {"train.dtype=fp8", "job.device=cuda"});
}

TEST(JobConfig, ADeviceMemoryLimitIsTheBudgetThePlannerPlansFor) {
  // 22 GiB is 23.62 GB, of which the planner plans for 85% where no budget was given, or where a
  // larger one was; a smaller budget stays. CPU workers have no device memory to cap.
  auto c = Parse(kValid, {"job.device=cuda", "job.device_memory_limit_gib=22"});
  ASSERT_TRUE(c.ok()) << c.status().message();
  EXPECT_NEAR(c->schedule.gpu_memory_gb, 0.85 * 22 * 1.073741824, 1e-9);
  c = Parse(kValid,
            {"job.device=cuda", "job.device_memory_limit_gib=22", "schedule.gpu_memory_gb=23"});
  ASSERT_TRUE(c.ok()) << c.status().message();
  EXPECT_NEAR(c->schedule.gpu_memory_gb, 0.85 * 22 * 1.073741824, 1e-9);
  c = Parse(kValid,
            {"job.device=cuda", "job.device_memory_limit_gib=22", "schedule.gpu_memory_gb=20"});
  ASSERT_TRUE(c.ok()) << c.status().message();
  EXPECT_EQ(c->schedule.gpu_memory_gb, 20);
  c = Parse(kValid, {"job.device=cuda"});
  ASSERT_TRUE(c.ok()) << c.status().message();
  EXPECT_EQ(c->schedule.gpu_memory_gb, 0);
  ExpectError(kValid, "job.device_memory_limit_gib: caps a CUDA worker's",
              {"job.device=cpu", "job.device_memory_limit_gib=22"});
}

TEST(JobConfig, WithoutABudgetCudaWorkersPlanForTheHostsSmallestGpu) {
  // rp-launch found an 80 GiB card: 85% of it, as for a limit; a limit or a budget given wins,
  // and CPU workers plan with none. Without a card (0), nothing changes.
  const HostFacts h100{80.0};
  auto plan_for = [&](std::vector<std::string> sets, const HostFacts& host) {
    return ParseJobConfig(kValid, CorpusDir(), sets, host);
  };
  auto c = plan_for({"job.device=cuda"}, h100);
  ASSERT_TRUE(c.ok()) << c.status().message();
  EXPECT_NEAR(c->schedule.gpu_memory_gb, 0.85 * 80 * 1.073741824, 1e-9);
  c = plan_for({"job.device=auto"}, h100);
  ASSERT_TRUE(c.ok()) << c.status().message();
  EXPECT_NEAR(c->schedule.gpu_memory_gb, 0.85 * 80 * 1.073741824, 1e-9);
  c = plan_for({"job.device=cuda", "schedule.gpu_memory_gb=70"}, h100);
  ASSERT_TRUE(c.ok()) << c.status().message();
  EXPECT_EQ(c->schedule.gpu_memory_gb, 70);  // the user's budget, within the card
  // A budget above the card (an H200 job file on an 80 GiB card) is refused naming both.
  c = plan_for({"job.device=cuda", "schedule.gpu_memory_gb=130"}, h100);
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("schedule.gpu_memory_gb = 130"), std::string::npos)
      << c.status().message();
  EXPECT_NE(c.status().message().find("85.9 GB, 80.0 GiB"), std::string::npos)
      << c.status().message();
  // CPU workers have no card to outgrow.
  EXPECT_TRUE(plan_for({"job.device=cpu", "schedule.gpu_memory_gb=130"}, h100).ok());
  c = plan_for({"job.device=cuda", "job.device_memory_limit_gib=22"}, h100);
  ASSERT_TRUE(c.ok()) << c.status().message();
  EXPECT_NEAR(c->schedule.gpu_memory_gb, 0.85 * 22 * 1.073741824, 1e-9);
  c = plan_for({"job.device=cpu"}, h100);
  ASSERT_TRUE(c.ok()) << c.status().message();
  EXPECT_EQ(c->schedule.gpu_memory_gb, 0);
  c = plan_for({"job.device=cuda"}, HostFacts{});
  ASSERT_TRUE(c.ok()) << c.status().message();
  EXPECT_EQ(c->schedule.gpu_memory_gb, 0);
  // A planner choice that needs a budget is then allowed without one given.
  EXPECT_TRUE(plan_for({"job.device=cuda", "schedule.kept_blocks=-1"}, h100).ok());
}

TEST(JobConfig, GradientsWaitingInWorkersNeedWhatTheyCanHold) {
  auto c = Parse(kValid, {"optimizer.gradients_wait_in=workers", "model.tie_embeddings=false",
                          "train.accum_calls=1"});
  ASSERT_TRUE(c.ok()) << c.status().message();
  EXPECT_TRUE(ResolveExecution(*c).gradients_wait_in_workers);
  // Its commits come after the norm, the tail's last: the next step's tokens and checkpoints go
  // into a second slot set instead of waiting for them (the host-held exact run keeps one).
  EXPECT_EQ(ResolveExecution(*c).activation_parities, 2);
  auto host = Parse(kValid, {"model.tie_embeddings=false", "train.accum_calls=1"});
  ASSERT_TRUE(host.ok()) << host.status().message();
  EXPECT_EQ(ResolveExecution(*host).activation_parities, 1);
  // Exact mode merges the calls into one round: allowed with accumulation calls too.
  EXPECT_TRUE(
      Parse(kValid, {"optimizer.gradients_wait_in=workers", "model.tie_embeddings=false"}).ok());
  ExpectError(kValid, "optimizer.gradients_wait_in",
              {"optimizer.gradients_wait_in=workers", "model.tie_embeddings=false",
               "optimizer.mode=stale1"});
  ExpectError(kValid, "optimizer.gradients_wait_in",
              {"optimizer.gradients_wait_in=workers", "train.accum_calls=1"});
  ExpectError(
      kValid, "optimizer.gradients_wait_in",
      {"optimizer.gradients_wait_in=workers", "model.tie_embeddings=false", "train.grad_clip=0"});
  EXPECT_TRUE(
      Parse(kValid, {"optimizer.gradients_wait_in=workers", "train.accum_calls=1", "lora.rank=4"})
          .ok());
  // fp16's scaler needs the norm first even without clipping.
  EXPECT_TRUE(Parse(kValid, {"optimizer.gradients_wait_in=workers", "model.tie_embeddings=false",
                             "train.grad_clip=0", "train.dtype=fp16"})
                  .ok());
}

TEST(JobConfig, DeviceUpdatesNeedAClippedExactAdamWStepInOneRound) {
  auto c = Parse(
      kValid, {"optimizer.device_update_blocks=2", "train.grad_clip=1.0", "train.accum_calls=1"});
  ASSERT_TRUE(c.ok()) << c.status().message();
  EXPECT_EQ(ResolveExecution(*c).device_update_blocks, 2);
  const std::string key = "optimizer.device_update_blocks";
  const std::vector<std::string> on = {"optimizer.device_update_blocks=2", "train.grad_clip=1.0",
                                       "train.accum_calls=1"};
  auto with = [&](std::vector<std::string> more) {
    more.insert(more.begin(), on.begin(), on.end());
    return more;
  };
  ExpectError(kValid, key, with({"train.grad_clip=0"}));
  ExpectError(kValid, key, with({"optimizer.mode=stale1"}));
  ExpectError(kValid, key, with({"optimizer.name=sgd"}));
  ExpectError(kValid, key, with({"optimizer.speculative_update=true"}));
  // Exact mode merges accumulation calls into one round: accepted.
  EXPECT_TRUE(Parse(kValid, with({"train.accum_calls=2"})).ok());
  ExpectError(kValid, key, with({"lora.rank=4"}));
  ExpectError(kValid, key, with({"train.dtype=fp16", "job.device=cuda"}));
  ExpectError(kValid, key, with({"optimizer.device_update_blocks=4096"}));
  JobConfig nodes = *c;
  nodes.nodes.count = 2;
  nodes.train.microbatches = 4;
  const Status several = CheckNodes(nodes);
  EXPECT_FALSE(several.ok());
  EXPECT_NE(several.message().find(key), std::string::npos) << several.message();
}

TEST(JobConfig, ASpeculativeUpdateNeedsAClippedExactAdamWStepOnTheHost) {
  auto c = Parse(kValid, {"optimizer.speculative_update=true", "train.grad_clip=1.0"});
  ASSERT_TRUE(c.ok()) << c.status().message();
  EXPECT_TRUE(ResolveExecution(*c).speculative_update);
  EXPECT_FALSE(ResolveExecution(*Parse(kValid, {"train.grad_clip=1.0"})).speculative_update);
  const std::string key = "optimizer.speculative_update";
  ExpectError(kValid, key, {"optimizer.speculative_update=true", "train.grad_clip=0"});
  ExpectError(
      kValid, key,
      {"optimizer.speculative_update=true", "train.grad_clip=1.0", "optimizer.mode=stale1"});
  ExpectError(kValid, key,
              {"optimizer.speculative_update=true", "train.grad_clip=1.0", "optimizer.name=sgd"});
  ExpectError(kValid, key,
              {"optimizer.speculative_update=true", "train.grad_clip=1.0",
               "optimizer.gradients_wait_in=workers", "model.tie_embeddings=false"});
  ExpectError(kValid, key,
              {"optimizer.speculative_update=true", "train.grad_clip=1.0", "train.dtype=fp16",
               "job.device=cuda"});
  JobConfig nodes = *c;
  nodes.nodes.count = 2;
  nodes.train.microbatches = 4;
  const Status several = CheckNodes(nodes);
  EXPECT_FALSE(several.ok());
  EXPECT_EQ(several.message().rfind(key, 0), 0u) << several.message();
}

TEST(JobConfig, AnAutoMlpTileNeedsTheDeviceMemoryToFit) {
  ExpectError(kValid, "train.mlp_tile_tokens = -1", {"train.mlp_tile_tokens=-1"});
  auto c = Parse(kValid, {"train.mlp_tile_tokens=-1", "schedule.gpu_memory_gb=40"});
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->train.mlp_tile_tokens, kMlpTileAuto);
  ExpectError(kValid, "train.mlp_tile_tokens",
              {"train.mlp_tile_tokens=-2", "schedule.gpu_memory_gb=40"});
}

TEST(JobConfig, KeptBlocksAreChecked) {
  // The default model: 4 blocks, none in the tail, so 4 precede it.
  ExpectError(kValid, "schedule.frozen_on_device: set, but lora.rank = 0",
              {"schedule.frozen_on_device=true"});
  EXPECT_TRUE(Parse(kValid, {"schedule.frozen_on_device=true", "lora.rank=4"}).ok());
  EXPECT_TRUE(Parse(kValid, {"schedule.kept_blocks=4"}).ok());
  ExpectError(kValid, "schedule.kept_blocks: 4 kept blocks, but only 3",
              {"schedule.kept_blocks=4", "schedule.tail_blocks=1"});
  ExpectError(kValid, "schedule.kept_blocks",
              {"schedule.kept_blocks=2", "train.layer_recompute=true"});
  ExpectError(kValid, "schedule.kept_blocks: a tiled MLP",
              {"schedule.kept_blocks=2", "train.mlp_tile_tokens=8"});
  ExpectError(kValid, "schedule.kept_blocks = -1", {"schedule.kept_blocks=-1"});
  auto c = Parse(kValid, {"schedule.kept_blocks=-1", "schedule.gpu_memory_gb=40"});
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->schedule.kept_blocks, kKeptBlocksAuto);
  const std::vector<std::string> moe = {"model.num_experts=4", "model.experts_per_token=2",
                                        "model.expert_intermediate_size=16",
                                        "schedule.kept_blocks=1"};
  ExpectError(kValid, "schedule.kept_blocks: block 3 is a mixture-of-experts block", moe);
}

TEST(JobConfig, LoraKeysAreChecked) {
  const std::string lora = std::string(kValid) + "[lora]\nrank = 4\n";
  ExpectError(lora + "target_modules = [\"qproj\"]\n", "lora.target_modules: \"qproj\"");
  ExpectError(lora + "target_modules = [\"q_proj\", \"q_proj\"]\n",
              "lora.target_modules: \"q_proj\" is listed twice");
  ExpectError(lora + "target_modules = []\n", "lora.target_modules: empty");
  ExpectError(lora + "target_modules = [\"q_proj\", 3]\n", "lora.target_modules[1]");
  ExpectError(lora + "init_from = \"no/such/adapter\"\n", "lora.init_from: no such directory");
  ExpectError(std::string(kValid) + "[lora]\ninit_from = \".\"\n",
              "lora.init_from: set, but lora.rank = 0");
  ExpectError(lora + "dropout = 1.0\n", "lora.dropout");
  // Expert tensors: PEFT's names, a model with experts, no dropout, the per-expert rank bound.
  const std::vector<std::string> moe = {"model.num_experts=4", "model.experts_per_token=2",
                                        "model.expert_intermediate_size=16"};
  auto experts =
      Parse(lora + "target_modules = []\ntarget_parameters = [\"mlp.experts.down_proj\"]\n", moe);
  ASSERT_TRUE(experts.ok()) << experts.status().ToString();
  EXPECT_EQ(experts->lora.target_parameters, std::vector<std::string>{"mlp.experts.down_proj"});
  ExpectError(lora + "target_parameters = [\"mlp.experts.down_proj\"]\n",
              "lora.target_parameters: \"mlp.experts.down_proj\" names expert tensors");
  ExpectError(lora + "target_parameters = [\"experts.down\"]\n",
              "lora.target_parameters: \"experts.down\" is not", moe);
  ExpectError(lora + "target_parameters = [\"proj\"]\n", "lora.target_parameters: \"proj\" is not",
              moe);
  // PEFT's suffix matching: a suffix after a dot names the same tensor.
  auto suffix =
      Parse(lora + "target_parameters = [\"down_proj\", \"experts.gate_up_proj\"]\n", moe);
  ASSERT_TRUE(suffix.ok()) << suffix.status().ToString();
  EXPECT_EQ(CanonicalLoraParameter("down_proj"), "mlp.experts.down_proj");
  EXPECT_EQ(CanonicalLoraParameter("xperts.down_proj"), "");
  ExpectError(lora + "target_parameters = [\"mlp.experts.down_proj\", \"down_proj\"]\n",
              "lora.target_parameters: \"down_proj\" names mlp.experts.down_proj twice", moe);
  // Experts in the config but no sparse block: nothing to adapt.
  ExpectError(lora + "target_parameters = [\"down_proj\"]\n",
              "lora.target_parameters: \"down_proj\" names expert tensors, and no block",
              {"model.num_experts=4", "model.experts_per_token=2",
               "model.expert_intermediate_size=16", "model.sparse_step=1000"});
  ExpectError(lora + "dropout = 0.1\ntarget_parameters = [\"mlp.experts.gate_up_proj\"]\n",
              "lora.dropout: must be 0", moe);
  ExpectError(
      std::string(kValid) + "[lora]\nrank = 17\ntarget_parameters = [\"mlp.experts.down_proj\"]\n",
      "lora.rank: 17 exceeds mlp.experts.down_proj", moe);
  ExpectError(std::string(kValid) + "[lora]\ntarget_parameters = [\"mlp.experts.down_proj\"]\n",
              "lora.target_parameters: set, but lora.rank = 0", moe);
  ExpectError(lora + "target_modules = [\"up_proj\"]\n",
              "lora.target_modules: \"up_proj\" on a mixture-of-experts", moe);
  auto c = Parse(lora + "alpha = 16\ntarget_modules = [\"down_proj\"]\n");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_DOUBLE_EQ(c->lora.scale(), 4.0);
  EXPECT_EQ(c->lora.target_modules, std::vector<std::string>{"down_proj"});
}

TEST(JobConfig, EvalKeysAreChecked) {
  ExpectError(kValid, "train.eval_every: needs an eval set", {"train.eval_every=5"});
  ExpectError(kValid, "data.eval_path: no such file", {"data.eval_path=nope.txt"});
  ExpectError(kValid, "data.eval_fraction", {"data.eval_fraction=0.6"});
  ExpectError(kValid, "data.eval_fraction: set together with data.eval_path",
              {"data.eval_fraction=0.1", "data.eval_path=tiny_corpus.txt"});
  auto c = Parse(kValid, {"train.eval_every=5", "data.eval_fraction=0.1"});
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->train.eval_every, 5);
}

TEST(JobConfig, MissingFiles) {
  ExpectError("[data]\npath = \"no_such_file.txt\"\n", "data.path: no such file");
  auto c = LoadJobConfig("/nonexistent/job.toml", {});
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("no such file"), std::string::npos);
}

TEST(JobConfig, SyntaxErrorNamesLine) {
  auto c = Parse("[train]\nsteps = = 3\n");
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find(":2:"), std::string::npos) << c.status().message();
}

TEST(JobConfig, Overrides) {
  auto c = Parse(kValid, {"train.steps=7", "optimizer.lr=1e-4", "optimizer.min_lr=0",
                          "job.name=abc", "schedule.forward_cuts=[2]", "model.qk_norm=false"});
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->train.steps, 7);
  EXPECT_DOUBLE_EQ(c->optimizer.lr, 1e-4);
  EXPECT_EQ(c->job.name, "abc");
  EXPECT_EQ(c->schedule.forward_cuts, std::vector<int64_t>{2});
  EXPECT_FALSE(c->model.qk_norm);
  ExpectError(kValid, "--set train.steps", {"train.steps"});
  ExpectError(kValid, "--set train.stepz: unknown key; did you mean train.steps?",
              {"train.stepz=3"});
  ExpectError(kValid, "--set train.steps: expected an integer", {"train.steps=three"});
  ExpectError(kValid, "--set trian: unknown section", {"trian.steps=3"});
  // Did you mean: the same key in its section, or the closest name; nothing when none is close.
  ExpectError(kValid, "--set train.lr: unknown key; did you mean optimizer.lr?", {"train.lr=1e-3"});
  ExpectError(std::string(kValid) + "[optimizer]\nwarmup_step = 3\n",
              "optimizer.warmup_step: unknown key; did you mean optimizer.warmup_steps?");
  // Trainer's name for it.
  ExpectError(std::string(kValid) + "[optimizer]\nlearning_rate = 1e-3\n",
              "optimizer.learning_rate: unknown key; did you mean optimizer.lr?");
  ExpectError(kValid, "--set trian: unknown section; did you mean [train]?", {"trian.steps=3"});
}

TEST(JobConfig, MergeCallsRunsTheStepsCallsAsOneRound) {
  // auto: exact mode with two calls merges (the same activation slots as two calls in flight).
  // The user's K and M stay as written; the round says how the step runs.
  auto a = Parse(kValid, {"train.accum_calls=2", "train.microbatches=3"});
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  EXPECT_EQ(a->train.accum_calls, 2);
  EXPECT_EQ(a->train.microbatches, 3);
  EXPECT_EQ(Round(*a).calls, 1);
  EXPECT_EQ(Round(*a).microbatches, 6);
  EXPECT_EQ(Round(*a).merged_calls, 2);
  // The merged round keeps one activation parity, as the two calls' two parities of M did.
  EXPECT_EQ(ResolveExecution(*a).activation_parities, 1);
  // auto leaves more calls, stale1 and one call alone; never keeps the calls; always merges.
  for (auto sets :
       std::vector<std::vector<std::string>>{{"train.accum_calls=3"},
                                             {"train.accum_calls=2", "optimizer.mode=stale1"},
                                             {"train.accum_calls=1"},
                                             {"train.accum_calls=2", "RP_MERGE_CALLS=never"}}) {
    sets.push_back("train.microbatches=3");
    ScopedEnv env(sets[1].rfind("RP_", 0) == 0 ? sets[1] : "");
    if (sets[1].rfind("RP_", 0) == 0) sets.erase(sets.begin() + 1);
    auto c = Parse(kValid, sets);
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    EXPECT_EQ(Round(*c).microbatches, 3) << sets[0];
    EXPECT_EQ(Round(*c).calls, c->train.accum_calls) << sets[0];
    EXPECT_EQ(Round(*c).merged_calls, 1) << sets[0];
  }
  ScopedEnv always("RP_MERGE_CALLS=always");
  auto s = Parse(kValid, {"train.accum_calls=3", "train.microbatches=2", "optimizer.mode=stale1"});
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  EXPECT_EQ(s->train.accum_calls, 3);
  EXPECT_EQ(Round(*s).calls, 1);
  EXPECT_EQ(Round(*s).microbatches, 6);
  EXPECT_EQ(Round(*s).merged_calls, 3);
  ExpectError(kValid, "RP_MERGE_CALLS: train.accum_calls x train.microbatches = 8192",
              {"train.accum_calls=2", "train.microbatches=4096"});
  {
    ScopedEnv wrong("RP_LAYER_MAJOR_FORWARD=sometimes");
    ExpectError(kValid, "RP_LAYER_MAJOR_FORWARD: must be one of", {});
  }
  {
    ScopedEnv flag("RP_FUSED_NORMS=yes");
    ExpectError(kValid, "RP_FUSED_NORMS: must be 0 or 1", {});
  }
}

// configs/README.md's key table and the parser's table (what --print-keys prints) agree on every
// key's name, type and default, in both directions.
TEST(JobConfig, ReadmeDocumentsEveryKeyWithItsTypeAndDefault) {
  const std::string readme = testing::ReadFile(testing::SourceDir() + "/configs/README.md");
  ASSERT_FALSE(readme.empty());
  // Rows "| `section.key` | type | default | meaning |".
  std::map<std::string, std::pair<std::string, std::string>> rows;
  std::istringstream in(readme);
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("| `", 0) != 0) continue;
    std::vector<std::string> cells;
    for (size_t a = 1, b; (b = line.find(" | ", a)) != std::string::npos || a < line.size();
         a = b + 3) {
      if (b == std::string::npos) b = line.size();
      std::string c = line.substr(a, b - a);
      while (!c.empty() && (c.front() == ' ' || c.front() == '|')) c.erase(0, 1);
      while (!c.empty() && (c.back() == ' ' || c.back() == '|')) c.pop_back();
      cells.push_back(c);
      if (cells.size() == 3) break;
    }
    if (cells.size() < 3 || cells[0].size() < 3 || cells[0].find('.') == std::string::npos)
      continue;
    rows[cells[0].substr(1, cells[0].size() - 2)] = {cells[1], cells[2]};
  }
  std::set<std::string> seen;
  for (const auto& k : DocumentedKeys()) {
    const std::string name = k.section + "." + k.key;
    EXPECT_TRUE(seen.insert(name).second) << "declared twice: " << name;
    auto row = rows.find(name);
    if (row == rows.end()) {
      ADD_FAILURE() << name << " is not documented in configs/README.md";
      continue;
    }
    EXPECT_EQ(row->second.first, k.type) << name << ": type in configs/README.md";
    EXPECT_EQ(row->second.second, "`" + k.default_value + "`")
        << name << ": default in configs/README.md";
  }
  for (const auto& [name, row] : rows)
    EXPECT_TRUE(seen.count(name)) << "configs/README.md documents " << name
                                  << ", which is not a key";
}

TEST(JobConfig, ShippedConfigsAreValid) {
  // Every shipped job parses, gets a plan for one worker (the auto planner included) and a
  // shared-memory layout: what rp-launch does before it starts anything.
  int checked = 0;
  for (const auto& e : std::filesystem::directory_iterator(testing::SourceDir() + "/configs")) {
    if (e.path().extension() != ".toml") continue;
    const std::string f = e.path().string();
    auto c = LoadJobConfig(f, {});
    ASSERT_TRUE(c.ok()) << f << ": " << c.status().ToString();
    auto plan = MakePlan(*c, 1);
    ASSERT_TRUE(plan.ok()) << f << ": " << plan.status().ToString();
    auto layout =
        shm::ComputeLayout(*c, ResolveExecution(*c), BuildModelSpec(c->model, c->lora), *plan);
    EXPECT_TRUE(layout.ok()) << f << ": " << layout.status().ToString();
    ++checked;
  }
  EXPECT_GE(checked, 5);
}

// model.path as a Hugging Face model id, found in a hub cache laid out as huggingface_hub lays it
// out: refs/<revision> names a commit, snapshots/<commit>/ holds the files (links into blobs/).
// Every shipped fine-tuning job (configs/sft) is a valid job once its model is in the cache and
// its data prepared: here a hub cache holding the publishers' config.json (Qwen3-8B's for every
// Qwen3 id) and the chat fixtures' token file as the data; its epochs give steps.
TEST(JobConfig, FineTuningJobsParseWithTheirModelInTheCache) {
  namespace fs = std::filesystem;
  const std::string cache = testing::MakeTempDir("rp-hub-");
  const std::string configs = testing::SourceDir() + "/tests/testdata/publisher_configs/";
  auto put = [&](const std::string& id, const std::string& publisher) {
    std::string dir = "models--" + id;
    dir.replace(dir.find('/'), 1, "--");
    const std::string snapshot = cache + "/" + dir + "/snapshots/0000";
    fs::create_directories(snapshot);
    fs::create_directories(cache + "/" + dir + "/refs");
    fs::copy_file(configs + publisher + "/config.json", snapshot + "/config.json");
    std::ofstream(cache + "/" + dir + "/refs/main") << "0000";
  };
  for (const char* id : {"Qwen/Qwen3-0.6B", "Qwen/Qwen3-1.7B", "Qwen/Qwen3-8B"})
    put(id, "Qwen3-8B");
  put("meta-llama/Llama-3.1-8B-Instruct", "Llama-3.1-8B");
  ScopedEnv hub("HF_HUB_CACHE=" + cache);
  int jobs = 0;
  for (const auto& e : fs::directory_iterator(testing::SourceDir() + "/configs/sft")) {
    const std::string data = testing::SourceDir() + "/tests/testdata/chat/chatml.bin";
    auto job = LoadJobConfig(e.path().string(), {"data.path=\"" + data + "\"", "data.seq_len=64"});
    ASSERT_TRUE(job.ok()) << e.path() << ": " << job.status().message();
    EXPECT_EQ(job->data.packing, DataPacking::kDocuments) << e.path();
    EXPECT_EQ(job->checkpoint.export_dtype, ExportDtype::kBfloat16) << e.path();
    EXPECT_EQ(job->train.epochs, 3.0) << e.path();
    EXPECT_EQ(job->lora.enabled(), e.path().string().find("-lora") != std::string::npos)
        << e.path();
    ASSERT_TRUE(ResolveTrainingLength(&*job).ok()) << e.path();
    EXPECT_GE(job->train.steps, 1);
    ++jobs;
  }
  EXPECT_EQ(jobs, 8);
  fs::remove_all(cache);
}

TEST(JobConfig, ModelIdsResolveInTheHubCache) {
  namespace fs = std::filesystem;
  const std::string cache = testing::MakeTempDir("rp-hub-");
  const std::string repo = cache + "/models--tiny-org--Tiny.Llama-1";
  const std::string fixture =
      testing::SourceDir() + "/tests/testdata/hf_fixtures/llama3/config.json";
  for (const std::string commit : {"1111aaaa", "2222bbbb"}) {
    fs::create_directories(repo + "/snapshots/" + commit);
    fs::create_directories(repo + "/blobs");
    fs::copy_file(fixture, repo + "/blobs/" + commit, fs::copy_options::overwrite_existing);
    fs::create_symlink("../../blobs/" + commit, repo + "/snapshots/" + commit + "/config.json");
  }
  fs::create_directories(repo + "/refs");
  std::ofstream(repo + "/refs/main") << "1111aaaa";
  std::ofstream(repo + "/refs/v2") << "2222bbbb\n";
  ScopedEnv hub("HF_HUB_CACHE=" + cache);
  auto job = [](const std::string& path) {
    return std::string(kValid) + "[model]\npath = \"" + path + "\"\n";
  };
  auto main = Parse(job("tiny-org/Tiny.Llama-1"));
  ASSERT_TRUE(main.ok()) << main.status().message();
  EXPECT_EQ(main->model.path, repo + "/snapshots/1111aaaa");
  EXPECT_EQ(main->model.model_type, "llama");  // its config.json was read
  auto tag = Parse(job("tiny-org/Tiny.Llama-1@v2"));
  ASSERT_TRUE(tag.ok()) << tag.status().message();
  EXPECT_EQ(tag->model.path, repo + "/snapshots/2222bbbb");
  auto commit = Parse(job("tiny-org/Tiny.Llama-1@2222bbbb"));
  ASSERT_TRUE(commit.ok()) << commit.status().message();
  EXPECT_EQ(commit->model.path, repo + "/snapshots/2222bbbb");
  // HF_HOME/hub when HF_HUB_CACHE is unset.
  {
    ScopedEnv no_cache("HF_HUB_CACHE=");
    ::unsetenv("HF_HUB_CACHE");
    const std::string home = testing::MakeTempDir("rp-hf-home-");
    fs::create_symlink(cache, home + "/hub");
    ScopedEnv hf_home("HF_HOME=" + home);
    auto via_home = Parse(job("tiny-org/Tiny.Llama-1"));
    ASSERT_TRUE(via_home.ok()) << via_home.status().message();
    EXPECT_EQ(via_home->model.path,
              home + "/hub/models--tiny-org--Tiny.Llama-1/snapshots/1111aaaa");
    fs::remove_all(home);
  }
  ::setenv("HF_HUB_CACHE", cache.c_str(), 1);
  // Missing: the message says where it looked and how to fetch it.
  auto missing = Parse(job("Qwen/Qwen3-0.6B"));
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("models--Qwen--Qwen3-0.6B does not exist"),
            std::string::npos)
      << missing.status().message();
  EXPECT_NE(missing.status().message().find("hf download Qwen/Qwen3-0.6B"), std::string::npos)
      << missing.status().message();
  auto no_revision = Parse(job("tiny-org/Tiny.Llama-1@v9"));
  ASSERT_FALSE(no_revision.ok());
  EXPECT_NE(no_revision.status().message().find("snapshots/v9/config.json is missing"),
            std::string::npos)
      << no_revision.status().message();
  EXPECT_NE(no_revision.status().message().find("--revision v9"), std::string::npos)
      << no_revision.status().message();
  // A directory of that name relative to the job file wins over the cache.
  const std::string job_dir = testing::MakeTempDir("rp-job-dir-");
  const std::string local = job_dir + "/tiny-org/Tiny.Llama-1";
  fs::create_directories(local);
  fs::copy_file(fixture, local + "/config.json");
  auto dir = ParseJobConfig("[data]\npath = \"" + CorpusDir() +
                                "/tiny_corpus.txt\"\nseq_len = 16\n"
                                "[model]\npath = \"tiny-org/Tiny.Llama-1\"\n",
                            job_dir, {});
  fs::remove_all(job_dir);
  ASSERT_TRUE(dir.ok()) << dir.status().message();
  EXPECT_EQ(dir->model.path, local);
  fs::remove_all(cache);
}

}  // namespace
}  // namespace rp::core
