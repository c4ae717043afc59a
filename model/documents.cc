// SPDX-License-Identifier: Apache-2.0
#include "model/documents.h"

#include <algorithm>

namespace rp::model {

DocumentBounds FindDocuments(const int64_t* positions, int64_t rows, int64_t seq) {
  DocumentBounds b;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t* p = positions + r * seq;
    for (int64_t j = 0; j < seq; ++j) {
      if (p[j] != j) b.plain = false;
      b.max_position = std::max(b.max_position, p[j]);
      if (j == 0 || p[j] != p[j - 1] + 1) b.starts.push_back(r * seq + j);
    }
  }
  b.starts.push_back(rows * seq);
  for (size_t d = 0; d + 1 < b.starts.size(); ++d)
    b.max_length = std::max(b.max_length, b.starts[d + 1] - b.starts[d]);
  return b;
}

Documents MakeDocuments(const int64_t* positions, int64_t rows, int64_t seq,
                        const HostToDevice& to_device) {
  const DocumentBounds b = FindDocuments(positions, rows, seq);
  if (b.plain) return {};
  std::vector<int64_t> segments(static_cast<size_t>(rows * seq));
  for (size_t d = 0; d + 1 < b.starts.size(); ++d)
    std::fill(segments.begin() + b.starts[d], segments.begin() + b.starts[d + 1],
              static_cast<int64_t>(d));
  Documents out;
  out.positions = to_device(positions, rows * seq).view({rows, seq});
  out.segments = to_device(segments.data(), rows * seq).view({rows, seq});
  out.cu_seqlens = to_device(b.starts.data(), static_cast<int64_t>(b.starts.size())).to(at::kInt);
  out.max_length = b.max_length;
  out.max_position = b.max_position;
  return out;
}

}  // namespace rp::model
