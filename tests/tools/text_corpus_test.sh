#!/usr/bin/env bash
# bench/text_corpus.sh: the size asked for, the same bytes on a second run, and refusals of a bad
# size and of a size larger than the text on the machine.
#   tests/tools/text_corpus_test.sh SOURCE_DIR
set -uo pipefail
src=${1:?usage: text_corpus_test.sh SOURCE_DIR}
tmp=$(mktemp -d /tmp/rp-corpus-test-XXXXXX)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "text_corpus_test: $*" >&2; exit 1; }
bash "$src/bench/text_corpus.sh" "$tmp/a" 100000 > "$tmp/a.out" || fail "a 100000-byte corpus failed: $(cat "$tmp/a.out")"
bash "$src/bench/text_corpus.sh" "$tmp/b" 100000 > "$tmp/b.out" || fail "the second run failed"
[ "$(stat -c %s "$tmp/a")" -eq 100000 ] || fail "wrote $(stat -c %s "$tmp/a") bytes, not 100000"
cmp -s "$tmp/a" "$tmp/b" || fail "two runs wrote different bytes"
grep -q "^$(md5sum "$tmp/a" | cut -d' ' -f1) " "$tmp/a.out" || fail "the printed md5 is not the file's: $(cat "$tmp/a.out")"
bash "$src/bench/text_corpus.sh" "$tmp/c" 12abc 2> "$tmp/c.err"; rc=$?
[ $rc -eq 2 ] && grep -q "SIZE must be" "$tmp/c.err" || fail "a bad size gave exit $rc: $(cat "$tmp/c.err")"
bash "$src/bench/text_corpus.sh" "$tmp/d" 1000000000000 2> "$tmp/d.err"; rc=$?
[ $rc -eq 1 ] && grep -q "found only" "$tmp/d.err" || fail "a size beyond the text gave exit $rc: $(cat "$tmp/d.err")"
echo "text_corpus_test: passed"
