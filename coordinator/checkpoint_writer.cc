// SPDX-License-Identifier: Apache-2.0
#include "coordinator/checkpoint_writer.h"

#include <algorithm>
#include <cstring>

#include "common/logging.h"
#include "common/test_hooks.h"
#include "common/time_util.h"
#include "shm/segment.h"

namespace rp::coord {
namespace {

constexpr uint64_t kBlock = 64ull << 20;

// RP_TEST_SLOW_CHECKPOINT_MS: a slower disk, counted in the write's time like a real one.
void SlowDiskForTest(WriteStats* w) {
  if (const double slow = TestCheckpointDelaySeconds(); slow > 0) {
    std::this_thread::sleep_for(std::chrono::duration<double>(slow));
    w->total_s += slow;
  }
}

void LogWrite(int64_t steps_done, const std::string& dir, const WriteStats& w,
              const std::string& how) {
  RP_LOG(INFO) << "checkpoint after step " << steps_done << " written to " << dir << ": "
               << static_cast<double>(w.bytes) / 1e9 << " GB in " << w.total_s << " s ("
               << static_cast<double>(w.bytes) / 1e9 / std::max(w.total_s, 1e-9)
               << " GB/s; checksums " << w.checksum_s << " s), " << how;
}

}  // namespace

CheckpointWriter::CheckpointWriter(Setup setup, std::vector<StateSection> live,
                                   AsyncOptimizer& optimizer, int64_t written)
    : setup_(std::move(setup)), live_(std::move(live)), optimizer_(optimizer), written_(written) {
  for (const auto& s : live_) bytes_ += s.bytes;
  // Whole copies where they fit the budget, by default the host's available memory with a quarter
  // to spare (the page cache the file writes fill comes out of the same memory).
  const uint64_t avail = shm::AvailableHostMemory();
  const bool fixed = setup_.memory_bytes >= 0;
  const uint64_t budget = static_cast<uint64_t>(std::max<int64_t>(setup_.memory_bytes, 0));
  int n = 0;
  if (setup_.background && !TestCheckpointOnLoop()) {
    for (int want = 2; want > 0 && n == 0; --want)
      if (fixed ? bytes_ * want <= budget : avail > 0 && (bytes_ + bytes_ / 4) * want < avail)
        n = want;
    if (n == 0 && !setup_.params.empty()) {
      PlanPartialCopy(fixed ? budget : avail / 2);
      partial_copy_ = true;
      n = 1;
    }
  }
  copies_.resize(n);
  // Allocated and touched now, on the copy threads' count of cores, so a snapshot costs no page
  // faults; the start-up (weights, workers' registration) hides it.
  const uint64_t size = partial_copy_ ? partial_.copy_bytes : bytes_;
  for (auto& c : copies_) {
    c.bytes.reset(new uint8_t[std::max<uint64_t>(size, 1)]);
    const int threads = std::max(1, setup_.copy_threads);
    std::vector<std::thread> touch;
    for (int t = 0; t < threads; ++t)
      touch.emplace_back([p = c.bytes.get(), n = size, t, threads] {
        for (uint64_t off = static_cast<uint64_t>(t) * kBlock; off < n; off += threads * kBlock)
          std::memset(p + off, 0, std::min(kBlock, n - off));
      });
    for (auto& th : touch) th.join();
  }
  if (partial_copy_)
    RP_LOG(INFO)
        << "checkpoints: " << static_cast<double>(partial_.copy_bytes) / 1e9 << " of "
        << static_cast<double>(bytes_) / 1e9 << " GB copied ("
        << (fixed ? "checkpoint.memory_gb" : "half of the host's available memory") << "), "
        << static_cast<double>(partial_.in_place_bytes) / 1e9
        << " GB written from the live state, each parameter's next update waiting for its bytes";
}

void CheckpointWriter::PlanPartialCopy(uint64_t budget) {
  Partial& q = partial_;
  const size_t params = setup_.params.size();
  // What no parameter owns (alignment, the loss scaler's record) is always copied: the optimizer
  // holds no parameter's update for it.
  std::vector<std::vector<std::pair<uint64_t, uint64_t>>> owned(live_.size());
  for (const auto& places : setup_.params)
    for (const auto& pl : places) owned[pl.section].emplace_back(pl.offset, pl.bytes);
  std::vector<Placement> unowned;
  for (size_t sec = 0; sec < live_.size(); ++sec) {
    std::sort(owned[sec].begin(), owned[sec].end());
    uint64_t at = 0;
    for (const auto& [offset, bytes] : owned[sec]) {
      if (offset > at) unowned.push_back({static_cast<int>(sec), at, offset - at});
      at = std::max(at, offset + bytes);
    }
    if (live_[sec].bytes > at)
      unowned.push_back({static_cast<int>(sec), at, live_[sec].bytes - at});
  }
  uint64_t used = 0;
  auto copy = [&](const Placement& pl) {
    q.copied.push_back({pl.section, pl.offset, used, pl.bytes});
    used += pl.bytes;
  };
  for (const auto& pl : unowned) copy(pl);
  // The parameters updated first are copied while they fit (a larger one is skipped, not the end
  // of the copy): the later a parameter's update, the longer its in-place write has.
  q.in_place.assign(params, 1);
  for (int p : setup_.update_order) {
    uint64_t bytes = 0;
    for (const auto& pl : setup_.params[p]) bytes += pl.bytes;
    if (used + bytes > budget) continue;
    q.in_place[p] = 0;
    for (const auto& pl : setup_.params[p]) copy(pl);
  }
  q.copy_bytes = used;
  // The file: the in-place parameters first, in update order (each one's extents form its group),
  // then what was copied.
  for (int p : setup_.update_order)
    if (q.in_place[p])
      for (const auto& pl : setup_.params[p]) {
        q.extents.push_back({pl.section, pl.offset, pl.bytes, nullptr, p});
        q.copy_at.push_back(-1);
        q.in_place_bytes += pl.bytes;
      }
  for (const auto& r : q.copied) {
    q.extents.push_back({r.section, r.offset, r.bytes, nullptr, -1});
    q.copy_at.push_back(static_cast<int64_t>(r.at));
  }
}

CheckpointWriter::~CheckpointWriter() {
  for (auto& c : copies_) {
    for (auto& t : c.copy_threads) t.join();
    if (c.file.valid()) c.file.wait();
  }
  optimizer_.ReleaseUpdates();
}

CheckpointWriter::Copy* CheckpointWriter::FreeCopy() {
  for (auto& c : copies_)
    if (c.steps < 0) return &c;
  return nullptr;
}

CheckpointWriter::Copy* CheckpointWriter::CopyOf(int64_t steps_done) {
  for (auto& c : copies_)
    if (c.steps == steps_done) return &c;
  return nullptr;
}

void CheckpointWriter::StartCopy(Copy& c, int64_t steps_done) {
  c.steps = steps_done;
  // Step steps_done's updates wait for the copy; its last thread lets them go, all of them, or
  // with a partial copy all but the parameters written in place (their file thread's).
  optimizer_.HoldUpdatesFrom(steps_done);
  const int n = std::max(1, setup_.copy_threads);
  copy_threads_left_.store(n);
  for (int t = 0; t < n; ++t)
    c.copy_threads.emplace_back([this, dst = c.bytes.get(), t, n] {
      uint64_t block = 0;
      auto copy = [&](const uint8_t* from, uint64_t bytes, uint64_t at) {
        for (uint64_t off = 0; off < bytes; off += kBlock, ++block)
          if (block % n == static_cast<uint64_t>(t))
            std::memcpy(dst + at + off, from + off, std::min(kBlock, bytes - off));
      };
      if (partial_copy_) {
        for (const auto& r : partial_.copied) copy(live_[r.section].data + r.offset, r.bytes, r.at);
      } else {
        uint64_t base = 0;
        for (const auto& s : live_) {
          // A section of pieces is packed into the copy in order.
          ForEachPiece(s, [&](const uint8_t* from, uint64_t bytes, uint64_t at) {
            copy(from, bytes, base + at);
          });
          base += s.bytes;
        }
      }
      if (copy_threads_left_.fetch_sub(1) == 1) {
        if (partial_copy_) optimizer_.HoldOnly(partial_.in_place);
        else optimizer_.ReleaseUpdates();
      }
    });
}

void CheckpointWriter::Snapshot(int64_t steps_done) {
  if (copies_.empty() || CopyOf(steps_done)) return;
  if (Copy* c = FreeCopy()) {
    StartCopy(*c, steps_done);
    Launch(*c, steps_done);
  }
}

Status CheckpointWriter::Collect(Copy& c) {
  for (auto& t : c.copy_threads) t.join();
  c.copy_threads.clear();
  Status s = Status::Ok();
  if (c.file.valid()) {
    auto [status, w] = c.file.get();
    s = status;
    if (s.ok()) {
      written_ = std::max(written_, c.steps);
      completed_.push_back({c.steps, w.bytes, w.total_s, w.checksum_s, true});
    }
  }
  c.steps = -1;
  return s;
}

Status CheckpointWriter::Poll() {
  for (auto& c : copies_)
    if (c.file.valid() && c.file.wait_for(std::chrono::seconds(0)) == std::future_status::ready)
      RP_RETURN_IF_ERROR(Collect(c));
  return Status::Ok();
}

Status CheckpointWriter::Write(int64_t steps_done) {
  RP_RETURN_IF_ERROR(Poll());
  if (copies_.empty()) {
    WriteStats w;
    RP_RETURN_IF_ERROR(WriteTrainingState(setup_.dir, steps_done, setup_.state_hash,
                                          setup_.masters_in_state, setup_.run, live_, setup_.keep,
                                          0, &w, setup_.shard));
    SlowDiskForTest(&w);
    written_ = steps_done;
    completed_.push_back({steps_done, w.bytes, w.total_s, w.checksum_s, false});
    LogWrite(steps_done, setup_.dir, w, "on the loop");
    return Status::Ok();
  }
  Copy* c = CopyOf(steps_done);
  if (!c) {
    // No copy was taken: a final checkpoint (not periodic), or every copy was still being
    // written, and then the oldest file is waited for. The live state still holds steps_done
    // updates: the optimizer has seen nothing of the next step.
    c = FreeCopy();
    if (!c) {
      const double t0 = MonoSeconds();
      for (auto& x : copies_)
        if (!c || x.steps < c->steps) c = &x;
      RP_RETURN_IF_ERROR(Collect(*c));
      RP_LOG(WARNING) << "checkpoint after step " << steps_done << ": waited " << MonoSeconds() - t0
                      << " s for the previous checkpoint's write (the disk is slower than "
                         "checkpoint.every steps)";
    }
    StartCopy(*c, steps_done);
  }
  if (!c->file.valid()) Launch(*c, steps_done);
  return Status::Ok();
}

void CheckpointWriter::Launch(Copy& c, int64_t steps_done) {
  // The file thread finishes the copy (its threads are handed over) and writes it.
  std::vector<SectionShape> shapes;
  std::vector<SourcedExtent> extents;
  for (const auto& s : live_) shapes.push_back({s.name, s.bytes});
  if (partial_copy_) {
    extents = partial_.extents;
    for (size_t k = 0; k < extents.size(); ++k)
      extents[k].src = partial_.copy_at[k] >= 0
                           ? c.bytes.get() + partial_.copy_at[k]
                           : live_[extents[k].section].data + extents[k].offset;
  } else {
    uint64_t base = 0;
    for (size_t i = 0; i < live_.size(); ++i) {
      if (live_[i].bytes > 0)
        extents.push_back({static_cast<int>(i), 0, live_[i].bytes, c.bytes.get() + base, -1});
      base += live_[i].bytes;
    }
  }
  const bool partial = partial_copy_;
  const std::string how = partial ? "in the background, " +
                                        std::to_string(partial_.in_place_bytes >> 20) +
                                        " MiB of it from the live state"
                                  : std::string("in the background");
  // setup_ does not change after construction: the thread reads it in place.
  c.file = std::async(std::launch::async,
                      [this, shapes = std::move(shapes), extents = std::move(extents), steps_done,
                       partial, how, threads = std::move(c.copy_threads), disk = disk_]() mutable {
                        for (auto& t : threads) t.join();
                        // One file at a time: in step order, and a second writer would only share
                        // the disk.
                        std::lock_guard<std::mutex> one_at_a_time(*disk);
                        WriteStats w;
                        const Setup& setup = setup_;
                        Status s = WriteTrainingStateExtents(
                            setup.dir, steps_done, setup.state_hash, setup.masters_in_state,
                            setup.run, shapes, extents, setup.keep, setup.checksum_threads, &w,
                            setup.shard, [this](int param) { optimizer_.ReleaseParam(param); });
                        // Written or not, no update waits for this file any longer.
                        if (partial) optimizer_.ReleaseUpdates();
                        SlowDiskForTest(&w);
                        if (s.ok()) LogWrite(steps_done, setup.dir, w, how);
                        return std::make_pair(s, w);
                      });
  c.copy_threads.clear();
}

std::vector<core::StepMetrics::Checkpoint> CheckpointWriter::TakeCompleted() {
  std::vector<core::StepMetrics::Checkpoint> out;
  out.swap(completed_);
  all_.insert(all_.end(), out.begin(), out.end());
  return out;
}

Status CheckpointWriter::Finish() {
  Status first = Status::Ok();
  for (auto& c : copies_)
    if (c.steps >= 0)
      if (Status s = Collect(c); !s.ok() && first.ok()) first = s;
  return first;
}

}  // namespace rp::coord
