#!/usr/bin/env bash
# Every tracked C++ and CUDA source is laid out as .clang-format says. The layout depends on
# clang-format's version, so the check runs the one Debian bookworm ships (14), which
# scripts/setup.sh installs; another version is refused by name rather than compared.
#   tests/tools/format_test.sh SOURCE_DIR
# Fix a failure with: clang-format-14 -i FILE ... (or every file: see the message).
set -euo pipefail
cd "$1"
tool=""
for candidate in clang-format-14 clang-format; do
  if command -v "$candidate" >/dev/null 2>&1 &&
     "$candidate" --version | grep -qE 'version 14\.'; then
    tool=$candidate
    break
  fi
done
if [ -z "$tool" ]; then
  echo "format_test: clang-format 14 not found (found: $(clang-format --version 2>/dev/null || echo none));" \
       "scripts/setup.sh installs Debian bookworm's clang-format" >&2
  exit 1
fi
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  mapfile -t files < <(git ls-files -- '*.cc' '*.h' '*.cu' '*.cuh')
else
  mapfile -t files < <(find . -path ./build\* -prune -o -type f \( -name '*.cc' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' \) -print)
fi
((${#files[@]} > 0)) || { echo "format_test: no sources found under $PWD" >&2; exit 1; }
# The check must see a misplaced layout, or it proves nothing.
probe=$(mktemp --suffix=.cc)
trap 'rm -f "$probe"' EXIT
printf 'int  f( int x ){return x;}\n' > "$probe"
if "$tool" --style=file:"$PWD/.clang-format" --dry-run --Werror "$probe" >/dev/null 2>&1; then
  echo "format_test: $tool accepted a misformatted probe; the check is broken" >&2
  exit 1
fi
bad=()
for f in "${files[@]}"; do
  "$tool" --dry-run --Werror "$f" >/dev/null 2>&1 || bad+=("$f")
done
if ((${#bad[@]})); then
  echo "format_test: ${#bad[@]} file(s) not laid out as .clang-format says:" >&2
  printf '  %s\n' "${bad[@]}" >&2
  echo "fix with: $tool -i ${bad[*]}" >&2
  exit 1
fi
echo "format_test: ${#files[@]} files laid out as .clang-format says ($tool)"
