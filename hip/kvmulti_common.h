// kvmulti HIP kernels: shared helpers (dtype conversion, wave size, block reductions).
//
// The same source compiles with
//   * hipcc / clang -x hip for AMD GPUs (HIP_PLATFORM=amd),
//   * nvcc -x cu through kvmulti's compat headers (hip/compat),
//   * g++ through kvmulti's HIP-on-CPU harness (hip/cpu_harness).
#pragma once

#include <hip/hip_runtime.h>
#include <hip/hip_fp16.h>
#include <hip/hip_bfloat16.h>
#include <float.h>
#include <stdint.h>

namespace kvmulti {

// Threads per attention block = kNumWarps * WAVE (256 on CDNA wave64, 128 on RDNA wave32 / NVIDIA).
constexpr int kNumWarps = 4;

// Wave size of the code being generated: 64 on CDNA (gfx9), 32 on RDNA (gfx10+/gfx11 default wave32)
// and NVIDIA; 0 on host passes and on the CPU harness (where the launcher picks the instantiation
// from the emulated device's warp size). Kernels are templated on WAVE; an instantiation whose WAVE
// differs from the target's wave size compiles to an empty body (it can never be launched there:
// the launcher dispatches on hipDeviceAttributeWarpSize).
#if defined(__HIP_DEVICE_COMPILE__) && defined(__AMDGCN_WAVEFRONT_SIZE__)
#define KVMULTI_DEVICE_WAVE __AMDGCN_WAVEFRONT_SIZE__
#elif defined(__HIP_DEVICE_COMPILE__) && defined(__AMDGCN_WAVEFRONT_SIZE)
#define KVMULTI_DEVICE_WAVE __AMDGCN_WAVEFRONT_SIZE
#elif defined(__CUDA_ARCH__)
#define KVMULTI_DEVICE_WAVE 32
#else
#define KVMULTI_DEVICE_WAVE 0
#endif

template <int WAVE>
__host__ __device__ constexpr bool wave_matches_target() {
  return KVMULTI_DEVICE_WAVE == 0 || KVMULTI_DEVICE_WAVE == WAVE;
}

template <typename T> struct Cvt;
template <> struct Cvt<float> {
  __device__ __forceinline__ static float to(float x) { return x; }
  __device__ __forceinline__ static float from(float x) { return x; }
};
template <> struct Cvt<__half> {
  __device__ __forceinline__ static float to(__half x) { return __half2float(x); }
  __device__ __forceinline__ static __half from(float x) { return __float2half(x); }
};
template <> struct Cvt<hip_bfloat16> {
  __device__ __forceinline__ static float to(hip_bfloat16 x) { return static_cast<float>(x); }
  __device__ __forceinline__ static hip_bfloat16 from(float x) { return hip_bfloat16(x); }
};

// Butterfly reductions inside one wave. Every lane of the wave must call them (uniform control flow).
template <int WAVE>
__device__ __forceinline__ float wave_sum(float v) {
#pragma unroll
  for (int m = WAVE / 2; m > 0; m >>= 1) v += __shfl_xor(v, m, WAVE);
  return v;
}
template <int WAVE>
__device__ __forceinline__ float wave_max(float v) {
#pragma unroll
  for (int m = WAVE / 2; m > 0; m >>= 1) v = fmaxf(v, __shfl_xor(v, m, WAVE));
  return v;
}

// Block-wide reduction; every thread of the block must call it and gets the same result (the
// per-wave partials are combined in the same order by every thread). red: NUM_WARPS floats of
// shared memory. Contains two barriers; it also publishes every shared-memory write made before it.
template <int WAVE, int NUM_WARPS, bool IS_MAX>
__device__ __forceinline__ float block_reduce(float v, float* red) {
  v = IS_MAX ? wave_max<WAVE>(v) : wave_sum<WAVE>(v);
  const int tid = (int)threadIdx.x;
  if (tid % WAVE == 0) red[tid / WAVE] = v;
  __syncthreads();
  float r = red[0];
#pragma unroll
  for (int i = 1; i < NUM_WARPS; ++i) r = IS_MAX ? fmaxf(r, red[i]) : r + red[i];
  __syncthreads();  // red[] may be rewritten by the next reduction
  return r;
}

}  // namespace kvmulti
