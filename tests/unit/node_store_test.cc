// SPDX-License-Identifier: Apache-2.0
// The node store's seal: values only the run's processes can write, keys only they can name, and
// the run's secret as each rp-launch resolves it.
#include <sys/stat.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>

#include "launcher/run_secret.h"
#include "nodes/node_store.h"
#include "nodes/store_seal.h"
#include "rp_config.h"
#include "tests/testing/process_harness.h"
#if RP_WITH_C10D
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "nodes/sealed_store.h"
#endif

namespace rp::nodes {
namespace {

namespace fs = std::filesystem;

TEST(StoreSeal, OpensWhatItSealedAndNothingElse) {
  const StoreSeal seal("a secret of this run"), other("another run's secret");
  const std::string key = seal.Key("rp/plan/0");
  const std::string sealed = seal.Seal(key, "plan text");
  auto opened = seal.Open(key, sealed);
  ASSERT_TRUE(opened.ok()) << opened.status().message();
  EXPECT_EQ(*opened, "plan text");
  EXPECT_EQ(*seal.Open(key, seal.Seal(key, "")), "");

  std::string altered = sealed;
  altered[0] ^= 1;
  std::string retagged = sealed;
  retagged.back() ^= 1;
  for (const auto& [what, bad] : std::map<std::string, StatusOr<std::string>>{
           {"an altered value", seal.Open(key, altered)},
           {"an altered tag", seal.Open(key, retagged)},
           {"a value moved from another key",
            seal.Open(key, seal.Seal(seal.Key("rp/plan/1"), "plan text"))},
           {"a value sealed with another secret", seal.Open(key, other.Seal(key, "plan text"))},
           {"a value written without a seal", seal.Open(key, "plan text")},
           {"a value shorter than a tag", seal.Open(key, "x")}}) {
    ASSERT_FALSE(bad.ok()) << what;
    EXPECT_EQ(bad.status().code(), StatusCode::kProtocolError) << what;
    EXPECT_NE(bad.status().message().find("fails authentication"), std::string::npos) << what;
    EXPECT_NE(bad.status().message().find(key), std::string::npos) << what;
  }
}

TEST(StoreSeal, ThePrefixDependsOnTheSecretAlone) {
  EXPECT_EQ(StoreSeal("one secret").prefix(), StoreSeal("one secret").prefix());
  EXPECT_NE(StoreSeal("one secret").prefix(), StoreSeal("two secret").prefix());
  EXPECT_EQ(StoreSeal("one secret").prefix().size(), 3u + 16u + 1u);
  // The prefix is no part of the secret's bytes.
  EXPECT_EQ(StoreSeal("0123456789abcdef").prefix().find("0123456789abcdef"), std::string::npos);
}

#if RP_WITH_C10D
// A client of the same port that knows no secret: what anyone on the network can be.
c10::intrusive_ptr<c10d::TCPStore> Rogue(int port) {
  c10d::TCPStoreOptions o;
  o.port = static_cast<uint16_t>(port);
  o.isServer = false;
  o.waitWorkers = false;
  o.timeout = std::chrono::milliseconds(5000);
  return c10::make_intrusive<c10d::TCPStore>("127.0.0.1", o);
}

std::vector<uint8_t> Bytes(const std::string& s) { return {s.begin(), s.end()}; }

TEST(NodeStore, AValueWrittenWithoutTheSecretIsRefusedNamingTampering) {
  const int port = testing::FreePort();
  const StoreSeal seal("the run's secret, 16+");
  auto host = NodeStore::Host("127.0.0.1", port, 10.0, seal);
  ASSERT_TRUE(host.ok()) << host.status().message();
  auto node1 = NodeStore::Connect("127.0.0.1", port, 10.0, seal);
  ASSERT_TRUE(node1.ok()) << node1.status().message();
  ASSERT_TRUE((*node1)->Set("rp/end/1", "0 ").ok());
  // c10d's set does not wait for the store: another client sees it once the store has it.
  ASSERT_TRUE((*host)->Wait({"rp/end/1"}).ok());
  auto got = (*host)->TryGet("rp/end/1");
  ASSERT_TRUE(got.ok() && got->has_value()) << got.status().message();
  EXPECT_EQ(**got, "0 ");

  // Another secret names other keys: its values are not this run's, and it sees none of them.
  auto stranger = NodeStore::Connect("127.0.0.1", port, 10.0, StoreSeal("someone else's secret"));
  ASSERT_TRUE(stranger.ok());
  ASSERT_TRUE((*stranger)->Set("rp/end/0", "1 forged failure").ok());
  EXPECT_FALSE(*(*host)->TryGet("rp/end/0"));
  EXPECT_FALSE(*(*stranger)->TryGet("rp/end/1"));

  // A client that learned the key's name (c10d can list keys) overwrites its value.
  auto rogue = Rogue(port);
  rogue->set(seal.Key("rp/end/1"), Bytes("1 forged failure"));
  (void)rogue->get(seal.Key("rp/end/1"));  // answered once the store has the set before it
  auto forged = (*host)->TryGet("rp/end/1");
  ASSERT_FALSE(forged.ok());
  EXPECT_EQ(forged.status().code(), StatusCode::kProtocolError);
  EXPECT_NE(forged.status().message().find("fails authentication"), std::string::npos)
      << forged.status().message();
  EXPECT_NE(forged.status().message().find("rp/end/1"), std::string::npos)
      << forged.status().message();
}

TEST(SealedStore, GlooAndNcclRendezvousValuesAreSealedToo) {
  const int port = testing::FreePort();
  const StoreSeal seal("the run's secret, 16+");
  auto host = NodeStore::Host("127.0.0.1", port, 10.0, seal);
  ASSERT_TRUE(host.ok()) << host.status().message();
  auto sealed = c10::make_intrusive<SealedStore>(Rogue(port), seal);
  sealed->set("rank_0", Bytes("10.0.0.1:4242"));
  EXPECT_EQ(sealed->get("rank_0"), Bytes("10.0.0.1:4242"));
  EXPECT_TRUE(sealed->check({"rank_0"}));
  EXPECT_EQ(sealed->add("count", 2), 2);

  auto rogue = Rogue(port);
  // Stored under the prefix, sealed: the plain name holds nothing.
  EXPECT_FALSE(rogue->check({"rank_0"}));
  EXPECT_NE(rogue->get(seal.Key("rank_0")), Bytes("10.0.0.1:4242"));
  // An address swapped for the rogue's own fails the join instead of connecting to it.
  rogue->set(seal.Key("rank_0"), Bytes("10.6.6.6:4242"));
  (void)rogue->get(seal.Key("rank_0"));
  try {
    (void)sealed->get("rank_0");
    ADD_FAILURE() << "a forged rendezvous value was accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("fails authentication"), std::string::npos) << e.what();
  }
}
#endif

}  // namespace
}  // namespace rp::nodes

namespace rp::launch {
namespace {

namespace fs = std::filesystem;

EnvLookup Env(std::map<std::string, std::string> vars) {
  return [vars](const std::string& name) -> std::optional<std::string> {
    auto it = vars.find(name);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  };
}

class RunSecretTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("rp-secret-" + std::to_string(::getpid()));
    fs::remove_all(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path dir_;
};

TEST_F(RunSecretTest, TheUsersSecretComesFirstAndMustBeLongEnough) {
  auto given = ResolveRunSecret(dir_.string(), Env({{"RP_NODE_SECRET", "sixteen chars ok"}}));
  ASSERT_TRUE(given.ok()) << given.status().message();
  EXPECT_EQ(given->value, "sixteen chars ok");
  EXPECT_TRUE(given->from_env);
  EXPECT_FALSE(fs::exists(dir_ / kNodeSecretFile));
  auto shorter = ResolveRunSecret(dir_.string(), Env({{"RP_NODE_SECRET", "too short"}}));
  ASSERT_FALSE(shorter.ok());
  EXPECT_EQ(shorter.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(shorter.status().message().find("RP_NODE_SECRET"), std::string::npos);
}

TEST_F(RunSecretTest, NodesSharingTheOutputDirectoryAgreeAndEachAllocationDiffers) {
  auto first = ResolveRunSecret(dir_.string(), Env({}));
  ASSERT_TRUE(first.ok()) << first.status().message();
  EXPECT_FALSE(first->from_env);
  struct stat st {};
  ASSERT_EQ(::stat((dir_ / kNodeSecretFile).c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  auto second = ResolveRunSecret(dir_.string(), Env({}));
  ASSERT_TRUE(second.ok());
  EXPECT_EQ(first->value, second->value);  // the file is made once
  auto job7 = ResolveRunSecret(dir_.string(), Env({{"SLURM_JOB_ID", "7"}}));
  auto job8 = ResolveRunSecret(dir_.string(), Env({{"SLURM_JOB_ID", "8"}}));
  ASSERT_TRUE(job7.ok() && job8.ok());
  EXPECT_NE(job7->value, first->value);
  EXPECT_NE(job7->value, job8->value);
  EXPECT_NE(job7->source.find("SLURM_JOB_ID"), std::string::npos);
  // A fresh directory is a fresh secret.
  auto elsewhere = ResolveRunSecret((dir_ / "other").string(), Env({}));
  ASSERT_TRUE(elsewhere.ok());
  EXPECT_NE(elsewhere->value, first->value);
}

TEST_F(RunSecretTest, AFileThatIsNoSecretIsRefusedNamingIt) {
  fs::create_directories(dir_);
  const fs::path file = dir_ / kNodeSecretFile;
  auto refused = [&](const std::string& what) {
    auto bad = ResolveRunSecret(dir_.string(), Env({}));
    ASSERT_FALSE(bad.ok()) << what;
    EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument) << what;
    EXPECT_NE(bad.status().message().find(file.string()), std::string::npos)
        << what << ": " << bad.status().message();
  };
  std::ofstream(file) << "not hex\n";
  fs::permissions(file, fs::perms::owner_read | fs::perms::owner_write);
  refused("not hex");
  // A good secret that others may read is no secret.
  std::ofstream(file) << std::string(64, 'a') << "\n";
  fs::permissions(file, fs::perms::owner_read | fs::perms::owner_write | fs::perms::group_read |
                            fs::perms::others_read);
  refused("readable by others");
  // A link planted where the file goes, to a file whose contents someone else chose.
  fs::remove(file);
  const fs::path chosen = dir_ / "chosen";
  std::ofstream(chosen) << std::string(64, 'b') << "\n";
  fs::permissions(chosen, fs::perms::owner_read | fs::perms::owner_write);
  fs::create_symlink(chosen, file);
  refused("a symbolic link");
}

}  // namespace
}  // namespace rp::launch
