// SPDX-License-Identifier: Apache-2.0
// Which node a launch is: flags, torchrun's and Slurm's environments, Slurm host lists.
#include <gtest/gtest.h>

#include <map>

#include "launcher/host_gpus.h"
#include "launcher/node_world.h"

namespace rp::launch {
namespace {

EnvLookup Env(std::map<std::string, std::string> vars) {
  return [vars](const std::string& name) -> std::optional<std::string> {
    auto it = vars.find(name);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  };
}

TEST(NodeWorld, NothingGivenIsOneNode) {
  auto w = ResolveNodeWorld({}, Env({}));
  ASSERT_TRUE(w.ok()) << w.status().message();
  EXPECT_EQ(w->nodes, 1);
  EXPECT_EQ(w->rank, 0);
  EXPECT_EQ(w->source, "single");
}

TEST(NodeWorld, Flags) {
  auto w = ResolveNodeWorld({3, 2, "10.0.0.5:29611"}, Env({{"RANK", "7"}, {"WORLD_SIZE", "9"}}));
  ASSERT_TRUE(w.ok()) << w.status().message();
  EXPECT_EQ(w->nodes, 3);
  EXPECT_EQ(w->rank, 2);
  EXPECT_EQ(w->store_host, "10.0.0.5");
  EXPECT_EQ(w->store_port, 29611);
  EXPECT_EQ(w->source, "flags");  // flags win over the environment
  auto v6 = ResolveNodeWorld({2, 0, "[fe80::1]:5000"}, Env({}));
  ASSERT_TRUE(v6.ok()) << v6.status().message();
  EXPECT_EQ(v6->store_host, "fe80::1");
  EXPECT_EQ(v6->store_port, 5000);
}

TEST(NodeWorld, BadFlagsAreNamed) {
  const std::vector<std::pair<NodeFlags, std::string>> cases = {
      {{2, -1, "h:1"}, "needs --node-rank"},
      {{2, 0, ""}, "needs --master"},
      {{2, 2, "h:1"}, "--node-rank = 2 is not below --nnodes = 2"},
      {{2, 1, "h"}, "is not ADDR:PORT"},
      {{2, 1, "h:70000"}, "--master's port"},
      {{2, 1, "h:x1"}, "--master's port"},
      {{0, 1, "h:1"}, "need --nnodes"},
  };
  for (const auto& [flags, want] : cases) {
    auto w = ResolveNodeWorld(flags, Env({}));
    ASSERT_FALSE(w.ok()) << want;
    EXPECT_NE(w.status().message().find(want), std::string::npos) << w.status().message();
  }
}

TEST(NodeWorld, Torchrun) {
  auto w = ResolveNodeWorld({}, Env({{"RANK", "1"},
                                     {"WORLD_SIZE", "4"},
                                     {"LOCAL_WORLD_SIZE", "1"},
                                     {"MASTER_ADDR", "node-a"},
                                     {"MASTER_PORT", "29500"}}));
  ASSERT_TRUE(w.ok()) << w.status().message();
  EXPECT_EQ(w->source, "torchrun");
  EXPECT_EQ(w->nodes, 4);
  EXPECT_EQ(w->rank, 1);
  EXPECT_EQ(w->store_host, "node-a");
  EXPECT_EQ(w->store_port, 29501);  // torchrun's own store keeps 29500
  auto own = ResolveNodeWorld({}, Env({{"RANK", "0"},
                                       {"WORLD_SIZE", "2"},
                                       {"MASTER_ADDR", "a"},
                                       {"MASTER_PORT", "29500"},
                                       {"RP_MASTER_PORT", "31000"}}));
  ASSERT_TRUE(own.ok());
  EXPECT_EQ(own->store_port, 31000);
  auto two = ResolveNodeWorld({}, Env({{"RANK", "0"},
                                       {"WORLD_SIZE", "2"},
                                       {"LOCAL_WORLD_SIZE", "8"},
                                       {"MASTER_ADDR", "a"},
                                       {"MASTER_PORT", "1"}}));
  ASSERT_FALSE(two.ok());
  EXPECT_NE(two.status().message().find("--nproc-per-node 1"), std::string::npos);
  auto bad = ResolveNodeWorld({}, Env({{"RANK", "2"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "a"}}));
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("RANK = 2 is not below WORLD_SIZE = 2"), std::string::npos);
  auto noaddr =
      ResolveNodeWorld({}, Env({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "5"}}));
  ASSERT_FALSE(noaddr.ok());
  EXPECT_NE(noaddr.status().message().find("MASTER_ADDR is not set"), std::string::npos);
}

TEST(NodeWorld, Slurm) {
  auto w = ResolveNodeWorld({}, Env({{"SLURM_PROCID", "2"},
                                     {"SLURM_NTASKS", "3"},
                                     {"SLURM_JOB_NODELIST", "gpu[07-09,12],cpu3"}}));
  ASSERT_TRUE(w.ok()) << w.status().message();
  EXPECT_EQ(w->source, "slurm");
  EXPECT_EQ(w->nodes, 3);
  EXPECT_EQ(w->rank, 2);
  EXPECT_EQ(w->store_host, "gpu07");
  EXPECT_EQ(w->store_port, 29500);
  auto port = ResolveNodeWorld({}, Env({{"SLURM_PROCID", "0"},
                                        {"SLURM_NTASKS", "2"},
                                        {"SLURM_JOB_NODELIST", "a,b"},
                                        {"MASTER_PORT", "4000"}}));
  ASSERT_TRUE(port.ok());
  EXPECT_EQ(port->store_host, "a");
  EXPECT_EQ(port->store_port, 4000);
  auto bad = ResolveNodeWorld({}, Env({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "two"}}));
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("SLURM_NTASKS"), std::string::npos);
  auto step = ResolveNodeWorld({}, Env({{"SLURM_PROCID", "1"},
                                        {"SLURM_NTASKS", "2"},
                                        {"SLURM_NTASKS_PER_NODE", "1"},
                                        {"SLURM_STEP_NODELIST", "n[3-4]"},
                                        {"SLURM_JOB_NODELIST", "n[1-4]"}}));
  ASSERT_TRUE(step.ok()) << step.status().message();
  EXPECT_EQ(step->store_host, "n3");  // the step's hosts, not the allocation's
  auto eight = ResolveNodeWorld({}, Env({{"SLURM_PROCID", "1"},
                                         {"SLURM_NTASKS", "16"},
                                         {"SLURM_NTASKS_PER_NODE", "8"},
                                         {"SLURM_JOB_NODELIST", "n[1-2]"}}));
  ASSERT_FALSE(eight.ok());
  EXPECT_NE(eight.status().message().find("--ntasks-per-node 1"), std::string::npos);
  auto one = ResolveNodeWorld({}, Env({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"}}));
  ASSERT_TRUE(one.ok());
  EXPECT_EQ(one->nodes, 1);
}

TEST(NodeWorld, HostLists) {
  const std::vector<std::pair<std::string, std::vector<std::string>>> cases = {
      {"node[01-03,7]", {"node01", "node02", "node03", "node7"}},
      {"a", {"a"}},
      {"a,b[1-2]", {"a", "b1", "b2"}},
      {"r[1-2]-n[08-09]", {"r1-n08", "r1-n09", "r2-n08", "r2-n09"}},
      {"gpu[098-101]", {"gpu098", "gpu099", "gpu100", "gpu101"}},
  };
  for (const auto& [list, want] : cases) {
    auto got = ExpandHostList(list);
    ASSERT_TRUE(got.ok()) << list << ": " << got.status().message();
    EXPECT_EQ(*got, want) << list;
  }
  for (const std::string bad : {"", "a[1-", "a]1[", "a[3-1]", "a[x]", "a,,b", "a,"}) {
    auto got = ExpandHostList(bad);
    EXPECT_FALSE(got.ok()) << bad;
  }
}

}  // namespace
}  // namespace rp::launch

namespace rp::launch {
namespace {

TEST(HostGpus, TheSmallestVisibleGpuInGib) {
  const std::string smi = "81559\n143771\n81559\n40960\n";
  EXPECT_DOUBLE_EQ(SmallestGpuMemoryGib(smi, std::nullopt), 40.0);
  EXPECT_DOUBLE_EQ(SmallestGpuMemoryGib(smi, std::string("1")), 143771 / 1024.0);
  EXPECT_DOUBLE_EQ(SmallestGpuMemoryGib(smi, std::string("1,2")), 81559 / 1024.0);
  // Indices past the list are ignored; UUIDs are not mapped, so every GPU counts.
  EXPECT_DOUBLE_EQ(SmallestGpuMemoryGib(smi, std::string("1,9")), 143771 / 1024.0);
  EXPECT_DOUBLE_EQ(SmallestGpuMemoryGib(smi, std::string("GPU-5e1f0c2a,1")), 40.0);
  EXPECT_DOUBLE_EQ(SmallestGpuMemoryGib("", std::nullopt), 0.0);
  EXPECT_DOUBLE_EQ(SmallestGpuMemoryGib("No devices were found\n", std::nullopt), 0.0);
  EXPECT_DOUBLE_EQ(SmallestGpuMemoryGib("[N/A]\n81559\n", std::nullopt), 81559 / 1024.0);
}

}  // namespace
}  // namespace rp::launch
