// SPDX-License-Identifier: Apache-2.0
// The worker's exception boundary: what a LibTorch failure becomes, and what an out-of-memory
// error adds (the keys that decide the plan's device memory).
#include "gpu_worker/guarded.h"

#include <gtest/gtest.h>

#include <c10/util/Exception.h>

#include <stdexcept>
#include <string>

namespace rp::worker {
namespace {

TEST(Guarded, AFailureNamesWhatWasBeingDoneAndOutOfMemoryNamesWhatDecidesThePlan) {
  const Status fine = Guarded([] { return std::string("job 3"); }, [] { return Status::Ok(); });
  EXPECT_TRUE(fine.ok());
  const Status error = Guarded(
      [] { return std::string("job 3"); },
      []() -> Status {
        throw c10::Error({__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, "shape mismatch");
      });
  EXPECT_EQ(error.code(), StatusCode::kInternal);
  EXPECT_NE(error.message().find("job 3: shape mismatch"), std::string::npos) << error.message();
  EXPECT_EQ(error.message().find("schedule.gpu_memory_gb"), std::string::npos) << error.message();
  const Status oom =
      Guarded([] { return std::string("job 3 microbatch 0"); },
              []() -> Status {
                throw c10::OutOfMemoryError({__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
                                            "CUDA out of memory. Tried to allocate 400.00 MiB");
              });
  EXPECT_EQ(oom.code(), StatusCode::kInternal);
  EXPECT_NE(
      oom.message().find("job 3 microbatch 0: CUDA out of memory. Tried to allocate 400.00 MiB"),
      std::string::npos)
      << oom.message();
  for (const char* hint : {"rp-plan", "schedule.gpu_memory_gb", "job.device_memory_limit_gib"})
    EXPECT_NE(oom.message().find(hint), std::string::npos) << hint << " in " << oom.message();
  const Status runtime =
      Guarded([] { return std::string("fetching weights"); },
              []() -> Status { throw std::runtime_error("cudaMemcpyAsync failed"); });
  EXPECT_NE(runtime.message().find("fetching weights: cudaMemcpyAsync failed"), std::string::npos);
}

}  // namespace
}  // namespace rp::worker
