// SPDX-License-Identifier: Apache-2.0
// Activation pools between two real worker processes, through the Device seam: a producer
// creates its pool, stores tensors into it and announces the handle; a consumer opens it, checks
// the bytes, stores its answer into its own pool; the producer opens that one and checks the
// answer. The processes are this test binary started again in a child role (a process that has
// used CUDA cannot fork, so they are spawned, not forked).
//
// Built twice: rp_pool_tests (label unit) runs the CPU backend, whose pools are named
// shared-memory objects; rp_gpu_pool_tests (label gpu, RP_POOL_TEST_CUDA) the CUDA backend,
// whose pools are device memory exported with CUDA IPC, both processes on GPU 0.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

#include "gpu_worker/device.h"
#include "shm/layout.h"
#include "tests/testing/process_harness.h"

#ifndef RP_POOL_TEST_CUDA
#define RP_POOL_TEST_CUDA 0
#endif

namespace rp {
namespace {

namespace fs = std::filesystem;

constexpr uint64_t kPoolBytes = 8ull << 20;
constexpr uint64_t kLayoutHash = 0x5eed;
constexpr int64_t kElems = 300001;         // odd: no accidental alignment
constexpr uint64_t kProducerOffset = 4096;  // not the pool's start
constexpr uint64_t kAnswerOffset = 3ull << 20;

const char* Role() { return std::getenv("RP_POOL_TEST_ROLE"); }
std::string Dir() { return std::getenv("RP_POOL_TEST_DIR"); }

// The pattern the producer stores: distinct, exactly representable values in fp32 and bf16.
at::Tensor Pattern(const at::TensorOptions& o) {
  return (at::arange(kElems, o.dtype(at::kFloat)).remainder(251) - 125).mul(0.25);
}

bool WaitForFile(const std::string& path, double seconds) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (!fs::exists(path)) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return true;
}

// Written under a temporary name and renamed, so the reader never sees half a handle.
void WriteHandle(const std::string& path, const worker::Device::PoolHandle& h) {
  {
    std::ofstream out(path + ".tmp", std::ios::binary);
    out.write(h.data(), static_cast<std::streamsize>(h.size()));
  }
  fs::rename(path + ".tmp", path);
}

worker::Device::PoolHandle ReadHandle(const std::string& path) {
  worker::Device::PoolHandle h{};
  std::ifstream in(path, std::ios::binary);
  in.read(h.data(), static_cast<std::streamsize>(h.size()));
  return h;
}

// One process's device: the CPU backend, or CUDA device 0 with a small registered host buffer
// standing in for the state segment.
struct Backend {
  std::vector<char> host = std::vector<char>(1 << 20);
  std::unique_ptr<worker::Device> device;
};

Backend MakeBackend() {
  Backend b;
  if (RP_POOL_TEST_CUDA) {
    auto d = worker::MakeCudaDevice(0, b.host.data(), b.host.size());
    EXPECT_TRUE(d.ok()) << d.status().ToString();
    if (d.ok()) b.device = std::move(*d);
  } else {
    b.device = worker::MakeCpuDevice();
  }
  return b;
}

std::string PoolName(int rank) { return shm::PoolSegmentName("pooltest" + std::to_string(::getppid()), rank); }

// Child roles: run only when the parent test starts this binary with RP_POOL_TEST_ROLE.
TEST(PoolChild, Producer) {
  if (!Role() || std::string(Role()) != "producer") GTEST_SKIP() << "child role only";
  Backend b = MakeBackend();
  ASSERT_TRUE(b.device);
  auto h = b.device->CreatePool(0, kPoolBytes, kLayoutHash, PoolName(0));
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  const auto o = at::TensorOptions().device(b.device->torch_device());
  at::Tensor t = Pattern(o);
  b.device->StoreToPool(t, kProducerOffset, at::kFloat);
  b.device->StoreToPool(t, kProducerOffset + kElems * 4, at::kBFloat16);  // converted on the way
  b.device->Synchronize();
  WriteHandle(Dir() + "/producer.handle", *h);
  ASSERT_TRUE(WaitForFile(Dir() + "/consumer.handle", 60)) << "no answer from the consumer";
  ASSERT_TRUE(b.device->OpenPeerPool(1, ReadHandle(Dir() + "/consumer.handle"), kPoolBytes, kLayoutHash).ok());
  at::Tensor answer = b.device->FetchFromPool(1, kAnswerOffset, {kElems}, at::kFloat).cpu();
  EXPECT_TRUE(answer.equal(Pattern(at::TensorOptions()) * 3)) << "the consumer's answer differs";
  std::ofstream(Dir() + "/done") << "ok";
}

TEST(PoolChild, Consumer) {
  if (!Role() || std::string(Role()) != "consumer") GTEST_SKIP() << "child role only";
  Backend b = MakeBackend();
  ASSERT_TRUE(b.device);
  auto h = b.device->CreatePool(1, kPoolBytes, kLayoutHash, PoolName(1));
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  ASSERT_TRUE(WaitForFile(Dir() + "/producer.handle", 60)) << "no handle from the producer";
  // A pool announced with another size is refused before anything maps it.
  EXPECT_FALSE(b.device->OpenPeerPool(0, ReadHandle(Dir() + "/producer.handle"), kPoolBytes / 2, kLayoutHash).ok());
  Status opened = b.device->OpenPeerPool(0, ReadHandle(Dir() + "/producer.handle"), kPoolBytes, kLayoutHash);
  ASSERT_TRUE(opened.ok()) << opened.ToString();
  at::Tensor f32 = b.device->FetchFromPool(0, kProducerOffset, {kElems}, at::kFloat);
  at::Tensor bf16 = b.device->FetchFromPool(0, kProducerOffset + kElems * 4, {kElems}, at::kBFloat16);
  EXPECT_EQ(f32.device(), b.device->torch_device());
  EXPECT_TRUE(f32.cpu().equal(Pattern(at::TensorOptions())));
  EXPECT_TRUE(bf16.cpu().to(at::kFloat).equal(Pattern(at::TensorOptions())));
  // Reading past the pool's end throws instead of touching memory the pool does not own.
  EXPECT_ANY_THROW(b.device->FetchFromPool(0, kPoolBytes - 8, {4}, at::kFloat));
  EXPECT_ANY_THROW(b.device->FetchFromPool(7, 0, {4}, at::kFloat));  // no such peer
  b.device->StoreToPool(f32 * 3, kAnswerOffset, at::kFloat);
  b.device->Synchronize();
  WriteHandle(Dir() + "/consumer.handle", *h);
  // The producer reads the answer from this process's pool: it must stay alive until then.
  ASSERT_TRUE(WaitForFile(Dir() + "/done", 60)) << "the producer never finished";
}

TEST(ActivationPool, RoundTripBetweenTwoWorkerProcesses) {
  if (Role()) GTEST_SKIP() << "parent only";
  if (RP_POOL_TEST_CUDA && !fs::exists("/dev/nvidiactl") && !fs::exists("/dev/nvidia0"))
    GTEST_SKIP() << "no NVIDIA device";
  const auto before = testing::LeftoverSegments();
  const std::string dir = testing::MakeTempDir("rp-pool-");
  const std::string self = fs::read_symlink("/proc/self/exe").string();
  auto child = [&](const char* role, const char* test) {
    return testing::Process({self, std::string("--gtest_filter=PoolChild.") + test},
                            {std::string("RP_POOL_TEST_ROLE=") + role, "RP_POOL_TEST_DIR=" + dir});
  };
  testing::Process producer = child("producer", "Producer");
  testing::Process consumer = child("consumer", "Consumer");
  auto c = consumer.Wait(120);
  auto p = producer.Wait(120);
  EXPECT_FALSE(c.timed_out || c.signaled) << c.output;
  EXPECT_FALSE(p.timed_out || p.signaled) << p.output;
  EXPECT_EQ(c.code, 0) << c.output;
  EXPECT_EQ(p.code, 0) << p.output;
  EXPECT_NE(c.output.find("[  PASSED  ] 1 test"), std::string::npos) << c.output;  // ran, not skipped
  EXPECT_NE(p.output.find("[  PASSED  ] 1 test"), std::string::npos) << p.output;
  EXPECT_EQ(p.output.find("SKIPPED"), std::string::npos) << p.output;
  EXPECT_TRUE(fs::exists(dir + "/done"));
  // Each process unlinked its CPU pool on exit.
  EXPECT_EQ(testing::LeftoverSegments(), before);
  std::error_code ec;
  fs::remove_all(dir, ec);
}

}  // namespace
}  // namespace rp
