// SPDX-License-Identifier: Apache-2.0
// A training checkpoint of a tiny job (fuzz/tiny.toml's): any bytes under its name are found,
// checked (header, run record, sections, checksums) and read into the job's buffers, or refused
// with a Status, never a crash or an access outside the file or the buffers.
#include <cstdint>
#include <filesystem>
#include <vector>

#include "config/job_config.h"
#include "config/model_spec.h"
#include "optim/training_state.h"
#include "fuzz/fuzz_files.h"
#include "planning/partitioner.h"
#include "shm/layout.h"

namespace {

struct TinyJob {
  rp::core::JobConfig config;
  rp::core::ModelSpec spec;
  rp::shm::ArenaLayout layout;
  uint64_t hash = 0;
};

const TinyJob& Job() {
  static const TinyJob job = [] {
    TinyJob j;
    auto config = rp::core::LoadJobConfig(RP_FUZZ_SOURCE_DIR "/fuzz/tiny.toml", {});
    if (!config.ok()) __builtin_trap();
    j.config = *config;
    j.spec = rp::core::BuildModelSpec(j.config.model, j.config.lora);
    auto plan = rp::core::MakePlan(j.config, 1);
    if (!plan.ok()) __builtin_trap();
    auto layout =
        rp::shm::ComputeLayout(j.config, rp::core::ResolveExecution(j.config), j.spec, *plan);
    if (!layout.ok()) __builtin_trap();
    j.layout = *layout;
    j.hash = rp::coord::TrainingStateHash(j.config, j.spec, j.layout);
    return j;
  }();
  return job;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const TinyJob& job = Job();
  const std::string dir = rp::fuzz::ScratchDir() + "/checkpoints";
  std::filesystem::create_directories(dir);
  rp::fuzz::WriteFile(dir + "/step-00000002.rpstate", {reinterpret_cast<const char*>(data), size});
  auto file = rp::coord::FindLatestTrainingState(dir);
  if (!file.ok()) return 0;
  (void)rp::coord::ReadRunRecord(*file);
  std::vector<uint8_t> optim(job.layout.optim_total_bytes), state(job.layout.total_bytes);
  (void)rp::coord::ReadTrainingStateShares(*file, job.config, job.spec, job.layout, job.hash,
                                           nullptr, nullptr);
  (void)rp::coord::ReadTrainingStateShares(*file, job.config, job.spec, job.layout, job.hash,
                                           optim.data(), state.data());
  return 0;
}
