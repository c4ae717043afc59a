#!/usr/bin/env bash
# Packs the non-LibTorch C++ dependencies for a GPU host without network access (many training
# clusters have none). Run on a Debian bookworm machine with apt access:
#   scripts/pack-offline-deps.sh DIR
# then copy DIR to the GPU host (or keep it in the checkout, ignored by git) and there:
#   source DIR/offline-env.sh
#   cmake -S . -B build-cuda -G Ninja -DCMAKE_BUILD_TYPE=Release $RP_CMAKE_ARGS && cmake --build build-cuda
# The host needs CUDA, a C++20 compiler, CMake, Boost headers, GoogleTest, protobuf 3 (libprotobuf-dev
# and protobuf-compiler) and python3 with a CUDA torch wheel (its LibTorch is what we link).
# Bookworm's libraries (glibc 2.36) run on newer glibc hosts such as Ubuntu 24.04.
set -euo pipefail
dir=${1:?usage: pack-offline-deps.sh DIR}
mkdir -p "$dir/debs"
dir=$(cd "$dir" && pwd)
pkgs=(libzmq5 libzmq3-dev cppzmq-dev libsodium23 libpgm-5.3-0 libnorm1
      libgoogle-glog0v6 libgoogle-glog-dev libgflags2.2 libgflags-dev libunwind8 libunwind-dev liblzma-dev
      libtomlplusplus3 libtomlplusplus-dev nlohmann-json3-dev libcli11-dev zlib1g zlib1g-dev libssl3 libssl-dev)
(cd "$dir/debs" && apt-get download "${pkgs[@]}" 2>&1 | grep -v '^W: ' || true)
cp "$(dirname "$0")/offline-env.sh" "$dir/offline-env.sh"
echo "packed $(ls "$dir/debs" | wc -l) packages into $dir ($(du -sh "$dir" | cut -f1))"
