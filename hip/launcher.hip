// kvmulti HIP launcher: C ABI over the kernels in kvmulti_attention.hip.
//
// Built three ways from this one file:
//   * ROCm host:  hipcc -O3 -shared -fPIC --offload-arch=<PYTORCH_ROCM_ARCH or the host's GPUs>
//                 -> libkvmulti_hip.so, called from kvmulti/backends/hip/library.py through ctypes with torch
//                 tensors' data_ptr()s and torch's current HIP stream;
//   * CPU harness: g++ -x c++ -I hip/cpu_harness/include -> the same entry points running the same
//                 kernels on CPU fibers (verification only), in translation units compiled in parallel
//                 (KVM_ATTENTION_PAIRS below);
//   * nvcc -x cu -I hip/compat: compile check for NVIDIA targets.
// Every entry point returns a hipError_t value (0 = success).
#include <cstring>

#include "kvmulti_prefill.hip"

// The attention launches, one dispatch_wave<query, cache> per pair of KVM_ATTENTION_PAIRS. Built in one
// translation unit, or -- the CPU harness's parallel build (kvmulti/backends/hip/build.py) -- one unit per pair
// (-DKVM_ATTENTION_UNIT=<its index>) and the C ABI's unit (-DKVM_ATTENTION_UNITS), which takes them
// from the others.
#define KVM_ATTENTION_PAIRS(X)                                                                                 \
  X(0, float, float) X(1, float, kvmulti::Fp8E4M3) X(2, float, kvmulti::Fp8E5M2) X(3, __half, __half)          \
  X(4, __half, kvmulti::Fp8E4M3) X(5, __half, kvmulti::Fp8E5M2) X(6, hip_bfloat16, hip_bfloat16)               \
  X(7, hip_bfloat16, kvmulti::Fp8E4M3) X(8, hip_bfloat16, kvmulti::Fp8E5M2) X(9, float, kvmulti::Fp8E4M3Fnuz)    \
  X(10, float, kvmulti::Fp8E5M2Fnuz) X(11, __half, kvmulti::Fp8E4M3Fnuz) X(12, __half, kvmulti::Fp8E5M2Fnuz)       \
  X(13, hip_bfloat16, kvmulti::Fp8E4M3Fnuz) X(14, hip_bfloat16, kvmulti::Fp8E5M2Fnuz)

namespace kvmulti::launch {

// Instantiations the prefill kernel serves: every one on wave64 -- fp16 / bf16 queries over a cache of their
// own type or of fp8 codes (v_mfma_f32_16x16x16{f16,bf16_1k}), fp32 queries over an fp32 or fp8 cache
// (v_mfma_f32_16x16x4f32; fp8 codes widened to fp32 in LDS), every head size, ALiBi included -- each passing
// the compile check's thresholds (hip/README.md); on wave32 every query type over a cache of its own type at
// heads up to 128 (fma_tile_path): the WMMA engine (prefill_wmma_path: fp16 / bf16) on gfx11 / gfx12, the FMA
// tile engine for the rest -- every type on gfx10 and on NVIDIA through hip/compat, fp32 queries on gfx11 /
// gfx12. fp8 caches and head 256 on wave32 run the attention kernel.
template <typename T, typename C, int HS, int WAVE>
constexpr bool prefill_served() {
  return WAVE == 64 || (WAVE == 32 && kvmulti::fma_tile_path<T, C, HS>());
}

template <typename T, typename C, int HS, int WAVE>
hipError_t launch_attention(const PagedAttentionParams& p, bool prefill, hipStream_t stream) {
  dim3 block(kvmulti::kNumWarps * WAVE);
  if constexpr (prefill_served<T, C, HS, WAVE>()) {
    if (prefill) {
      const kvmulti::RowMap map(p.num_q_heads, p.num_kv_heads, kvmulti::kPrefillRows);
      const long long tiles = ((long long)p.num_tokens + map.tokens_per_block - 1) / map.tokens_per_block + p.num_reqs;
      dim3 grid((unsigned)tiles, (unsigned)(p.num_kv_heads * map.chunks), (unsigned)p.num_partitions);
      hipLaunchKernelGGL((kvmulti::paged_prefill_kernel<T, C, HS, WAVE>), grid, block, 0, stream, p);
    }
  } else {
    prefill = false;
  }
  if (!prefill) {
    const kvmulti::RowMap map(p.num_q_heads, p.num_kv_heads, kvmulti::rows_per_block<T, WAVE, C>());
    dim3 grid((unsigned)p.num_tokens, (unsigned)(p.num_kv_heads * map.chunks), (unsigned)p.num_partitions);
    hipLaunchKernelGGL((kvmulti::paged_attention_kernel<T, C, HS, WAVE>), grid, block, 0, stream, p);
  }
  hipError_t e = hipGetLastError();
  if (e != hipSuccess || p.num_partitions <= 1) return e;
  dim3 rgrid((unsigned)p.num_tokens, (unsigned)p.num_q_heads);
  hipLaunchKernelGGL((kvmulti::paged_attention_reduce_kernel<T>), rgrid, dim3(HS < 256 ? HS : 256),
                     kvmulti::reduce_shared_bytes(p.num_partitions), stream, p, HS);
  return hipGetLastError();
}

template <typename T, typename C, int WAVE>
hipError_t dispatch_head_size(int head_size, const PagedAttentionParams& p, bool pf, hipStream_t s) {
  switch (head_size) {
    case 64: return launch_attention<T, C, 64, WAVE>(p, pf, s);
    case 80: return launch_attention<T, C, 80, WAVE>(p, pf, s);
    case 96: return launch_attention<T, C, 96, WAVE>(p, pf, s);
    case 128: return launch_attention<T, C, 128, WAVE>(p, pf, s);
    case 256: return launch_attention<T, C, 256, WAVE>(p, pf, s);
    default: return hipErrorInvalidValue;
  }
}

template <typename T, typename C>
hipError_t dispatch_wave(int wave, int head_size, const PagedAttentionParams& p, bool pf, hipStream_t s) {
  switch (wave) {
    case 64: return dispatch_head_size<T, C, 64>(head_size, p, pf, s);
    case 32: return dispatch_head_size<T, C, 32>(head_size, p, pf, s);
    default: return hipErrorInvalidDeviceFunction;
  }
}

template <int I>
struct AttentionPair;
#define KVM_PAIR_TYPES(I, T, C) \
  template <>                   \
  struct AttentionPair<I> {     \
    using Query = T;            \
    using Cache = C;            \
  };
KVM_ATTENTION_PAIRS(KVM_PAIR_TYPES)
#undef KVM_PAIR_TYPES

}  // namespace kvmulti::launch

#if defined(KVM_ATTENTION_UNIT)
template hipError_t kvmulti::launch::dispatch_wave<kvmulti::launch::AttentionPair<KVM_ATTENTION_UNIT>::Query,
                                                   kvmulti::launch::AttentionPair<KVM_ATTENTION_UNIT>::Cache>(
    int, int, const kvmulti::PagedAttentionParams&, bool, hipStream_t);
#else
#if defined(KVM_ATTENTION_UNITS)
#define KVM_PAIR_ELSEWHERE(I, T, C)                                                                     \
  extern template hipError_t kvmulti::launch::dispatch_wave<T, C>(int, int, const kvmulti::PagedAttentionParams&, \
                                                                  bool, hipStream_t);
KVM_ATTENTION_PAIRS(KVM_PAIR_ELSEWHERE)
#undef KVM_PAIR_ELSEWHERE
#endif

namespace {

using kvmulti::PagedAttentionParams;
using kvmulti::WriteKVParams;

// Split-KV heuristic (documented in kvmulti/backends/hip/backend.py too):
//   * partition_size_request > 0: always split, in partitions of that many keys (tests, tuning);
//   * partition_size_request == 0: never split;
//   * partition_size_request < 0 (auto): split in partitions of kDefaultPartition (512) keys when the
//     longest key span is > 2 * 512 keys AND the un-split grid has fewer than 4 working blocks per
//     compute unit (one block per up to 8 (token, head) rows, see RowMap; wave64 blocks of fp16 / bf16
//     queries take 16, the estimate uses 8 since the plan does not know the dtype), i.e. when a few long
//     sequences would leave most of the GPU idle while each block streams a long context.
constexpr int kDefaultPartition = 512;
// Largest block size the attention kernel accepts (key indices inside a block-table window of 64
// blocks stay far below 2^31).
constexpr int kMaxBlockSize = 1 << 20;
// cache_dtype codes of the fp8 formats (kvmulti/backends/hip/library.py)
constexpr int kCacheE4M3 = 3, kCacheE5M2 = 4, kCacheE4M3Fnuz = 5, kCacheE5M2Fnuz = 6;
// Default prefill threshold: a step whose longest query has at least this many tokens runs the prefill
// kernel. 64 tokens fill a 64-row tile at any GQA group (the group's heads x 64 / group tokens), and from
// there on the decode kernel re-reads every K/V tile once per 16 rows where the prefill kernel reads it
// once per 64 (4x less L2 traffic) and keeps 3 of every 4 of its grid's blocks busy instead of exiting.
constexpr int kDefaultPrefillMinQuery = 64;

int device_wave_size(int wave) {
  if (wave == 32 || wave == 64) return wave;
  int dev = 0, ws = 0;
  if (hipGetDevice(&dev) != hipSuccess) return 0;
  if (hipDeviceGetAttribute(&ws, hipDeviceAttributeWarpSize, dev) != hipSuccess) return 0;
  return ws;
}

int device_cu_count() {
  int dev = 0, n = 0;
  if (hipGetDevice(&dev) != hipSuccess) return 1;
  if (hipDeviceGetAttribute(&n, hipDeviceAttributeMultiprocessorCount, dev) != hipSuccess || n < 1) return 1;
  return n;
}

// The cache's element type: the query's (cache_dtype == dtype) or fp8 (3 = e4m3fn, 4 = e5m2, 5 = e4m3fnuz,
// 6 = e5m2fnuz).
template <typename T>
hipError_t dispatch_cache(int dtype, int cache_dtype, int wave, int head_size, const PagedAttentionParams& p,
                          bool pf, hipStream_t s) {
  if (cache_dtype == dtype) return kvmulti::launch::dispatch_wave<T, T>(wave, head_size, p, pf, s);
  if (!p.k_scale || !p.v_scale) return hipErrorInvalidValue;
  if (cache_dtype == kCacheE4M3) return kvmulti::launch::dispatch_wave<T, kvmulti::Fp8E4M3>(wave, head_size, p, pf, s);
  if (cache_dtype == kCacheE5M2) return kvmulti::launch::dispatch_wave<T, kvmulti::Fp8E5M2>(wave, head_size, p, pf, s);
  if (cache_dtype == kCacheE4M3Fnuz) return kvmulti::launch::dispatch_wave<T, kvmulti::Fp8E4M3Fnuz>(wave, head_size, p, pf, s);
  if (cache_dtype == kCacheE5M2Fnuz) return kvmulti::launch::dispatch_wave<T, kvmulti::Fp8E5M2Fnuz>(wave, head_size, p, pf, s);
  return hipErrorInvalidValue;
}

template <typename T>
hipError_t launch_write(int dtype, int cache_dtype, const WriteKVParams& p, hipStream_t s) {
  const dim3 grid((unsigned)p.num_tokens), block(128);
  if (cache_dtype == dtype) {
    hipLaunchKernelGGL((kvmulti::write_kv_kernel<T, T>), grid, block, 0, s, p);
  } else if (p.k_scale && p.v_scale && cache_dtype == kCacheE4M3) {
    hipLaunchKernelGGL((kvmulti::write_kv_kernel<T, kvmulti::Fp8E4M3>), grid, block, 0, s, p);
  } else if (p.k_scale && p.v_scale && cache_dtype == kCacheE5M2) {
    hipLaunchKernelGGL((kvmulti::write_kv_kernel<T, kvmulti::Fp8E5M2>), grid, block, 0, s, p);
  } else if (p.k_scale && p.v_scale && cache_dtype == kCacheE4M3Fnuz) {
    hipLaunchKernelGGL((kvmulti::write_kv_kernel<T, kvmulti::Fp8E4M3Fnuz>), grid, block, 0, s, p);
  } else if (p.k_scale && p.v_scale && cache_dtype == kCacheE5M2Fnuz) {
    hipLaunchKernelGGL((kvmulti::write_kv_kernel<T, kvmulti::Fp8E5M2Fnuz>), grid, block, 0, s, p);
  } else {
    return hipErrorInvalidValue;
  }
  return hipGetLastError();
}

}  // namespace

extern "C" {

// Bumped whenever an entry point's signature or the codes it accepts change (checked by the Python side).
__attribute__((visibility("default"))) int kvmulti_hip_abi_version() { return 7; }

// Head sizes with compiled instantiations (K and V head sizes must be equal for attention).
__attribute__((visibility("default"))) int kvmulti_hip_head_sizes(int* out, int cap) {
  static const int hs[] = {64, 80, 96, 128, 256};
  const int n = (int)(sizeof(hs) / sizeof(hs[0]));
  for (int i = 0; i < n && i < cap; ++i) out[i] = hs[i];
  return n;
}

// Wave size the kernels will use (wave: 0 = ask the current device).
__attribute__((visibility("default"))) int kvmulti_hip_wave_size(int wave) { return device_wave_size(wave); }

// Decides the split-KV configuration; see the heuristic above.
__attribute__((visibility("default"))) int kvmulti_hip_plan(int num_tokens, int num_q_heads, int num_kv_heads,
                                                            int max_span, int partition_size_request,
                                                            int* partition_size, int* num_partitions) {
  int ps = 0;
  if (num_kv_heads <= 0 || num_q_heads < num_kv_heads) return (int)hipErrorInvalidValue;
  const kvmulti::RowMap map(num_q_heads, num_kv_heads, 8);
  // working blocks of the un-split grid (blocks not starting a token tile exit at once)
  const long long blocks = ((long long)num_tokens + map.tokens_per_block - 1) / map.tokens_per_block *
                           num_kv_heads * map.chunks;
  if (partition_size_request > 0) {
    ps = partition_size_request;
  } else if (partition_size_request < 0 && max_span > 2 * kDefaultPartition && blocks < 4LL * device_cu_count()) {
    ps = kDefaultPartition;
  }
  int np = 1;
  if (ps > 0) np = max_span > 0 ? (int)(((long long)max_span + ps - 1) / ps) : 1;
  if (np <= 1) {
    np = 1;
    ps = 0;
  }
  *partition_size = ps;
  *num_partitions = np;
  return 0;
}

// Float workspace (in floats) needed by the split-KV path.
__attribute__((visibility("default"))) long long kvmulti_hip_workspace_floats(int num_tokens, int num_q_heads,
                                                                             int head_size, int num_partitions) {
  if (num_partitions <= 1) return 0;
  return (long long)num_tokens * num_q_heads * num_partitions * (head_size + 2);
}

// dtype (query, out): 0 = float32, 1 = float16, 2 = bfloat16; cache_dtype: dtype, or 3 = float8_e4m3fn,
// 4 = float8_e5m2 (then k_scale / v_scale: fp32 [num_kv_heads] on the device). Strides in elements. sliding_window 0 = none,
// softcap 0 = none. num_partitions/partition_size from kvmulti_hip_plan; workspace: at least
// kvmulti_hip_workspace_floats() floats on the device when num_partitions > 1.
// Bounds (memory safety, whatever the metadata holds): num_query_rows = rows of query and out (tokens
// past it are neither read nor written), block table [bt_rows, >= bt_cols] with row stride bt_stride,
// num_blocks = blocks of kv_cache. query_start_loc must hold num_reqs + 1 and seq_lens num_reqs ints.
// max_query_len: the step's longest query (an upper bound is fine); prefill_min_query: the prefill kernel
// runs when max_query_len >= it (< 0: the default threshold, 0: never). sinks / alibi_slopes: fp32
// [num_q_heads] on the device or null (attention-sink logits joining each row's softmax denominator once;
// ALiBi slopes, score += slope * (key position - query position) after scale and softcap). causal 0: every
// query row sees all seq_lens[r] keys of its request (a sliding window still cuts keys before pos - W + 1).
__attribute__((visibility("default"))) int kvmulti_hip_paged_attention(
    int dtype, int cache_dtype, const float* k_scale, const float* v_scale, int head_size, int wave, void* out,
    const void* query, const void* kv_cache,
    const int* query_start_loc, const int* seq_lens, const int* block_table, long long q_stride_token,
    long long q_stride_head, long long o_stride_token, long long o_stride_head, long long kv_stride_block,
    long long kv_stride_token, long long kv_stride_head, long long bt_stride, int num_reqs, int num_tokens,
    int num_q_heads, int num_kv_heads, int block_size, int sliding_window, float scale, float softcap,
    int partition_size, int num_partitions, float* workspace, int num_query_rows, int bt_rows, int bt_cols,
    int num_blocks, int max_query_len, int prefill_min_query, const float* sinks, const float* alibi_slopes,
    int causal, void* stream) {
  if (num_tokens > num_query_rows) num_tokens = num_query_rows;  // never touch rows past query / out
  if (num_tokens <= 0) return hipSuccess;
  if (num_reqs <= 0 || num_q_heads <= 0 || num_kv_heads <= 0 || num_q_heads % num_kv_heads != 0 ||
      block_size <= 0 || num_partitions <= 0 || (num_partitions > 1 && (partition_size <= 0 || !workspace)) ||
      bt_rows < 0 || bt_cols < 0 || num_blocks <= 0 || block_size > kMaxBlockSize)
    return hipErrorInvalidValue;
  PagedAttentionParams p;
  p.out = out;
  p.query = query;
  p.kv_cache = kv_cache;
  p.query_start_loc = query_start_loc;
  p.seq_lens = seq_lens;
  p.block_table = block_table;
  const long long np = (long long)num_tokens * num_q_heads * num_partitions;
  p.part_out = num_partitions > 1 ? workspace : nullptr;
  p.part_max = num_partitions > 1 ? workspace + np * head_size : nullptr;
  p.part_sum = num_partitions > 1 ? workspace + np * (head_size + 1) : nullptr;
  p.q_stride_token = q_stride_token;
  p.q_stride_head = q_stride_head;
  p.o_stride_token = o_stride_token;
  p.o_stride_head = o_stride_head;
  p.kv_stride_block = kv_stride_block;
  p.kv_stride_token = kv_stride_token;
  p.kv_stride_head = kv_stride_head;
  p.bt_stride = bt_stride;
  p.num_reqs = num_reqs;
  p.num_tokens = num_tokens;
  p.num_q_heads = num_q_heads;
  p.num_kv_heads = num_kv_heads;
  p.block_size = block_size;
  p.bt_rows = bt_rows;
  p.bt_cols = bt_cols;
  p.num_blocks = num_blocks;
  p.sliding_window = sliding_window > 0 ? sliding_window : 0;
  p.partition_size = num_partitions > 1 ? partition_size : 0;
  p.num_partitions = num_partitions;
  // Row offsets are multiples of the strides (for the canonical layout: of the entry size,
  // 2 * head_size elements), so K rows are 16-byte aligned when the base and the strides are.
  const long long esz = cache_dtype == 0 ? 4 : cache_dtype <= 2 ? 2 : 1;
  p.kv_aligned16 = ((uintptr_t)kv_cache % 16 == 0 && (kv_stride_block * esz) % 16 == 0 &&
                    (kv_stride_token * esz) % 16 == 0 && (kv_stride_head * esz) % 16 == 0) ? 1 : 0;
  p.scale = scale;
  p.softcap = softcap > 0.f ? softcap : 0.f;
  p.inv_softcap = softcap > 0.f ? 1.f / softcap : 0.f;
  p.k_scale = k_scale;
  p.v_scale = v_scale;
  p.sinks = sinks;
  p.alibi_slopes = alibi_slopes;
  p.causal = causal ? 1 : 0;
  hipStream_t s = (hipStream_t)stream;
  const int w = device_wave_size(wave);
  const int threshold = prefill_min_query < 0 ? kDefaultPrefillMinQuery : prefill_min_query;
  const bool pf = threshold > 0 && max_query_len >= threshold;
  switch (dtype) {
    case 0: return dispatch_cache<float>(dtype, cache_dtype, w, head_size, p, pf, s);
    case 1: return dispatch_cache<__half>(dtype, cache_dtype, w, head_size, p, pf, s);
    case 2: return dispatch_cache<hip_bfloat16>(dtype, cache_dtype, w, head_size, p, pf, s);
    default: return hipErrorInvalidValue;
  }
}

__attribute__((visibility("default"))) int kvmulti_hip_write_kv(
    int dtype, int cache_dtype, const float* k_scale, const float* v_scale, const void* key, const void* value,
    void* kv_cache, const long long* slot_mapping,
    long long k_stride_token, long long k_stride_head, long long k_stride_dim, long long v_stride_token,
    long long v_stride_head, long long v_stride_dim, long long kv_stride_block, long long kv_stride_token,
    long long kv_stride_head, int num_tokens, int num_kv_heads, int head_size, int head_size_v, int block_size,
    int num_blocks, void* stream) {
  if (num_tokens <= 0) return hipSuccess;
  if (block_size <= 0 || num_kv_heads <= 0 || head_size <= 0 || head_size_v < 0 || num_blocks < 0)
    return hipErrorInvalidValue;
  WriteKVParams p;
  p.key = key;
  p.value = value;
  p.kv_cache = kv_cache;
  p.slot_mapping = reinterpret_cast<const int64_t*>(slot_mapping);
  p.k_stride_token = k_stride_token;
  p.k_stride_head = k_stride_head;
  p.k_stride_dim = k_stride_dim;
  p.v_stride_token = v_stride_token;
  p.v_stride_head = v_stride_head;
  p.v_stride_dim = v_stride_dim;
  p.kv_stride_block = kv_stride_block;
  p.kv_stride_token = kv_stride_token;
  p.kv_stride_head = kv_stride_head;
  p.num_tokens = num_tokens;
  p.num_kv_heads = num_kv_heads;
  p.head_size = head_size;
  p.head_size_v = head_size_v;
  p.block_size = block_size;
  p.num_blocks = num_blocks;
  p.k_scale = k_scale;
  p.v_scale = v_scale;
  hipStream_t s = (hipStream_t)stream;
  switch (dtype) {
    case 0: return launch_write<float>(dtype, cache_dtype, p, s);
    case 1: return launch_write<__half>(dtype, cache_dtype, p, s);
    case 2: return launch_write<hip_bfloat16>(dtype, cache_dtype, p, s);
    default: return hipErrorInvalidValue;
  }
}

__attribute__((visibility("default"))) const char* kvmulti_hip_error_string(int e) {
  return hipGetErrorString((hipError_t)e);
}

}  // extern "C"

#endif  // KVM_ATTENTION_UNIT
