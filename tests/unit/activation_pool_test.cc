// SPDX-License-Identifier: Apache-2.0
// Activation pools between two real worker processes, through the Device seam: a producer
// creates its pool, stores tensors into it and announces the handle; a consumer opens it, checks
// the bytes, stores its answer into its own pool; the producer opens that one and checks the
// answer. The processes are this test binary started again in a child role (a process that has
// used CUDA cannot fork, so they are spawned, not forked).
// No std::filesystem here (nor the test harness, which uses it): the GPU host's LibTorch exports
// its own copy of libstdc++'s std::filesystem (142 symbols in libtorch_cpu.so), and with it this
// binary's parent crashed (SIGSEGV) before any child ran. Plain POSIX calls instead.
//
// Built twice: rp_pool_tests (label unit) runs the CPU backend, whose pools are named
// shared-memory objects; rp_gpu_pool_tests (label gpu, RP_POOL_TEST_CUDA) the CUDA backend,
// whose pools are device memory exported with CUDA IPC, both processes on GPU 0.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <fstream>
#include <sstream>
#include <thread>
#include <vector>

#include "gpu_worker/device.h"
#include "shm/layout.h"

extern char** environ;

#ifndef RP_POOL_TEST_CUDA
#define RP_POOL_TEST_CUDA 0
#endif
// Distinct test names per build: CTest applies properties (labels) by name across binaries.
#if RP_POOL_TEST_CUDA
#define RP_POOL_CHILD CudaPoolChild
#define RP_POOL_SUITE CudaActivationPool
#else
#define RP_POOL_CHILD CpuPoolChild
#define RP_POOL_SUITE CpuActivationPool
#endif
#define RP_STR2(x) #x
#define RP_STR(x) RP_STR2(x)

namespace rp {
namespace {

bool Exists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0;
}

// This test's pool segments in /dev/shm (named after the parent's pid, PoolName below): other
// tests running at the same time create and remove segments of their own.
std::vector<std::string> OurSegments() {
  const std::string mine = "pooltest" + std::to_string(::getpid()) + "-pool";
  std::vector<std::string> out;
  if (DIR* d = ::opendir("/dev/shm")) {
    while (dirent* e = ::readdir(d))
      if (std::strncmp(e->d_name, "rp-", 3) == 0 && std::strstr(e->d_name, mine.c_str()) != nullptr)
        out.emplace_back(e->d_name);
    ::closedir(d);
  }
  std::sort(out.begin(), out.end());
  return out;
}

// One child process: this binary with `args`, extra environment `env`, output to `log`.
struct Child {
  pid_t pid = -1;
  std::string log;
  int code = -1;  // exit status, 128 + signal, or -1 when killed at the deadline
};

Child Spawn(const std::vector<std::string>& args, const std::vector<std::string>& env,
            const std::string& log) {
  Child c;
  c.log = log;
  std::vector<std::string> env_store;
  for (char** e = environ; *e; ++e) env_store.emplace_back(*e);
  env_store.insert(env_store.end(), env.begin(), env.end());
  std::vector<char*> argv, envp;
  for (auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  for (auto& e : env_store) envp.push_back(const_cast<char*>(e.c_str()));
  envp.push_back(nullptr);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  posix_spawn_file_actions_adddup2(&fa, 1, 2);
  if (::posix_spawn(&c.pid, args[0].c_str(), &fa, nullptr, argv.data(), envp.data()) != 0)
    c.pid = -1;
  posix_spawn_file_actions_destroy(&fa);
  return c;
}

void Reap(Child* c, double seconds) {
  if (c->pid <= 0) return;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  int st = 0;
  while (::waitpid(c->pid, &st, WNOHANG) == 0) {
    if (std::chrono::steady_clock::now() > deadline) {
      ::kill(c->pid, SIGKILL);
      ::waitpid(c->pid, &st, 0);
      c->code = -1;
      return;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  c->code = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

std::string Slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

constexpr uint64_t kPoolBytes = 8ull << 20;
constexpr uint64_t kLayoutHash = 0x5eed;
constexpr int64_t kElems = 300001;          // odd: no accidental alignment
constexpr uint64_t kProducerOffset = 4096;  // not the pool's start
constexpr uint64_t kAnswerOffset = 3ull << 20;

const char* Role() { return std::getenv("RP_POOL_TEST_ROLE"); }
std::string Dir() {
  const char* d = std::getenv("RP_POOL_TEST_DIR");
  return d ? d : "/nonexistent";
}

// The pattern the producer stores: distinct, exactly representable values in fp32 and bf16.
at::Tensor Pattern(const at::TensorOptions& o) {
  return (at::arange(kElems, o.dtype(at::kFloat)).remainder(251) - 125).mul(0.25);
}

bool WaitForFile(const std::string& path, double seconds) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (!Exists(path)) {
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
  std::rename((path + ".tmp").c_str(), path.c_str());
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

std::string PoolName(int rank) {
  return shm::PoolSegmentName("pooltest" + std::to_string(::getppid()), rank);
}

// Child roles: run only when the parent test starts this binary with RP_POOL_TEST_ROLE.
TEST(RP_POOL_CHILD, Producer) {
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
  ASSERT_TRUE(
      b.device->OpenPeerPool(1, ReadHandle(Dir() + "/consumer.handle"), kPoolBytes, kLayoutHash)
          .ok());
  at::Tensor answer = b.device->FetchFromPool(1, kAnswerOffset, {kElems}, at::kFloat).cpu();
  EXPECT_TRUE(answer.equal(Pattern(at::TensorOptions()) * 3)) << "the consumer's answer differs";
  std::ofstream(Dir() + "/done") << "ok";
}

TEST(RP_POOL_CHILD, Consumer) {
  if (!Role() || std::string(Role()) != "consumer") GTEST_SKIP() << "child role only";
  Backend b = MakeBackend();
  ASSERT_TRUE(b.device);
  auto h = b.device->CreatePool(1, kPoolBytes, kLayoutHash, PoolName(1));
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  ASSERT_TRUE(WaitForFile(Dir() + "/producer.handle", 60)) << "no handle from the producer";
  // A pool announced with another size is refused before anything maps it.
  EXPECT_FALSE(
      b.device->OpenPeerPool(0, ReadHandle(Dir() + "/producer.handle"), kPoolBytes / 2, kLayoutHash)
          .ok());
  Status opened =
      b.device->OpenPeerPool(0, ReadHandle(Dir() + "/producer.handle"), kPoolBytes, kLayoutHash);
  ASSERT_TRUE(opened.ok()) << opened.ToString();
  at::Tensor f32 = b.device->FetchFromPool(0, kProducerOffset, {kElems}, at::kFloat);
  at::Tensor bf16 =
      b.device->FetchFromPool(0, kProducerOffset + kElems * 4, {kElems}, at::kBFloat16);
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

TEST(RP_POOL_SUITE, RoundTripBetweenTwoWorkerProcesses) {
  if (Role()) GTEST_SKIP() << "parent only";
  if (RP_POOL_TEST_CUDA && !Exists("/dev/nvidiactl") && !Exists("/dev/nvidia0"))
    GTEST_SKIP() << "no NVIDIA device";
  const auto before = OurSegments();
  char tmpl[] = "/tmp/rp-pool-XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  char self[4096];
  const ssize_t n = ::readlink("/proc/self/exe", self, sizeof(self) - 1);
  ASSERT_GT(n, 0);
  self[n] = '\0';
  auto child = [&](const char* role, const char* test) {
    return Spawn({self, std::string("--gtest_filter=" RP_STR(RP_POOL_CHILD) ".") + test},
                 {std::string("RP_POOL_TEST_ROLE=") + role, "RP_POOL_TEST_DIR=" + dir},
                 dir + "/" + role + ".log");
  };
  Child producer = child("producer", "Producer");
  Child consumer = child("consumer", "Consumer");
  ASSERT_GT(producer.pid, 0);
  ASSERT_GT(consumer.pid, 0);
  Reap(&consumer, 120);
  Reap(&producer, 120);
  const std::string c = Slurp(consumer.log), p = Slurp(producer.log);
  EXPECT_EQ(consumer.code, 0) << c;
  EXPECT_EQ(producer.code, 0) << p;
  EXPECT_NE(c.find("[  PASSED  ] 1 test"), std::string::npos) << c;  // ran, not skipped
  EXPECT_NE(p.find("[  PASSED  ] 1 test"), std::string::npos) << p;
  EXPECT_EQ(p.find("SKIPPED"), std::string::npos) << p;
  EXPECT_TRUE(Exists(dir + "/done"));
  // Each process unlinked its CPU pool on exit.
  EXPECT_EQ(OurSegments(), before);
  for (const char* f :
       {"/producer.log", "/consumer.log", "/producer.handle", "/consumer.handle", "/done"})
    ::unlink((dir + f).c_str());
  ::rmdir(dir.c_str());
}

}  // namespace
}  // namespace rp
