// SPDX-License-Identifier: Apache-2.0
// The CUDA worker's model::FusedKernels: tensor checks, then the launchers of kernels.cu on
// the compute stream, LibTorch's default stream (cuda_device.cc: kComputeStream; its stream
// guards cover only its own copies and gradient adds, never model math).
#include <ATen/cuda/CUDAContext.h>
#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <torch/version.h>

#include <mutex>
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
  throw std::invalid_argument(std::string(what) + " has dtype " +
                              std::string(c10::toString(t.scalar_type())) +
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
    if (labels.device() != logits.device() || labels.scalar_type() != at::kLong ||
        labels.dim() != 1 || labels.size(0) != logits.size(0) || !labels.is_contiguous())
      throw std::invalid_argument(
          "labels must be a contiguous int64 [rows] tensor on the logits' device");
    at::Tensor row_loss = at::empty({logits.size(0)}, logits.options().dtype(at::kFloat));
    Check(kernels::CrossEntropyRows(dt, logits.data_ptr(), labels.data_ptr<int64_t>(),
                                    logits.size(0), logits.size(1), static_cast<float>(scale),
                                    write_grad, row_loss.data_ptr<float>(), kComputeStream),
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
                        x.numel() / x.size(3), x.size(1), x.size(2), x.size(3), backward,
                        kComputeStream),
          "rope kernel launch");
    return y;
  }

  bool HeadNormRopeSupports(int64_t dim) const override {
    return dim == 64 || dim == 128 || dim == 256;
  }

  at::Tensor HeadNormRope(const at::Tensor& x, const at::Tensor& w, const at::Tensor& cos,
                          const at::Tensor& sin_signed, double eps) const override {
    const kernels::Dtype dt = CheckHeadNormRope(x, w, cos, sin_signed);
    at::Tensor y = at::empty_like(x);
    Check(
        kernels::HeadNormRope(dt, x.data_ptr(), w.data_ptr(), cos.data_ptr(), sin_signed.data_ptr(),
                              y.data_ptr(), x.numel() / x.size(3), x.size(1), x.size(2), x.size(3),
                              static_cast<float>(eps), kComputeStream),
        "head norm + rope kernel launch");
    return y;
  }

  std::pair<at::Tensor, at::Tensor> HeadNormRopeBackward(const at::Tensor& x, const at::Tensor& w,
                                                         const at::Tensor& cos,
                                                         const at::Tensor& sin_signed, double eps,
                                                         const at::Tensor& dy,
                                                         bool weight_grad) const override {
    const kernels::Dtype dt = CheckHeadNormRope(x, w, cos, sin_signed);
    if (DtypeOf(dy, "head norm + rope gradient") != dt || !dy.sizes().equals(x.sizes()))
      throw std::invalid_argument(
          "head norm + rope gradient must have the input's shape and dtype");
    at::Tensor dx = at::empty_like(x);
    at::Tensor dw =
        weight_grad ? at::zeros({x.size(3)}, x.options().dtype(at::kFloat)) : at::Tensor();
    Check(kernels::HeadNormRopeBackward(
              dt, x.data_ptr(), w.data_ptr(), cos.data_ptr(), sin_signed.data_ptr(), dy.data_ptr(),
              dx.data_ptr(), weight_grad ? dw.data_ptr<float>() : nullptr, x.numel() / x.size(3),
              x.size(1), x.size(2), x.size(3), static_cast<float>(eps), kComputeStream),
          "head norm + rope backward kernel launch");
    return {dx, weight_grad ? dw.to(w.scalar_type()) : at::Tensor()};
  }

  bool RmsNormSupports(int64_t dim) const override { return kernels::RmsNormSupports(dim); }

  std::pair<at::Tensor, at::Tensor> AddRmsNorm(const at::Tensor& x, const at::Tensor& res,
                                               const at::Tensor& w, double eps) const override {
    const kernels::Dtype dt = CheckRmsNorm(x, w, res, "residual");
    at::Tensor sum = res.defined() ? at::empty_like(x) : at::Tensor();
    at::Tensor y = at::empty_like(x);
    Check(kernels::AddRmsNorm(dt, x.data_ptr(), res.defined() ? res.data_ptr() : nullptr,
                              w.data_ptr(), res.defined() ? sum.data_ptr() : nullptr, y.data_ptr(),
                              x.numel() / x.size(-1), x.size(-1), static_cast<float>(eps),
                              kComputeStream),
          "rmsnorm kernel launch");
    return {sum, y};
  }

  std::pair<at::Tensor, at::Tensor> RmsNormBackward(const at::Tensor& s, const at::Tensor& w,
                                                    double eps, const at::Tensor& dy,
                                                    const at::Tensor& ds_other,
                                                    bool weight_grad) const override {
    const kernels::Dtype dt = CheckRmsNorm(s, w, ds_other, "other gradient");
    if (DtypeOf(dy, "rmsnorm gradient") != dt || !dy.sizes().equals(s.sizes()) ||
        !dy.is_contiguous())
      throw std::invalid_argument(
          "rmsnorm gradient must be contiguous with the input's shape and dtype");
    at::Tensor ds = at::empty_like(s);
    at::Tensor dw =
        weight_grad ? at::zeros({s.size(-1)}, s.options().dtype(at::kFloat)) : at::Tensor();
    Check(kernels::RmsNormBackward(dt, s.data_ptr(), w.data_ptr(), dy.data_ptr(),
                                   ds_other.defined() ? ds_other.data_ptr() : nullptr,
                                   ds.data_ptr(), weight_grad ? dw.data_ptr<float>() : nullptr,
                                   s.numel() / s.size(-1), s.size(-1), static_cast<float>(eps),
                                   kComputeStream),
          "rmsnorm backward kernel launch");
    return {ds, weight_grad ? dw.to(w.scalar_type()) : at::Tensor()};
  }

  at::Tensor SwiGlu(const at::Tensor& gate, const at::Tensor& up) const override {
    const kernels::Dtype dt = CheckSwiGlu(gate, up);
    at::Tensor y = at::empty(gate.sizes(), gate.options());
    const int64_t cols = gate.size(-1);
    Check(kernels::SwiGlu(dt, gate.data_ptr(), up.data_ptr(), gate.stride(-2), y.data_ptr(),
                          gate.numel() / cols, cols, kComputeStream),
          "swiglu kernel launch");
    return y;
  }

  std::pair<at::Tensor, at::Tensor> SwiGluBackward(const at::Tensor& gate, const at::Tensor& up,
                                                   const at::Tensor& dy) const override {
    const kernels::Dtype dt = CheckSwiGlu(gate, up);
    if (DtypeOf(dy, "swiglu gradient") != dt || !dy.sizes().equals(gate.sizes()))
      throw std::invalid_argument("swiglu gradient must have the inputs' shape and dtype");
    at::Tensor dg = at::empty(gate.sizes(), gate.options()),
               du = at::empty(gate.sizes(), gate.options());
    const int64_t cols = gate.size(-1);
    Check(kernels::SwiGluBackward(dt, gate.data_ptr(), up.data_ptr(), gate.stride(-2),
                                  dy.data_ptr(), dg.data_ptr(), du.data_ptr(), gate.numel() / cols,
                                  cols, kComputeStream),
          "swiglu backward kernel launch");
    return {dg, du};
  }

  void AddWeightGrad(const at::Tensor& sink, const at::Tensor& dy,
                     const at::Tensor& x) const override {
    const kernels::Dtype dt = DtypeOf(dy, "weight gradient's output gradient");
    if (DtypeOf(x, "weight gradient's input") != dt)
      throw std::invalid_argument("weight gradient: output gradient and input must have one dtype");
    if (DtypeOf(sink, "weight gradient sink") != kernels::Dtype::kFloat32)
      throw std::invalid_argument("weight gradient sink must be float32");
    if (dy.dim() != 2 || x.dim() != 2 || sink.dim() != 2 || dy.size(0) != x.size(0) ||
        sink.size(0) != dy.size(1) || sink.size(1) != x.size(1))
      throw std::invalid_argument(
          "weight gradient expects dy [rows, out], x [rows, in], sink [out, in]; got dy " +
          c10::str(dy.sizes()) + ", x " + c10::str(x.sizes()) + ", sink " + c10::str(sink.sizes()));
    if (dy.device() != sink.device() || x.device() != sink.device())
      throw std::invalid_argument("weight gradient tensors must be on one device");
    const int64_t rows = x.size(0), in = x.size(1), out = dy.size(1);
    if (rows == 0 || in == 0 || out == 0) return;
    if (rows > INT32_MAX || in > INT32_MAX || out > INT32_MAX)
      throw std::invalid_argument("weight gradient dimensions exceed cuBLAS's int range");
    // Row-major sink [out, in] is column-major sink^T [in, out] = x^T dy, with x and dy read as
    // the column-major [in, rows] and [out, rows] they are in memory. LibTorch's handle for the
    // current device, bound to the current (compute) stream; fp32 products without TF32, as
    // LibTorch's own fp32 matmul by default.
    cublasHandle_t handle = at::cuda::getCurrentCUDABlasHandle();
    const cudaDataType_t in_type = dt == kernels::Dtype::kBFloat16 ? CUDA_R_16BF : CUDA_R_32F;
    const float alpha = 1.0f, beta = 1.0f;
    const cublasStatus_t st =
        cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_T, static_cast<int>(in), static_cast<int>(out),
                     static_cast<int>(rows), &alpha, x.data_ptr(), in_type, static_cast<int>(in),
                     dy.data_ptr(), in_type, static_cast<int>(out), &beta, sink.data_ptr(),
                     CUDA_R_32F, static_cast<int>(in), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    if (st != CUBLAS_STATUS_SUCCESS)
      throw std::runtime_error(std::string("weight gradient GEMM (cublasGemmEx ") +
                               std::to_string(out) + "x" + std::to_string(in) + ", " +
                               std::to_string(rows) + " rows): " + cublasGetStatusString(st));
  }

  bool E4m3MatmulSupported() const override {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 5)
    // Tried once per process (a worker uses one GPU): which GPUs LibTorch runs a row-scaled e4m3
    // product on depends on its version and build, so a 16 x 16 product of ones is asked for.
    std::call_once(e4m3_probe_, [this] {
      const cudaDeviceProp* p = at::cuda::getCurrentDeviceProperties();
      if (p->major < 8 || (p->major == 8 && p->minor < 9)) return;  // no e4m3 tensor cores
      try {
        const at::Tensor ones =
            at::ones({16, 16}, at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16));
        const auto [q, scales] = QuantizeRowsE4m3(ones);
        e4m3_supported_ =
            MatmulE4m3(q, scales, q, scales, false).to(at::kFloat).eq(16.0).all().item<bool>();
      } catch (const std::exception&) {
        e4m3_supported_ = false;
      }
    });
    return e4m3_supported_;
#else
    return false;  // no float8 dtype or row-scaled product in this LibTorch
#endif
  }

  std::pair<at::Tensor, at::Tensor> QuantizeRowsE4m3(const at::Tensor& x) const override {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 5)
    const kernels::Dtype dt = DtypeOf(x, "e4m3 quantization input");
    if (x.dim() != 2)
      throw std::invalid_argument("e4m3 quantization expects x [rows, cols], got " +
                                  c10::str(x.sizes()));
    if (x.size(0) > INT32_MAX)
      throw std::invalid_argument(
          "e4m3 quantization takes at most 2^31 - 1 rows (one block each), got " +
          std::to_string(x.size(0)));
    at::Tensor q = at::empty(x.sizes(), x.options().dtype(at::kFloat8_e4m3fn));
    at::Tensor scales = at::empty({x.size(0), 1}, x.options().dtype(at::kFloat));
    Check(kernels::QuantizeRowsE4m3(dt, x.data_ptr(), static_cast<uint8_t*>(q.data_ptr()),
                                    scales.data_ptr<float>(), x.size(0), x.size(1), kComputeStream),
          "e4m3 quantization kernel launch");
    return {q, scales};
#else
    (void)x;
    throw std::invalid_argument("e4m3 quantization needs LibTorch 2.5 or newer");
#endif
  }

  at::Tensor MatmulE4m3(const at::Tensor& a, const at::Tensor& a_scales, const at::Tensor& b,
                        const at::Tensor& b_scales, bool fast_accum) const override {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 5)
    if (a.dim() != 2 || b.dim() != 2 || a.size(1) != b.size(1) || a_scales.numel() != a.size(0) ||
        b_scales.numel() != b.size(0))
      throw std::invalid_argument(
          "e4m3 product expects a [m, k], b [n, k] and one scale per row; got a " +
          c10::str(a.sizes()) + ", b " + c10::str(b.sizes()));
    if (a.size(1) % 16 != 0 || b.size(0) % 16 != 0)
      throw std::invalid_argument("e4m3 product needs k and n multiples of 16; got a " +
                                  c10::str(a.sizes()) + ", b " + c10::str(b.sizes()));
    // b^T as the column-major [k, n] operand the product takes; its scales as a [1, n] row.
    return at::_scaled_mm(a, b.t(), a_scales.view({-1, 1}), b_scales.view({1, -1}), std::nullopt,
                          std::nullopt, at::kBFloat16, fast_accum);
#else
    (void)a, (void)a_scales, (void)b, (void)b_scales, (void)fast_accum;
    throw std::invalid_argument("e4m3 products need LibTorch 2.5 or newer");
#endif
  }

 private:
  mutable std::once_flag e4m3_probe_;
  mutable bool e4m3_supported_ = false;

  static kernels::Dtype CheckHeadNormRope(const at::Tensor& x, const at::Tensor& w,
                                          const at::Tensor& cos, const at::Tensor& sin_signed) {
    const kernels::Dtype dt = DtypeOf(x, "head norm + rope input");
    if (DtypeOf(w, "head norm weight") != dt || DtypeOf(cos, "rope cos table") != dt ||
        DtypeOf(sin_signed, "rope sin table") != dt)
      throw std::invalid_argument("head norm weight and rope tables must have the input's dtype");
    if (x.dim() != 4 || w.dim() != 1 || w.size(0) != x.size(3) || cos.dim() != 2 ||
        !cos.sizes().equals(sin_signed.sizes()) || cos.size(0) != x.size(1) ||
        cos.size(1) != x.size(3))
      throw std::invalid_argument(
          "head norm + rope expects x [batch, seq, heads, dim], w [dim], tables [seq, dim]");
    return dt;
  }

  // x (and `other`, when defined) contiguous of one shape and dtype; w [x's last dim], x's dtype.
  static kernels::Dtype CheckRmsNorm(const at::Tensor& x, const at::Tensor& w,
                                     const at::Tensor& other, const char* other_name) {
    const kernels::Dtype dt = DtypeOf(x, "rmsnorm input");
    if (x.dim() < 1 || !x.is_contiguous() || !kernels::RmsNormSupports(x.size(-1)))
      throw std::invalid_argument(
          "rmsnorm input must be contiguous with a supported last dim (got " +
          std::to_string(x.dim() ? x.size(-1) : 0) + ")");
    if (DtypeOf(w, "rmsnorm weight") != dt || w.dim() != 1 || w.size(0) != x.size(-1))
      throw std::invalid_argument("rmsnorm weight must be [dim] in the input's dtype");
    if (other.defined() && (DtypeOf(other, other_name) != dt || !other.sizes().equals(x.sizes()) ||
                            !other.is_contiguous()))
      throw std::invalid_argument(std::string("rmsnorm ") + other_name +
                                  " must be contiguous with the input's shape and dtype");
    return dt;
  }

  // gate and up: equal shapes, unit stride in the last dim, rows at one common stride (a
  // contiguous tensor, or the two halves of one).
  static kernels::Dtype CheckSwiGlu(const at::Tensor& gate, const at::Tensor& up) {
    if (!gate.is_cuda() || !up.is_cuda() || gate.device() != up.device())
      throw std::invalid_argument("swiglu inputs must be on one CUDA device");
    if (gate.scalar_type() != up.scalar_type() || !gate.sizes().equals(up.sizes()) ||
        gate.dim() < 2)
      throw std::invalid_argument("swiglu gate and up must have one shape and dtype");
    const int64_t cols = gate.size(-1);
    auto rows_at_stride = [cols](const at::Tensor& t, int64_t ld) {
      if (t.stride(-1) != 1) return false;
      int64_t expect = ld;
      for (int64_t d = t.dim() - 2; d >= 0; --d) {
        if (t.size(d) != 1 && t.stride(d) != expect) return false;
        expect *= t.size(d);
      }
      return ld >= cols;
    };
    const int64_t ld = gate.stride(-2);
    if (!rows_at_stride(gate, ld) || !rows_at_stride(up, ld))
      throw std::invalid_argument("swiglu gate and up must be row-major with one row stride");
    if (gate.scalar_type() == at::kFloat) return kernels::Dtype::kFloat32;
    if (gate.scalar_type() == at::kBFloat16) return kernels::Dtype::kBFloat16;
    throw std::invalid_argument("swiglu inputs must be float32 or bfloat16");
  }
};

}  // namespace

const model::FusedKernels& CudaKernels() {
  static const CudaFusedKernels kernels;
  return kernels;
}

}  // namespace rp::worker
