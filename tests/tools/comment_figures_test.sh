#!/usr/bin/env bash
# Comments say why, not what was measured when: no comment in the product's code or configs may
# carry a measured figure (a time, a rate, a throughput), a date or a commit hash. Figures belong
# in docs/benchmarks.md and bench/results.jsonl, with the command that produced them. Units in a
# contract (a design constant such as a poll interval) are allowed by name below.
#   tests/tools/comment_figures_test.sh SOURCE_DIR
set -euo pipefail
cd "$1"
dirs=(common config io planning shm protocol model coordinator optim gpu_worker nodes launcher tools)
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  mapfile -t files < <(git ls-files -- "${dirs[@]/%//}" configs | grep -E '\.(cc|h|cu|cuh|toml)$')
else
  mapfile -t files < <(find "${dirs[@]}" configs -type f | grep -E '\.(cc|h|cu|cuh|toml)$')
fi
hash='\b(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b'
date='\b20[0-9]{2}-[01][0-9]-[0-3][0-9]\b'
figure='[0-9][0-9.,]*\s?(ms|us|µs|ns|GB/s|MB/s|GiB/s|MiB/s|tokens/s|tok/s|TFLOP/s|GFLOP/s|parameters/s)\b|(?<![0-9A-Za-z])[+-][0-9.]+%'
# A GPU named beside a number other than its own name's digits: a measurement on that card.
gpu='\b(H100|H200|A100|A800|RTX ?4090)\b'
where="$gpu.*(?<![A-Za-z0-9.])[0-9]|(?<![A-Za-z0-9.])[0-9].*$gpu"
pattern="$hash|$date|$figure|$where"
# In code, a decimal size or time is a measurement too (configs state sizes derived from shapes).
measured='(?<![A-Za-z0-9.])[0-9]+\.[0-9]+ ?(s|GiB|GB|MiB|MB)\b'
code_pattern="^[^:]*\.(cc|h|cu|cuh):[0-9]+:.*($measured)"
# Design constants stated in contracts: "file: text" pairs the check lets through.
allowed=(
  "coordinator/progress_beacon.h: at least every 200 ms"
  "gpu_worker/worker.cc: this loop's 1 ms poll"
)
# The pattern must find what it is meant to find, or the check proves nothing.
for probe in "fixed in 544a817" "measured 2026-11-30" "6.207 -> 6.028 ms per microbatch" "(21,886 tokens/s)" \
             "53.9 GB/s in" "0.78 of peak on the H200" "estimate +4.7%" "the H200 (a 130 GB budget)"; do
  if ! grep -qP "$pattern" <<<"$probe"; then
    echo "comment_figures_test: the pattern misses \"$probe\"" >&2
    exit 1
  fi
done
for probe in "every microbatch" "a 64 MiB chunk" "the head's 2.5 GB of fp32 gradient" "bf16 and fp32" "0x9e3779b9" "the H100's datasheet matches the H200's in bf16" "20-28% fewer"; do
  if grep -qP "$pattern" <<<"$probe"; then
    echo "comment_figures_test: the pattern flags \"$probe\", which is no figure" >&2
    exit 1
  fi
done
# Every comment, as FILE:LINE:TEXT (the text after // in code, after # in configs).
comments=$(awk '{
    marker = FILENAME ~ /\.toml$/ ? "#" : "//"
    k = index($0, marker)
    if (k == 0) next
    text = substr($0, k + length(marker))
    if (marker == "//" && substr($0, k - 1, 1) == ":") next  # a URL in a string
    print FILENAME ":" FNR ":" text
  }' "${files[@]}")
hits=""
while IFS= read -r hit; do
  [ -z "$hit" ] && continue
  f=${hit%%:*}
  comment=${hit#*:}
  comment=${comment#*:}
  ok=0
  for a in "${allowed[@]}"; do
    [[ "$f" == "${a%%: *}" && "$comment" == *"${a#*: }"* ]] && ok=1
  done
  [ $ok -eq 1 ] || hits+="$hit"$'\n'
done < <(grep -P "^[^:]*:[0-9]+:.*($pattern)|$code_pattern" <<<"$comments" || true)
if [ -n "$hits" ]; then
  echo "comment_figures_test: comments carrying a measured figure, a date or a commit hash (move the figure to docs/benchmarks.md and say why):" >&2
  printf '%s' "$hits" >&2
  exit 1
fi
echo "comment_figures_test: ${#files[@]} files clean"
