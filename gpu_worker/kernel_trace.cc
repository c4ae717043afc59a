// SPDX-License-Identifier: Apache-2.0
#include "gpu_worker/kernel_trace.h"
#include "common/environment.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/profiler_kineto.h>

#include <cstdlib>
#include <exception>
#include <set>
#include <utility>

#include "common/logging.h"
#include "gpu_worker/guarded.h"

namespace rp::worker {

namespace prof = torch::autograd::profiler;
using torch::profiler::impl::ActivityType;

void StartKineto() {
  torch::profiler::impl::ProfilerConfig config(torch::profiler::impl::ProfilerState::KINETO);
  std::set<ActivityType> activities{ActivityType::CPU};
  if (at::hasCUDA()) activities.insert(ActivityType::CUDA);
  prof::prepareProfiler(config, activities);
  prof::enableProfiler(config, activities);
}

std::unique_ptr<prof::ProfilerResult> StopKineto() { return prof::disableProfiler(); }

KernelTrace::KernelTrace(int rank, std::function<void()> drain) : drain_(std::move(drain)) {
  const auto prefix = EnvironmentValue("RP_TRACE_KERNELS");
  if (!prefix || prefix->empty()) return;
  path_ = *prefix + ".w" + std::to_string(rank) + ".json";
  if (const auto s = EnvironmentValue("RP_TRACE_KERNELS_STEP")) step_ = std::atoll(s->c_str());
}

KernelTrace::~KernelTrace() { Stop(); }

void KernelTrace::OnJobBegin(int64_t step) {
  if (path_.empty() || done_) return;
  if (active_ && step > step_) {
    Stop();
    return;
  }
  if (active_ || step != step_) return;
  Status s = Guarded([] { return std::string("starting LibTorch's profiler"); },
                     [&] {
                       StartKineto();
                       return Status::Ok();
                     });
  if (!s.ok()) {
    RP_LOG(WARNING) << "RP_TRACE_KERNELS: " << s.message();
    done_ = true;
    return;
  }
  active_ = true;
  RP_LOG(INFO) << "tracing step " << step_ << " into " << path_;
}

void KernelTrace::Stop() {
  if (!active_) return;
  active_ = false;
  done_ = true;
  Status s = Guarded([&] { return "writing " + path_; },
                     [&] {
                       if (drain_) drain_();
                       auto result = StopKineto();
                       if (result) result->save(path_);
                       return Status::Ok();
                     });
  if (s.ok()) RP_LOG(INFO) << "wrote the trace of step " << step_ << " to " << path_;
  else RP_LOG(WARNING) << "RP_TRACE_KERNELS: " << s.message();
}

}  // namespace rp::worker
