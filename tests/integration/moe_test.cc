// SPDX-License-Identifier: Apache-2.0
// Mixture-of-experts models (Qwen3-MoE) through real processes: the pipeline against
// rp-train-ref for one to three workers in both optimizer modes, with and without the routers'
// load-balancing loss, both checkpoint layouts of the experts, the export's layout, and what is
// refused.
#include <gtest/gtest.h>

#include <cmath>
#include <deque>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "io/safetensors.h"
#include "tests/integration/launch_fixture.h"
#include "tests/testing/process_harness.h"

namespace rp {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using testing::Losses;

constexpr int64_t kVocab = 256, kHidden = 32, kHeads = 4, kKvHeads = 2, kHeadDim = 8, kInter = 64;
constexpr int64_t kLayers = 3, kExperts = 4, kTopK = 2, kExpertInter = 16;

json MoeConfig() {
  return {{"architectures", {"Qwen3MoeForCausalLM"}},
          {"model_type", "qwen3_moe"},
          {"vocab_size", kVocab},
          {"hidden_size", kHidden},
          {"intermediate_size", kInter},
          {"num_hidden_layers", kLayers},
          {"num_attention_heads", kHeads},
          {"num_key_value_heads", kKvHeads},
          {"head_dim", kHeadDim},
          {"rms_norm_eps", 1e-6},
          {"rope_parameters", {{"rope_type", "default"}, {"rope_theta", 1000000.0}}},
          {"tie_word_embeddings", false},
          {"num_experts", kExperts},
          {"num_experts_per_tok", kTopK},
          {"moe_intermediate_size", kExpertInter},
          {"norm_topk_prob", true},
          {"decoder_sparse_step", 1},
          {"mlp_only_layers", {1}},
          {"output_router_logits", false},
          {"router_aux_loss_coef", 0.001}};
}

// A Qwen3-MoE directory with random weights (std 0.1; routers 0.4 so that routing is decided by
// clear margins; norms around 1): the experts one tensor per expert and projection, as the
// published checkpoints store them, or transformers 5's fused gate_up_proj / down_proj. The same
// seed gives the same values in both layouts.
void WriteMoeModel(const std::string& dir, bool fused, const json& config = MoeConfig()) {
  fs::create_directories(dir);
  std::ofstream(dir + "/config.json") << config.dump(2);
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::deque<std::vector<float>> store;  // keeps the data in place until written
  std::vector<core::SafetensorToWrite> tensors;
  auto add = [&](const std::string& name, std::vector<int64_t> shape, float mean, float std) {
    int64_t n = 1;
    for (auto d : shape) n *= d;
    store.emplace_back(static_cast<size_t>(n));
    for (auto& v : store.back()) v = mean + std * normal(rng);
    tensors.push_back({name, "F32", shape, store.back().data(), static_cast<uint64_t>(n) * 4});
  };
  add("model.embed_tokens.weight", {kVocab, kHidden}, 0.0f, 0.1f);
  for (int64_t i = 0; i < kLayers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    add(p + "input_layernorm.weight", {kHidden}, 1.0f, 0.1f);
    add(p + "self_attn.q_proj.weight", {kHeads * kHeadDim, kHidden}, 0.0f, 0.1f);
    add(p + "self_attn.k_proj.weight", {kKvHeads * kHeadDim, kHidden}, 0.0f, 0.1f);
    add(p + "self_attn.v_proj.weight", {kKvHeads * kHeadDim, kHidden}, 0.0f, 0.1f);
    add(p + "self_attn.o_proj.weight", {kHidden, kHeads * kHeadDim}, 0.0f, 0.1f);
    add(p + "self_attn.q_norm.weight", {kHeadDim}, 1.0f, 0.1f);
    add(p + "self_attn.k_norm.weight", {kHeadDim}, 1.0f, 0.1f);
    add(p + "post_attention_layernorm.weight", {kHidden}, 1.0f, 0.1f);
    if (i == 1) {  // mlp_only_layers
      add(p + "mlp.gate_proj.weight", {kInter, kHidden}, 0.0f, 0.1f);
      add(p + "mlp.up_proj.weight", {kInter, kHidden}, 0.0f, 0.1f);
      add(p + "mlp.down_proj.weight", {kHidden, kInter}, 0.0f, 0.1f);
      continue;
    }
    add(p + "mlp.gate.weight", {kExperts, kHidden}, 0.0f, 0.4f);
    if (!fused) {
      for (int64_t e = 0; e < kExperts; ++e) {
        const std::string x = p + "mlp.experts." + std::to_string(e) + ".";
        add(x + "gate_proj.weight", {kExpertInter, kHidden}, 0.0f, 0.1f);
        add(x + "up_proj.weight", {kExpertInter, kHidden}, 0.0f, 0.1f);
        add(x + "down_proj.weight", {kHidden, kExpertInter}, 0.0f, 0.1f);
      }
      continue;
    }
    // The same draws, stacked: expert e's gate rows then its up rows; the down matrices apart.
    std::vector<float> gate_up, down;
    for (int64_t e = 0; e < kExperts; ++e) {
      for (int j = 0; j < 3; ++j) {
        std::vector<float> v(static_cast<size_t>(kExpertInter * kHidden));
        for (auto& f : v) f = 0.1f * normal(rng);
        auto& to = j < 2 ? gate_up : down;
        to.insert(to.end(), v.begin(), v.end());
      }
    }
    store.push_back(gate_up);
    tensors.push_back({p + "mlp.experts.gate_up_proj",
                       "F32",
                       {kExperts, 2 * kExpertInter, kHidden},
                       store.back().data(),
                       gate_up.size() * 4});
    store.push_back(down);
    tensors.push_back({p + "mlp.experts.down_proj",
                       "F32",
                       {kExperts, kHidden, kExpertInter},
                       store.back().data(),
                       down.size() * 4});
  }
  add("model.norm.weight", {kHidden}, 1.0f, 0.1f);
  add("lm_head.weight", {kVocab, kHidden}, 0.0f, 0.1f);
  auto s = core::WriteSafetensors(dir + "/model.safetensors", tensors, {{"format", "pt"}});
  ASSERT_TRUE(s.ok()) << s.message();
}

std::vector<std::string> MoeJob(const std::string& model, int steps) {
  return {"model.path=" + model,     "data.seq_len=32",      "train.steps=" + std::to_string(steps),
          "train.microbatch_size=2", "train.microbatches=3", "train.accum_calls=2",
          "optimizer.lr=1e-2"};
}

void ExpectClose(const std::vector<double>& got, const std::vector<double>& want,
                 const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t s = 0; s < got.size(); ++s)
    EXPECT_LE(std::abs(got[s] - want[s]) / want[s], 1e-5) << what << ", step " << s + 1;
}

// The pipeline on 1-3 CPU workers, exact and stale1, against rp-train-ref of the same mode, with
// and without the routers' load-balancing loss (weight 0.05, so that it moves the trajectory);
// with the loss also a layer-major forward over unmerged calls, whose forward stages leave each
// block's router statistics one layer at a time.
TEST_F(LaunchTest, MoePipelineMatchesTheReferenceForOneToThreeWorkersInBothModes) {
  std::vector<double> without_aux;
  for (bool aux : {false, true}) {
    json cfg = MoeConfig();
    cfg["output_router_logits"] = aux;
    cfg["router_aux_loss_coef"] = 0.05;
    const std::string model = tmp_ + (aux ? "/moe-aux" : "/moe");
    WriteMoeModel(model, /*fused=*/false, cfg);
    for (const char* mode : {"exact", "stale1"}) {
      const std::string tag = std::string(mode) + (aux ? "-aux" : "");
      const auto sets = With(MoeJob(model, 8), {std::string("optimizer.mode=\"") + mode + "\""});
      auto ref = Ref(tmp_ + "/ref-" + tag, sets);
      ASSERT_EQ(ref.code, 0) << ref.output;
      const auto want = Losses(tmp_ + "/ref-" + tag + "/metrics.jsonl");
      ASSERT_EQ(want.size(), 8u);
      EXPECT_LT(want.back(), want.front()) << "eight steps should lower the loss";
      if (!aux && std::string(mode) == "exact") without_aux = want;
      if (aux && std::string(mode) == "exact") {
        ASSERT_EQ(without_aux.size(), 8u);
        EXPECT_GT(want[0] - without_aux[0], 1e-3) << "the load-balancing loss adds a positive term";
      }
      for (int n = 1; n <= 3; ++n) {
        const std::string out = tmp_ + "/run-" + tag + "-" + std::to_string(n);
        auto run = Launch(n, out, sets);
        ASSERT_EQ(run.code, 0) << run.output;
        ExpectClose(Losses(out + "/metrics.jsonl"), want,
                    tag + " on " + std::to_string(n) + " workers");
      }
      if (!aux) continue;
      const std::string out = tmp_ + "/run-" + tag + "-layer-major";
      auto run =
          Launch(3, out, With(sets, {"RP_LAYER_MAJOR_FORWARD=always", "RP_MERGE_CALLS=never"}));
      ASSERT_EQ(run.code, 0) << run.output;
      ExpectClose(Losses(out + "/metrics.jsonl"), want, tag + ", layer-major forward");
    }
  }
}

// Both layouts of the experts are one model, and the export (per-expert tensors) is that model
// again: with a zero learning rate the weights stay as loaded, so the fused directory, the
// per-expert one and the export of a run all give the same losses bit for bit. A swapped gate /
// up order anywhere would change them.
TEST_F(LaunchTest, MoeLayoutsAndTheExportAreTheSameModel) {
  const std::string per_expert = tmp_ + "/per-expert", fused = tmp_ + "/fused";
  WriteMoeModel(per_expert, false);
  WriteMoeModel(fused, true);
  const std::vector<std::string> still = {"optimizer.lr=0", "optimizer.min_lr=0"};
  auto a = Launch(2, tmp_ + "/a", With(MoeJob(per_expert, 2), still));
  ASSERT_EQ(a.code, 0) << a.output;
  auto b =
      Launch(2, tmp_ + "/b", With(MoeJob(fused, 2), With(still, {"checkpoint.export_hf=\"hf\""})));
  ASSERT_EQ(b.code, 0) << b.output;
  const auto la = Losses(tmp_ + "/a/metrics.jsonl");
  ASSERT_EQ(la.size(), 2u);
  EXPECT_EQ(la, Losses(tmp_ + "/b/metrics.jsonl"));
  const std::string exported = tmp_ + "/b/hf";
  auto header = core::SafetensorsFile::Open(exported + "/model.safetensors");
  ASSERT_TRUE(header.ok()) << header.status().message();
  EXPECT_NE(header->Find("model.layers.0.mlp.experts.3.up_proj.weight"), nullptr);
  EXPECT_EQ(header->Find("model.layers.0.mlp.experts.gate_up_proj"), nullptr);
  EXPECT_EQ(header->Find("model.layers.1.mlp.experts.0.up_proj.weight"), nullptr)
      << "layer 1 is dense";
  const json cfg = json::parse(testing::ReadFile(exported + "/config.json"));
  EXPECT_EQ(cfg["model_type"], "qwen3_moe");
  EXPECT_EQ(cfg["mlp_only_layers"], json::array({1}));
  auto c = Launch(2, tmp_ + "/c", With(MoeJob(exported, 2), still));
  ASSERT_EQ(c.code, 0) << c.output;
  EXPECT_EQ(la, Losses(tmp_ + "/c/metrics.jsonl"));
  // The routing matters: another top-k trains differently.
  json other = MoeConfig();
  other["num_experts_per_tok"] = 1;
  WriteMoeModel(tmp_ + "/top1", false, other);
  auto d = Launch(2, tmp_ + "/d", With(MoeJob(tmp_ + "/top1", 1), still));
  ASSERT_EQ(d.code, 0) << d.output;
  EXPECT_GT(std::abs(Losses(tmp_ + "/d/metrics.jsonl")[0] - la[0]), 1e-4);
}

// What the runtime does not compute is refused before anything starts, naming the key: a
// negative router loss weight, and dense-MLP module names on a model with experts (PEFT reads
// them differently across transformers versions; the experts take lora.target_parameters).
TEST_F(LaunchTest, MoeRefusesMlpModuleTargetsAndANegativeRouterLossWeight) {
  json cfg = MoeConfig();
  cfg["output_router_logits"] = true;
  cfg["router_aux_loss_coef"] = -0.5;
  WriteMoeModel(tmp_ + "/negative", false, cfg);
  auto r = Launch(2, tmp_ + "/r", MoeJob(tmp_ + "/negative", 2), 30);
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("router_aux_loss_coef"), std::string::npos) << r.output;
  WriteMoeModel(tmp_ + "/moe", false);
  auto l = Launch(
      2, tmp_ + "/l",
      With(MoeJob(tmp_ + "/moe", 2), {"lora.rank=4", "lora.target_modules=[\"up_proj\"]"}), 30);
  EXPECT_EQ(l.code, 2) << l.output;
  EXPECT_NE(l.output.find("lora.target_modules"), std::string::npos) << l.output;
  EXPECT_FALSE(fs::exists(tmp_ + "/r"));
  EXPECT_FALSE(fs::exists(tmp_ + "/l"));
}

// LoRA on the attention of a mixture-of-experts model (experts and routers frozen), with the
// load-balancing loss, whose gradient reaches the adapters through the routers' inputs: the
// pipeline on two workers against rp-train-ref.
TEST_F(LaunchTest, MoeLoraOnAttentionMatchesTheReference) {
  json cfg = MoeConfig();
  cfg["output_router_logits"] = true;
  cfg["router_aux_loss_coef"] = 0.05;
  WriteMoeModel(tmp_ + "/moe", false, cfg);
  const auto sets =
      With(MoeJob(tmp_ + "/moe", 6),
           {"lora.rank=4", "lora.target_modules=[\"q_proj\",\"k_proj\",\"v_proj\",\"o_proj\"]",
            "optimizer.lr=2e-2"});
  auto ref = Ref(tmp_ + "/ref", sets);
  ASSERT_EQ(ref.code, 0) << ref.output;
  auto run = Launch(2, tmp_ + "/run", sets);
  ASSERT_EQ(run.code, 0) << run.output;
  const auto want = Losses(tmp_ + "/ref/metrics.jsonl");
  ASSERT_EQ(want.size(), 6u);
  EXPECT_LT(want.back(), want.front());
  ExpectClose(Losses(tmp_ + "/run/metrics.jsonl"), want, "LoRA on 2 workers");
}

// Adapters on the experts (lora.target_parameters, PEFT's layout) and on the attention, with the
// load-balancing loss: the pipeline on 1-3 workers in both modes against rp-train-ref, and with
// one expert tensor targeted (the other naming) on two workers.
TEST_F(LaunchTest, MoeExpertAdaptersMatchTheReferenceForOneToThreeWorkersInBothModes) {
  json cfg = MoeConfig();
  cfg["output_router_logits"] = true;
  cfg["router_aux_loss_coef"] = 0.05;
  WriteMoeModel(tmp_ + "/moe", false, cfg);
  const std::vector<std::string> both = {
      "lora.rank=4", "lora.target_modules=[\"q_proj\",\"v_proj\"]",
      "lora.target_parameters=[\"mlp.experts.gate_up_proj\",\"mlp.experts.down_proj\"]",
      "optimizer.lr=2e-2"};
  for (const char* mode : {"exact", "stale1"}) {
    const auto sets = With(MoeJob(tmp_ + "/moe", 6),
                           With(both, {std::string("optimizer.mode=\"") + mode + "\""}));
    auto ref = Ref(tmp_ + "/ref-" + mode, sets);
    ASSERT_EQ(ref.code, 0) << ref.output;
    const auto want = Losses(tmp_ + "/ref-" + mode + "/metrics.jsonl");
    ASSERT_EQ(want.size(), 6u);
    EXPECT_LT(want.back(), want.front());
    for (int n = 1; n <= 3; ++n) {
      const std::string out = tmp_ + "/run-" + mode + "-" + std::to_string(n);
      auto run = Launch(n, out, sets);
      ASSERT_EQ(run.code, 0) << run.output;
      ExpectClose(Losses(out + "/metrics.jsonl"), want,
                  std::string(mode) + " on " + std::to_string(n) + " workers");
    }
  }
  const auto down_only =
      With(MoeJob(tmp_ + "/moe", 6),
           {"lora.rank=4", "lora.target_modules=[]",
            "lora.target_parameters=[\"mlp.experts.down_proj\"]", "optimizer.lr=2e-2"});
  auto ref = Ref(tmp_ + "/ref-down", down_only);
  ASSERT_EQ(ref.code, 0) << ref.output;
  auto run = Launch(2, tmp_ + "/run-down", down_only);
  ASSERT_EQ(run.code, 0) << run.output;
  const auto want = Losses(tmp_ + "/ref-down/metrics.jsonl");
  EXPECT_LT(want.back(), want.front()) << "adapters on the experts' down matrices alone learn";
  ExpectClose(Losses(tmp_ + "/run-down/metrics.jsonl"), want, "down_proj adapters on 2 workers");
}

// peft's own adapter on the experts (tests/testdata/moe_peft_fixture, made by
// tools/make_moe_peft_fixture.py): with lr = 0 the step-1 loss equals what transformers + peft
// computed within 1e-6 and the adapters' gradient norm within 1e-5, in rp-train-ref and the
// pipeline on one and three workers. The fixture's controls (lora_A read rank-major instead of
// expert-major, the expert adapters left out) each moved peft's loss by more than 1e-3.
TEST_F(LaunchTest, MoeExpertAdaptersSavedByPeftComputePeftsLossAndGradient) {
  const std::string dir = testing::SourceDir() + "/tests/testdata/moe_peft_fixture";
  const json expected = json::parse(testing::ReadFile(dir + "/expected.json"));
  const double loss = expected["loss"].get<double>(), norm = expected["grad_norm"].get<double>();
  // The fixture's own controls (stored by the script that made it): the layout matters to peft.
  for (const auto& [name, control] : expected["controls"].items())
    EXPECT_GE(std::abs(control["loss"].get<double>() - loss) / loss, 1e-3) << name;
  auto ref = testing::RunProcess({testing::BinDir() + "/rp-train-ref", dir + "/job.toml", "--set",
                                  "job.output_dir=" + tmp_ + "/ref"},
                                 240, Env());
  ASSERT_EQ(ref.code, 0) << ref.output;
  for (int n : {1, 3}) {
    const std::string out = tmp_ + "/pipe" + std::to_string(n);
    auto pipe = testing::RunProcess({testing::BinDir() + "/rp-launch", "--gpus", std::to_string(n),
                                     dir + "/job.toml", "--set", "job.output_dir=" + out},
                                    240, Env());
    ASSERT_EQ(pipe.code, 0) << pipe.output;
  }
  // The same tensors named by PEFT-style suffixes.
  auto suffixes =
      testing::RunProcess({testing::BinDir() + "/rp-train-ref", dir + "/job.toml", "--set",
                           "job.output_dir=" + tmp_ + "/suffixes", "--set",
                           "lora.target_parameters=[\"gate_up_proj\",\"experts.down_proj\"]"},
                          240, Env());
  ASSERT_EQ(suffixes.code, 0) << suffixes.output;
  for (const std::string out : {"/ref", "/pipe1", "/pipe3", "/suffixes"}) {
    const double got = Losses(tmp_ + out + "/metrics.jsonl").at(0);
    const double got_norm = Losses(tmp_ + out + "/metrics.jsonl", "grad_norm").at(0);
    EXPECT_LE(std::abs(got - loss) / loss, 1e-6) << out << ": " << got << " vs peft's " << loss;
    EXPECT_LE(std::abs(got_norm - norm) / norm, 1e-5)
        << out << ": gradient norm " << got_norm << " vs peft's " << norm;
  }
  // The adapter's target sets are checked against the job's.
  auto other = testing::RunProcess({testing::BinDir() + "/rp-launch", "--gpus", "1",
                                    dir + "/job.toml", "--set", "job.output_dir=" + tmp_ + "/other",
                                    "--set", "lora.target_parameters=[\"mlp.experts.down_proj\"]"},
                                   60, Env());
  EXPECT_EQ(other.code, 2) << other.output;
  EXPECT_NE(other.output.find("\"target_parameters\" is ["), std::string::npos) << other.output;
  // An adapter written by a peft that laid these tensors out the other way is refused by version.
  const std::string old_peft = tmp_ + "/old-peft";
  fs::create_directories(old_peft);
  fs::copy_file(dir + "/adapter/adapter_model.safetensors",
                old_peft + "/adapter_model.safetensors");
  json old_config = json::parse(testing::ReadFile(dir + "/adapter/adapter_config.json"));
  old_config["peft_version"] = "0.18.1";
  std::ofstream(old_peft + "/adapter_config.json") << old_config.dump(2);
  auto old = testing::RunProcess(
      {testing::BinDir() + "/rp-launch", "--gpus", "1", dir + "/job.toml", "--set",
       "job.output_dir=" + tmp_ + "/old", "--set", "lora.init_from=\"" + old_peft + "\""},
      60, Env());
  EXPECT_EQ(old.code, 2) << old.output;
  EXPECT_NE(old.output.find("\"peft_version\" is 0.18.1"), std::string::npos) << old.output;
}

// The trained expert adapters leave in PEFT's layout and as a merged model (W_e + s B_e A_e per
// expert), and both are the trained model: the adapter loaded back onto the base and the merged
// checkpoint alone give the same loss (1e-5), which differs from the base's.
TEST_F(LaunchTest, MoeExpertAdaptersExportAsPeftAndMerged) {
  WriteMoeModel(tmp_ + "/moe", false);
  const std::vector<std::string> lora = {
      "lora.rank=4", "lora.target_modules=[\"q_proj\"]",
      "lora.target_parameters=[\"mlp.experts.gate_up_proj\",\"mlp.experts.down_proj\"]"};
  auto train = Launch(2, tmp_ + "/train",
                      With(MoeJob(tmp_ + "/moe", 4),
                           With(lora, {"optimizer.lr=5e-2", "checkpoint.export_hf=\"hf\""})));
  ASSERT_EQ(train.code, 0) << train.output;
  const json cfg = json::parse(testing::ReadFile(tmp_ + "/train/adapter/adapter_config.json"));
  EXPECT_EQ(cfg["target_parameters"],
            json::array({"mlp.experts.gate_up_proj", "mlp.experts.down_proj"}));
  auto header = core::SafetensorsFile::Open(tmp_ + "/train/adapter/adapter_model.safetensors");
  ASSERT_TRUE(header.ok()) << header.status().message();
  const auto* gate_up_a =
      header->Find("base_model.model.model.layers.0.mlp.experts.base_layer.lora_A.weight");
  ASSERT_NE(gate_up_a, nullptr);
  EXPECT_EQ(gate_up_a->shape, (std::vector<int64_t>{4 * kExperts, kHidden}));
  EXPECT_NE(header->Find("base_model.model.model.layers.2.mlp.experts.lora_B.weight"), nullptr);
  EXPECT_EQ(header->Find("base_model.model.model.layers.1.mlp.experts.lora_A.weight"), nullptr)
      << "layer 1 is dense";
  const std::vector<std::string> still = {"optimizer.lr=0", "optimizer.min_lr=0"};
  auto loaded =
      Launch(2, tmp_ + "/loaded",
             With(MoeJob(tmp_ + "/moe", 1),
                  With(lora, With(still, {"lora.init_from=\"" + tmp_ + "/train/adapter\""}))));
  ASSERT_EQ(loaded.code, 0) << loaded.output;
  auto merged = Launch(2, tmp_ + "/merged", With(MoeJob(tmp_ + "/train/hf", 1), still));
  ASSERT_EQ(merged.code, 0) << merged.output;
  auto base = Launch(2, tmp_ + "/base", With(MoeJob(tmp_ + "/moe", 1), still));
  ASSERT_EQ(base.code, 0) << base.output;
  const double l = Losses(tmp_ + "/loaded/metrics.jsonl").at(0),
               m = Losses(tmp_ + "/merged/metrics.jsonl").at(0);
  EXPECT_LE(std::abs(l - m) / m, 1e-5) << "adapter on the base " << l << ", merged " << m;
  EXPECT_GT(std::abs(Losses(tmp_ + "/base/metrics.jsonl").at(0) - m) / m, 1e-4)
      << "the adapters changed the model";
}

// A mixture of experts from job keys (random init, no checkpoint; the CPU demo's kind of job):
// the pipeline against rp-train-ref with the load-balancing loss, and the export is a qwen3_moe
// checkpoint with the job's experts.
TEST_F(LaunchTest, MoeFromJobKeysMatchesTheReferenceAndExportsAsQwen3Moe) {
  const std::vector<std::string> sets = {"model.num_experts=4",
                                         "model.experts_per_token=2",
                                         "model.expert_intermediate_size=32",
                                         "model.norm_topk_prob=true",
                                         "model.router_aux_loss_coef=0.05",
                                         "model.sparse_step=2",
                                         "train.steps=4",
                                         "checkpoint.export_hf=hf"};
  auto ref = Ref(tmp_ + "/ref", sets);
  ASSERT_EQ(ref.code, 0) << ref.output;
  auto run = Launch(2, tmp_ + "/run", sets);
  ASSERT_EQ(run.code, 0) << run.output;
  ExpectClose(Losses(tmp_ + "/run/metrics.jsonl"), Losses(tmp_ + "/ref/metrics.jsonl"),
              "job keys on 2 workers");
  const json cfg = json::parse(ReadBytes(tmp_ + "/run/hf/config.json"));
  EXPECT_EQ(cfg["model_type"], "qwen3_moe");
  EXPECT_EQ(cfg["num_experts"], 4);
  EXPECT_EQ(cfg["num_experts_per_tok"], 2);
  EXPECT_EQ(cfg["decoder_sparse_step"], 2);
  EXPECT_EQ(cfg["output_router_logits"], true);
  // A dense job with a router weight, and more experts per token than experts: refused.
  for (const auto& bad :
       {std::vector<std::string>{"model.router_aux_loss_coef=0.01"},
        std::vector<std::string>{"model.num_experts=2", "model.experts_per_token=3"}}) {
    auto r = Launch(1, tmp_ + "/bad", bad, 30);
    EXPECT_EQ(r.code, 2) << r.output;
    EXPECT_NE(r.output.find(bad.back().substr(0, bad.back().find('='))), std::string::npos)
        << r.output;
  }
}

}  // namespace
}  // namespace rp
