// SPDX-License-Identifier: Apache-2.0
// Attention whose forward can be kept for the backward (schedule.keep_attention).
//
// Contract:
//  * RecordedAttention is causal attention (inside each document when `documents` is defined)
//    through kernels that also return each query row's log-sum-exp. On CUDA without documents:
//    the kernel scaled_dot_product_attention picks for the inputs Transformer::Attention gives it
//    (flash, cuDNN or memory-efficient), called as SDPA calls it, so the values and the speed are
//    those of the job without records; where SDPA would run no fused kernel, and with documents,
//    LibTorch's variable-length flash kernel for bf16 and fp16 (shared kv heads indexed by the
//    kernel; the one Transformer::DocumentAttention runs) or its memory-efficient kernel for
//    fp32 (kv heads expanded first). On the CPU, explicit fp32 scores. Its backward is that
//    kernel's backward, which needs only q, k, v, the output and the log-sum-exp: no forward runs
//    inside it.
//  * Records: without autograd and with `write`, the call stores its output and log-sum-exp
//    under `layer`; without `write`, a stored record's output is returned as it is. With autograd,
//    a record under `layer` is taken out of the map and stands in for the forward, so the
//    backward runs on the forward's own output. The kernels are deterministic in the forward, so
//    a recorded and a recomputed call give the same bits, forward and backward, as long as q, k
//    and v are the same.
//  * Every call of a job that keeps attention goes through these kernels, recorded or not, so a
//    backward without a record (another worker ran the forward) recomputes the same values.
#pragma once

#include <ATen/ATen.h>

#include <map>
#include <vector>

#include "model/documents.h"

namespace rp::model {

// One block's attention as its forward left it.
struct AttentionRecord {
  at::Tensor out;  // the output, in the layout the kernel wrote it
  at::Tensor lse;  // each query row's log-sum-exp of its scaled scores (fp32, the kernel's layout)
  std::vector<at::Tensor> kernel_state;  // what else the kernel's backward takes back
  int64_t max_q = 0, max_k = 0;          // likewise
  int64_t kernel = -1;                   // which kernel wrote it (its backward reads it)
  int64_t Bytes() const;
};
// Keyed by pipeline layer.
using AttentionRecords = std::map<int, AttentionRecord>;

// q [B, nh, S, D]; k, v [B, nkv, S, D] (nh a multiple of nkv) -> [B, nh, S, D]. `records` may be
// null (nothing read or written).
at::Tensor RecordedAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const Documents& documents, int layer, AttentionRecords* records,
                             bool write);

}  // namespace rp::model
