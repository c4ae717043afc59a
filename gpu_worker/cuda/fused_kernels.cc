// SPDX-License-Identifier: Apache-2.0
// The CUDA worker's model::FusedKernels: tensor checks, then the launchers of kernels.cu on
// LibTorch's current stream of the device, which is the default stream everywhere in the worker
// (cuda_device.cc: kComputeStream).
#include <cuda_runtime_api.h>

#include <stdexcept>
#include <string>

#include "gpu_worker/cuda/cuda_check.h"
#include "gpu_worker/cuda/fused_kernels.h"
#include "gpu_worker/cuda/kernels.h"

namespace rp::worker {
namespace {

constexpr cudaStream_t kComputeStream = nullptr;

kernels::Dtype DtypeOf(const at::Tensor& t, const char* what) {
  if (!t.is_cuda()) throw std::invalid_argument(std::string(what) + " is not on a CUDA device");
  if (!t.is_contiguous()) throw std::invalid_argument(std::string(what) + " is not contiguous");
  if (t.scalar_type() == at::kFloat) return kernels::Dtype::kFloat32;
  if (t.scalar_type() == at::kBFloat16) return kernels::Dtype::kBFloat16;
  throw std::invalid_argument(std::string(what) + " has dtype " + std::string(c10::toString(t.scalar_type())) +
                              " (float32 or bfloat16 expected)");
}

void Check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(CudaStatus(e, what).message());
}

class CudaFusedKernels final : public model::FusedKernels {
 public:
  at::Tensor CrossEntropyInPlace(at::Tensor logits, const at::Tensor& labels, double scale,
                                 bool write_grad) const override {
    const kernels::Dtype dt = DtypeOf(logits, "logits");
    if (logits.dim() != 2) throw std::invalid_argument("logits must be [rows, vocab]");
    if (labels.device() != logits.device() || labels.scalar_type() != at::kLong || labels.dim() != 1 ||
        labels.size(0) != logits.size(0) || !labels.is_contiguous())
      throw std::invalid_argument("labels must be a contiguous int64 [rows] tensor on the logits' device");
    at::Tensor row_loss = at::empty({logits.size(0)}, logits.options().dtype(at::kFloat));
    Check(kernels::CrossEntropyRows(dt, logits.data_ptr(), labels.data_ptr<int64_t>(), logits.size(0),
                                    logits.size(1), static_cast<float>(scale), write_grad,
                                    row_loss.data_ptr<float>(), kComputeStream),
          "cross-entropy kernel launch");
    return row_loss;
  }

  at::Tensor Rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin_signed,
                  bool backward) const override {
    const kernels::Dtype dt = DtypeOf(x, "rope input");
    if (DtypeOf(cos, "rope cos table") != dt || DtypeOf(sin_signed, "rope sin table") != dt)
      throw std::invalid_argument("rope tables must have the input's dtype");
    if (x.dim() != 4 || cos.dim() != 2 || !cos.sizes().equals(sin_signed.sizes()) ||
        cos.size(0) != x.size(1) || cos.size(1) != x.size(3))
      throw std::invalid_argument("rope expects x [batch, seq, heads, dim] and tables [seq, dim]");
    at::Tensor y = at::empty_like(x);
    Check(kernels::Rope(dt, x.data_ptr(), cos.data_ptr(), sin_signed.data_ptr(), y.data_ptr(),
                        x.numel() / x.size(3), x.size(1), x.size(2), x.size(3), backward, kComputeStream),
          "rope kernel launch");
    return y;
  }
};

}  // namespace

const model::FusedKernels& CudaKernels() {
  static const CudaFusedKernels kernels;
  return kernels;
}

}  // namespace rp::worker
