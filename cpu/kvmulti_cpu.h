// kvmulti native CPU attention: types shared by the torch binding (paged_attention.cpp) and the
// per-ISA kernel translation units (kernels_*.cpp). Plain C++17, no torch headers.
#pragma once

#include <cstdint>
#include <cstring>

namespace kvmulti_cpu {

enum DType : int { kF32 = 0, kF16 = 1, kBF16 = 2 };

// Keys per chunk: the unit of block-table walking, K/V conversion and online softmax.
constexpr int kChunk = 64;
// Rows (query token x query head of one KV head) handled together in registers.
constexpr int kRowBlock = 4;

// Everything a work item needs; all strides in ELEMENTS. The cache is read only through the
// named strides (block, token, head); the content dimension is contiguous (K then V).
struct AttnParams {
  const void* query;
  int64_t q_stride_token, q_stride_head;
  const void* cache;
  int64_t s_block, s_token, s_head;
  void* out;
  int64_t o_stride_token, o_stride_head;
  const int32_t* block_table;
  int64_t bt_stride;
  int num_blocks;      // cache blocks: a block id outside [0, num_blocks) is never dereferenced
  int head_size, head_size_v, num_q_heads, num_kv_heads, block_size;
  int dtype;           // DType
  float scale;
  int window;          // <= 0: no sliding window
  float softcap;       // <= 0: off
  bool causal;
};

// One unit of parallel work: query tokens [q_row0, q_row0 + num_tokens) of one request (their
// positions start at pos0), all query heads of KV heads [kv_head, kv_head + num_heads), keys at
// positions [k_lo, k_hi). The planner guarantees these rows, heads and block-table columns exist.
struct WorkItem {
  int req;
  int kv_head;
  int num_heads;
  int q_row0;
  int num_tokens;
  int pos0;
  int k_lo, k_hi;
  float* partial;      // nullptr: normalise and write `out`; else [rows][dvp] O, then m[rows], l[rows]
                       // (rows = num_heads x num_tokens x G, head-major)
};

// Floats of per-thread workspace a kernel of `lanes` SIMD width needs for items of up to
// max_rows_per_head rows (tokens x G) per KV head and max_heads KV heads.
inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
inline int64_t workspace_floats(int max_rows_per_head, int max_heads, int head_size, int head_size_v, int lanes) {
  int64_t dp = round_up(head_size, lanes), dvp = round_up(head_size_v, lanes);
  int64_t zero = dp > dvp ? dp : dvp;
  const int64_t rows = max_heads * round_up(max_rows_per_head, kRowBlock);   // whole row blocks per head
  return rows * (2 * dp + dvp + 2) + kChunk * (dp + dvp) + zero + 2 * kRowBlock * kChunk + 64;
}

using RunItemFn = void (*)(const AttnParams&, const WorkItem&, float* workspace);

// Provided by the kernel translation units (nullptr where an ISA was not compiled).
RunItemFn run_item_avx512bf16();
RunItemFn run_item_avx512();
RunItemFn run_item_avx2();
RunItemFn run_item_generic();
int lanes_avx512bf16();
int lanes_avx512();
int lanes_avx2();
int lanes_generic();

// Scalar conversions (bit exact, round to nearest even), shared by all code.
inline float bf16_to_f32(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}
inline float f16_to_f32(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0) {
    float f = float(m) * (1.0f / 16777216.0f);
    return sign ? -f : f;
  }
  uint32_t bits = e == 31 ? (sign | 0x7f800000u | (m << 13)) : (sign | ((e + 112u) << 23) | (m << 13));
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
inline uint16_t f32_to_f16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u) return uint16_t(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0u));
  if (ax >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // rounds to infinity
  if (ax < 0x38800000u) {                                    // half subnormal or zero
    float a;
    std::memcpy(&a, &ax, 4);
    float scaled = a * 16777216.0f;                          // exact; in [0, 1024)
    uint32_t m = uint32_t(scaled);
    float rem = scaled - float(m);
    if (rem > 0.5f || (rem == 0.5f && (m & 1u))) ++m;
    return uint16_t(sign | m);
  }
  ax -= 0x38000000u;
  return uint16_t(sign | ((ax + 0xfffu + ((ax >> 13) & 1u)) >> 13));
}

}  // namespace kvmulti_cpu
