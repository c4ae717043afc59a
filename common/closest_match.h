// SPDX-License-Identifier: Apache-2.0
// "Did you mean": the known name a mistyped one most likely meant, for messages about job keys,
// sections, mode names and command-line flags.
//
// Contract: ClosestMatch() returns the candidate at the smallest edit distance (insertions,
// deletions, substitutions) from `given`, when that distance is at most a third of the longer
// name (and at least 2 edits are allowed); one name starting with the other (3 characters or
// more) counts as 1. "" when none is that close. Ties go to the earlier candidate. Pure functions;
// no allocation beyond one row of the distance table.
#pragma once

#include <algorithm>
#include <cstddef>
#include <string>
#include <vector>

namespace rp {

inline size_t EditDistance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = up;
    }
  }
  return row[b.size()];
}

inline std::string ClosestMatch(const std::string& given,
                                const std::vector<std::string>& candidates) {
  std::string best;
  size_t best_distance = 0;
  for (const auto& c : candidates) {
    const size_t limit = std::max<size_t>(2, std::max(given.size(), c.size()) / 3);
    // A name cut short or run on ("training" for "train") counts as one edit.
    const bool prefix =
        std::min(given.size(), c.size()) >= 3 && (given.rfind(c, 0) == 0 || c.rfind(given, 0) == 0);
    const size_t d = prefix ? 1 : EditDistance(given, c);
    if (d <= limit && (best.empty() || d < best_distance)) {
      best = c;
      best_distance = d;
    }
  }
  return best;
}

}  // namespace rp
