# SPDX-License-Identifier: Apache-2.0
# Every find_package of the project, in one place. Configuring never downloads anything.
find_package(Threads REQUIRED)
# glog must precede LibTorch on the link line: a LibTorch built without glog (the torch wheel's)
# defines logging symbols of the same names in libc10 (FLAGS_logtostderr and others), and which
# definition a reference binds to depends on link order (see common/logging.h and common/logging.cc).
find_package(glog REQUIRED)
find_package(Boost 1.74 REQUIRED)
find_package(ZLIB REQUIRED)  # CRC-32 of checkpoint chunks
find_package(OpenSSL REQUIRED COMPONENTS Crypto)  # HMAC-SHA256 of the node store's values
find_package(cppzmq REQUIRED)
find_package(tomlplusplus REQUIRED)
find_package(nlohmann_json 3 REQUIRED)
find_package(CLI11 REQUIRED)
# TensorBoard event files (io/tensorboard.h): the Event and Summary messages through protoc.
find_package(Protobuf REQUIRED)
find_package(Torch REQUIRED)

# LibTorch's exported flags (ABI define) apply only to targets that use torch; keep them out of
# the global flags so torch-free libraries stay torch-free.
if(TARGET torch)
  set(RP_TORCH_TARGET torch)
endif()

# CUDA is used only when the LibTorch we build against has it (the GPU host's torch wheel).
set(RP_WITH_CUDA_DEFAULT OFF)
if(TORCH_CUDA_LIBRARIES OR TARGET torch_cuda OR TARGET c10_cuda)
  find_package(CUDAToolkit QUIET)
  # nvcc too: the project's own kernels need it.
  if(CUDAToolkit_FOUND AND CUDAToolkit_NVCC_EXECUTABLE)
    set(RP_WITH_CUDA_DEFAULT ON)
  endif()
endif()
option(RP_WITH_CUDA "Build the CUDA worker backend" ${RP_WITH_CUDA_DEFAULT})
if(RP_WITH_CUDA)
  find_package(CUDAToolkit REQUIRED)
  # The project's own kernels (gpu_worker/cuda/kernels.cu). Architectures: the ones LibTorch is
  # told to build for (TORCH_CUDA_ARCH_LIST, e.g. "9.0" on the H200 host), else this machine's.
  if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
    if(DEFINED ENV{TORCH_CUDA_ARCH_LIST})
      string(REPLACE "." "" _rp_archs "$ENV{TORCH_CUDA_ARCH_LIST}")
      string(REPLACE " " ";" _rp_archs "${_rp_archs}")
      string(REPLACE "+PTX" "" _rp_archs "${_rp_archs}")
      set(CMAKE_CUDA_ARCHITECTURES "${_rp_archs}")
    elseif(CMAKE_VERSION VERSION_GREATER_EQUAL 3.24)
      set(CMAKE_CUDA_ARCHITECTURES native)  # this machine's GPU
    else()
      message(FATAL_ERROR "RP_WITH_CUDA: set TORCH_CUDA_ARCH_LIST (e.g. 9.0) or CMAKE_CUDA_ARCHITECTURES (e.g. 90)")
    endif()
  endif()
  if(NOT CMAKE_CUDA_COMPILER AND EXISTS "${CUDAToolkit_BIN_DIR}/nvcc")
    set(CMAKE_CUDA_COMPILER "${CUDAToolkit_BIN_DIR}/nvcc")
  endif()
  enable_language(CUDA)
endif()
message(STATUS "RoundPipe: RP_WITH_CUDA=${RP_WITH_CUDA}, Torch ${Torch_VERSION}")

find_package(GTest QUIET)

# Several nodes: LibTorch's c10d (TCPStore) for the rendezvous, its ProcessGroupGloo for CPU
# workers' cross-node sums. Debian's LibTorch has both, Gloo's headers coming from libgloo-dev.
set(RP_WITH_C10D OFF)
set(RP_WITH_GLOO OFF)
find_path(RP_C10D_INCLUDE torch/csrc/distributed/c10d/TCPStore.hpp HINTS ${TORCH_INCLUDE_DIRS})
if(RP_C10D_INCLUDE)
  set(RP_WITH_C10D ON)
  find_path(RP_GLOO_INCLUDE gloo/context.h HINTS ${TORCH_INCLUDE_DIRS})
  if(RP_GLOO_INCLUDE AND EXISTS "${RP_C10D_INCLUDE}/torch/csrc/distributed/c10d/ProcessGroupGloo.hpp")
    set(RP_WITH_GLOO ON)
  endif()
endif()
# CUDA workers on several nodes: c10d's ProcessGroupNCCL (in libtorch_cuda), whose header needs
# nccl.h: the torch wheel's nvidia-nccl package next to it, else the system's.
set(RP_WITH_NCCL OFF)
if(RP_WITH_CUDA AND RP_WITH_C10D AND EXISTS "${RP_C10D_INCLUDE}/torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp")
  get_filename_component(_rp_site_packages "${Torch_DIR}/../../../.." ABSOLUTE)
  find_path(RP_NCCL_INCLUDE nccl.h HINTS "${_rp_site_packages}/nvidia/nccl/include" ${CUDAToolkit_INCLUDE_DIRS})
  if(RP_NCCL_INCLUDE)
    set(RP_WITH_NCCL ON)
  endif()
endif()
message(STATUS "RoundPipe: several nodes: c10d ${RP_WITH_C10D}, Gloo ${RP_WITH_GLOO}, NCCL ${RP_WITH_NCCL}")
