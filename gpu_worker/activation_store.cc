// SPDX-License-Identifier: Apache-2.0
#include "gpu_worker/activation_store.h"

#include <map>
#include <stdexcept>
#include <string>
#include <tuple>

namespace rp::worker {
namespace {

using Kind = ActivationStore::Kind;

// The shared segment's slots.
class SegmentSlots final : public ActivationStore {
 public:
  SegmentSlots(const shm::ArenaLayout& layout, const shm::Segment& segment, Device& device,
               std::vector<int64_t> shape, at::ScalarType dtype)
      : layout_(layout),
        segment_(segment),
        device_(device),
        shape_(std::move(shape)),
        dtype_(dtype) {}
  at::Tensor Read(Kind kind, int parity, int mb, int slot, int, int64_t) override {
    return device_.FetchActivation(segment_.data() + Offset(kind, parity, mb, slot), shape_,
                                   dtype_);
  }
  void Write(Kind kind, int parity, int mb, int slot, const at::Tensor& t) override {
    device_.Store(t, segment_.data() + Offset(kind, parity, mb, slot), dtype_);
  }

 private:
  uint64_t Offset(Kind kind, int parity, int mb, int slot) const {
    return kind == Kind::kHidden ? layout_.HiddenSlot(parity, mb, slot)
                                 : layout_.InputGradSlot(parity, mb, slot);
  }
  const shm::ArenaLayout& layout_;
  const shm::Segment& segment_;
  Device& device_;
  const std::vector<int64_t> shape_;
  const at::ScalarType dtype_;
};

// This worker's device memory (one worker only).
class WorkerMemory final : public ActivationStore {
 public:
  WorkerMemory(const shm::ArenaLayout& layout, at::ScalarType dtype)
      : layout_(layout), dtype_(dtype) {}
  at::Tensor Read(Kind kind, int parity, int mb, int slot, int, int64_t) override {
    const auto& slots = kind == Kind::kHidden ? hidden_ : grads_;
    const Key key = KeyOf(kind, parity, mb, slot);
    auto it = slots.find(key);
    if (it == slots.end())
      throw std::runtime_error(
          std::string(kind == Kind::kHidden ? "hidden-state" : "input-gradient") + " slot " +
          std::to_string(std::get<2>(key)) + " of microbatch " + std::to_string(mb) + " (parity " +
          std::to_string(parity) +
          ") was never written in this worker (schedule.activations = \"worker\")");
    // A new handle on the same storage: the reader may make it a leaf that requires grad.
    return it->second.detach();
  }
  void Write(Kind kind, int parity, int mb, int slot, const at::Tensor& t) override {
    (kind == Kind::kHidden ? hidden_ : grads_)[KeyOf(kind, parity, mb, slot)] =
        t.detach().to(dtype_);
  }

 private:
  using Key = std::tuple<int, int, int>;
  // Input-gradient slots repeat per microbatch as the shared segment's do.
  Key KeyOf(Kind kind, int parity, int mb, int slot) const {
    return {parity, mb, kind == Kind::kHidden ? slot : slot % layout_.grad_slots_per_mb};
  }
  const shm::ArenaLayout& layout_;
  const at::ScalarType dtype_;
  std::map<Key, at::Tensor> hidden_, grads_;
};

// The workers' activation pools.
class Pools final : public ActivationStore {
 public:
  Pools(const shm::ArenaLayout& layout, Device& device, std::vector<int64_t> shape,
        at::ScalarType dtype)
      : layout_(layout), device_(device), shape_(std::move(shape)), dtype_(dtype) {}
  at::Tensor Read(Kind kind, int parity, int mb, int slot, int from_rank, int64_t job) override {
    // A pool-held input must come with the rank holding it (InputReady); a missing one is the
    // coordinator's protocol error, reported as such rather than read from the wrong pool.
    if (from_rank < 0)
      throw std::runtime_error("InputReady for job " + std::to_string(job) + " microbatch " +
                               std::to_string(mb) + " names no pool holding its " +
                               (kind == Kind::kHidden ? "hidden state" : "input gradient"));
    return device_.FetchFromPool(from_rank, Offset(kind, parity, mb, slot), shape_, dtype_);
  }
  void Write(Kind kind, int parity, int mb, int slot, const at::Tensor& t) override {
    device_.StoreToPool(t, Offset(kind, parity, mb, slot), dtype_);
  }

 private:
  uint64_t Offset(Kind kind, int parity, int mb, int slot) const {
    return kind == Kind::kHidden ? layout_.PoolHiddenSlot(parity, mb, slot)
                                 : layout_.PoolInputGradSlot(parity, mb, slot);
  }
  const shm::ArenaLayout& layout_;
  Device& device_;
  const std::vector<int64_t> shape_;
  const at::ScalarType dtype_;
};

}  // namespace

std::unique_ptr<ActivationStore> MakeActivationStore(const shm::ArenaLayout& layout,
                                                     const shm::Segment& segment, Device& device,
                                                     std::vector<int64_t> shape,
                                                     at::ScalarType dtype) {
  if (layout.activations == core::Activations::kWorker)
    return std::make_unique<WorkerMemory>(layout, dtype);
  if (layout.activations == core::Activations::kCudaIpc)
    return std::make_unique<Pools>(layout, device, std::move(shape), dtype);
  return std::make_unique<SegmentSlots>(layout, segment, device, std::move(shape), dtype);
}

}  // namespace rp::worker
