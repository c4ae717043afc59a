#!/usr/bin/env bash
# Installs what is missing on Debian bookworm (as root, or with sudo), then configures and builds
# into build/. Idempotent: a machine that has everything skips apt entirely.
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(g++ cmake ninja-build pkg-config libtorch-dev libopenblas0-serial libzmq3-dev cppzmq-dev
          libboost-dev libgoogle-glog-dev libtomlplusplus-dev nlohmann-json3-dev libcli11-dev
          libgtest-dev zlib1g-dev libssl-dev libgloo-dev libprotobuf-dev protobuf-compiler gdb iproute2
          clang-format)
# RP_EXTRA_PACKAGES: more for the caller (scripts/test.sh adds the browser its report test renders in).
packages+=(${RP_EXTRA_PACKAGES:-})
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# Debian's LibTorch calls whatever libblas.so.3 the alternatives system selects; the reference
# BLAS is ~10x slower than OpenBLAS. Single-threaded OpenBLAS also keeps CPU results
# reproducible (one intra-op thread per worker).
export OPENBLAS_NUM_THREADS=1

cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
# Two jobs at most: a LibTorch translation unit needs about 1 GB of memory to compile.
cmake --build build -j "${RP_BUILD_JOBS:-2}"
