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
// (query token, query head) rows computed by one attention block (see RowMap in kvmulti_attention.hip).
constexpr int kMaxRows = 8;

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

// 16 bytes of a row: 4 floats or 8 halves / bf16s, read with one vector load.
struct alignas(16) Chunk16 {
  uint32_t w[4];
};
template <typename T> struct ChunkElem;
template <> struct ChunkElem<float> {
  static constexpr int N = 4;
  __device__ __forceinline__ static float get(const Chunk16& c, int j) { return __uint_as_float(c.w[j]); }
};
template <> struct ChunkElem<__half> {
  static constexpr int N = 8;
  __device__ __forceinline__ static float get(const Chunk16& c, int j) {
    return __half2float(__ushort_as_half((unsigned short)((c.w[j >> 1] >> (16 * (j & 1))) & 0xffffu)));
  }
};
template <> struct ChunkElem<hip_bfloat16> {
  static constexpr int N = 8;
  __device__ __forceinline__ static float get(const Chunk16& c, int j) {
    return __uint_as_float(((c.w[j >> 1] >> (16 * (j & 1))) & 0xffffu) << 16);
  }
};

// Dot products of up to G (pre-scaled, fp32) query rows in shared memory (q: [G][HS]) with one K
// row of HS elements, read once; rows [0, rows) are computed into s[]. aligned (16-byte aligned
// row; the usual case, see kv_aligned16) reads the row in 16-byte chunks, else element by element.
template <typename T, int HS, int G>
__device__ __forceinline__ void dot_rows(const float* __restrict__ q, const T* __restrict__ row, bool aligned,
                                         int rows, float (&s)[G]) {
  constexpr int N = ChunkElem<T>::N;
#pragma unroll
  for (int r = 0; r < G; ++r) s[r] = 0.f;
  if (HS % N == 0 && aligned) {
    const Chunk16* chunks = reinterpret_cast<const Chunk16*>(row);
    for (int i = 0; i < HS / N; ++i) {
      const Chunk16 c = chunks[i];
#pragma unroll
      for (int j = 0; j < N; ++j) {
        const float k = ChunkElem<T>::get(c, j);
#pragma unroll
        for (int r = 0; r < G; ++r)
          if (r < rows) s[r] += q[r * HS + i * N + j] * k;
      }
    }
  } else {
    for (int d = 0; d < HS; ++d) {
      const float k = Cvt<T>::to(row[d]);
#pragma unroll
      for (int r = 0; r < G; ++r)
        if (r < rows) s[r] += q[r * HS + d] * k;
    }
  }
}

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

// Block-wide reduction of G values per thread at once (rows [0, rows) used; rows must be
// block-uniform). red: G x NUM_WARPS floats of shared memory. Two barriers; publishes every
// shared-memory write made before it.
template <int WAVE, int NUM_WARPS, bool IS_MAX, int G>
__device__ __forceinline__ void block_reduce_rows(float (&v)[G], int rows, float (*red)[NUM_WARPS]) {
  const int tid = (int)threadIdx.x;
#pragma unroll
  for (int r = 0; r < G; ++r) {
    if (r < rows) {  // uniform across the block: every lane reaches the same shuffles
      const float w = IS_MAX ? wave_max<WAVE>(v[r]) : wave_sum<WAVE>(v[r]);
      if (tid % WAVE == 0) red[r][tid / WAVE] = w;
    }
  }
  __syncthreads();
#pragma unroll
  for (int r = 0; r < G; ++r) {
    if (r < rows) {
      float x = red[r][0];
#pragma unroll
      for (int i = 1; i < NUM_WARPS; ++i) x = IS_MAX ? fmaxf(x, red[r][i]) : x + red[r][i];
      v[r] = x;
    }
  }
  __syncthreads();  // red[][] may be rewritten by the next reduction
}

}  // namespace kvmulti
