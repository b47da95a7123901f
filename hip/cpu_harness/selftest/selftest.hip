// Self-test kernels for kvmulti's HIP-on-CPU harness (tests/test_hip_harness.py).
// Ordinary HIP: it also compiles with hipcc. Each kernel has a correct and a buggy variant; the
// harness must give the right answer for the first and catch the second (wrong result or error).
#include <hip/hip_runtime.h>

namespace selftest {

constexpr int N = 64;  // threads per block in the shared-memory tests

// out[i] = in[i] + in[next(i)] via static shared memory; BARRIER=false omits the __syncthreads()
// between the writes and the reads of another thread's element.
template <bool BARRIER>
__global__ void neighbor_sum(const float* in, float* out) {
  __shared__ float s[N];
  const int t = (int)threadIdx.x, base = (int)blockIdx.x * N;
  s[t] = in[base + t];
  if (BARRIER) __syncthreads();
  out[base + t] = s[t] + s[(t + 1) % N];
}

// Same through dynamic shared memory, reading the PREVIOUS thread's element.
template <bool BARRIER>
__global__ void neighbor_sum_dynamic(const float* in, float* out) {
  HIP_DYNAMIC_SHARED(float, s)
  const int t = (int)threadIdx.x, n = (int)blockDim.x, base = (int)blockIdx.x * n;
  s[t] = in[base + t];
  if (BARRIER) __syncthreads();
  out[base + t] = s[t] + s[(t + n - 1) % n];
}

// Barrier reached by only some threads of the block (a hang or UB on a GPU).
__global__ void divergent_barrier(const float* in, float* out) {
  const int t = (int)threadIdx.x;
  if (t < 8) __syncthreads();
  out[t] = in[t];
}

// Wave reductions with each shuffle flavour; WIDTH = the wave size being emulated.
template <int WIDTH>
__global__ void wave_ops(const float* in, float* out) {
  const int t = (int)threadIdx.x, lane = t % WIDTH;
  const int base = (int)blockIdx.x * (int)blockDim.x;
  float v = in[base + t];
  float sum = v;
  for (int m = WIDTH / 2; m > 0; m >>= 1) sum += __shfl_xor(sum, m, WIDTH);
  float down = v;
  for (int d = WIDTH / 2; d > 0; d >>= 1) down += __shfl_down(down, d, WIDTH);  // lane 0 holds the sum
  const float bcast = __shfl(v, WIDTH - 1 - lane, WIDTH);                    // reversed lanes
  out[4 * (base + t) + 0] = sum;
  out[4 * (base + t) + 1] = __shfl(down, 0, WIDTH);
  out[4 * (base + t) + 2] = bcast;
  out[4 * (base + t) + 3] = (float)lane;
}

// A shuffle inside a branch taken by half of the wave (non-uniform: a deadlock in the harness).
template <int WIDTH>
__global__ void divergent_shuffle(const float* in, float* out) {
  const int t = (int)threadIdx.x;
  float v = in[t];
  if (t % WIDTH < WIDTH / 2) v = __shfl_xor(v, 1, WIDTH);
  out[t] = v;
}

#if defined(KVMULTI_HIP_CPU_HARNESS) || defined(__gfx90a__) || defined(__gfx940__) || defined(__gfx941__) || \
    defined(__gfx942__)
#define SELFTEST_HAS_MFMA 1
#if defined(KVMULTI_HIP_CPU_HARNESS)
typedef ::kvcpu::f32x4 f32x4;
typedef ::kvcpu::f16x4 f16x4;
typedef ::kvcpu::bf16x4 bf16x4;
#else
typedef float f32x4 __attribute__((ext_vector_type(4)));
typedef _Float16 f16x4 __attribute__((ext_vector_type(4)));
typedef short bf16x4 __attribute__((ext_vector_type(4)));
#endif

// One 16x16x16 MFMA on raw registers: regs[lane] = {A VGPR 0, A VGPR 1, B VGPR 0, B VGPR 1} (bit
// patterns), C = 0; d[lane][i] = D VGPR i. One 64-lane wave.
template <bool BF16, bool DIVERGENT = false>
__global__ void mfma_raw(const unsigned* regs, float* d) {
  const int lane = (int)threadIdx.x;
  if (DIVERGENT && lane >= 32) return;  // half a wave calls the wave-wide builtin: a deadlock here
  unsigned a[2] = {regs[4 * lane], regs[4 * lane + 1]}, b[2] = {regs[4 * lane + 2], regs[4 * lane + 3]};
  f32x4 c = {0.f, 0.f, 0.f, 0.f};
  if constexpr (BF16) {
    bf16x4 x, y;
    __builtin_memcpy(&x, a, 8);
    __builtin_memcpy(&y, b, 8);
    c = __builtin_amdgcn_mfma_f32_16x16x16bf16_1k(x, y, c, 0, 0, 0);
  } else {
    f16x4 x, y;
    __builtin_memcpy(&x, a, 8);
    __builtin_memcpy(&y, b, 8);
    c = __builtin_amdgcn_mfma_f32_16x16x16f16(x, y, c, 0, 0, 0);
  }
  for (int i = 0; i < 4; ++i) d[4 * lane + i] = c[i];
}

// One v_mfma_f32_16x16x4f32 on raw registers: regs[lane] = {A VGPR 0, unused, B VGPR 0, unused} (fp32
// bit patterns), C = 0; d[lane][i] = D VGPR i. One 64-lane wave.
__global__ void mfma_raw_f32(const unsigned* regs, float* d) {
  const int lane = (int)threadIdx.x;
  float a, b;
  __builtin_memcpy(&a, &regs[4 * lane], 4);
  __builtin_memcpy(&b, &regs[4 * lane + 2], 4);
  f32x4 c = {0.f, 0.f, 0.f, 0.f};
  c = __builtin_amdgcn_mfma_f32_16x16x4f32(a, b, c, 0, 0, 0);
  for (int i = 0; i < 4; ++i) d[4 * lane + i] = c[i];
}
#endif

#if defined(KVMULTI_HIP_CPU_HARNESS) || defined(__GFX11__) || defined(__GFX12__)
#define SELFTEST_HAS_WMMA 1
#if defined(KVMULTI_HIP_CPU_HARNESS)
typedef ::kvcpu::f32x8 f32x8;
typedef ::kvcpu::f16x16 f16x16;
typedef ::kvcpu::bf16x16 bf16x16;
typedef ::kvcpu::f16x8 f16x8;
typedef ::kvcpu::bf16x8 bf16x8;
#else
typedef float f32x8 __attribute__((ext_vector_type(8)));
typedef _Float16 f16x16 __attribute__((ext_vector_type(16)));
typedef short bf16x16 __attribute__((ext_vector_type(16)));
typedef _Float16 f16x8 __attribute__((ext_vector_type(8)));
typedef short bf16x8 __attribute__((ext_vector_type(8)));
#endif

// One 16x16x16 WMMA on raw registers: regs[lane] = {A VGPRs 0..7, B VGPRs 0..7} (bit patterns; gfx12 reads
// VGPRs 0..3 of each), C = 0; d[lane][i] = D VGPR i. One 32-lane wave. KIND: 0 / 1 gfx11 f16 / bf16, 2 / 3
// gfx12 f16 / bf16.
template <int KIND>
__global__ void wmma_raw(const unsigned* regs, float* d) {
  const int lane = (int)threadIdx.x;
  const unsigned* a = regs + 16 * lane;
  const unsigned* b = a + 8;
  f32x8 c = {};
#if defined(KVMULTI_HIP_CPU_HARNESS) || defined(__GFX11__)
  if constexpr (KIND == 0) {
    f16x16 x, y;
    __builtin_memcpy(&x, a, 32);
    __builtin_memcpy(&y, b, 32);
    c = __builtin_amdgcn_wmma_f32_16x16x16_f16_w32(x, y, c);
  } else if constexpr (KIND == 1) {
    bf16x16 x, y;
    __builtin_memcpy(&x, a, 32);
    __builtin_memcpy(&y, b, 32);
    c = __builtin_amdgcn_wmma_f32_16x16x16_bf16_w32(x, y, c);
  }
#endif
#if defined(KVMULTI_HIP_CPU_HARNESS) || defined(__GFX12__)
  if constexpr (KIND == 2) {
    f16x8 x, y;
    __builtin_memcpy(&x, a, 16);
    __builtin_memcpy(&y, b, 16);
    c = __builtin_amdgcn_wmma_f32_16x16x16_f16_w32_gfx12(x, y, c);
  } else if constexpr (KIND == 3) {
    bf16x8 x, y;
    __builtin_memcpy(&x, a, 16);
    __builtin_memcpy(&y, b, 16);
    c = __builtin_amdgcn_wmma_f32_16x16x16_bf16_w32_gfx12(x, y, c);
  }
#endif
  for (int i = 0; i < 8; ++i) d[8 * lane + i] = c[i];
}
#endif

}  // namespace selftest

// which: 0/1 neighbor_sum with/without barrier, 2/3 dynamic-shared variant with/without barrier,
// 4 divergent barrier, 5 wave_ops, 6 divergent shuffle. Returns the hipError_t of the launch.
extern "C" __attribute__((visibility("default"))) int selftest_run(int which, const float* in, float* out,
                                                                   int blocks, int threads) {
  const int w = warpSize;
  switch (which) {
    case 0: hipLaunchKernelGGL(selftest::neighbor_sum<true>, dim3(blocks), dim3(selftest::N), 0, 0, in, out); break;
    case 1: hipLaunchKernelGGL(selftest::neighbor_sum<false>, dim3(blocks), dim3(selftest::N), 0, 0, in, out); break;
    case 2:
      hipLaunchKernelGGL(selftest::neighbor_sum_dynamic<true>, dim3(blocks), dim3(threads), threads * sizeof(float),
                         0, in, out);
      break;
    case 3:
      hipLaunchKernelGGL(selftest::neighbor_sum_dynamic<false>, dim3(blocks), dim3(threads), threads * sizeof(float),
                         0, in, out);
      break;
    case 4: hipLaunchKernelGGL(selftest::divergent_barrier, dim3(blocks), dim3(threads), 0, 0, in, out); break;
    case 5:
      if (w == 64) hipLaunchKernelGGL(selftest::wave_ops<64>, dim3(blocks), dim3(threads), 0, 0, in, out);
      else hipLaunchKernelGGL(selftest::wave_ops<32>, dim3(blocks), dim3(threads), 0, 0, in, out);
      break;
    case 6:
      if (w == 64) hipLaunchKernelGGL(selftest::divergent_shuffle<64>, dim3(blocks), dim3(threads), 0, 0, in, out);
      else hipLaunchKernelGGL(selftest::divergent_shuffle<32>, dim3(blocks), dim3(threads), 0, 0, in, out);
      break;
    default: return (int)hipErrorInvalidValue;
  }
  return (int)hipGetLastError();
}

// Runs selftest::mfma_raw (bf16: 1 = v_mfma_f32_16x16x16bf16_1k, 0 = v_mfma_f32_16x16x16f16, 2 = the
// f16 one called by half of the wave only, 3 = v_mfma_f32_16x16x4f32 through mfma_raw_f32) on one 64-lane wave. Returns the hipError_t of the launch
// (hipErrorInvalidDeviceFunction without MFMA).
extern "C" __attribute__((visibility("default"))) int selftest_mfma(int bf16, const unsigned* regs, float* d) {
#if defined(SELFTEST_HAS_MFMA)
  if (bf16 == 3) hipLaunchKernelGGL(selftest::mfma_raw_f32, dim3(1), dim3(64), 0, 0, regs, d);
  else if (bf16 == 2) hipLaunchKernelGGL((selftest::mfma_raw<false, true>), dim3(1), dim3(64), 0, 0, regs, d);
  else if (bf16) hipLaunchKernelGGL(selftest::mfma_raw<true>, dim3(1), dim3(64), 0, 0, regs, d);
  else hipLaunchKernelGGL(selftest::mfma_raw<false>, dim3(1), dim3(64), 0, 0, regs, d);
  return (int)hipGetLastError();
#else
  (void)bf16, (void)regs, (void)d;
  return (int)hipErrorInvalidDeviceFunction;
#endif
}

// Runs selftest::wmma_raw<kind> (0 / 1: gfx11 v_wmma_f32_16x16x16_f16 / _bf16, 2 / 3: the gfx12 ones) on one
// 32-lane wave. Returns the hipError_t of the launch (hipErrorInvalidDeviceFunction without WMMA or for a kind
// outside 0..3).
extern "C" __attribute__((visibility("default"))) int selftest_wmma(int kind, const unsigned* regs, float* d) {
#if defined(SELFTEST_HAS_WMMA)
  switch (kind) {
    case 0: hipLaunchKernelGGL(selftest::wmma_raw<0>, dim3(1), dim3(32), 0, 0, regs, d); break;
    case 1: hipLaunchKernelGGL(selftest::wmma_raw<1>, dim3(1), dim3(32), 0, 0, regs, d); break;
    case 2: hipLaunchKernelGGL(selftest::wmma_raw<2>, dim3(1), dim3(32), 0, 0, regs, d); break;
    case 3: hipLaunchKernelGGL(selftest::wmma_raw<3>, dim3(1), dim3(32), 0, 0, regs, d); break;
    default: return (int)hipErrorInvalidDeviceFunction;
  }
  return (int)hipGetLastError();
#else
  (void)kind, (void)regs, (void)d;
  return (int)hipErrorInvalidDeviceFunction;
#endif
}
