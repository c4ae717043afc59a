// SPDX-License-Identifier: Apache-2.0
// The documents of a packed microbatch (data.packing = "documents" or "pad"), for attention
// that stays inside each document and RoPE positions that restart at each one.
//
// Contract:
//  * A microbatch's documents are read from its RoPE positions alone ([rows, seq] int64, as
//    io/data.h writes them): a document begins at each row's first token and wherever a position
//    is not its predecessor's plus one. Nothing else travels with a microbatch.
//  * FindDocuments runs on the host positions; a microbatch whose every row is one document at
//    positions 0..seq-1 is `plain`: plain causal attention computes the same thing without any
//    mask, so callers keep today's path for it (stream packing always is plain).
//  * Documents (the tensors) are built once per microbatch on the compute device and handed to
//    model::Transformer::SetDocuments for every layer the microbatch runs through, forward and
//    recompute alike.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <vector>

namespace rp::model {

struct DocumentBounds {
  std::vector<int64_t>
      starts;  // each document's first token in the flattened rows x seq tokens, then rows x seq
  int64_t max_length = 0;    // the longest document's tokens
  int64_t max_position = 0;  // the largest RoPE position
  bool plain = true;         // one document per row, at positions 0..seq-1
};
DocumentBounds FindDocuments(const int64_t* positions, int64_t rows, int64_t seq);

struct Documents {
  at::Tensor positions;   // [rows, seq] int64: each token's RoPE position
  at::Tensor segments;    // [rows, seq] int64: each token's document, counted over the microbatch
  at::Tensor cu_seqlens;  // [documents + 1] int32: DocumentBounds::starts
  int64_t max_length = 0;
  int64_t max_position = 0;
  bool defined() const { return positions.defined(); }
};

// Copies a host int64 array of `n` elements to the compute device (the worker's activation
// path; a plain copy on the CPU).
using HostToDevice = std::function<at::Tensor(const int64_t* host, int64_t n)>;

// The tensors of `bounds` for the microbatch whose host positions are `positions`; undefined
// Documents when the microbatch is plain.
Documents MakeDocuments(const int64_t* positions, int64_t rows, int64_t seq,
                        const HostToDevice& to_device);

}  // namespace rp::model
