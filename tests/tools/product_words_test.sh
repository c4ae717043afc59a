#!/usr/bin/env bash
# Product files speak of the product: no tracked file may describe how the project is worked on
# (its tool calls, notes or issue numbers, its ordinal working sessions or stops) or point at
# files outside the repository.
#   tests/tools/product_words_test.sh SOURCE_DIR
set -euo pipefail
cd "$1"
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  mapfile -t files < <(git ls-files)
else
  mapfile -t files < <(find . -type f -not -path './.git/*' -not -path './build*' | sed 's|^\./||')
fi
self=tests/tools/product_words_test.sh
ordinals='first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|thirteenth|fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth'
# The refused phrases are assembled from single words, so this file does not spell them itself.
tool="device"; call="call"; closing="closing"; note="note"; tracker="issue"; sitting="session"
halt="stop"; outside="shared"
pattern="$tool ${call}s?|$closing ${note}s?|\\b${tracker}s? #?[0-9]+|\\b($ordinals) ($sitting|$halt)s?\\b"
pattern+="|\\.\\./$outside/|\\b$outside/(DESIGN|docs|gpu-host|hooks)"
# The pattern must find what it is meant to find, or the check proves nothing.
for probe in "$tool $call 2" "the $closing $note" "$tracker 24" "${tracker^} 5's targets" "the fourteenth $sitting" \
             "Third $halt" "see ../$outside/DESIGN.md" "$outside/gpu-host/README.md"; do
  if ! grep -q -i -E "$pattern" <<<"$probe"; then
    echo "product_words_test: the pattern misses \"$probe\"" >&2
    exit 1
  fi
done
checked=0
hits=""
for f in "${files[@]}"; do
  [ "$f" = "$self" ] && continue
  [ -f "$f" ] || continue
  checked=$((checked + 1))
  h=$(grep -n -i -I -E "$pattern" "$f" | cut -c1-200 | sed "s|^|$f:|" || true)
  [ -n "$h" ] && hits+="$h"$'\n'
done
if [ "$checked" -lt 50 ]; then
  echo "product_words_test: only $checked files checked; is $1 the source tree?" >&2
  exit 1
fi
if [ -n "$hits" ]; then
  echo "product_words_test: product files that speak of how the project is worked on, or point outside it:" >&2
  printf '%s' "$hits" >&2
  exit 1
fi
echo "product_words_test: $checked files clean"
