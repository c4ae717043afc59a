#!/usr/bin/env bash
# The environment is read in one place: no product source but common/environment.cc calls getenv
# (or secure_getenv) or reads environ, and every RP_TEST_* hook a product source names is in
# common/test_hooks.h's kTestHookVariables, which reads them once.
#   tests/tools/environment_test.sh SOURCE_DIR
set -euo pipefail
cd "$1"
dirs=(common config io planning protocol model shm nodes optim coordinator gpu_worker launcher tools bench)
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  mapfile -t files < <(git ls-files -- "${dirs[@]/%//}" | grep -E '\.(cc|h|cu|cuh)$')
else
  mapfile -t files < <(find "${dirs[@]}" -type f | grep -E '\.(cc|h|cu|cuh)$')
fi
((${#files[@]} > 0)) || { echo "environment_test: no sources found under $PWD" >&2; exit 1; }
reader='\b(secure_)?getenv\s*\(|\benviron\b'
# The pattern must find what it is meant to find, or the check proves nothing.
for probe in 'const char* v = std::getenv("X");' 'for (char** e = environ; *e; ++e) {}'; do
  grep -qP "$reader" <<< "$probe" || { echo "environment_test: the pattern misses: $probe" >&2; exit 1; }
done
status=0
readers=$(grep -nP "$reader" "${files[@]}" | grep -v '^common/environment\.cc:' | grep -vP '^[^:]+:[0-9]+:\s*//' || true)
if [ -n "$readers" ]; then
  echo "environment_test: read the environment through rp::EnvironmentValue (common/environment.h), not here:" >&2
  echo "$readers" >&2
  status=1
fi
listed=$(grep -oE '"RP_TEST_[A-Z_]+"' common/test_hooks.h | tr -d '"' | grep -vx 'RP_TEST_X' | sort -u)
named=$(grep -ohE 'RP_TEST_[A-Z_]+' "${files[@]}" | grep -vx 'RP_TEST_X' | sort -u)
missing=$(comm -13 <(echo "$listed") <(echo "$named"))
if [ -n "$missing" ]; then
  echo "environment_test: hooks named in the sources but not in kTestHookVariables:" $missing >&2
  status=1
fi
[ "$status" = 0 ] && echo "environment_test: ${#files[@]} files read the environment through common/environment.h; $(wc -w <<< "$listed") test hooks listed"
exit $status
