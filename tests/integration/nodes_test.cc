// SPDX-License-Identifier: Apache-2.0
// Several nodes on one machine: rp-launch processes over loopback, each with its own coordinator,
// CPU workers and shared memory, summing gradients through c10d's Gloo. A step on N nodes must
// equal the one-node step of the same global batch.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <atomic>
#include <future>
#include <map>
#include <memory>
#include <thread>

#include "rp_config.h"
#include "tests/integration/launch_fixture.h"
#if RP_WITH_C10D
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "nodes/store_seal.h"
#endif

namespace rp {
namespace {

namespace fs = std::filesystem;

// Every fp32 tensor of a safetensors file, by name.
std::map<std::string, std::vector<float>> ReadTensors(const std::string& path) {
  const std::string bytes = ReadBytes(path);
  std::map<std::string, std::vector<float>> out;
  if (bytes.size() < 8) return out;
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  const auto header = nlohmann::json::parse(bytes.substr(8, n));
  for (const auto& [name, t] : header.items()) {
    if (name == "__metadata__" || t["dtype"] != "F32") continue;
    const uint64_t begin = t["data_offsets"][0], end = t["data_offsets"][1];
    std::vector<float> v((end - begin) / 4);
    std::memcpy(v.data(), bytes.data() + 8 + n + begin, end - begin);
    out[name] = std::move(v);
  }
  return out;
}

void ExpectClose(const std::vector<double>& got, const std::vector<double>& want, double rel,
                 const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i)
    EXPECT_NEAR(got[i], want[i], rel * std::abs(want[i]) + 1e-12) << what << " at step " << i + 1;
}

class NodesTest : public LaunchTest {
 protected:
  // Starts `nodes` rp-launch processes of `workers` CPU workers each, meeting at a fresh port.
  std::vector<std::unique_ptr<testing::Process>> StartNodes(int nodes, int workers,
                                                            const std::string& out,
                                                            const std::vector<std::string>& sets,
                                                            bool resume = false) {
    port_ = testing::FreePort();
    const std::string master = "127.0.0.1:" + std::to_string(port_);
    std::vector<std::unique_ptr<testing::Process>> procs;
    for (int r = 0; r < nodes; ++r) {
      auto args = LaunchArgs(workers, out, sets);
      args.insert(args.end(), {"--nnodes", std::to_string(nodes), "--node-rank", std::to_string(r),
                               "--master", master});
      if (resume) args.push_back("--resume");
      procs.push_back(std::make_unique<testing::Process>(args, NodeEnv(sets)));
    }
    return procs;
  }
  // StartNodes, then waits for all of them.
  std::vector<testing::ProcessResult> LaunchNodes(int nodes, int workers, const std::string& out,
                                                  const std::vector<std::string>& sets,
                                                  bool resume = false, double timeout = 300) {
    std::vector<testing::ProcessResult> results;
    for (auto& p : StartNodes(nodes, workers, out, sets, resume))
      results.push_back(p->Wait(timeout));
    return results;
  }
  std::vector<std::string> NodeEnv(const std::vector<std::string>& sets) const {
    auto env = EnvWith(sets);
    env.push_back("GLOO_SOCKET_IFNAME=lo");
    return env;
  }
  // `job` (10 steps) on two nodes of two workers: whole, in `whole`, and stopped after step 5
  // with a checkpoint, in `half`. Returns the whole run's losses.
  std::vector<double> WholeAndHalf(const std::vector<std::string>& job) {
    auto whole = LaunchNodes(2, 2, tmp_ + "/whole", job);
    for (const auto& r : whole) EXPECT_EQ(r.code, 0) << Outputs(whole);
    auto half = LaunchNodes(2, 2, tmp_ + "/half", With(job, {"train.stop_after=5"}));
    for (const auto& r : half) EXPECT_EQ(r.code, 0) << Outputs(half);
    return testing::Losses(tmp_ + "/whole/metrics.jsonl");
  }
  // Resumes `dir` (a copy of a checkpointed run) on `nodes` nodes of two workers; expects the
  // losses `want` within 1e-5.
  void ExpectResumed(int nodes, const std::string& dir, const std::vector<std::string>& job,
                     const std::vector<double>& want, const std::string& what) {
    if (nodes == 1) {
      auto r = testing::RunProcess(With(LaunchArgs(2, dir, job), {"--resume"}), 240, Env());
      ASSERT_EQ(r.code, 0) << what << ": " << r.output;
    } else {
      auto rs = LaunchNodes(nodes, 2, dir, job, /*resume=*/true);
      for (const auto& r : rs) ASSERT_EQ(r.code, 0) << what << ": " << Outputs(rs);
    }
    ExpectClose(testing::Losses(dir + "/metrics.jsonl"), want, 1e-5, what);
  }
  // Two runs' losses, gradient norms and exported models are the same bits.
  static void ExpectSameBits(const std::string& a, const std::string& b, const std::string& what) {
    for (const std::string field : {"loss", "grad_norm"})
      EXPECT_EQ(testing::Losses(a + "/metrics.jsonl", field),
                testing::Losses(b + "/metrics.jsonl", field))
          << what << ": " << field;
    EXPECT_TRUE(ReadBytes(a + "/hf/model.safetensors") == ReadBytes(b + "/hf/model.safetensors"))
        << what << ": the exported models differ";
  }
  static std::string Outputs(const std::vector<testing::ProcessResult>& rs) {
    std::string all;
    for (size_t r = 0; r < rs.size(); ++r)
      all += "--- node " + std::to_string(r) + ":\n" + rs[r].output;
    return all;
  }
  void SetUp() override {
    LaunchTest::SetUp();
    if (!RP_WITH_GLOO) GTEST_SKIP() << "this build's LibTorch has no c10d Gloo";
  }
  int port_ = 0;  // the node store's port of the last StartNodes
};

// Six microbatches per step: they split over 2 and over 3 nodes.
const std::vector<std::string> kJob = {"train.steps=10", "train.microbatches=6",
                                       "train.accum_calls=1", "train.grad_clip=1.0",
                                       "checkpoint.export_hf=hf"};

TEST_F(NodesTest, TwoAndThreeNodesEqualOneNodeInBothModes) {
  for (const std::string mode : {"exact", "stale1"}) {
    const auto job = With(kJob, {"optimizer.mode=" + mode});
    const std::string one = tmp_ + "/one-" + mode;
    auto r1 = Launch(2, one, job);
    ASSERT_EQ(r1.code, 0) << r1.output;
    const auto want = testing::Losses(one + "/metrics.jsonl");
    const auto want_norm = testing::Losses(one + "/metrics.jsonl", "grad_norm");
    const auto want_model = ReadTensors(one + "/hf/model.safetensors");
    ASSERT_FALSE(want_model.empty());
    for (int nodes : {2, 3}) {
      const std::string out = tmp_ + "/n" + std::to_string(nodes) + "-" + mode;
      auto rs = LaunchNodes(nodes, 2, out, job);
      for (const auto& r : rs) ASSERT_EQ(r.code, 0) << Outputs(rs);
      const std::string what = mode + " on " + std::to_string(nodes) + " nodes";
      ExpectClose(testing::Losses(out + "/metrics.jsonl"), want, 1e-5, what + ": loss");
      ExpectClose(testing::Losses(out + "/metrics.jsonl", "grad_norm"), want_norm, 1e-5,
                  what + ": grad norm");
      // Every node reports the same (whole-step) loss; node 0 alone exports.
      for (int r = 1; r < nodes; ++r) {
        const std::string mine = out + "/node-" + std::to_string(r);
        EXPECT_EQ(testing::Losses(mine + "/metrics.jsonl"), testing::Losses(out + "/metrics.jsonl"))
            << what;
        EXPECT_FALSE(fs::exists(mine + "/hf")) << what;
        EXPECT_EQ(Summary(mine)["node_rank"], r);
      }
      EXPECT_EQ(Summary(out)["nodes"], nodes);
      const auto got = ReadTensors(out + "/hf/model.safetensors");
      ASSERT_EQ(got.size(), want_model.size()) << what;
      for (const auto& [name, w] : want_model) {
        const auto& g = got.at(name);
        ASSERT_EQ(g.size(), w.size()) << name;
        // Relative to the tensor's norm: Adam turns a rounding-sized change of a near-zero
        // gradient element (another summation order) into an lr-sized step of that element.
        double diff = 0.0, norm = 0.0;
        for (size_t i = 0; i < w.size(); ++i) {
          diff += (double(g[i]) - w[i]) * (double(g[i]) - w[i]);
          norm += double(w[i]) * w[i];
        }
        EXPECT_LT(std::sqrt(diff / norm), 1e-5) << what << ": exported " << name;
      }
    }
  }
}

TEST_F(NodesTest, MergedCallsLoraDropoutAndEvaluationsEqualOneNode) {
  // Two calls of 3 microbatches merged into one round of 6, LoRA adapters with dropout (keyed by
  // the global microbatch), an eval split, stale1 with two unmerged calls (accumulating commits).
  const std::vector<std::vector<std::string>> jobs = {
      {"train.steps=6", "train.microbatches=3", "train.accum_calls=2", "lora.rank=4",
       "lora.dropout=0.1", "train.eval_every=2", "data.eval_fraction=0.1"},
      {"train.steps=6", "train.microbatches=6", "train.accum_calls=2", "optimizer.mode=stale1"},
  };
  for (size_t i = 0; i < jobs.size(); ++i) {
    const std::string tag = std::to_string(i);
    auto one = Launch(2, tmp_ + "/one" + tag, jobs[i]);
    ASSERT_EQ(one.code, 0) << one.output;
    auto rs = LaunchNodes(2, 2, tmp_ + "/two" + tag, jobs[i]);
    for (const auto& r : rs) ASSERT_EQ(r.code, 0) << Outputs(rs);
    for (const std::string field : {"loss", "grad_norm", "eval_loss"})
      ExpectClose(testing::Losses(tmp_ + "/two" + tag + "/metrics.jsonl", field),
                  testing::Losses(tmp_ + "/one" + tag + "/metrics.jsonl", field), 1e-5,
                  "job " + tag + ": " + field);
  }
}

// A mixture-of-experts model with the routers' load-balancing loss (the transformers-saved
// fixture): each microbatch's loss term and gradient are its own node's, weighted by the whole
// step's microbatch count, so two nodes train as one.
TEST_F(NodesTest, MixtureOfExpertsWithTheRouterLossEqualsOneNode) {
  const std::vector<std::string> job = {
      "model.path=" + testing::SourceDir() + "/tests/testdata/hf_fixtures/qwen3_moe_aux",
      "data.seq_len=32",
      "train.steps=4",
      "train.microbatches=4",
      "train.accum_calls=1",
      "optimizer.lr=1e-2"};
  auto one = Launch(2, tmp_ + "/one", job);
  ASSERT_EQ(one.code, 0) << one.output;
  auto rs = LaunchNodes(2, 1, tmp_ + "/two", job);
  for (const auto& r : rs) ASSERT_EQ(r.code, 0) << Outputs(rs);
  for (const std::string field : {"loss", "grad_norm"})
    ExpectClose(testing::Losses(tmp_ + "/two/metrics.jsonl", field),
                testing::Losses(tmp_ + "/one/metrics.jsonl", field), 1e-5, field);
}

TEST_F(NodesTest, EvaluationsSplitAcrossNodesWhenTheyDivide) {
  // Three eval microbatches: one per node on 3 nodes (each eval job's loss summed across them),
  // all three on every node of 2. Both equal one node's eval losses.
  const std::vector<std::string> job = {"train.steps=4",          "train.microbatches=6",
                                        "train.accum_calls=1",    "train.eval_every=2",
                                        "data.eval_fraction=0.1", "train.eval_microbatches=3"};
  auto one = Launch(2, tmp_ + "/one", job);
  ASSERT_EQ(one.code, 0) << one.output;
  const auto want = testing::Losses(tmp_ + "/one/metrics.jsonl", "eval_loss");
  for (int nodes : {3, 2}) {
    const std::string out = tmp_ + "/n" + std::to_string(nodes);
    auto rs = LaunchNodes(nodes, 1, out, job);
    for (const auto& r : rs) ASSERT_EQ(r.code, 0) << Outputs(rs);
    ExpectClose(testing::Losses(out + "/metrics.jsonl", "eval_loss"), want, 1e-5,
                "eval loss on " + std::to_string(nodes) + " nodes");
    EXPECT_EQ(Summary(out)["eval_microbatches_here"], nodes == 3 ? 1 : 3);
    EXPECT_EQ(testing::Losses(out + "/node-1/metrics.jsonl", "eval_loss"),
              testing::Losses(out + "/metrics.jsonl", "eval_loss"));
  }
}

TEST_F(NodesTest, OneNodeEqualsTheReference) {
  // The one-node run above is the multi-node runs' yardstick; it is itself rp-train-ref's step.
  auto ref = Ref(tmp_ + "/ref", kJob);
  ASSERT_EQ(ref.code, 0) << ref.output;
  auto rs = LaunchNodes(2, 1, tmp_ + "/n2", kJob);
  for (const auto& r : rs) ASSERT_EQ(r.code, 0) << Outputs(rs);
  ExpectClose(testing::Losses(tmp_ + "/n2/metrics.jsonl"),
              testing::Losses(tmp_ + "/ref/metrics.jsonl"), 1e-5, "2 nodes against rp-train-ref");
}

TEST_F(NodesTest, CheckpointOnTwoNodesResumesOnThreeAndOnOne) {
  const auto job = With(kJob, {"checkpoint.every=5"});
  const auto want = WholeAndHalf(job);
  if (HasFailure()) return;
  // Node 0 wrote the checkpoint; the other nodes wrote none.
  EXPECT_TRUE(fs::exists(tmp_ + "/half/checkpoints/step-00000005.rpstate"));
  EXPECT_FALSE(fs::exists(tmp_ + "/half/node-1/checkpoints"));
  fs::copy(tmp_ + "/half", tmp_ + "/on1", fs::copy_options::recursive);
  fs::copy(tmp_ + "/half", tmp_ + "/on3", fs::copy_options::recursive);

  ExpectResumed(3, tmp_ + "/on3", job, want, "resumed on 3 nodes");
  ExpectResumed(1, tmp_ + "/on1", job, want, "resumed on 1 node");
}

// The workers of one node sum across a group of that node alone (a test hook): every gradient,
// loss and the whole collective path runs, and no bit may change.
TEST_F(NodesTest, SumsAcrossANodeAloneChangeNothing) {
  for (const std::string mode : {"exact", "stale1"}) {
    const auto job = With(kJob, {"optimizer.mode=" + mode});
    auto plain = Launch(2, tmp_ + "/plain-" + mode, job);
    ASSERT_EQ(plain.code, 0) << plain.output;
    auto env = EnvWith(job);
    env.push_back("RP_TEST_NODE_SUMS_ALONE=1");
    auto alone = testing::RunProcess(LaunchArgs(2, tmp_ + "/alone-" + mode, job), 240, env);
    ASSERT_EQ(alone.code, 0) << alone.output;
    EXPECT_NE(alone.output.find("joined the cross-node reduction group"), std::string::npos)
        << alone.output;
    ExpectSameBits(tmp_ + "/alone-" + mode, tmp_ + "/plain-" + mode, mode);
    // Sharded state on that node alone: its share is everything, and every gather runs.
    const auto sharded = With(job, {"optimizer.state=sharded"});
    auto gathered =
        testing::RunProcess(LaunchArgs(2, tmp_ + "/sharded-" + mode, sharded), 240, env);
    ASSERT_EQ(gathered.code, 0) << gathered.output;
    EXPECT_NE(gathered.output.find("joined the cross-node gather group"), std::string::npos)
        << gathered.output;
    ExpectSameBits(tmp_ + "/sharded-" + mode, tmp_ + "/plain-" + mode, mode + ", sharded");
  }
}

// Without clipping the gradient slots of sharded state hold only the node's share of each
// parameter (ExecutionPlan::sharded_gradients), so the gradient arena shrinks with the node count
// too; the step's norm is then the sum of the squares the workers took of the whole summed gradient
// (reported only: nothing waits for it). Losses and the exported model are the replicated run's
// bits; the norm, summed in another order, agrees to rounding.
TEST_F(NodesTest, ShardedGradientSlotsHoldTheNodesShareWithoutClipping) {
  for (const std::string mode : {"exact", "stale1"}) {
    const auto job =
        With(kJob, {"optimizer.mode=" + mode, "train.grad_clip=0", "model.tie_embeddings=false"});
    for (int nodes : {2, 3}) {
      const std::string tag = mode + std::to_string(nodes),
                        what = mode + " on " + std::to_string(nodes) + " nodes";
      auto rep = LaunchNodes(nodes, 2, tmp_ + "/rep" + tag, job);
      for (const auto& r : rep) ASSERT_EQ(r.code, 0) << Outputs(rep);
      auto sh = LaunchNodes(nodes, 2, tmp_ + "/sh" + tag, With(job, {"optimizer.state=sharded"}));
      for (const auto& r : sh) ASSERT_EQ(r.code, 0) << Outputs(sh);
      EXPECT_EQ(testing::Losses(tmp_ + "/sh" + tag + "/metrics.jsonl"),
                testing::Losses(tmp_ + "/rep" + tag + "/metrics.jsonl"))
          << what;
      EXPECT_TRUE(ReadBytes(tmp_ + "/sh" + tag + "/hf/model.safetensors") ==
                  ReadBytes(tmp_ + "/rep" + tag + "/hf/model.safetensors"))
          << what << ": the exported models differ";
      const auto norms = testing::Losses(tmp_ + "/sh" + tag + "/metrics.jsonl", "grad_norm");
      const auto want = testing::Losses(tmp_ + "/rep" + tag + "/metrics.jsonl", "grad_norm");
      ASSERT_EQ(norms.size(), want.size()) << what;
      ASSERT_FALSE(norms.empty()) << what;
      for (size_t s = 0; s < norms.size(); ++s)
        EXPECT_NEAR(norms[s], want[s], 1e-12 * want[s]) << what << ", step " << s + 1;
      const double replicated = Summary(tmp_ + "/rep" + tag)["grad_arena_bytes"].get<double>();
      for (int r = 0; r < nodes; ++r) {
        const std::string dir =
            tmp_ + "/sh" + tag + (r == 0 ? std::string() : "/node-" + std::to_string(r));
        const double mine = Summary(dir)["grad_arena_bytes"].get<double>();
        // Each slot rounds up to 256 bytes (the tiny model has many small ones), the arena to a
        // page.
        EXPECT_LT(mine, replicated / nodes * 1.25 + 8 * 1024)
            << what << ", node " << r << " (replicated " << replicated << " bytes)";
      }
      if (mode != "exact" || nodes != 2) continue;
      // Squares and microbatches reported late, as a GPU's copies land after the host has moved
      // on: a job's commit is reported done only once its squares are written too.
      auto late =
          LaunchNodes(nodes, 2, tmp_ + "/late" + tag,
                      With(job, {"optimizer.state=sharded", "RP_TEST_LATE_COMPLETION_MS=15"}));
      for (const auto& r : late) ASSERT_EQ(r.code, 0) << Outputs(late);
      EXPECT_EQ(testing::Losses(tmp_ + "/late" + tag + "/metrics.jsonl", "grad_norm"), norms)
          << what << ", reported late";
      EXPECT_TRUE(ReadBytes(tmp_ + "/late" + tag + "/hf/model.safetensors") ==
                  ReadBytes(tmp_ + "/rep" + tag + "/hf/model.safetensors"))
          << what << ", reported late";
    }
  }
}

// Sharded state with a compute dtype below fp32: where workers fetch the fp32 masters (exact mode,
// weights_source "auto") the gathered weights are the masters, so the runs agree with replicated
// bit for bit; where the compute copies are rounded (stale1), the export could not read the
// masters back, and the job is refused naming why.
TEST_F(NodesTest, ShardedStateInFp16WhereWorkersFetchTheMasters) {
  const auto job = With(kJob, {"train.dtype=\"fp16\""});
  auto rep = LaunchNodes(2, 2, tmp_ + "/rep", job);
  for (const auto& r : rep) ASSERT_EQ(r.code, 0) << Outputs(rep);
  auto sh = LaunchNodes(2, 2, tmp_ + "/sh", With(job, {"optimizer.state=sharded"}));
  for (const auto& r : sh) ASSERT_EQ(r.code, 0) << Outputs(sh);
  ExpectSameBits(tmp_ + "/sh", tmp_ + "/rep", "fp16, exact, on 2 nodes");

  auto stale = testing::RunProcess(
      With(LaunchArgs(2, tmp_ + "/stale",
                      With(job, {"optimizer.state=sharded", "optimizer.mode=stale1"})),
           {"--nnodes", "2", "--node-rank", "0", "--master", "127.0.0.1:1"}),
      60, Env());
  EXPECT_EQ(stale.code, 2) << stale.output;
  EXPECT_NE(stale.output.find("hold the fp32 masters only where workers fetch them"),
            std::string::npos)
      << stale.output;
}

// Sharded optimizer state (ZeRO-1 across nodes): each node updates its share with the same
// summed gradient the replicated run updates everything with, elementwise, so the runs agree bit
// for bit; each node's optimizer segment holds about 1/N of the replicated one's.
TEST_F(NodesTest, ShardedStateEqualsReplicatedBitForBit) {
  for (const std::string mode : {"exact", "stale1"}) {
    const auto job = With(kJob, {"optimizer.mode=" + mode});
    for (int nodes : {2, 3}) {
      const std::string tag = mode + std::to_string(nodes);
      auto rep = LaunchNodes(nodes, 2, tmp_ + "/rep" + tag, job);
      for (const auto& r : rep) ASSERT_EQ(r.code, 0) << Outputs(rep);
      auto sh = LaunchNodes(nodes, 2, tmp_ + "/sh" + tag, With(job, {"optimizer.state=sharded"}));
      for (const auto& r : sh) ASSERT_EQ(r.code, 0) << Outputs(sh);
      const std::string what = mode + " on " + std::to_string(nodes) + " nodes";
      ExpectSameBits(tmp_ + "/sh" + tag, tmp_ + "/rep" + tag, what);
      const double replicated = Summary(tmp_ + "/rep" + tag)["optim_segment_bytes"].get<double>();
      for (int r = 0; r < nodes; ++r) {
        const std::string dir =
            tmp_ + "/sh" + tag + (r == 0 ? std::string() : "/node-" + std::to_string(r));
        const double mine = Summary(dir)["optim_segment_bytes"].get<double>();
        // Each array of each parameter rounds up to 256 bytes, each region to a page.
        EXPECT_LT(mine, replicated / nodes * 1.1 + 64 * 1024) << what << ", node " << r;
      }
    }
  }
}

// The other shapes of the optimizer segment under sharding: SGD (one moment), masters beside a
// compute copy (weights_source = compute_copy), LoRA with dropout and an eval split; the same bits
// as replicated, and a checkpoint of the sharded run resumes on 3 nodes.
TEST_F(NodesTest, ShardedStateWithSgdComputeCopiesAndLoraEqualsReplicated) {
  const std::vector<std::vector<std::string>> jobs = {
      With(kJob, {"optimizer.name=sgd", "optimizer.lr=0.05", "schedule.weights_source=compute_copy",
                  "checkpoint.every=5"}),
      With(kJob, {"lora.rank=4", "lora.dropout=0.1", "train.eval_every=5", "data.eval_fraction=0.1",
                  "checkpoint.export_hf=", "lora.export=adapter"}),
  };
  for (size_t i = 0; i < jobs.size(); ++i) {
    const std::string tag = std::to_string(i);
    auto rep = LaunchNodes(2, 2, tmp_ + "/rep" + tag, jobs[i]);
    for (const auto& r : rep) ASSERT_EQ(r.code, 0) << Outputs(rep);
    auto sh = LaunchNodes(2, 2, tmp_ + "/sh" + tag, With(jobs[i], {"optimizer.state=sharded"}));
    for (const auto& r : sh) ASSERT_EQ(r.code, 0) << Outputs(sh);
    for (const std::string field : {"loss", "grad_norm", "eval_loss"})
      EXPECT_EQ(testing::Losses(tmp_ + "/sh" + tag + "/metrics.jsonl", field),
                testing::Losses(tmp_ + "/rep" + tag + "/metrics.jsonl", field))
          << "job " << tag << ": " << field;
  }
  // The SGD job's sharded checkpoint after step 5 resumes on 3 sharded nodes.
  const auto sgd = With(jobs[0], {"optimizer.state=sharded"});
  auto half = LaunchNodes(2, 2, tmp_ + "/half", With(sgd, {"train.stop_after=5"}));
  for (const auto& r : half) ASSERT_EQ(r.code, 0) << Outputs(half);
  ExpectResumed(3, tmp_ + "/half", sgd, testing::Losses(tmp_ + "/sh0/metrics.jsonl"),
                "SGD resumed on 3 sharded nodes");
}

TEST_F(NodesTest, ShardedCheckpointsResumeOnAnyNodeCount) {
  const auto job = With(kJob, {"checkpoint.every=5", "optimizer.mode=stale1"});
  const auto sharded = With(job, {"optimizer.state=sharded"});
  const auto want = WholeAndHalf(sharded);
  if (HasFailure()) return;
  // Every node wrote its own file into node 0's checkpoint directory; no whole file.
  EXPECT_TRUE(fs::exists(tmp_ + "/half/checkpoints/step-00000005.shard-0-of-2.rpstate"));
  EXPECT_TRUE(fs::exists(tmp_ + "/half/checkpoints/step-00000005.shard-1-of-2.rpstate"));
  EXPECT_FALSE(fs::exists(tmp_ + "/half/checkpoints/step-00000005.rpstate"));
  // rp-export reads both shards back as one node: the export the stopped run wrote, bit for bit.
  auto exported = testing::RunProcess(
      {testing::BinDir() + "/rp-export", tmp_ + "/half", "--out", tmp_ + "/half-export"}, 120,
      Env());
  ASSERT_EQ(exported.code, 0) << exported.output;
  EXPECT_TRUE(ReadBytes(tmp_ + "/half-export/model.safetensors") ==
              ReadBytes(tmp_ + "/half/hf/model.safetensors"));
  for (const std::string to : {"on2", "on3", "on1", "rep3", "lost"})
    fs::copy(tmp_ + "/half", tmp_ + "/" + to, fs::copy_options::recursive);

  // The same node count: bit for bit.
  auto on2 = LaunchNodes(2, 2, tmp_ + "/on2", sharded, /*resume=*/true);
  for (const auto& r : on2) ASSERT_EQ(r.code, 0) << Outputs(on2);
  EXPECT_EQ(testing::Losses(tmp_ + "/on2/metrics.jsonl"), want);
  EXPECT_TRUE(ReadBytes(tmp_ + "/on2/hf/model.safetensors") ==
              ReadBytes(tmp_ + "/whole/hf/model.safetensors"))
      << "the exported models differ";
  // Other counts, sharded and replicated: the shares re-partitioned.
  ExpectResumed(3, tmp_ + "/on3", sharded, want, "resumed on 3 sharded nodes");
  ExpectResumed(3, tmp_ + "/rep3", job, want, "resumed on 3 replicated nodes");
  ExpectResumed(1, tmp_ + "/on1", job, want, "resumed on 1 node");
  // That one-node run writes whole files again.
  EXPECT_TRUE(fs::exists(tmp_ + "/on1/checkpoints/step-00000010.rpstate"));

  // A set missing a shard is no checkpoint: nothing to resume from, named.
  fs::remove(tmp_ + "/lost/checkpoints/step-00000005.shard-1-of-2.rpstate");
  auto lost =
      testing::RunProcess(With(LaunchArgs(2, tmp_ + "/lost", job), {"--resume"}), 60, Env());
  EXPECT_EQ(lost.code, 2) << lost.output;
  EXPECT_NE(lost.output.find("no complete training checkpoint"), std::string::npos) << lost.output;
}

TEST_F(NodesTest, AKilledNodeStopsTheOthersNamingIt) {
  // Slow steps, so the run is mid-way when node 2 dies; a short node timeout bounds the wait.
  const auto job = With(kJob, {"train.steps=400", "job.node_timeout_s=10"});
  auto procs = StartNodes(3, 1, tmp_ + "/killed", job);
  // Wait until node 0 reports steps, then kill node 2's launcher (its children follow it).
  for (int i = 0; i < 600 && testing::Losses(tmp_ + "/killed/metrics.jsonl").size() < 2; ++i)
    ::usleep(100 * 1000);
  ASSERT_GE(testing::Losses(tmp_ + "/killed/metrics.jsonl").size(), 2u) << procs[0]->OutputSoFar();
  const auto killed_at = std::chrono::steady_clock::now();
  ::kill(procs[2]->pid(), SIGKILL);
  for (int r = 0; r < 2; ++r) {
    auto res = procs[r]->Wait(120);
    EXPECT_FALSE(res.timed_out) << res.output;
    EXPECT_EQ(res.code, 10) << res.output;
    EXPECT_NE(res.output.find("node 2"), std::string::npos) << res.output;
  }
  const double took =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - killed_at).count();
  EXPECT_LT(took, 10 + 30) << "the others stopped " << took << " s after node 2 died";
  procs[2]->Wait(10);
  // Node 2's workers died with its launcher and its coordinator removed the node's shared memory
  // and runtime directory: TearDown finds nothing of any node left, with no later rp-launch.
}

TEST_F(NodesTest, AStoppedNodeLauncherIsWaitedForAndTheRunGoesOnUnchanged) {
  // Node 1's rp-launch SIGSTOPped for 3.5x job.worker_timeout_s (its coordinator and workers run
  // on), then SIGCONT: both nodes complete with the uninterrupted run's losses bit for bit, and
  // no worker is replaced.
  const auto job = With(kJob, {"train.steps=16", "job.worker_timeout_s=2",
                               "job.max_worker_restarts=0", "RP_TEST_SLOW_FROM_STEP=0:30"});
  auto clean = LaunchNodes(2, 1, tmp_ + "/clean", job);
  for (const auto& r : clean) ASSERT_EQ(r.code, 0) << Outputs(clean);
  auto procs = StartNodes(2, 1, tmp_ + "/stopped", job);
  for (int i = 0; i < 600 && testing::Losses(tmp_ + "/stopped/metrics.jsonl").size() < 2; ++i)
    ::usleep(100 * 1000);
  ASSERT_GE(testing::Losses(tmp_ + "/stopped/metrics.jsonl").size(), 2u) << procs[0]->OutputSoFar();
  ::kill(procs[1]->pid(), SIGSTOP);
  std::this_thread::sleep_for(std::chrono::milliseconds(7000));
  ::kill(procs[1]->pid(), SIGCONT);
  std::vector<testing::ProcessResult> results;
  for (auto& p : procs) results.push_back(p->Wait(120));
  for (const auto& r : results) EXPECT_EQ(r.code, 0) << Outputs(results);
  EXPECT_EQ(testing::Losses(tmp_ + "/stopped/metrics.jsonl"),
            testing::Losses(tmp_ + "/clean/metrics.jsonl"));
  EXPECT_EQ(Summary(tmp_ + "/stopped")["worker_replacements"], 0);
}

// An interrupt of one node stops every node after one agreed step (common/stop_agreement.h):
// with sharded state each node writes its part of the checkpoint, so the parts must be of the
// same step, and the run resumed from them continues as the uninterrupted run. Node 1
// interrupted, then node 0, which hosts the node store from a thread of its own (SIGINT must
// still reach its supervision loop).
TEST_F(NodesTest, AnInterruptOfOneNodeStopsEveryNodeAfterTheSameStep) {
  const auto job = With(kJob, {"train.steps=400", "checkpoint.every=1000", "job.node_timeout_s=20",
                               "optimizer.state=sharded"});
  for (int interrupted : {1, 0}) {
    const std::string out = tmp_ + "/int" + std::to_string(interrupted),
                      other = std::to_string(1 - interrupted);
    auto procs = StartNodes(2, 1, out, job);
    for (int i = 0; i < 600 && testing::Losses(out + "/metrics.jsonl").size() < 2; ++i)
      ::usleep(100 * 1000);
    ASSERT_GE(testing::Losses(out + "/metrics.jsonl").size(), 2u) << procs[0]->OutputSoFar();
    ::kill(procs[interrupted]->pid(), SIGINT);
    std::vector<testing::ProcessResult> ends;
    for (auto& p : procs) ends.push_back(p->Wait(120));
    for (const auto& e : ends) ASSERT_EQ(e.code, 3) << Outputs(ends);
    EXPECT_NE(ends[1 - interrupted].output.find("node " + std::to_string(interrupted) +
                                                " was interrupted"),
              std::string::npos)
        << Outputs(ends);
    // Both nodes reported the same last step, and wrote their parts of its checkpoint.
    const auto steps0 = testing::Losses(out + "/metrics.jsonl", "step");
    const auto steps1 = testing::Losses(out + "/node-1/metrics.jsonl", "step");
    ASSERT_FALSE(steps0.empty());
    ASSERT_EQ(steps0, steps1) << "node " << other << " stopped after another step";
    const int stop = static_cast<int>(steps0.back());
    ASSERT_LT(stop, 400);
    char name[64];
    for (int r = 0; r < 2; ++r) {
      std::snprintf(name, sizeof(name), "/checkpoints/step-%08d.shard-%d-of-2.rpstate", stop, r);
      EXPECT_TRUE(fs::exists(out + name)) << out + name << " is missing: " << Outputs(ends);
    }
    // Resumed for two more steps: the uninterrupted run's losses there, bit for bit.
    const auto more = With(job, {"train.stop_after=" + std::to_string(stop + 2)});
    auto resumed = LaunchNodes(2, 1, out, more, /*resume=*/true);
    for (const auto& r : resumed) ASSERT_EQ(r.code, 0) << Outputs(resumed);
    auto whole = LaunchNodes(2, 1, out + "-whole", more);
    for (const auto& r : whole) ASSERT_EQ(r.code, 0) << Outputs(whole);
    const auto got = testing::Losses(out + "/metrics.jsonl"),
               want = testing::Losses(out + "-whole/metrics.jsonl");
    ASSERT_EQ(want.size(), static_cast<size_t>(stop + 2));
    ASSERT_GE(got.size(), 2u);
    EXPECT_EQ(std::vector<double>(got.end() - 2, got.end()),
              std::vector<double>(want.end() - 2, want.end()))
        << "node " << interrupted << " interrupted";
  }
}

TEST_F(NodesTest, NodesWithDifferentPlansAreRefused) {
  // Node 1 with another partition, then with another worker count: the round-robin would pair
  // different jobs in the sums.
  const std::vector<std::pair<std::vector<std::string>, int>> differences = {
      {{"--set", "schedule.forward_stages=1"}, 2}, {{}, 1}};
  for (const auto& [difference, workers] : differences) {
    const std::string master = "127.0.0.1:" + std::to_string(testing::FreePort());
    std::vector<std::unique_ptr<testing::Process>> procs;
    for (int r = 0; r < 2; ++r) {
      auto args = LaunchArgs(r == 1 ? workers : 2, tmp_ + "/mismatch",
                             With(kJob, {"job.node_timeout_s=20"}));
      if (r == 1) args.insert(args.end(), difference.begin(), difference.end());
      args.insert(args.end(),
                  {"--nnodes", "2", "--node-rank", std::to_string(r), "--master", master});
      procs.push_back(std::make_unique<testing::Process>(args, NodeEnv({})));
    }
    for (auto& p : procs) {
      auto res = p->Wait(60);
      EXPECT_EQ(res.code, 2) << workers << " workers: " << res.output;
      EXPECT_NE(res.output.find("every node must resolve the same run"), std::string::npos)
          << res.output;
    }
  }
}

// Nodes holding different secrets name different keys, so they never see each other: each stops
// within job.node_timeout_s (polled, never c10d's wait, which on LibTorch 1.13 outlasts its
// timeout for a key never set), naming the nodes missing and the secret they must share.
TEST_F(NodesTest, NodesWithDifferentSecretsNeverMeetAndSaySo) {
  const std::string master = "127.0.0.1:" + std::to_string(testing::FreePort());
  std::vector<std::unique_ptr<testing::Process>> procs;
  for (int r = 0; r < 2; ++r) {
    auto args = LaunchArgs(1, tmp_ + "/strangers", With(kJob, {"job.node_timeout_s=5"}));
    args.insert(args.end(),
                {"--nnodes", "2", "--node-rank", std::to_string(r), "--master", master});
    procs.push_back(std::make_unique<testing::Process>(
        args, NodeEnv({"RP_NODE_SECRET=the secret of node " + std::to_string(r) + " alone"})));
  }
  for (auto& p : procs) {
    auto res = p->Wait(60);
    EXPECT_FALSE(res.timed_out) << res.output;
    EXPECT_EQ(res.code, 10) << res.output;
    EXPECT_NE(res.output.find("did not arrive"), std::string::npos) << res.output;
    EXPECT_NE(res.output.find("share the run's secret"), std::string::npos) << res.output;
  }
}

// Two network namespaces joined by a veth pair: two hosts on one machine, whose link can be cut.
// Needs root (CI runs as root). Removed, with the pair, on destruction.
class NetworkPair {
 public:
  NetworkPair() : tag_(std::to_string(::getpid() % 100000)) {
    ok_ = Ip({"netns", "add", ns(0)}) && Ip({"netns", "add", ns(1)}) &&
          Ip({"link", "add", dev(0), "netns", ns(0), "type", "veth", "peer", "name", dev(1),
              "netns", ns(1)});
    for (int r = 0; r < 2 && ok_; ++r)
      ok_ = Ip({"-n", ns(r), "addr", "add", address(r) + "/24", "dev", dev(r)}) &&
            Ip({"-n", ns(r), "link", "set", "lo", "up"}) &&
            Ip({"-n", ns(r), "link", "set", dev(r), "up"});
  }
  ~NetworkPair() {
    for (int r = 0; r < 2; ++r) (void)Ip({"netns", "del", ns(r)});
  }
  bool ok() const { return ok_; }
  const std::string& error() const { return error_; }
  std::string ns(int r) const { return "rp-net" + std::to_string(r) + "-" + tag_; }
  std::string dev(int r) const { return "rpv" + std::to_string(r) + "-" + tag_; }
  std::string address(int r) const { return "10.201.0." + std::to_string(r + 1); }
  // Node r's side of the link down: packets vanish, no connection is reset.
  bool Cut() { return Ip({"-n", ns(0), "link", "set", dev(0), "down"}); }

 private:
  bool Ip(std::vector<std::string> args) {
    args.insert(args.begin(), "/usr/sbin/ip");
    auto r = testing::RunProcess(args, 30);
    if (r.code != 0) error_ += r.output;
    return r.code == 0;
  }
  std::string tag_, error_;
  bool ok_ = false;
};

// A network cut between two nodes mid-run stops both within job.node_timeout_s, each naming the
// other, with nothing left behind; --resume on every node afterwards continues from the newest
// checkpoint with the uninterrupted run's losses.
TEST_F(NodesTest, ANetworkCutStopsBothNodesNamingTheOtherAndTheRunResumes) {
  if (::geteuid() != 0) {
    if (const char* ci = std::getenv("CI"); ci && std::string(ci) == "true")
      FAIL() << "CI runs as root";
    GTEST_SKIP() << "network namespaces need root";
  }
  NetworkPair net;
  ASSERT_TRUE(net.ok()) << net.error();
  const auto job = With(kJob, {"train.steps=40", "checkpoint.every=5", "job.node_timeout_s=10",
                               "RP_TEST_SLOW_FROM_STEP=0:20"});
  auto clean = LaunchNodes(2, 1, tmp_ + "/clean", job);
  for (const auto& r : clean) ASSERT_EQ(r.code, 0) << Outputs(clean);
  const std::string out = tmp_ + "/cut",
                    master = net.address(0) + ":" + std::to_string(testing::FreePort());
  std::vector<std::unique_ptr<testing::Process>> procs;
  for (int r = 0; r < 2; ++r) {
    auto args = LaunchArgs(1, out, job);
    args.insert(args.begin(), {"/usr/sbin/ip", "netns", "exec", net.ns(r)});
    args.insert(args.end(),
                {"--nnodes", "2", "--node-rank", std::to_string(r), "--master", master});
    auto env = EnvWith(job);
    env.push_back("GLOO_SOCKET_IFNAME=" + net.dev(r));
    procs.push_back(std::make_unique<testing::Process>(args, env));
  }
  for (int i = 0; i < 600 && testing::Losses(out + "/metrics.jsonl").size() < 12; ++i)
    ::usleep(100 * 1000);
  ASSERT_GE(testing::Losses(out + "/metrics.jsonl").size(), 12u) << procs[0]->OutputSoFar();
  const auto cut_at = std::chrono::steady_clock::now();
  ASSERT_TRUE(net.Cut()) << net.error();
  std::vector<testing::ProcessResult> ends;
  for (auto& p : procs) ends.push_back(p->Wait(120));
  const double took =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - cut_at).count();
  for (const auto& e : ends) {
    EXPECT_FALSE(e.timed_out) << Outputs(ends);
    EXPECT_EQ(e.code, 10) << Outputs(ends);
  }
  EXPECT_NE(ends[0].output.find("node 1 gave no sign of life"), std::string::npos) << Outputs(ends);
  EXPECT_NE(ends[1].output.find("node 0 is gone or unreachable"), std::string::npos)
      << Outputs(ends);
  EXPECT_LT(took, 10 + 15) << "the nodes stopped " << took << " s after the cut";
  ASSERT_LT(testing::Losses(out + "/metrics.jsonl").size(), 40u) << "the run ended before the cut";
  ExpectResumed(2, out, job, testing::Losses(tmp_ + "/clean/metrics.jsonl"),
                "resumed after the cut");
}

TEST_F(NodesTest, AStepThatDoesNotSplitIsRefused) {
  auto r = testing::RunProcess(
      With(LaunchArgs(2, tmp_ + "/uneven", {"train.microbatches=3", "train.accum_calls=1"}),
           {"--nnodes", "2", "--node-rank", "0", "--master", "127.0.0.1:1"}),
      60, Env());
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("do not split evenly over 2 nodes"), std::string::npos) << r.output;
}

#if RP_WITH_C10D
namespace rogue {

// A raw TCP connection to the store's port (-1 if refused).
int Connect(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<uint16_t>(port));
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// What anyone who reaches the store's port can do without the run's secret, until `done`: write
// and delete the keys the run would use were there no secret prefix (and, given `prefix`, those
// it does use, as a client that listed them), bump counters, hold connections open and send
// bytes that are no store protocol. Every c10d error is the store refusing it; it goes on.
void Disturb(int port, const std::string& prefix, const std::atomic<bool>& done) {
  std::vector<int> held;
  std::vector<std::string> names;
  for (const std::string what : {"plan", "met", "beat", "end", "failing", "interrupt", "stop"})
    for (int r = 0; r < 2; ++r) names.push_back(prefix + "rp/" + what + "/" + std::to_string(r));
  for (const std::string purpose : {"reduce", "gather"})
    for (const std::string key : {"0", "1", "rank_0", "rank_1"})
      names.push_back(prefix + "rp/" + purpose + "/0/" + key);
  const std::vector<uint8_t> junk = {'1', ' ', 'x', 0, 0xff};
  uint32_t lcg = 12345;
  while (!done) {
    try {
      c10d::TCPStoreOptions o;
      o.port = static_cast<uint16_t>(port);
      o.isServer = false;
      o.waitWorkers = false;
      o.timeout = std::chrono::milliseconds(2000);
      auto store = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", o);
      for (const auto& n : names) {
        store->set(n, junk);
        (void)store->add(n + "/counter", 7);
        // Plain names are deleted again; forged values under the run's names are left to be read.
        if (prefix.empty()) (void)store->deleteKey(n);
      }
      (void)store->getNumKeys();
    } catch (const std::exception&) {
    }
    if (held.size() < 16)
      if (const int fd = Connect(port); fd >= 0) held.push_back(fd);
    // Bytes that are no query, on a connection then closed.
    if (const int fd = Connect(port); fd >= 0) {
      char bytes[64];
      for (char& b : bytes) b = static_cast<char>((lcg = lcg * 1664525u + 1013904223u) >> 24);
      (void)::send(fd, bytes, sizeof(bytes), MSG_NOSIGNAL);
      ::close(fd);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  for (int fd : held) ::close(fd);
}

}  // namespace rogue

// A client of node 0's store port that knows no secret writes, deletes and counts keys, holds
// connections and sends garbage for the whole run: the run's keys are under its secret's prefix
// and its values sealed, so it ends as the undisturbed run, bit for bit.
TEST_F(NodesTest, ARogueClientOnTheStorePortChangesNothing) {
  const auto job = With(kJob, {"train.steps=12", "job.node_timeout_s=20"});
  auto clean = LaunchNodes(2, 1, tmp_ + "/clean", job);
  for (const auto& r : clean) ASSERT_EQ(r.code, 0) << Outputs(clean);
  auto procs = StartNodes(2, 1, tmp_ + "/rogue", job);
  std::atomic<bool> done{false};
  std::thread disturb(rogue::Disturb, port_, "", std::cref(done));
  std::vector<testing::ProcessResult> results;
  for (auto& p : procs) results.push_back(p->Wait(240));
  done = true;
  disturb.join();
  for (const auto& r : results) EXPECT_EQ(r.code, 0) << Outputs(results);
  EXPECT_EQ(testing::Losses(tmp_ + "/rogue/metrics.jsonl", "loss"),
            testing::Losses(tmp_ + "/clean/metrics.jsonl", "loss"));
  EXPECT_EQ(testing::Losses(tmp_ + "/rogue/metrics.jsonl", "grad_norm"),
            testing::Losses(tmp_ + "/clean/metrics.jsonl", "grad_norm"));
}

// The same client, given the run's key names (as one that lists the store's keys would have
// them) but not its secret: its first forged value stops both nodes within job.node_timeout_s,
// naming the tampering, never a silent change and never a hang.
TEST_F(NodesTest, AForgedValueUnderTheRunsKeysStopsTheRunNamingTheTampering) {
  const std::string secret = "a secret of this test's run";
  const auto job =
      With(kJob, {"train.steps=400", "job.node_timeout_s=10", "RP_NODE_SECRET=" + secret});
  auto procs = StartNodes(2, 1, tmp_ + "/forged", job);
  for (int i = 0; i < 600 && testing::Losses(tmp_ + "/forged/metrics.jsonl").size() < 2; ++i)
    ::usleep(100 * 1000);
  ASSERT_GE(testing::Losses(tmp_ + "/forged/metrics.jsonl").size(), 2u) << procs[0]->OutputSoFar();
  const auto forged_at = std::chrono::steady_clock::now();
  std::atomic<bool> done{false};
  std::thread disturb(rogue::Disturb, port_, nodes::StoreSeal(secret).prefix(), std::cref(done));
  std::vector<testing::ProcessResult> results;
  for (auto& p : procs) results.push_back(p->Wait(120));
  done = true;
  disturb.join();
  const double took =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - forged_at).count();
  for (const auto& r : results) {
    EXPECT_FALSE(r.timed_out) << Outputs(results);
    EXPECT_NE(r.code, 0) << Outputs(results);
  }
  EXPECT_NE(Outputs(results).find("fails authentication"), std::string::npos) << Outputs(results);
  EXPECT_LT(took, 10 + 30) << "the nodes stopped " << took << " s after the first forged value";
  EXPECT_LT(testing::Losses(tmp_ + "/forged/metrics.jsonl").size(), 400u);
}
#endif

}  // namespace
}  // namespace rp
