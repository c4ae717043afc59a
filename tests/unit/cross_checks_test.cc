// SPDX-License-Identifier: Apache-2.0
// Walks the table of cross-key checks: every entry refuses a job of its own, first among the
// entries and naming one of its keys, and ParseJobConfig refuses that job with the same message.
#include <gtest/gtest.h>

#include <map>
#include <set>
#include <string>
#include <vector>

#include "config/cross_checks.h"
#include "config/job_config.h"
#include "tests/testing/process_harness.h"

namespace rp::core {
namespace {

std::string DataDir() { return testing::SourceDir() + "/data"; }

// A valid job relative to data/, which every check lets through.
const char* kBase = R"(
[data]
path = "tiny_corpus.txt"
seq_len = 16
[train]
steps = 3
)";

struct Example {
  std::vector<std::string> sets;
  std::string key;  // what the refusal begins with
};

// For each entry of CrossChecks() by name: jobs that entry refuses (and no entry before it).
const std::map<std::string, std::vector<Example>>& Examples() {
  const std::string moe_sets = "model.num_experts=4";
  static const std::map<std::string, std::vector<Example>> examples = {
      {"a device memory limit needs a device",
       {{{"job.device=cpu", "job.device_memory_limit_gib=8"}, "job.device_memory_limit_gib"}}},
      {"experts of a model from job keys",
       {{{moe_sets, "model.experts_per_token=8"}, "model.experts_per_token"},
        {{moe_sets, "model.experts_per_token=2", "model.qk_norm=false"}, "model.num_experts"},
        {{"model.router_aux_loss_coef=0.01"}, "model.router_aux_loss_coef"}}},
      {"the attention's shape",
       {{{"model.num_kv_heads=3"}, "model.num_kv_heads"},
        {{"model.head_dim=31"}, "model.head_dim"}}},
      {"the data files",
       {{{"data.path=no_such_corpus.txt"}, "data.path"},
        {{"data.format=tokens", "data.path=no_such_tokens.bin"}, "data.path"},
        {{"model.vocab_size=200"}, "model.vocab_size"},
        {{"data.seq_len=8192"}, "data.path"}}},
      {"packing needs records", {{{"data.packing=documents"}, "data.packing"}}},
      {"the eval set",
       {{{"data.eval_fraction=0.1", "data.eval_path=tiny_corpus.txt"}, "data.eval_fraction"},
        {{"data.format=random", "data.eval_fraction=0.1"}, "data.eval_fraction"},
        {{"data.eval_path=no_such_eval.txt"}, "data.eval_path"},
        {{"data.format=random", "data.eval_path=tiny_corpus.txt"}, "data.eval_path"},
        {{"train.eval_every=1"}, "train.eval_every"}}},
      {"adapters on expert tensors",
       {{{"lora.rank=4", "lora.target_modules=[]"}, "lora.target_modules"},
        {{"lora.rank=4", "lora.target_parameters=[\"mlp.experts.nope\"]"},
         "lora.target_parameters"},
        {{"lora.rank=4", "lora.target_parameters=[\"mlp.experts.down_proj\"]"},
         "lora.target_parameters"},
        {{moe_sets, "model.experts_per_token=2", "lora.rank=4", "lora.target_modules=[]",
          "lora.target_parameters=[\"mlp.experts.down_proj\"]", "lora.dropout=0.1"},
         "lora.dropout"},
        {{moe_sets, "model.experts_per_token=2", "lora.rank=4096", "lora.target_modules=[]",
          "lora.target_parameters=[\"mlp.experts.down_proj\"]"},
         "lora.rank"}}},
      {"adapters on projections",
       {{{"lora.rank=4", "lora.target_modules=[\"x_proj\"]"}, "lora.target_modules"},
        {{"lora.rank=4", "lora.target_modules=[\"q_proj\", \"q_proj\"]"}, "lora.target_modules"},
        {{moe_sets, "model.experts_per_token=2", "lora.rank=4",
          "lora.target_modules=[\"gate_proj\"]"},
         "lora.target_modules"},
        {{"lora.rank=65", "lora.target_modules=[\"k_proj\"]"}, "lora.rank"}}},
      {"adapter keys without adapters",
       {{{"lora.rank=4", "lora.init_from=no_such_adapter"}, "lora.init_from"},
        {{"lora.init_from=no_such_adapter"}, "lora.init_from"},
        {{"lora.target_parameters=[\"mlp.experts.down_proj\"]"}, "lora.target_parameters"},
        {{"schedule.frozen_on_device=true"}, "schedule.frozen_on_device"}}},
      {"planner choices need a budget",
       {{{"schedule.kept_blocks=-1"}, "schedule.kept_blocks"},
        {{"schedule.keep_attention=-1"}, "schedule.keep_attention"},
        {{"train.mlp_tile_tokens=-1"}, "train.mlp_tile_tokens"}}},
      {"the learning rate's floor",
       {{{"optimizer.lr=0.001", "optimizer.min_lr=0.01"}, "optimizer.min_lr"}}},
      {"fp16's loss scaling",
       {{{"train.loss_scale_growth_factor=1"}, "train.loss_scale_growth_factor"},
        {{"train.loss_scale_backoff_factor=1"}, "train.loss_scale_backoff_factor"},
        {{"train.loss_scale_init=1024"}, "train.loss_scale_*"}}},
      {"gradients that wait in workers",
       {{{"optimizer.gradients_wait_in=workers", "train.grad_clip=0"},
         "optimizer.gradients_wait_in"},
        {{"optimizer.gradients_wait_in=workers", "optimizer.mode=stale1"},
         "optimizer.gradients_wait_in"},
        {{"optimizer.gradients_wait_in=workers", "train.accum_calls=1"},
         "optimizer.gradients_wait_in"}}},
      {"speculative updates",
       {{{"optimizer.speculative_update=true", "optimizer.mode=stale1"},
         "optimizer.speculative_update"},
        {{"optimizer.speculative_update=true", "optimizer.name=sgd"},
         "optimizer.speculative_update"},
        {{"optimizer.speculative_update=true", "optimizer.gradients_wait_in=workers",
          "train.accum_calls=1", "model.tie_embeddings=false"},
         "optimizer.speculative_update"},
        {{"optimizer.speculative_update=true", "train.dtype=fp16"},
         "optimizer.speculative_update"}}},
      {"updates on the device",
       {{{"optimizer.device_update_blocks=1", "optimizer.mode=stale1"},
         "optimizer.device_update_blocks"},
        {{"optimizer.device_update_blocks=1", "optimizer.name=sgd"},
         "optimizer.device_update_blocks"},
        {{"optimizer.device_update_blocks=1", "optimizer.speculative_update=true"},
         "optimizer.device_update_blocks"},
        {{"optimizer.device_update_blocks=1", "optimizer.mode=stale1", "train.accum_calls=1"},
         "optimizer.device_update_blocks"},
        {{"optimizer.device_update_blocks=1", "lora.rank=4"}, "optimizer.device_update_blocks"},
        {{"optimizer.device_update_blocks=1", "train.dtype=fp16"},
         "optimizer.device_update_blocks"},
        {{"optimizer.device_update_blocks=5"}, "optimizer.device_update_blocks"}}},
      {"update passes",
       {{{"optimizer.update_passes=2", "optimizer.mode=stale1"}, "optimizer.update_passes"},
        {{"optimizer.update_passes=1", "optimizer.speculative_update=true"},
         "optimizer.update_passes"},
        {{"optimizer.update_passes=1", "optimizer.device_update_blocks=1", "train.accum_calls=1"},
         "optimizer.update_passes"}}},
      {"fp8 products", {{{"train.dtype=fp8", "job.device=cpu"}, "train.dtype"}}},
      {"the fused tail and kept blocks",
       {{{"schedule.tail_blocks=5"}, "schedule.tail_blocks"},
        {{"schedule.tail_blocks=1", "schedule.kept_blocks=4"}, "schedule.kept_blocks"},
        {{"schedule.kept_blocks=1", "train.mlp_tile_tokens=8"}, "schedule.kept_blocks"},
        {{"schedule.kept_blocks=1", "train.layer_recompute=true"}, "schedule.kept_blocks"},
        {{moe_sets, "model.experts_per_token=2", "schedule.kept_blocks=1"},
         "schedule.kept_blocks"}}},
      {"stages and cuts",
       {{{"schedule.forward_stages=50"}, "schedule.forward_stages"},
        {{"schedule.backward_stages=50"}, "schedule.backward_stages"},
        {{"schedule.partition=auto", "schedule.forward_cuts=[2]"}, "schedule.partition"},
        {{"schedule.forward_cuts=[3, 2]"}, "schedule.forward_cuts"},
        {{"schedule.backward_cuts=[99]"}, "schedule.backward_cuts[0]"}}},
      {"exports need a destination", {{{"checkpoint.export_every=2"}, "checkpoint.export_every"}}},
      {"stopping within the run", {{{"train.stop_after=50"}, "train.stop_after"}}},
  };
  return examples;
}

// The first entry that refuses `job`, or nullptr.
const CrossCheck* FirstRefusing(const JobConfig& job, Status* refusal) {
  for (const CrossCheck& entry : CrossChecks()) {
    *refusal = entry.check(job);
    if (!refusal->ok()) return &entry;
  }
  return nullptr;
}

bool StartsWith(const std::string& s, const std::string& prefix) { return s.rfind(prefix, 0) == 0; }

TEST(CrossChecks, TheBaseJobPassesEveryEntry) {
  auto job = ParseJobConfigBeforeCrossChecks(kBase, DataDir(), {});
  ASSERT_TRUE(job.ok()) << job.status().message();
  for (const CrossCheck& entry : CrossChecks())
    EXPECT_TRUE(entry.check(*job).ok()) << entry.name << ": " << entry.check(*job).message();
  EXPECT_TRUE(ParseJobConfig(kBase, DataDir(), {}).ok());
}

TEST(CrossChecks, EveryEntryHasExamplesAndEveryExampleAnEntry) {
  std::set<std::string> names;
  for (const CrossCheck& entry : CrossChecks()) {
    EXPECT_TRUE(names.insert(entry.name).second) << "two entries named " << entry.name;
    EXPECT_FALSE(entry.keys.empty()) << entry.name;
    auto it = Examples().find(entry.name);
    EXPECT_TRUE(it != Examples().end() && !it->second.empty())
        << "no job in this test makes \"" << entry.name << "\" refuse";
  }
  for (const auto& [name, examples] : Examples())
    EXPECT_TRUE(names.count(name)) << "examples for \"" << name << "\", which is not in the table";
}

TEST(CrossChecks, EachEntryRefusesItsExamplesFirstNamingOneOfItsKeys) {
  for (const CrossCheck& entry : CrossChecks()) {
    auto it = Examples().find(entry.name);
    if (it == Examples().end()) continue;  // the test above names it
    for (const Example& example : it->second) {
      std::string sets;
      for (const auto& s : example.sets) sets += " --set " + s;
      SCOPED_TRACE(std::string(entry.name) + ":" + sets);
      auto job = ParseJobConfigBeforeCrossChecks(kBase, DataDir(), example.sets);
      if (!job.ok()) {
        ADD_FAILURE() << "refused before the cross checks: " << job.status().message();
        continue;
      }
      Status refusal;
      const CrossCheck* refusing = FirstRefusing(*job, &refusal);
      if (refusing == nullptr) {
        ADD_FAILURE() << "no entry refuses it";
        continue;
      }
      EXPECT_STREQ(refusing->name, entry.name) << refusal.message();
      EXPECT_EQ(refusal.code(), StatusCode::kInvalidArgument);
      const std::string& message = refusal.message();
      EXPECT_TRUE(StartsWith(message, example.key)) << message;
      bool names_a_key = false;
      for (const char* key : entry.keys) names_a_key = names_a_key || StartsWith(message, key);
      EXPECT_TRUE(names_a_key) << "begins with none of the entry's keys: " << message;
      // The parse refuses the job with that message (its key said as given on the command line).
      auto parsed = ParseJobConfig(kBase, DataDir(), example.sets);
      if (parsed.ok()) {
        ADD_FAILURE() << "ParseJobConfig accepts it";
        continue;
      }
      EXPECT_NE(parsed.status().message().find(message), std::string::npos)
          << parsed.status().message();
    }
  }
}

}  // namespace
}  // namespace rp::core
