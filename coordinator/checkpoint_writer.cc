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

// The copy when it fits beside everything else: MemAvailable must cover it with a quarter to
// spare (the page cache the file write fills comes out of the same memory).
bool CopyFits(uint64_t bytes) {
  const uint64_t avail = shm::AvailableHostMemory();
  return avail > 0 && bytes + bytes / 4 < avail;
}

void LogWrite(int64_t steps_done, const std::string& dir, const WriteStats& w, bool background) {
  RP_LOG(INFO) << "checkpoint after step " << steps_done << " written to " << dir << ": "
               << static_cast<double>(w.bytes) / 1e9 << " GB in " << w.total_s << " s ("
               << static_cast<double>(w.bytes) / 1e9 / std::max(w.total_s, 1e-9) << " GB/s; checksums "
               << w.checksum_s << " s)" << (background ? ", in the background" : ", on the loop");
}

}  // namespace

CheckpointWriter::CheckpointWriter(Setup setup, std::vector<StateSection> live, int64_t written)
    : setup_(std::move(setup)), live_(std::move(live)), written_(written) {
  for (const auto& s : live_) bytes_ += s.bytes;
  background_ = CopyFits(bytes_) && !TestCheckpointOnLoop();
}

CheckpointWriter::~CheckpointWriter() {
  for (auto& t : copy_threads_) t.join();
  if (file_.valid()) file_.wait();
}

void CheckpointWriter::CopyIn() {
  // Each thread copies every copy_threads-th 64 MiB block of every section.
  const int n = std::max(1, setup_.copy_threads);
  for (int t = 0; t < n; ++t)
    copy_threads_.emplace_back([this, t, n] {
      uint64_t base = 0;
      uint64_t block = 0;
      for (const auto& s : live_) {
        for (uint64_t off = 0; off < s.bytes; off += kBlock, ++block)
          if (block % n == static_cast<uint64_t>(t))
            std::memcpy(copy_.get() + base + off, s.data + off, std::min(kBlock, s.bytes - off));
        base += s.bytes;
      }
    });
}

void CheckpointWriter::Snapshot(int64_t steps_done) {
  if (!background_ || copying_ == steps_done) return;
  for (auto& t : copy_threads_) t.join();  // an earlier copy (its file thread has it) is done
  copy_threads_.clear();
  // The previous file still being written from the copy: this one waits for Write().
  if (file_.valid() && file_.wait_for(std::chrono::seconds(0)) != std::future_status::ready) return;
  if (!copy_) copy_.reset(new uint8_t[bytes_]);
  copying_ = steps_done;
  CopyIn();
}

Status CheckpointWriter::WaitForFile() {
  if (!file_.valid()) return Status::Ok();
  Status s = file_.get();
  if (s.ok()) written_ = file_steps_;
  return s;
}

Status CheckpointWriter::Write(int64_t steps_done) {
  RP_RETURN_IF_ERROR(WaitForFile());
  if (!background_) {
    WriteStats w;
    RP_RETURN_IF_ERROR(WriteTrainingState(setup_.dir, steps_done, setup_.state_hash, setup_.masters_in_state, live_,
                                          setup_.keep, 0, &w));
    if (const double slow = TestCheckpointDelaySeconds(); slow > 0)  // a slow disk, for the liveness test
      std::this_thread::sleep_for(std::chrono::duration<double>(slow));
    written_ = steps_done;
    LogWrite(steps_done, setup_.dir, w, false);
    return Status::Ok();
  }
  if (copying_ != steps_done) Snapshot(steps_done);
  const double t0 = MonoSeconds();
  for (auto& t : copy_threads_) t.join();
  copy_threads_.clear();
  if (const double waited = MonoSeconds() - t0; waited > 0.05)
    RP_LOG(INFO) << "checkpoint after step " << steps_done << ": waited " << waited << " s for the state's copy";
  std::vector<StateSection> sections;
  uint64_t base = 0;
  for (const auto& s : live_) {
    sections.push_back({s.name, copy_.get() + base, s.bytes});
    base += s.bytes;
  }
  file_steps_ = steps_done;
  copying_ = -1;  // the copy belongs to the file thread until it is done
  file_ = std::async(std::launch::async, [setup = setup_, sections = std::move(sections), steps_done] {
    WriteStats w;
    Status s = WriteTrainingState(setup.dir, steps_done, setup.state_hash, setup.masters_in_state, sections,
                                  setup.keep, setup.checksum_threads, &w);
    if (const double slow = TestCheckpointDelaySeconds(); slow > 0)
      std::this_thread::sleep_for(std::chrono::duration<double>(slow));
    if (s.ok()) LogWrite(steps_done, setup.dir, w, true);
    return s;
  });
  return Status::Ok();
}

Status CheckpointWriter::Finish() {
  for (auto& t : copy_threads_) t.join();
  copy_threads_.clear();
  return WaitForFile();
}

}  // namespace rp::coord
