// kvmulti HIP kernels: shared helpers (dtype conversion, wave size, wave sync, 16-byte chunks, MFMA wrappers).
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
#include <type_traits>

// Device code for an AMD GPU: not NVIDIA through hip/compat, not the CPU harness (which defines
// KVMULTI_HIP_CPU_HARNESS in its hip_runtime.h).
#if defined(__HIP_DEVICE_COMPILE__) && !defined(__CUDA_ARCH__) && !defined(KVMULTI_HIP_CPU_HARNESS)
#define KVM_AMDGPU_DEVICE 1
#else
#define KVM_AMDGPU_DEVICE 0
#endif

// Built without AMD's device libraries (clang -nogpulib, KVM_NO_DEVICE_LIBS: Debian's clang-19 for
// gfx942 / gfx11 / gfx12, whose ROCm 5.2 device libraries lack those targets): the work-item queries
// the HIP headers' threadIdx / blockIdx / blockDim call and the fence their __syncthreads calls are
// defined here from compiler builtins, so no kernel calls into a device library. With the device
// libraries (hipcc, ROCm) they come from there.
#if defined(KVM_NO_DEVICE_LIBS) && KVM_AMDGPU_DEVICE
extern "C" __device__ inline __attribute__((always_inline, const)) size_t __ockl_get_local_id(uint dim) {
  return dim == 0 ? __builtin_amdgcn_workitem_id_x()
                  : dim == 1 ? __builtin_amdgcn_workitem_id_y() : __builtin_amdgcn_workitem_id_z();
}
extern "C" __device__ inline __attribute__((always_inline, const)) size_t __ockl_get_group_id(uint dim) {
  return dim == 0 ? __builtin_amdgcn_workgroup_id_x()
                  : dim == 1 ? __builtin_amdgcn_workgroup_id_y() : __builtin_amdgcn_workgroup_id_z();
}
extern "C" __device__ inline __attribute__((always_inline, const)) size_t __ockl_get_local_size(uint dim) {
  return dim == 0 ? __builtin_amdgcn_workgroup_size_x()
                  : dim == 1 ? __builtin_amdgcn_workgroup_size_y() : __builtin_amdgcn_workgroup_size_z();
}
// Every address space is fenced whatever the flags say (as strong as asked for, or stronger).
#define KVMULTI_FENCE_AT(order)                                                                 \
  switch (scope) {                                                                              \
    case __memory_scope_work_item: break;                                                       \
    case __memory_scope_sub_group: __builtin_amdgcn_fence(order, "wavefront"); break;            \
    case __memory_scope_work_group: __builtin_amdgcn_fence(order, "workgroup"); break;           \
    case __memory_scope_device: __builtin_amdgcn_fence(order, "agent"); break;                   \
    default: __builtin_amdgcn_fence(order, ""); break;                                          \
  }
extern "C" __device__ inline __attribute__((always_inline)) void __atomic_work_item_fence(
    __cl_mem_fence_flags, __memory_order order, __memory_scope scope) {
  switch (order) {
    case __memory_order_relaxed: break;
    case __memory_order_acquire: KVMULTI_FENCE_AT(__ATOMIC_ACQUIRE) break;
    case __memory_order_release: KVMULTI_FENCE_AT(__ATOMIC_RELEASE) break;
    case __memory_order_acq_rel: KVMULTI_FENCE_AT(__ATOMIC_ACQ_REL) break;
    default: KVMULTI_FENCE_AT(__ATOMIC_SEQ_CST) break;
  }
}
#undef KVMULTI_FENCE_AT
#endif

namespace kvmulti {

// Threads per attention block = kNumWarps * WAVE (256 on CDNA wave64, 128 on RDNA wave32 / NVIDIA).
constexpr int kNumWarps = 4;
// Query rows per prefill work-group: one 16-row tile per wave.
constexpr int kPrefillRows = 16 * kNumWarps;

// fp8 KV-cache elements (kvmulti/fp8.py): the raw byte of torch.float8_e4m3fn / torch.float8_e5m2 (OCP)
// and of torch.float8_e4m3fnuz / torch.float8_e5m2fnuz (gfx942's FNUZ formats: exponent bias one higher,
// no infinity, no negative zero, one NaN 0x80).
struct Fp8E4M3 {
  uint8_t bits;
};
struct Fp8E5M2 {
  uint8_t bits;
};
struct Fp8E4M3Fnuz {
  uint8_t bits;
};
struct Fp8E5M2Fnuz {
  uint8_t bits;
};
template <typename C> struct Fp8Format {
  static constexpr bool kIsFp8 = false;
};
template <> struct Fp8Format<Fp8E4M3> {  // 3 mantissa bits, bias 7, largest finite 448, NaN 0x7F
  static constexpr bool kIsFp8 = true, kFnuz = false;
  static constexpr int kMant = 3, kBias = 7;
  static constexpr uint32_t kMaxBits = 0x43E00000u;
};
template <> struct Fp8Format<Fp8E5M2> {  // 2 mantissa bits, bias 15, largest finite 57344, IEEE inf/NaN
  static constexpr bool kIsFp8 = true, kFnuz = false;
  static constexpr int kMant = 2, kBias = 15;
  static constexpr uint32_t kMaxBits = 0x47600000u;
};
template <> struct Fp8Format<Fp8E4M3Fnuz> {  // 3 mantissa bits, bias 8, largest finite 240, NaN 0x80
  static constexpr bool kIsFp8 = true, kFnuz = true;
  static constexpr int kMant = 3, kBias = 8;
  static constexpr uint32_t kMaxBits = 0x43700000u;
};
template <> struct Fp8Format<Fp8E5M2Fnuz> {  // 2 mantissa bits, bias 16, largest finite 57344, NaN 0x80
  static constexpr bool kIsFp8 = true, kFnuz = true;
  static constexpr int kMant = 2, kBias = 16;
  static constexpr uint32_t kMaxBits = 0x47600000u;
};
template <typename C>
__host__ __device__ constexpr bool is_fp8() {
  return Fp8Format<C>::kIsFp8;
}

// (query token, query head) rows computed by one attention block (see RowMap in
// kvmulti_attention.hip): 16 for 16-bit queries on wave64 (the N dimension of the 16x16x16 MFMA tiles;
// the cache may be 16-bit or fp8, whose codes the MFMA engine widens to the query's type), 8 otherwise
// (the FMA path keeps per-row state in registers). T: the query's type, C: the cache's.
template <typename T, int WAVE, typename C = T>
__host__ __device__ constexpr int rows_per_block() {
  static_assert(sizeof(C) == sizeof(T) || is_fp8<C>(), "a cache holds the query's type or fp8 codes");
  return (sizeof(T) == 2 && WAVE == 64) ? 16 : 8;
}

// Matrix cores: CDNA2 (gfx90a) and CDNA3 (gfx940/941/942) device passes, and the CPU harness (which
// emulates the builtins). Everything else (host passes, RDNA, NVIDIA) uses the FMA path.
#if defined(KVMULTI_HIP_CPU_HARNESS)
#define KVMULTI_HAS_MFMA 1
#elif defined(__HIP_DEVICE_COMPILE__) && \
    (defined(__gfx90a__) || defined(__gfx940__) || defined(__gfx941__) || defined(__gfx942__))
#define KVMULTI_HAS_MFMA 1
#else
#define KVMULTI_HAS_MFMA 0
#endif

// WMMA (16x16x16 wave32 matrix instructions): RDNA3 (gfx11) and RDNA4 (gfx12) device passes, whose operand
// layouts differ (see wmma_family), and the CPU harness (which emulates either, kvcpu_set_wmma_family).
#if defined(KVMULTI_HIP_CPU_HARNESS)
#define KVMULTI_HAS_WMMA 1
#elif KVM_AMDGPU_DEVICE && (defined(__GFX11__) || defined(__GFX12__))
#define KVMULTI_HAS_WMMA 1
#else
#define KVMULTI_HAS_WMMA 0
#endif

// True when the code being generated runs with WAVE lanes per wave. Kernels are templated on WAVE
// and return at once when it does not match (the launcher dispatches on hipDeviceAttributeWarpSize,
// so such an instantiation is never launched; the branch folds away and leaves an empty body).
// AMD: HIP's warpSize (constexpr in HIP 5.x, __builtin_amdgcn_wavefrontsize() in newer ROCm; both
// fold at compile time) -- not the deprecated __AMDGCN_WAVEFRONT_SIZE(__) macros. NVIDIA: 32. The CPU
// harness: the launcher already picked the instantiation of the emulated device's warp size.
template <int WAVE>
__device__ __forceinline__ bool wave_matches_target() {
#if defined(KVMULTI_HIP_CPU_HARNESS)
  return true;
#elif defined(__CUDA_ARCH__)
  return WAVE == 32;
#elif defined(__HIP_DEVICE_COMPILE__)
  return warpSize == WAVE;
#else
  return true;
#endif
}

// Wave-level barrier: LDS writes made by the lanes of this wave before it are visible to every lane of
// the wave after it. Every lane must call it (uniform control flow).
__device__ __forceinline__ void wave_sync() {
#if defined(KVMULTI_HIP_CPU_HARNESS)
  ::kvcpu::warp_sync();
#elif defined(__CUDA_ARCH__)
  __syncwarp();
#elif defined(__HIP_DEVICE_COMPILE__)
  __builtin_amdgcn_fence(__ATOMIC_RELEASE, "wavefront");
  __builtin_amdgcn_wave_barrier();
  __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "wavefront");
#endif
}

// Whether the MFMA path may run (harness: kvcpu_set_mfma_enabled, to exercise both paths).
// A wave's key tile on the prefill kernel's FMA tile engine: the harness counts them (kvcpu_fma_tile_count).
__device__ __forceinline__ void count_fma_tile(int lane) {
#if defined(KVMULTI_HIP_CPU_HARNESS)
  if (lane == 0) ::kvcpu::count_fma_tile();
#else
  (void)lane;
#endif
}

__device__ __forceinline__ bool mfma_enabled() {
#if defined(KVMULTI_HIP_CPU_HARNESS)
  return ::kvcpu::mfma_enabled();
#else
  return true;
#endif
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

// fp8 code -> fp32 (exact): the fp32 bit pattern of a normal code, m * 2^(1 - bias - mant) for a
// subnormal one; e4m3fn has no inf and NaN at 0x7F, e5m2 IEEE inf/NaN at exponent 31, the FNUZ formats
// NaN at 0x80 alone (their top exponent is finite).
template <typename C>
__device__ __forceinline__ float fp8_decode(uint8_t code) {
  using F = Fp8Format<C>;
  const uint32_t sign = (uint32_t)(code & 0x80u) << 24;
  const uint32_t e = (code & 0x7Fu) >> F::kMant, m = code & ((1u << F::kMant) - 1u);
  constexpr uint32_t kTopExp = (1u << (7 - F::kMant)) - 1u;
  float mag;
  if (F::kFnuz && code == 0x80u) {
    return __uint_as_float(0x7FC00000u);
  } else if (!F::kFnuz && F::kMant == 3 && (code & 0x7Fu) == 0x7Fu) {
    mag = __uint_as_float(0x7FC00000u);
  } else if (!F::kFnuz && F::kMant == 2 && e == kTopExp) {
    mag = __uint_as_float(m ? 0x7FC00000u : 0x7F800000u);
  } else if (e == 0) {
    mag = (float)m * __uint_as_float((uint32_t)(127 + 1 - F::kBias - F::kMant) << 23);
  } else {
    mag = __uint_as_float(((e + 127u - F::kBias) << 23) | (m << (23 - F::kMant)));
  }
  return __uint_as_float(__float_as_uint(mag) | sign);
}

// fp32 -> fp8 code by kvmulti/fp8.py's rule for an already divided value y: saturate to the largest
// finite value (±inf too), NaN -> 0x7F with its sign (FNUZ: 0x80), round to nearest even in integers (the
// normal range: add half an ulp - 1 + the kept low bit, truncate; the subnormal range: the 24-bit
// significand shifted to the fp8 quantum with the same rounding term); an FNUZ zero is +0 (0x80 is NaN).
template <typename C>
__device__ __forceinline__ uint8_t fp8_encode(float y) {
  using F = Fp8Format<C>;
  constexpr int kShift = 23 - F::kMant;
  const uint32_t bits = __float_as_uint(y);
  const uint32_t sign = (bits >> 24) & 0x80u;
  uint32_t mag = bits & 0x7FFFFFFFu;
  if (mag > 0x7F800000u) return F::kFnuz ? (uint8_t)0x80u : (uint8_t)(0x7Fu | sign);
  if (mag > F::kMaxBits) mag = F::kMaxBits;
  const int exponent = (int)(mag >> 23);
  uint32_t code;
  if (exponent >= 128 - F::kBias) {
    code = ((mag + ((1u << (kShift - 1)) - 1u) + ((mag >> kShift) & 1u)) >> kShift) -
           ((uint32_t)(127 - F::kBias) << F::kMant);
  } else {
    int shift = (151 - F::kBias - F::kMant) - exponent;
    shift = shift < 1 ? 1 : (shift > 31 ? 31 : shift);
    const uint32_t sig = (mag & 0x7FFFFFu) | 0x800000u;
    code = (sig + (1u << (shift - 1)) - 1u + ((sig >> shift) & 1u)) >> shift;
  }
  if (F::kFnuz && code == 0u) return 0u;
  return (uint8_t)(code | sign);
}

// fp8 code -> fp32 (exact, as fp8_decode) in a few ALU ops: the code's exponent and mantissa bits placed
// at the top of an fp32's (a normal code's fp32 exponent is then its own, a subnormal's an fp32 subnormal)
// times 2^(127 - bias), the sign kept; NaN codes (e4m3fn 0x7F / 0xFF, FNUZ 0x80) and e5m2's top exponent
// (inf / NaN) by select. Needs fp32 subnormals kept (the GPUs' default for HIP and CUDA; not flushed).
template <typename C>
__device__ __forceinline__ float fp8_to_float(uint32_t code) {
  using F = Fp8Format<C>;
  const uint32_t mag = code & 0x7Fu, sign = (code & 0x80u) << 24;
  const float x = __uint_as_float(sign | (mag << (23 - F::kMant))) *
                  __uint_as_float((uint32_t)(127 + 127 - F::kBias) << 23);
  if constexpr (F::kFnuz) {
    return code == 0x80u ? __uint_as_float(0x7FC00000u) : x;
  } else if constexpr (F::kMant == 3) {
    return mag == 0x7Fu ? __uint_as_float(sign | 0x7FC00000u) : x;
  } else {
    const bool top = mag >= 0x7Cu;  // exponent 31: inf (mantissa 0) or NaN
    return top ? __uint_as_float(sign | (mag == 0x7Cu ? 0x7F800000u : 0x7FC00000u)) : x;
  }
}

template <typename C> struct Fp8Cvt {
  __device__ __forceinline__ static float to(C x) { return fp8_decode<C>(x.bits); }
  __device__ __forceinline__ static C from(float x) { return C{fp8_encode<C>(x)}; }
};
template <> struct Cvt<Fp8E4M3> : Fp8Cvt<Fp8E4M3> {};
template <> struct Cvt<Fp8E5M2> : Fp8Cvt<Fp8E5M2> {};
template <> struct Cvt<Fp8E4M3Fnuz> : Fp8Cvt<Fp8E4M3Fnuz> {};
template <> struct Cvt<Fp8E5M2Fnuz> : Fp8Cvt<Fp8E5M2Fnuz> {};

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

template <typename T> struct Bits16;
template <> struct Bits16<__half> {
  __device__ __forceinline__ static unsigned short of(float x) { return __half_as_ushort(__float2half(x)); }
};
template <> struct Bits16<hip_bfloat16> {
  __device__ __forceinline__ static unsigned short of(float x) {
    const hip_bfloat16 b(x);
    unsigned short u;
    __builtin_memcpy(&u, &b, 2);
    return u;
  }
};

// 16 bytes at p: one 16-byte vector load when ALIGNED (p is 16-byte aligned), else element loads.
template <typename T, bool ALIGNED>
__device__ __forceinline__ Chunk16 load_chunk(const T* __restrict__ p) {
  if constexpr (ALIGNED) {
    return *reinterpret_cast<const Chunk16*>(p);
  } else if constexpr (sizeof(T) == 4) {
    Chunk16 c;
    const uint32_t* e = reinterpret_cast<const uint32_t*>(p);
#pragma unroll
    for (int i = 0; i < 4; ++i) c.w[i] = e[i];
    return c;
  } else if constexpr (sizeof(T) == 1) {
    Chunk16 c;
    const uint8_t* b = reinterpret_cast<const uint8_t*>(p);
#pragma unroll
    for (int i = 0; i < 4; ++i)
      c.w[i] = (uint32_t)b[4 * i] | ((uint32_t)b[4 * i + 1] << 8) | ((uint32_t)b[4 * i + 2] << 16) |
               ((uint32_t)b[4 * i + 3] << 24);
    return c;
  } else {
    Chunk16 c;
    const unsigned short* h = reinterpret_cast<const unsigned short*>(p);
#pragma unroll
    for (int i = 0; i < 4; ++i) c.w[i] = (uint32_t)h[2 * i] | ((uint32_t)h[2 * i + 1] << 16);
    return c;
  }
}

// The 16-bit halves `hi` (0: low, 1: high) of a and b as one word (a's in the low half): one v_perm_b32
// on AMD GPUs, shifts and masks elsewhere.
// x where `up`, else y, per lane. On AMD device passes a v_perm_b32 (the byte selector picks the source): as a
// select between two elements of an array, the optimizer would turn it into a lane-dependent index into the
// array, which the AMDGPU backend lowers to a select over every element (and the array to scratch).
__device__ __forceinline__ float lane_pick(bool up, float x, float y) {
#if KVM_AMDGPU_DEVICE
  return __uint_as_float(__builtin_amdgcn_perm(__float_as_uint(x), __float_as_uint(y), up ? 0x07060504u : 0x03020100u));
#else
  return up ? x : y;
#endif
}

__device__ __forceinline__ uint32_t pair_halves(uint32_t a, uint32_t b, int hi) {
#if KVM_AMDGPU_DEVICE
  return __builtin_amdgcn_perm(b, a, hi ? 0x07060302u : 0x05040100u);
#else
  return hi ? (a >> 16) | (b & 0xFFFF0000u) : (a & 0xFFFFu) | (b << 16);
#endif
}

// 2^x: v_exp_f32 on AMD GPUs (a compiler builtin where the compiler has it, else the device library's
// native exp2), exp2f elsewhere.
#if KVM_AMDGPU_DEVICE
#if __has_builtin(__builtin_amdgcn_exp2f)
#define KVMULTI_AMDGCN_EXP2(x) __builtin_amdgcn_exp2f(x)
#else
extern "C" __device__ float __ocml_native_exp2_f32(float);
#define KVMULTI_AMDGCN_EXP2(x) __ocml_native_exp2_f32(x)
#endif
#endif
__device__ __forceinline__ float fast_exp2(float x) {
#if KVM_AMDGPU_DEVICE
  return KVMULTI_AMDGCN_EXP2(x);
#else
  return exp2f(x);
#endif
}

// tanh (the softcap). Without AMD's device libraries (KVM_NO_DEVICE_LIBS) from v_exp_f32 and v_rcp_f32:
// (1 - e) / (1 + e) with e = exp(-2|x|), and below |x| = 1/8, where 1 - e would cancel, its Taylor series
// to x^7 (truncation under 2e-9 relative); the absolute error stays within a few 1e-7. tanhf elsewhere
// (with the device libraries: theirs).
__device__ __forceinline__ float softcap_tanh(float x) {
#if defined(KVM_NO_DEVICE_LIBS) && KVM_AMDGPU_DEVICE
  const float a = __builtin_fabsf(x);
  const float e = fast_exp2(-2.8853900817779268f * a);   // exp(-2a) = 2^(-2a log2 e)
  const float big = (1.f - e) * __builtin_amdgcn_rcpf(1.f + e);
  const float a2 = a * a;
  const float small = a * (1.f + a2 * (-1.f / 3.f + a2 * (2.f / 15.f + a2 * (-17.f / 315.f))));
  return __builtin_copysignf(a < 0.125f ? small : big, x);
#else
  return tanhf(x);
#endif
}


// Lane src's x as a wave-uniform value (src wave-uniform): v_readlane_b32 into a scalar register on AMD (no
// LDS traffic, unlike a shuffle); a shuffle on the CPU harness, which fails the launch when src differs
// between lanes. Every lane must call it.
__device__ __forceinline__ int wave_read_lane(int x, int src) {
#if defined(KVMULTI_HIP_CPU_HARNESS)
  if (__shfl(src, 0) != src) ::kvcpu::fail(hipErrorLaunchFailure, "kvcpu: wave_read_lane with a divergent lane");
  return __shfl(x, src);
#elif KVM_AMDGPU_DEVICE
  return __builtin_amdgcn_readlane(x, src);
#else
  return __shfl(x, src);
#endif
}

// out[k] = v[k] of lane (lane ^ mask) of the wave, k < N (mask < WAVE). Every lane must call it. N shuffles on
// a GPU; on the CPU harness one warp collective per 16 floats (what keeps its fiber switches few).
template <int WAVE, int N>
__device__ __forceinline__ void shfl_xor_n(const float (&v)[N], float (&out)[N], int mask) {
#if defined(KVMULTI_HIP_CPU_HARNESS)
  constexpr int kPer = (int)(::kvcpu::kSlotBytes / sizeof(float));
  for (int k0 = 0; k0 < N; k0 += kPer) {
    const int n = N - k0 < kPer ? N - k0 : kPer;
    const auto* slots = ::kvcpu::publish(v + k0, n * sizeof(float));
    __builtin_memcpy(out + k0, &slots[::kvcpu::lane_id() ^ mask][0], n * sizeof(float));
  }
#else
#pragma unroll
  for (int k = 0; k < N; ++k) out[k] = __shfl_xor(v[k], mask, WAVE);
#endif
}

// v[k] combined (max or sum) over the lanes whose lane bits differ from this lane's in masks FIRST .. WAVE / 2:
// a butterfly inside one wave. Every lane must call it.
template <int WAVE, int FIRST, bool MAX, int N>
__device__ __forceinline__ void butterfly(float (&v)[N]) {
#pragma unroll
  for (int m = FIRST; m < WAVE; m <<= 1) {
    float other[N];
    shfl_xor_n<WAVE, N>(v, other, m);
#pragma unroll
    for (int k = 0; k < N; ++k) v[k] = MAX ? fmaxf(v[k], other[k]) : v[k] + other[k];
  }
}
template <int WAVE, int FIRST = 1>
__device__ __forceinline__ float wave_max_from(float v) {
  float a[1] = {v};
  butterfly<WAVE, FIRST, true>(a);
  return a[0];
}
template <int WAVE, int FIRST = 1>
__device__ __forceinline__ float wave_sum_from(float v) {
  float a[1] = {v};
  butterfly<WAVE, FIRST, false>(a);
  return a[0];
}

// N values of type V every lane of the wave publishes; read(src, k) is value k of lane src (k a constant
// in unrolled code). Every lane must construct it and make the same reads (a shuffle each on a GPU); on
// the CPU harness the construction is the one warp collective and reads are loads, valid until the lane's
// next collective.
template <int WAVE, typename V, int N>
struct WaveView {
#if defined(KVMULTI_HIP_CPU_HARNESS)
  static_assert(N * sizeof(V) <= ::kvcpu::kSlotBytes, "a WaveView fits one harness slot");
  const uint64_t (*slots)[::kvcpu::kSlotWords];
  __device__ explicit WaveView(const V (&own)[N]) : slots(::kvcpu::publish(own, sizeof(own))) {}
  __device__ V read(int src, int k) const {
    V x;
    __builtin_memcpy(&x, reinterpret_cast<const unsigned char*>(&slots[src][0]) + k * sizeof(V), sizeof(V));
    return x;
  }
#else
  V own[N];
  __device__ explicit WaveView(const V (&v)[N]) {
#pragma unroll
    for (int k = 0; k < N; ++k) own[k] = v[k];
  }
  __device__ V read(int src, int k) const { return __shfl(own[k], src, WAVE); }
#endif
};

#if KVMULTI_HAS_MFMA || KVMULTI_HAS_WMMA
// Register types of the 16x16x16 matrix builtins: C/D 4 x fp32; A/B 4 x 16-bit (f16 or bf16).
#if defined(KVMULTI_HIP_CPU_HARNESS)
typedef ::kvcpu::f32x4 mfma_f32x4;
typedef ::kvcpu::f16x4 mfma_f16x4;
typedef ::kvcpu::bf16x4 mfma_bf16x4;
#else
typedef float mfma_f32x4 __attribute__((ext_vector_type(4)));
typedef _Float16 mfma_f16x4 __attribute__((ext_vector_type(4)));
typedef short mfma_bf16x4 __attribute__((ext_vector_type(4)));
#endif

// A or B fragment of a 16x16x16 tile: 4 consecutive K-elements (16-bit each) of one lane, 2 VGPRs.
struct Frag {
  uint32_t w[2];
};

// c += A * B for one 16 x 16 x 16 tile (v_mfma_f32_16x16x16f16 / _16x16x16bf16_1k); all 64 lanes.
template <typename T>
__device__ __forceinline__ mfma_f32x4 mfma_16x16x16(const Frag& a, const Frag& b, mfma_f32x4 c) {
  if constexpr (std::is_same<T, __half>::value) {
    mfma_f16x4 x, y;
    __builtin_memcpy(&x, &a, 8);
    __builtin_memcpy(&y, &b, 8);
    return __builtin_amdgcn_mfma_f32_16x16x16f16(x, y, c, 0, 0, 0);
  } else {
    mfma_bf16x4 x, y;
    __builtin_memcpy(&x, &a, 8);
    __builtin_memcpy(&y, &b, 8);
    return __builtin_amdgcn_mfma_f32_16x16x16bf16_1k(x, y, c, 0, 0, 0);
  }
}

// ---- fp8 codes -> 16-bit MFMA operands (the MFMA engine over fp8 caches)
// Every value of the four fp8 formats is exactly an fp16 value and exactly a bf16 value: e4m3fn's 4
// significand bits and range 2^-9 .. 448 fit fp16 (5 exponent bits; subnormals from 2^-24, largest 65504)
// and bf16; e5m2 is bit for bit the top byte of fp16 (same bias, same subnormals 2^-16 .. 3 * 2^-16, same
// inf / NaN encodings) and its 3 significand bits and range up to 57344 fit bf16; e4m3fnuz (2^-10 .. 240)
// and e5m2fnuz (2^-17 .. 57344, exponent 31 finite) are half the OCP formats' values of the same bits.
// NaN stays NaN and e5m2's ±inf stay ±inf, so the widening below is exact for all 256 codes of each
// format (the scales are applied outside the MFMAs: the fragments hold the codes' values).
//
// A "pair" holds two codes in the high byte of each 16-bit half (one in bits 8..15, one in bits 24..31),
// i.e. already at fp16's sign / exponent / top mantissa bits; the MFMA engine gathers them so.

// x * K (a power of two) in both fp16 halves of w: exact, the products are normal fp16 values. One
// v_pk_mul_f16 on the GPU, where fp16 denormal inputs are kept (the default FP16/FP64 denormal mode,
// .amdhsa_float_denorm_mode_16_64 3 in the kernel descriptor, checked by compile_check.py).
template <int K>
__device__ __forceinline__ uint32_t f16x2_times(uint32_t w) {
#if defined(KVMULTI_HIP_CPU_HARNESS)
  const float lo = __half2float(__ushort_as_half((unsigned short)(w & 0xFFFFu))) * (float)K;
  const float hi = __half2float(__ushort_as_half((unsigned short)(w >> 16))) * (float)K;
  return (uint32_t)__half_as_ushort(__float2half(lo)) | ((uint32_t)__half_as_ushort(__float2half(hi)) << 16);
#else
  typedef _Float16 f16x2 __attribute__((ext_vector_type(2)));
  f16x2 v;
  __builtin_memcpy(&v, &w, 4);
  v = v * (f16x2){(_Float16)(float)K, (_Float16)(float)K};
  __builtin_memcpy(&w, &v, 4);
  return w;
#endif
}

// The magnitudes of a pair of e4m3fn codes times 2^-8 as fp16 values, signs clear (exact: |code| << 7 at
// fp16's bit positions is the fp16 of |value| * 2^-8; subnormal codes give fp16 subnormals with the same
// significand). The same bits are an e4m3fnuz pair's magnitudes times 2^-7, without the NaN fix-up.
template <bool NAN_7F = true>
__device__ __forceinline__ uint32_t e4m3_pair_magnitudes(uint32_t pair) {
  const uint32_t mag = (pair >> 1) & 0x3F803F80u;
  if constexpr (!NAN_7F) return mag;
  // NaN (|code| = 0x7F, mag 0x3F80): mag + 0x80 reaches bit 14 for it alone; that bit completes the
  // exponent (0x7F80: fp16 NaN).
  return mag | ((mag + 0x00800080u) & 0x40004000u);
}

#if KVM_AMDGPU_DEVICE
// AMD devices: the FNUZ widenings below in packed 16-bit integer ops (v_pk_max_u16, v_pk_sub_u16, ...),
// one per pair where the portable 32-bit forms need three to five.
typedef unsigned short kvm_u16x2 __attribute__((ext_vector_type(2)));
__device__ __forceinline__ kvm_u16x2 as_u16x2(uint32_t w) {
  kvm_u16x2 v;
  __builtin_memcpy(&v, &w, 4);
  return v;
}
__device__ __forceinline__ uint32_t as_u32(kvm_u16x2 v) {
  uint32_t w;
  __builtin_memcpy(&w, &v, 4);
  return w;
}
#define KVM_PACKED_U16 1
#endif

// The magnitudes of a pair of e5m2fnuz codes as fp16 values, signs clear: half of e5m2's fp16 bits
// (exact: exponent - 1 for codes of exponent >= 2, a 1-bit shift into fp16's subnormals below; exponent
// 31, e5m2's inf / NaN, becomes 30: e5m2fnuz's finite 2^15 .. 57344). The larger of max(mag, 0x400) -
// 0x400 and mag >> 1 is the right one of the two: they are equal at mag = 0x800.
__device__ __forceinline__ uint32_t e5m2fnuz_pair_magnitudes(uint32_t pair) {
#if defined(KVM_PACKED_U16)
  const kvm_u16x2 mag = as_u16x2(pair & 0x7F007F00u), k = 0x400;
  const kvm_u16x2 dec = (mag > k ? mag : k) - k, half = mag >> 1;
  return as_u32(dec > half ? dec : half);
#else
  const uint32_t mag = pair & 0x7F007F00u;
  const uint32_t high = (((mag + 0x78007800u) & 0x80008000u) >> 15) * 0xFFFFu;  // halves with mag >= 0x0800
  return ((mag - (high & 0x04000400u)) & high) | ((mag >> 1) & ~high);
#endif
}

// NAN_BITS (a 16-bit pattern) in each half of the pair whose code is 0x80 (an FNUZ format's NaN; -0 in OCP),
// 0 elsewhere; the pair's low bytes are 0.
template <uint32_t NAN_BITS>
__device__ __forceinline__ uint32_t fnuz_nan_halves(uint32_t pair) {
#if defined(KVM_PACKED_U16)
  // x - 1 has bit 15 set for x = 0 alone among the sign-set codes' x (0x0000 .. 0x7F00)
  const kvm_u16x2 x = as_u16x2(pair ^ 0x80008000u), one = 1;
  return as_u32((((x - one) & as_u16x2(pair)) >> 15) * (unsigned short)NAN_BITS);
#else
  const uint32_t x = pair ^ 0x80008000u;
  const uint32_t nonzero = (((x & 0x7FFF7FFFu) + 0x7FFF7FFFu) | x) & 0x80008000u;
  return ((~nonzero & 0x80008000u) >> 15) * NAN_BITS;
#endif
}

// A pair of fp8 codes -> their two fp16 values (exact, see above): e4m3fn's magnitudes times 2^8 (one exact
// multiply, NaN stays NaN), e4m3fnuz's times 2^7, then the signs (NaN keeps its sign, as a float does);
// an FNUZ 0x80 becomes fp16's NaN.
template <typename C>
__device__ __forceinline__ uint32_t fp8_pair_to_f16x2(uint32_t pair) {
  const uint32_t sign = pair & 0x80008000u;
  if constexpr (std::is_same<C, Fp8E5M2>::value) {
    return pair;  // e5m2 is the top byte of fp16
  } else if constexpr (Fp8Format<C>::kMant == 3) {   // e4m3fn, e4m3fnuz
    constexpr bool fnuz = Fp8Format<C>::kFnuz;
    return f16x2_times<fnuz ? 128 : 256>(e4m3_pair_magnitudes<!fnuz>(pair)) | sign |
           (fnuz ? fnuz_nan_halves<0x7E00u>(pair) : 0u);
  } else {
    static_assert(std::is_same<C, Fp8E5M2Fnuz>::value, "fp8 format");
    return e5m2fnuz_pair_magnitudes(pair) | sign | fnuz_nan_halves<0x7E00u>(pair);
  }
}

// Two fp16 values -> the same values as bf16 (exact for widened fp8 codes: 3-4 significand bits; fp16
// subnormals become bf16 normals, NaN stays NaN through the fp32 widening).
__device__ __forceinline__ uint32_t f16x2_to_bf16x2(uint32_t h) {
  const uint32_t lo = __float_as_uint(__half2float(__ushort_as_half((unsigned short)(h & 0xFFFFu))));
  const uint32_t hi = __float_as_uint(__half2float(__ushort_as_half((unsigned short)(h >> 16))));
#if KVM_AMDGPU_DEVICE
  return __builtin_amdgcn_perm(hi, lo, 0x07060302u);  // the two top halves: one v_perm_b32
#else
  return (lo >> 16) | (hi & 0xFFFF0000u);
#endif
}

// A pair of fp8 codes -> two values of the 16-bit type T (low half: the code in bits 8..15), exactly.
template <typename C, typename T>
__device__ __forceinline__ uint32_t widen_pair(uint32_t pair) {
  const uint32_t h = fp8_pair_to_f16x2<C>(pair);
  if constexpr (std::is_same<T, __half>::value) return h;
  else return f16x2_to_bf16x2(h);
}

// The factor between an fp8 code's value and what widen_pair_scaled makes of it: 2^8 for e4m3fn codes
// and 2^7 for e4m3fnuz codes widened to bf16 (their fp16 values times 2^-8 / 2^-7 -- fp16 subnormals for
// the small codes -- become normal bf16 values through the fp32 widening, so the multiply moves into the
// scales), else 1. fp16 operands keep the multiply: the MFMA would read fp16 subnormals there.
template <typename C, typename T>
__host__ __device__ constexpr float widen_pair_unit() {
  if constexpr (!is_fp8<C>() || !std::is_same<T, hip_bfloat16>::value) return 1.f;
  else return Fp8Format<C>::kMant != 3 ? 1.f : Fp8Format<C>::kFnuz ? 128.f : 256.f;
}

// widen_pair divided by widen_pair_unit<C, T>() (exact: a power of two, no bf16 underflow): the decode
// engine's in-loop widening, one v_pk_mul_f16 per pair fewer for e4m3fn / e4m3fnuz -> bf16.
template <typename C, typename T>
__device__ __forceinline__ uint32_t widen_pair_scaled(uint32_t pair) {
  // the signs go in after the conversion: a pair's sign bits are a bf16 pair's
  if constexpr (widen_pair_unit<C, T>() == 1.f) {
    return widen_pair<C, T>(pair);
  } else {   // e4m3fn, e4m3fnuz into bf16
    constexpr bool fnuz = Fp8Format<C>::kFnuz;
    return f16x2_to_bf16x2(e4m3_pair_magnitudes<!fnuz>(pair)) | (pair & 0x80008000u) |
           (fnuz ? fnuz_nan_halves<0x7FC0u>(pair) : 0u);
  }
}
#endif  // KVMULTI_HAS_MFMA || KVMULTI_HAS_WMMA

}  // namespace kvmulti
