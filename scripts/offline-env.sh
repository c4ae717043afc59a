# Source on the offline GPU host (see pack-offline-deps.sh). Unpacks the packed .debs once into
# $RP_DEPS_PREFIX (default /opt/rpdeps), then points CMake and the loader at them and at the
# LibTorch inside the python3 torch wheel. Exports RP_CMAKE_ARGS for the configure step.
_rp_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
_rp_prefix=${RP_DEPS_PREFIX:-/opt/rpdeps}
if [ ! -f "$_rp_prefix/.rp-unpacked" ]; then
  mkdir -p "$_rp_prefix"
  for _rp_deb in "$_rp_dir"/debs/*.deb; do dpkg-deb -x "$_rp_deb" "$_rp_prefix"; done
  # Debian's -dev links are absolute (/lib/x86_64-linux-gnu/...): point them into the prefix.
  find "$_rp_prefix" -type l -lname '/*' | while read -r _rp_link; do
    _rp_target=$(readlink "$_rp_link")
    [ -e "$_rp_prefix$_rp_target" ] && ln -sf "$_rp_prefix$_rp_target" "$_rp_link"
  done
  touch "$_rp_prefix/.rp-unpacked"
fi
_rp_torch=$(python3 -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')
export CMAKE_PREFIX_PATH="$_rp_torch:$_rp_prefix/usr${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"
export LD_LIBRARY_PATH="$_rp_prefix/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# Torch's CMake config ignores CMAKE_CUDA_ARCHITECTURES; it reads this instead.
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-$(python3 -c 'import torch; c = torch.cuda.get_device_capability() if torch.cuda.is_available() else (9, 0); print(f"{c[0]}.{c[1]}")')}
# glog's CMake config looks for its Unwind module next to itself, not under /usr/share.
export RP_CMAKE_ARGS="-DCMAKE_MODULE_PATH=$_rp_prefix/usr/share/glog/cmake"
unset _rp_dir _rp_prefix _rp_torch _rp_deb _rp_link _rp_target
