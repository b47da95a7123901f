// kvmulti native CPU attention: types shared by the torch binding (paged_attention.cpp) and the
// per-ISA kernel translation units (kernels_*.cpp). Plain C++17, no torch headers.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace kvmulti_cpu {

enum DType : int { kF32 = 0, kF16 = 1, kBF16 = 2, kE4M3 = 3, kE5M2 = 4 };
// fp8 cache formats (kvmulti/fp8.py): e4m3fn (bias 7, no infinities, NaN = S.1111.111) and e5m2
// (bias 15, the top byte of an fp16).
constexpr bool is_fp8(int dtype) { return dtype == kE4M3 || dtype == kE5M2; }

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
  int dtype;           // DType of query and out
  int cache_dtype;     // DType of the cache: dtype, or kE4M3 / kE5M2 (then k_scale / v_scale are set)
  const float* k_scale;  // fp8 caches: [num_kv_heads] (keys read as fp8 * k_scale), else nullptr
  const float* v_scale;  // fp8 caches: [num_kv_heads], else nullptr
  float scale;
  int window;          // <= 0: no sliding window
  float softcap;       // <= 0: off
  const float* sinks;  // [num_q_heads] attention-sink logits (in each row's final denominator), or nullptr
  const float* alibi;  // [num_q_heads] ALiBi slopes (score += slope[h] * (k_pos - q_pos) after softcap), or nullptr
  bool causal;
  bool prefetch;       // software prefetch of K/V rows ahead (off for calls small enough to gain nothing)
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
  // Set per run by the scheduler: the item this thread runs next (its first chunks are prefetched
  // during this item's last ones), and whether the item before this one did that for this one.
  const WorkItem* next = nullptr;
  bool prefetched = false;
};

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// 1 / the softmax denominator of a finished row of query head h: its running sum l (max m) plus
// head h's sink logit where there is one; 0 for a row without keys or mass, NaN for a NaN row.
inline float row_inverse(const AttnParams& P, int h, float m, float l) {
  if (l != l) return l;
  if (P.sinks != nullptr) l += std::exp(P.sinks[h] - m);   // m = -inf (no key): l = inf, the row stays 0
  return l > 0.0f ? 1.0f / l : 0.0f;
}

// Keys per tile of the many-row path (prefill_tiles.h; a multiple of its register tiles' 16 keys),
// and the most rows per KV head it takes.
#ifndef KV_TILE_KEYS
#define KV_TILE_KEYS 64
#endif
constexpr int kTileKeys = KV_TILE_KEYS;
constexpr int kTileMaxRows = 256;
// Floats of per-thread workspace the many-row path needs for rows_per_head rows of one KV head.
inline int64_t tile_workspace_floats(int rows_per_head, int head_size, int head_size_v, int lanes) {
  const int64_t Mr = round_up(rows_per_head, lanes), D = head_size, Dv = head_size_v;
  return Mr * (D + Dv + kTileKeys + kTileKeys / 2) + kTileKeys * (D + Dv) + (D > Dv ? D : Dv) + 64;
}

// Floats of per-thread workspace a kernel of `lanes` SIMD width needs for items of up to
// max_rows_per_head rows (tokens x G) per KV head and max_heads KV heads.
inline int64_t workspace_floats(int max_rows_per_head, int max_heads, int head_size, int head_size_v, int lanes) {
  int64_t dp = round_up(head_size, lanes), dvp = round_up(head_size_v, lanes);
  int64_t zero = dp > dvp ? dp : dvp;
  const int64_t rows = max_heads * round_up(max_rows_per_head, kRowBlock);   // whole row blocks per head
  const int64_t row_blocks = rows * (2 * dp + dvp + 2) + kChunk * (dp + dvp) + zero + 2 * kRowBlock * kChunk + 64;
  const int64_t tiles = tile_workspace_floats(max_rows_per_head, head_size, head_size_v, lanes);
  return row_blocks > tiles ? row_blocks : tiles;
}

using RunItemFn = void (*)(const AttnParams&, const WorkItem&, float* workspace);
// dst[0:n] = the fp8 codes src[0:n] (dtype kE4M3 / kE5M2) as fp32, through the kernel's in-register loads;
// lut: through the direct path's byte tables (fp8_lut64) instead; false when the variant has none.
using WidenFp8Fn = bool (*)(int dtype, const uint8_t* src, int n, float* dst, bool lut);

// Provided by the kernel translation units (nullptr where an ISA was not compiled).
RunItemFn run_item_avx512bf16();
RunItemFn run_item_avx512();
RunItemFn run_item_avx2();
RunItemFn run_item_generic();
WidenFp8Fn widen_fp8_avx512bf16();
WidenFp8Fn widen_fp8_avx512();
WidenFp8Fn widen_fp8_avx2();
WidenFp8Fn widen_fp8_generic();
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


// ---- fp8 (kvmulti/fp8.py's rule) -----------------------------------------------------------------
// e5m2 is the top byte of an fp16. e4m3fn's 7 magnitude bits shifted left by 7 are an fp16 with the
// same mantissa and an exponent 8 lower (bias 15 vs 7, subnormals included): x 2^8 restores it.
// The one exception is NaN (0x7f / 0xff), which that mapping would make 480.
inline float e5m2_to_f32(uint8_t b) { return f16_to_f32(uint16_t(b) << 8); }
inline float e4m3_to_f32(uint8_t b) {
  if ((b & 0x7fu) == 0x7fu) return std::numeric_limits<float>::quiet_NaN();
  return f16_to_f32(uint16_t(((b & 0x80u) << 8) | ((b & 0x7fu) << 7))) * 256.0f;
}

// fp32 -> fp8 with EB exponent / MB mantissa bits, round to nearest even. |x| must be <= the
// format's max finite value (callers clamp first) or NaN; NaN becomes sign | 0x7f (as torch).
template <int EB, int MB> inline uint8_t f32_to_fp8(float x) {
  constexpr int bias = (1 << (EB - 1)) - 1;
  constexpr int min_exp = 1 - bias;                 // exponent of the smallest normal
  uint32_t u;
  std::memcpy(&u, &x, 4);
  const uint8_t sign = uint8_t((u >> 24) & 0x80u);
  const uint32_t ax = u & 0x7fffffffu;
  if (ax > 0x7f800000u) return uint8_t(sign | 0x7fu);
  if (ax < uint32_t(127 + min_exp) << 23) {         // subnormal (or zero): a multiple of 2^(min_exp - MB)
    float a;
    std::memcpy(&a, &ax, 4);
    const float magic = 8388608.0f;                  // 2^23: the sum rounds to an integer, ties to even
    const float scaled = a * float(1u << (MB - min_exp));   // exact: a power-of-two scaling up
    const float r = (scaled + magic) - magic;
    return uint8_t(sign | uint8_t(r));
  }
  const uint32_t odd = (ax >> (23 - MB)) & 1u;
  const uint32_t rebias = uint32_t(bias - 127) << 23;   // wraps: an unsigned subtraction of the exponent
  return uint8_t(sign | ((ax + rebias + (1u << (22 - MB)) - 1u + odd) >> (23 - MB)));
}
inline uint8_t f32_to_e4m3(float x) { return f32_to_fp8<4, 3>(x); }
inline uint8_t f32_to_e5m2(float x) { return f32_to_fp8<5, 2>(x); }

// kvmulti/fp8.py's quantisation: fp32 division by the scale, clamp to +-max finite (NaN stays NaN),
// round to nearest even.
inline uint8_t quantize_fp8(float x, float scale, int dtype) {
  const float limit = dtype == kE4M3 ? 448.0f : 57344.0f;
  float y = x / scale;
  y = y > limit ? limit : (y < -limit ? -limit : y);   // NaN compares false: passes through
  return dtype == kE4M3 ? f32_to_e4m3(y) : f32_to_e5m2(y);
}

}  // namespace kvmulti_cpu
