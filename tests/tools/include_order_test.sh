#!/usr/bin/env bash
# The folders' order (docs/architecture.md, "Folders"): a folder's sources include project
# headers only from itself and from folders before it in ORDER, so nothing calls up.
#   tests/tools/include_order_test.sh SOURCE_DIR
set -euo pipefail
cd "$1"
ORDER=(common config io planning protocol model shm nodes optim coordinator gpu_worker launcher tools bench tests fuzz)
rank() {
  local i
  for i in "${!ORDER[@]}"; do [ "${ORDER[$i]}" = "$1" ] && { echo "$i"; return; }; done
  echo -1
}
bad=""
checked=0
for dir in "${ORDER[@]}"; do
  [ -d "$dir" ] || { echo "include_order_test: folder $dir is missing" >&2; exit 1; }
  mine=$(rank "$dir")
  while IFS= read -r -d '' f; do
    checked=$((checked + 1))
    while IFS= read -r inc; do
      top=${inc%%/*}
      r=$(rank "$top")
      [ "$r" -lt 0 ] && continue   # not a project folder (a system or third-party header)
      if [ "$r" -gt "$mine" ]; then bad+="$f includes $inc ($top is above $dir)"$'\n'; fi
    done < <(sed -n 's/^#include "\([a-z_]*\/[^"]*\)".*/\1/p' "$f")
  done < <(find "$dir" -type f \( -name '*.h' -o -name '*.cc' -o -name '*.cu' \) -print0)
done
# The programs' folders are peers, not layers: none includes another's headers (what two of them
# share lives in a folder below them, as the optimizer and the training state in optim/).
PROGRAMS=(coordinator gpu_worker launcher)
for dir in "${PROGRAMS[@]}"; do
  while IFS= read -r -d '' f; do
    while IFS= read -r inc; do
      top=${inc%%/*}
      for other in "${PROGRAMS[@]}"; do
        if [ "$top" = "$other" ] && [ "$other" != "$dir" ]; then bad+="$f includes $inc (program folders are peers)"$'\n'; fi
      done
    done < <(sed -n 's/^#include "\([a-z_]*\/[^"]*\)".*/\1/p' "$f")
  done < <(find "$dir" -type f \( -name '*.h' -o -name '*.cc' -o -name '*.cu' \) -print0)
done
# The check must see the tree: every project folder has sources.
if [ "$checked" -lt 100 ]; then
  echo "include_order_test: only $checked files checked" >&2
  exit 1
fi
# Any folder of sources at the top level must have its place in ORDER.
for d in */; do
  d=${d%/}
  case "$d" in build*|deps|docs|configs|data|scripts|cmake) continue ;; esac
  if [ -n "$(find "$d" -maxdepth 2 -name '*.cc' -print -quit)" ] && [ "$(rank "$d")" -lt 0 ]; then
    bad+="folder $d has sources but no place in the order"$'\n'
  fi
done
if [ -n "$bad" ]; then
  printf 'include_order_test: includes against the folders'"'"' order:\n%s' "$bad" >&2
  exit 1
fi
echo "include_order_test: $checked files follow the order ${ORDER[*]}"
