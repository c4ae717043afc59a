// SPDX-License-Identifier: Apache-2.0
// CPU backend: host copies stand in for DMA, so the worker runs the same code path as on a GPU.
#include "rp_config.h"
#include "common/logging.h"
#include "common/test_hooks.h"
#include "optim/optimizer_step.h"
#include "gpu_worker/device.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <optional>
#include <stdexcept>
#include <vector>

#include "shm/segment.h"

namespace rp::worker {
namespace {

at::Tensor View(const void* p, at::IntArrayRef shape, at::ScalarType dtype) {
  return at::from_blob(const_cast<void*>(p), shape, at::TensorOptions().dtype(dtype));
}

class CpuDevice final : public Device {
 public:
  std::string Describe() const override { return "cpu"; }
  at::Device torch_device() const override { return at::Device(at::kCPU); }

  // Copies, not views: a job's weights must not change under it if the optimizer rewrites the
  // compute copy, and a consumer's input must not change if its slot is refilled.
  at::Tensor EmptyWeights(at::IntArrayRef shape, at::ScalarType dtype) override {
    return at::empty(shape, at::TensorOptions().dtype(dtype));
  }
  void CopyWeights(const at::Tensor& dst, const void* src, at::ScalarType stored) override {
    at::Tensor d = dst;
    d.copy_(View(src, dst.sizes(), stored));  // converts when the dtypes differ
  }
  at::Tensor MapWeights(const void* src, at::IntArrayRef shape, at::ScalarType stored) override {
    return View(src, shape, stored);
  }
  uint64_t WeightsFence() override { return 0; }
  void WaitWeights(uint64_t) override {}
  at::Tensor FetchActivation(const void* src, at::IntArrayRef shape,
                             at::ScalarType dtype) override {
    return View(src, shape, dtype).clone();
  }
  void Store(const at::Tensor& t, void* dst, at::ScalarType dtype) override {
    View(dst, t.sizes(), dtype).copy_(t.detach());
  }
  void Synchronize() override {}
  // Every CPU operation is complete when it returns; a test hook may report it later.
  uint64_t CompletionFence() override {
    if (late_s_ > 0.0) fenced_at_.push_back(std::chrono::steady_clock::now());
    if (++completions_ == 20 && TestDeviceHangOnce()) {
      RP_LOG(WARNING) << "RP_TEST_DEVICE_HANG_ONCE: the device stops completing work on purpose";
      hang_from_ = completions_;
    }
    return completions_;
  }
  bool Completed(uint64_t ticket) override {
    if (hang_from_ > 0 && ticket >= hang_from_) return false;
    if (late_s_ <= 0.0) return true;
    const auto at = fenced_at_.at(ticket - 1);
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - at).count() >= late_s_;
  }

  // The pool is a named shared-memory object: the CPU's stand-in for exported device memory, so
  // CI runs the same protocol the CUDA backend does. This worker unlinks its own on exit (the
  // launcher is the backstop); peers' mappings stay valid until they unmap.
  StatusOr<PoolHandle> CreatePool(int rank, uint64_t bytes, uint64_t layout_hash,
                                  const std::string& name) override {
    PoolHandle h{};
    if (name.size() >= h.size())
      return Status::InvalidArgument("activation pool name too long: " + name);
    if (pools_.count(rank))
      return Status::Internal("activation pool of rank " + std::to_string(rank) + " exists");
    RP_RETURN_IF_ERROR(shm::CheckSharedMemoryRoom(
        shm::kHeaderBytes + bytes, "worker " + std::to_string(rank) + "'s activation pool"));
    // The name is ours to remove only once we made it (create fails on an existing name).
    RP_ASSIGN_OR_RETURN(auto seg,
                        shm::Segment::CreateStamped(name, shm::kHeaderBytes + bytes, layout_hash));
    own_unlinker_.emplace(name);
    pools_.emplace(rank, Pool{std::move(seg), bytes});
    own_rank_ = rank;
    std::memcpy(h.data(), name.c_str(), name.size() + 1);
    return h;
  }
  Status OpenPeerPool(int rank, const PoolHandle& handle, uint64_t bytes,
                      uint64_t layout_hash) override {
    if (std::memchr(handle.data(), '\0', handle.size()) == nullptr)
      return Status::ProtocolError("activation pool of worker " + std::to_string(rank) +
                                   ": the handle is not a name");
    if (pools_.count(rank))
      return Status::ProtocolError("activation pool of worker " + std::to_string(rank) +
                                   " announced twice");
    RP_ASSIGN_OR_RETURN(auto seg, shm::Segment::Open(handle.data(), layout_hash));
    if (seg.size() != shm::kHeaderBytes + bytes)
      return Status::ProtocolError("activation pool " + seg.name() + " holds " +
                                   std::to_string(seg.size()) + " bytes, expected " +
                                   std::to_string(shm::kHeaderBytes + bytes));
    pools_.emplace(rank, Pool{std::move(seg), bytes});
    return Status::Ok();
  }
  uint64_t StartChunkSquares(std::vector<SquaresItem> items, int64_t chunk) override {
    // With the late-completion hook the sums land in `out` only when SquaresDone says so, as a
    // GPU's copy would, so a reader that does not wait for them sees stale values.
    LateSquares late;
    for (const auto& it : items) {
      const at::Tensor flat = it.grad.contiguous().view({-1});
      const float* p = flat.data_ptr<float>();
      const int64_t n = flat.numel();
      std::vector<double> sums;
      for (int64_t b = 0; b < n; b += chunk)
        sums.push_back(coord::SquaredSum(p + b, std::min(chunk, n - b)));
      if (late_s_ > 0.0) late.outs.emplace_back(it.out, std::move(sums));
      else std::copy(sums.begin(), sums.end(), it.out);
    }
    if (late_s_ > 0.0) {
      late.started = std::chrono::steady_clock::now();
      late_squares_.emplace(tickets_ + 1, std::move(late));
    }
    return ++tickets_;
  }
  bool SquaresDone(uint64_t ticket) override {
    auto it = late_squares_.find(ticket);
    if (it == late_squares_.end()) return true;
    if (std::chrono::duration<double>(std::chrono::steady_clock::now() - it->second.started)
            .count() < late_s_)
      return false;
    for (const auto& [out, sums] : it->second.outs) std::copy(sums.begin(), sums.end(), out);
    late_squares_.erase(it);
    return true;
  }
  at::Tensor FetchFromPool(int rank, uint64_t offset, at::IntArrayRef shape,
                           at::ScalarType dtype) override {
    uint64_t bytes = c10::elementSize(dtype);
    for (int64_t d : shape) bytes *= static_cast<uint64_t>(d);
    return View(PoolBytes(rank, offset, bytes), shape, dtype).clone();
  }
  void StoreToPool(const at::Tensor& t, uint64_t offset, at::ScalarType dtype) override {
    const uint64_t bytes = static_cast<uint64_t>(t.numel()) * c10::elementSize(dtype);
    View(PoolBytes(own_rank_, offset, bytes), t.sizes(), dtype).copy_(t.detach());
  }
  uint64_t StartCommit(std::vector<CommitItem> items, bool accumulate) override {
    for (auto& it : items) {
      at::Tensor out = View(it.dst, it.grad.sizes(), at::kFloat);
      if (accumulate) out.add_(it.grad.detach());
      else out.copy_(it.grad.detach());
    }
    return ++tickets_;
  }
  bool CommitDone(uint64_t) override { return true; }

  int Mark() override {
    marks_.push_back(std::chrono::steady_clock::now());
    return static_cast<int>(marks_.size()) - 1;
  }
  double MarkSeconds(int a, int b) override {
    return std::chrono::duration<double>(marks_.at(b) - marks_.at(a)).count();
  }
  void ClearMarks() override { marks_.clear(); }

  Status PinReadOnly(const void*, uint64_t) override { return Status::Ok(); }
  // The coordinator's own loop (coord::AdamWUpdate), so the bits are its bits by construction.
  void AdamWComputeCopy(const coord::AdamWHyper& h, float grad_scale, const at::Tensor& grad,
                        const at::Tensor& master, const at::Tensor& m, const at::Tensor& v,
                        const at::Tensor& out) override {
    const coord::ComputeDtype dtype = out.scalar_type() == at::kBFloat16
                                          ? coord::ComputeDtype::kBFloat16
                                          : coord::ComputeDtype::kFloat32;
    // With a compute copy apart from the master, kFetched writes only the copy: master, m and v
    // are read, never written.
    coord::AdamWUpdate(h, grad_scale, grad.data_ptr<float>(), master.data_ptr<float>(),
                       m.data_ptr<float>(), v.data_ptr<float>(), out.numel(), out.data_ptr(), dtype,
                       coord::UpdateWrites::kFetched);
  }

  // A CPU worker's "transfers" are the copies FetchWeights/FetchActivation/Store make.
  StatusOr<LinkRates> ProbeLink(const void* src, uint64_t bytes) override {
    std::vector<char> a(bytes), b(bytes);
    LinkRates r;
    for (int rep = 0; rep < 3; ++rep) {  // the best of three: the first touches fresh pages
      auto t0 = std::chrono::steady_clock::now();
      std::memcpy(a.data(), src, bytes);
      auto t1 = std::chrono::steady_clock::now();
      std::memcpy(b.data(), a.data(), bytes);
      auto t2 = std::chrono::steady_clock::now();
      r.h2d_bytes_per_s =
          std::max(r.h2d_bytes_per_s, bytes / std::chrono::duration<double>(t1 - t0).count());
      r.d2h_bytes_per_s =
          std::max(r.d2h_bytes_per_s, bytes / std::chrono::duration<double>(t2 - t1).count());
    }
    return r;
  }

 private:
  struct Pool {
    shm::Segment segment;
    uint64_t bytes;
  };
  uint8_t* PoolBytes(int rank, uint64_t offset, uint64_t bytes) {
    auto it = pools_.find(rank);
    if (it == pools_.end())
      throw std::runtime_error("no activation pool of worker " + std::to_string(rank) +
                               " is open here");
    if (bytes > it->second.bytes || offset > it->second.bytes - bytes)
      throw std::runtime_error("activation pool of worker " + std::to_string(rank) + ": " +
                               std::to_string(bytes) + " bytes at offset " +
                               std::to_string(offset) + " do not fit its " +
                               std::to_string(it->second.bytes));
    return it->second.segment.data() + shm::kHeaderBytes + offset;
  }
  std::optional<shm::Unlinker> own_unlinker_;  // before pools_: the name goes after the mapping
  std::map<int, Pool> pools_;
  int own_rank_ = -1;
  uint64_t tickets_ = 0;
  uint64_t completions_ = 0;
  const double late_s_ = TestLateCompletionSeconds();
  struct LateSquares {
    std::chrono::steady_clock::time_point started;
    std::vector<std::pair<double*, std::vector<double>>> outs;
  };
  std::map<uint64_t, LateSquares> late_squares_;  // RP_TEST_LATE_COMPLETION_MS only
  uint64_t hang_from_ = 0;  // RP_TEST_DEVICE_HANG_ONCE: no ticket from this one on completes
  std::vector<std::chrono::steady_clock::time_point> fenced_at_;  // per ticket, with the hook only
  std::vector<std::chrono::steady_clock::time_point> marks_;
};

}  // namespace

std::unique_ptr<Device> MakeCpuDevice() { return std::make_unique<CpuDevice>(); }

#if !RP_WITH_CUDA
int CudaDeviceCount() { return 0; }
StatusOr<std::unique_ptr<Device>> MakeCudaDevice(int, void*, uint64_t, uint64_t) {
  return Status::InvalidArgument(
      "job.device: \"cuda\" requested, but this build has no CUDA "
      "backend (configure against a CUDA LibTorch with the CUDA toolkit)");
}
bool NcclAvailable() { return false; }
StatusOr<std::unique_ptr<nodes::NodeReduction>> JoinNcclGroup(const nodes::NodeGroup&, int,
                                                              const std::string&, int) {
  return Status::InvalidArgument(
      "several nodes with CUDA workers need NCCL, and this build has no CUDA backend");
}
#endif

}  // namespace rp::worker
