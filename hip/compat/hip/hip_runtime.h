// kvmulti's HIP -> CUDA compat header: lets the kvmulti .hip sources compile with plain
// `nvcc -x cu -I hip/compat` (Debian's HIP-on-NVIDIA headers do not work with CUDA 13).
// Only the subset the kvmulti kernels and launcher use.
#pragma once
#include <cuda_runtime.h>
// Before the __shfl* macros below: these headers declare CUDA's own (deprecated) __shfl overloads.
#include <cuda_fp16.h>
#include <cuda_bf16.h>

#ifndef __HIP_PLATFORM_NVIDIA__
#define __HIP_PLATFORM_NVIDIA__ 1
#endif

typedef cudaError_t hipError_t;
typedef cudaStream_t hipStream_t;
typedef cudaDeviceAttr hipDeviceAttribute_t;
#define hipSuccess cudaSuccess
#define hipErrorInvalidValue cudaErrorInvalidValue
#define hipErrorInvalidConfiguration cudaErrorInvalidConfiguration
#define hipErrorInvalidDeviceFunction cudaErrorInvalidDeviceFunction
#define hipErrorLaunchFailure cudaErrorLaunchFailure
#define hipDeviceAttributeWarpSize cudaDevAttrWarpSize
#define hipDeviceAttributeMultiprocessorCount cudaDevAttrMultiProcessorCount
#define hipDeviceAttributeMaxThreadsPerBlock cudaDevAttrMaxThreadsPerBlock
#define hipGetLastError cudaGetLastError
#define hipPeekAtLastError cudaPeekAtLastError
#define hipGetErrorString cudaGetErrorString
#define hipGetDevice cudaGetDevice
#define hipDeviceGetAttribute cudaDeviceGetAttribute
#define hipStreamSynchronize cudaStreamSynchronize
#define hipDeviceSynchronize cudaDeviceSynchronize

#define HIP_DYNAMIC_SHARED(type, var) extern __shared__ type var[];
#define HIP_DYNAMIC_SHARED_ATTRIBUTE
#define hipLaunchKernelGGL(kernel, grid, block, shmem, stream, ...) \
  (kernel)<<<(grid), (block), (shmem), (stream)>>>(__VA_ARGS__)

#if defined(__CUDACC__)
// HIP's shuffles act on the whole wavefront; kvmulti only calls them with every lane active.
#define __shfl_xor(var, mask, ...) __shfl_xor_sync(0xffffffffu, (var), (mask), ##__VA_ARGS__)
#define __shfl_down(var, delta, ...) __shfl_down_sync(0xffffffffu, (var), (delta), ##__VA_ARGS__)
#define __shfl_up(var, delta, ...) __shfl_up_sync(0xffffffffu, (var), (delta), ##__VA_ARGS__)
#define __shfl(var, lane, ...) __shfl_sync(0xffffffffu, (var), (lane), ##__VA_ARGS__)
#endif
