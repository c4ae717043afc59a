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

void LogWrite(int64_t steps_done, const std::string& dir, const WriteStats& w, bool background) {
  RP_LOG(INFO) << "checkpoint after step " << steps_done << " written to " << dir << ": "
               << static_cast<double>(w.bytes) / 1e9 << " GB in " << w.total_s << " s ("
               << static_cast<double>(w.bytes) / 1e9 / std::max(w.total_s, 1e-9) << " GB/s; checksums "
               << w.checksum_s << " s)" << (background ? ", in the background" : ", on the loop");
}

}  // namespace

CheckpointWriter::CheckpointWriter(Setup setup, std::vector<StateSection> live, AsyncOptimizer& optimizer,
                                   int64_t written)
    : setup_(std::move(setup)), live_(std::move(live)), optimizer_(optimizer), written_(written) {
  for (const auto& s : live_) bytes_ += s.bytes;
  // Copies where they fit the host's available memory with a quarter to spare (the page cache
  // the file writes fill comes out of the same memory).
  const uint64_t avail = shm::AvailableHostMemory();
  int n = 0;
  if (setup_.background && !TestCheckpointOnLoop())
    for (int want = 2; want > 0 && n == 0; --want)
      if (avail > 0 && (bytes_ + bytes_ / 4) * want < avail) n = want;
  copies_.resize(n);
  // Allocated and touched now, on the copy threads' count of cores, so a snapshot costs no page
  // faults; the start-up (weights, workers' registration) hides it.
  for (auto& c : copies_) {
    c.bytes.reset(new uint8_t[bytes_]);
    const int threads = std::max(1, setup_.copy_threads);
    std::vector<std::thread> touch;
    for (int t = 0; t < threads; ++t)
      touch.emplace_back([p = c.bytes.get(), n = bytes_, t, threads] {
        for (uint64_t off = static_cast<uint64_t>(t) * kBlock; off < n; off += threads * kBlock)
          std::memset(p + off, 0, std::min(kBlock, n - off));
      });
    for (auto& th : touch) th.join();
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
  // Step steps_done's updates wait for the copy; its last thread lets them go.
  optimizer_.HoldUpdatesFrom(steps_done);
  const int n = std::max(1, setup_.copy_threads);
  copy_threads_left_.store(n);
  for (int t = 0; t < n; ++t)
    c.copy_threads.emplace_back([this, dst = c.bytes.get(), t, n] {
      uint64_t base = 0, block = 0;
      for (const auto& s : live_) {
        // A section of pieces is packed into the copy in order.
        ForEachPiece(s, [&](const uint8_t* from, uint64_t bytes, uint64_t at) {
          for (uint64_t off = 0; off < bytes; off += kBlock, ++block)
            if (block % n == static_cast<uint64_t>(t))
              std::memcpy(dst + base + at + off, from + off, std::min(kBlock, bytes - off));
        });
        base += s.bytes;
      }
      if (copy_threads_left_.fetch_sub(1) == 1) optimizer_.ReleaseUpdates();
    });
}

void CheckpointWriter::Snapshot(int64_t steps_done) {
  if (copies_.empty() || CopyOf(steps_done)) return;
  if (Copy* c = FreeCopy()) StartCopy(*c, steps_done);
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
    RP_RETURN_IF_ERROR(WriteTrainingState(setup_.dir, steps_done, setup_.state_hash, setup_.masters_in_state, setup_.run, live_,
                                          setup_.keep, 0, &w, setup_.shard));
    SlowDiskForTest(&w);
    written_ = steps_done;
    completed_.push_back({steps_done, w.bytes, w.total_s, w.checksum_s, false});
    LogWrite(steps_done, setup_.dir, w, false);
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
                      << " s for the previous checkpoint's write (the disk is slower than checkpoint.every steps)";
    }
    StartCopy(*c, steps_done);
  }
  // The file thread finishes the copy (its threads are handed over) and writes it.
  std::vector<StateSection> sections;
  uint64_t base = 0;
  for (const auto& s : live_) {
    sections.push_back({s.name, c->bytes.get() + base, s.bytes});
    base += s.bytes;
  }
  c->file = std::async(std::launch::async, [setup = setup_, sections = std::move(sections), steps_done,
                                            threads = std::move(c->copy_threads), disk = disk_]() mutable {
    for (auto& t : threads) t.join();
    // One file at a time: in step order, and a second writer would only share the disk.
    std::lock_guard<std::mutex> one_at_a_time(*disk);
    WriteStats w;
    Status s = WriteTrainingState(setup.dir, steps_done, setup.state_hash, setup.masters_in_state, setup.run, sections,
                                  setup.keep, setup.checksum_threads, &w, setup.shard);
    SlowDiskForTest(&w);
    if (s.ok()) LogWrite(steps_done, setup.dir, w, true);
    return std::make_pair(s, w);
  });
  c->copy_threads.clear();
  return Status::Ok();
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
