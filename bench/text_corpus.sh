#!/usr/bin/env bash
# Writes SIZE bytes of real text found on this machine to OUT, for loss-curve comparisons
# (data.format = "bytes") on hosts without network access. The text is the package copyright
# notices under /usr/share/doc, then the Python standard library's sources, each in path order,
# so two hosts with the same OS and Python release build the same file. Prints its md5 sum;
# record it next to the figures measured on it.
#   bench/text_corpus.sh OUT [SIZE]   (SIZE in bytes, default 6000000)
set -euo pipefail
out=${1:?usage: bench/text_corpus.sh OUT [SIZE]}
size=${2:-6000000}
[[ "$size" =~ ^[1-9][0-9]*$ ]] || { echo "text_corpus: SIZE must be a positive byte count, got '$size'" >&2; exit 2; }
stdlib=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
export LC_ALL=C  # a byte order for the sort, whatever the locale
{
  find /usr/share/doc -name copyright -type f 2>/dev/null | sort
  find "$stdlib" -path "$stdlib/site-packages" -prune -o -name '*.py' -type f -print | sort
} | while read -r f; do cat "$f" 2>/dev/null || true; done | head -c "$size" > "$out"
got=$(stat -c %s "$out")
[ "$got" -eq "$size" ] || { echo "text_corpus: found only $got bytes of text for $size" >&2; exit 1; }
echo "$(md5sum "$out" | cut -d' ' -f1) $out ($got bytes)"
