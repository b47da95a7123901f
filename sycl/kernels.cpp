// kvmulti SYCL kernels: paged attention and write_kv over the canonical KV-cache layout.
//
// SYCL 2020 C++ with free-function kernels (sycl_ext_oneapi_free_function_kernels). This file is
// the one source of truth; it is compiled at RUN TIME by the oneAPI kernel_compiler extension
// (create_kernel_bundle_from_source(ctx, source_language::sycl, src) + build) for the device that
// runs it, with these build options (kvmulti/backends/sycl/backend.py passes them):
//
//   -DKVM_DTYPE=0|1|2       element type of cache, query, key, value and out: fp32, fp16, bf16
//   -DKVM_HEAD_SIZE=D       key/query head size
//   -DKVM_HEAD_SIZE_V=DV    value head size
//   -DKVM_ROWS=R            (query token, query head) rows per work-group tile (host tiling)
//   -DKVM_WG=WG             work-group size of the attention kernels (a multiple of KVM_SG)
//   -DKVM_SG=SG             sub-group size the attention kernels require (default 16)
//   -DKVM_RB=RB             tile rows held in registers per pass over the keys (default 4)
//   -DKVM_KB=KB             keys per sub-group step, a power of two <= SG (default 4)
//   -DKVM_TERMS=1           also build kvm_paged_attention_terms (ALiBi / non-causal; default 0)
//   -DKVM_VG=VG             matrix body: V elements a lane reads per load for P.V (default 4, 2 over
//                           an fp8 cache; lowered to the largest power of two dividing ceil(DV / 16) and VW)
//   -DKVM_MMA=0|1|2         attention body: 0 the vector body (v2, below); fp16 / bf16 only: 1 the
//                           matrix body with the matrix built-in emulated by sub-group broadcasts
//                           (non-GPU devices: the OpenCL CPU device), 2 the matrix body on the
//                           built-in (Intel GPUs with it at sub-group size 16: dpas on PVC)
//   -DKVM_LARGE_GRF=1       the attention kernels carry grf_size<256> (IGC's 256-register mode);
//                           GPU-only (the OpenCL CPU device rejects the option it becomes)
//   -DKVM_SPLIT_KEYS=0|1    kvm_paged_prefill's matrix body splits its key loop into masked and
//                           unmasked loops, a copy of the step each (default: with KVM_MMA=2; the
//                           emulated build's JIT takes ~4x as long over the copies)
//
// Cache addressing (named strides, in elements): element d of K of (block, token, kv head) is at
// cache[block * s_block + token * s_token + head * s_head + d]; V follows at + D. Both physical
// orders (NHD, HND) differ only in s_token / s_head.
//
// Attention, vector body (v2; fp32, and fp16 / bf16 on GPUs without the matrix built-in): one
// work-group per (tile, KV head[, KV partition]); a tile is up to R consecutive rows of a request's
// flattened (query token, query head-in-group) space, so all GQA rows of a KV head (up to RB per
// pass) use every K/V row the sub-group loads. The NSG = WG / SG sub-groups of
// the work-group split the visible key range: sub-group s takes key steps s, s + NSG, ... of KB keys
// each and runs its own online softmax. Per step:
//   * lane j < KB reads the block-table entry of key j (one coalesced int load per step);
//   * each K row and then each V row is read by the whole sub-group with one vector load per lane
//     (lane l holds elements [c * SG * VW + l * VW, + VW) of the row, VW elements = up to 16 bytes in
//     the cache dtype, so one sub-group load is one contiguous up-to-256-byte message);
//   * the KB x RB partial dot products are finished with a butterfly reduce-scatter (KB - 1 + log2(SG
//     / KB) shuffles per row per step, lane l ends with the score of key bitrev(l mod KB));
//   * probabilities reach every lane by a sub-group broadcast for the P.V update;
//   * the next step's K/V rows are prefetched (sycl_ext_oneapi_prefetch) while this one computes
//     (IGC emits no message for it; the matrix bodies' GPU build prefetches through LSC: prefetch_row).
// K/V never touch local memory and the key loop has no barrier. At the end of a pass the sub-groups
// merge their (max, sum, accumulator) through local memory: one group_barrier per pass (and one more
// before a second pass reuses the scratch). Keys outside the causal / sliding-window range of a tile
// are never visited, so block-table entries for blocks wholly outside the window are never read.
//
// Attention, matrix body (KVM_MMA 1 / 2): see attention_body_mma. Both bodies share the tiles, the
// end-of-pass merge through local memory, split-KV and the optional terms below.
//
// kvm_paged_prefill (the host launches it for tiles of more than MR rows): the rows-on-lanes matrix
// body (prefill_body_mma) where the build has it, else the same body as kvm_paged_attention.
//
// Split-KV (long contexts, few work-groups): the same kernel over one partition of the key range
// writes an unnormalised partial output + (max, sum) per row; kvm_split_reduce combines them.
//
// Optional terms (the oracle's, kvmulti/reference.py):
//   * causal == 0 (non-causal, encoder-only): every row sees all seq_len keys of its request (the
//     host refuses a sliding window with it);
//   * alibi != nullptr: fp32 [Hq] slopes; score += slope[qh] * (key pos - query pos) after scale and
//     softcap, before the mask;
//   * sinks != nullptr: fp32 [Hq] logits; sinks[qh] joins the row's softmax max and denominator
//     once, where the row is normalised (the end-of-pass merge, or kvm_split_reduce: never per
//     partition), and adds no value.
// The first two change the key loop, so they live in a second instantiation of the body,
// kvm_paged_attention_terms (built only with KVM_TERMS: a bundle of its own, compiled on the first
// call that needs it); kvm_paged_attention compiles them away (its key loop is the plain causal
// one) and serves sinks, which touch only the merge after the loop.
//
// Memory safety: every index that comes from metadata is guarded. A tile whose request has
// query_start_loc entries outside [0, num_tokens] (or decreasing) is skipped; key positions stop
// at the block-table width (bt_cols * block_size) and at 0; a request index >= bt_rows is skipped;
// a block id outside [0, num_blocks) is a masked key whose row is never read. write_kv skips slots
// outside [0, num_blocks * block_size) and reads only num_tokens rows of key/value/slot_mapping.

#include <sycl/sycl.hpp>

#include <cstdint>
#include <limits>
#include <type_traits>

namespace syclext = sycl::ext::oneapi;
namespace syclexp = sycl::ext::oneapi::experimental;

#ifndef KVM_DTYPE
#error "KVM_DTYPE must be defined (0 fp32, 1 fp16, 2 bf16)"
#endif
#ifndef KVM_HEAD_SIZE
#error "KVM_HEAD_SIZE must be defined"
#endif
#ifndef KVM_HEAD_SIZE_V
#define KVM_HEAD_SIZE_V KVM_HEAD_SIZE
#endif
#ifndef KVM_ROWS
#define KVM_ROWS 16
#endif
#ifndef KVM_WG
#define KVM_WG 128
#endif
#ifndef KVM_SG
#define KVM_SG 16
#endif
#ifndef KVM_RB
#define KVM_RB 4
#endif
#ifndef KVM_KB
#define KVM_KB 4
#endif

constexpr int D = KVM_HEAD_SIZE;
constexpr int DV = KVM_HEAD_SIZE_V;
constexpr int E = D + DV;               // content elements per (token, head)
constexpr int ROWS = KVM_ROWS;
constexpr int WG = KVM_WG;
constexpr int SG = KVM_SG;
constexpr int NSG = WG / SG;
constexpr int RB = KVM_RB < ROWS ? KVM_RB : ROWS;
constexpr int KB = KVM_KB;

static_assert(D > 0 && DV > 0, "head sizes must be positive");
static_assert(WG % SG == 0, "the work-group size must be a multiple of the sub-group size");
static_assert(KB >= 1 && KB <= SG && (KB & (KB - 1)) == 0 && (SG & (SG - 1)) == 0,
              "KB and SG must be powers of two with KB <= SG");

// ---------------------------------------------------------------------------------------------
// Element type: loads widen to fp32, stores round from fp32 (bf16: round to nearest even).
#if KVM_DTYPE == 0
using elem_t = float;
static inline float to_f(elem_t x) { return x; }
static inline elem_t from_f(float x) { return x; }
#elif KVM_DTYPE == 1
using elem_t = sycl::half;
static inline float to_f(elem_t x) { return static_cast<float>(x); }
static inline elem_t from_f(float x) { return static_cast<sycl::half>(x); }
#elif KVM_DTYPE == 2
using elem_t = uint16_t;  // bfloat16 bits
static inline float to_f(elem_t x) { return sycl::bit_cast<float>(static_cast<uint32_t>(x) << 16); }
static inline elem_t from_f(float x) {
  uint32_t u = sycl::bit_cast<uint32_t>(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<elem_t>(0x7fc0);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<elem_t>(u >> 16);
}
#else
#error "KVM_DTYPE must be 0, 1 or 2"
#endif

// Cache element type: the activations' (KVM_CACHE unset or == KVM_DTYPE) or fp8 codes
// (kvmulti/fp8.py; KVM_CACHE 3 = float8_e4m3fn, 4 = float8_e5m2, 5 = float8_e4m3fnuz, 6 = float8_e5m2fnuz:
// gfx942's FNUZ formats, exponent bias one higher, no infinity, no negative zero, NaN 0x80 alone). An fp8
// cache is read as float(code) * scale[KV head] and written as fp8(x / scale[KV head]) (IEEE fp32 division,
// saturating, round to nearest even in integers, NaN kept, an FNUZ zero +0), bit-identical to
// kvmulti.fp8.quantize.
#if !defined(KVM_CACHE) || KVM_CACHE == KVM_DTYPE
using cache_t = elem_t;
constexpr bool FP8 = false;
static inline float cache_to_f(cache_t x) { return to_f(x); }
static inline cache_t cache_from(elem_t x, float) { return x; }
#elif KVM_CACHE >= 3 && KVM_CACHE <= 6
using cache_t = uint8_t;
constexpr bool FP8 = true, FNUZ = KVM_CACHE >= 5;
constexpr int FP8_MANT = KVM_CACHE % 2 == 1 ? 3 : 2, FP8_BIAS = (KVM_CACHE % 2 == 1 ? 7 : 15) + (FNUZ ? 1 : 0);
constexpr uint32_t FP8_MAX_BITS = KVM_CACHE == 3 ? 0x43E00000u : KVM_CACHE == 5 ? 0x43700000u : 0x47600000u;  // 448, 240, 57344
// An e4m3 code's value as bf16 bits, exactly and without branches: the exponent field moves from bias
// 7 to 127 in integer operations; a subnormal code (exponent field 0: m x 2^-9) is (1 + m / 8) x 2^-6
// minus 2^-6, an exact fp32 subtraction; 0x7F / 0xFF (NaN) become the canonical quiet NaN.
static inline uint32_t e4m3_bf16_bits(cache_t code) {
  const uint32_t mag = code & 0x7Fu, sub = static_cast<uint32_t>(mag < 8u);
  const float f = sycl::bit_cast<float>(((mag << 4) + 0x3C00u + (sub << 7)) << 16) - static_cast<float>(sub) * 0x1p-6f;
  const uint32_t bits = (sycl::bit_cast<uint32_t>(f) >> 16) | (static_cast<uint32_t>(code & 0x80u) << 8);
  const uint32_t nan = 0u - static_cast<uint32_t>(mag == 0x7Fu);
  return (bits & ~nan) | (0x7FC0u & nan);
}
static inline float cache_to_f(cache_t code) {
  if constexpr (KVM_CACHE == 3) return sycl::bit_cast<float>(e4m3_bf16_bits(code) << 16);
  const uint32_t sign = static_cast<uint32_t>(code & 0x80u) << 24;
  const uint32_t e = (code & 0x7Fu) >> FP8_MANT, m = code & ((1u << FP8_MANT) - 1u);
  float mag;
  if (FNUZ && code == 0x80u) {
    return std::numeric_limits<float>::quiet_NaN();
  } else if (KVM_CACHE == 3 && (code & 0x7Fu) == 0x7Fu) {
    mag = std::numeric_limits<float>::quiet_NaN();
  } else if (KVM_CACHE == 4 && e == 31u) {
    mag = m ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity();
  } else if (e == 0u) {
    mag = static_cast<float>(m) * sycl::bit_cast<float>(static_cast<uint32_t>(127 + 1 - FP8_BIAS - FP8_MANT) << 23);
  } else {
    mag = sycl::bit_cast<float>(((e + 127u - FP8_BIAS) << 23) | (m << (23 - FP8_MANT)));
  }
  return sycl::bit_cast<float>(sycl::bit_cast<uint32_t>(mag) | sign);
}
static inline cache_t cache_from(elem_t x, float scale) {
  constexpr int SHIFT = 23 - FP8_MANT;
  const uint32_t bits = sycl::bit_cast<uint32_t>(to_f(x) / scale);
  const uint32_t sign = (bits >> 24) & 0x80u;
  uint32_t mag = bits & 0x7FFFFFFFu;
  if (mag > 0x7F800000u) return static_cast<cache_t>(FNUZ ? 0x80u : 0x7Fu | sign);
  if (mag > FP8_MAX_BITS) mag = FP8_MAX_BITS;
  const int exponent = static_cast<int>(mag >> 23);
  uint32_t code;
  if (exponent >= 128 - FP8_BIAS) {
    code = ((mag + ((1u << (SHIFT - 1)) - 1u) + ((mag >> SHIFT) & 1u)) >> SHIFT) -
           (static_cast<uint32_t>(127 - FP8_BIAS) << FP8_MANT);
  } else {
    int shift = (151 - FP8_BIAS - FP8_MANT) - exponent;
    shift = shift < 1 ? 1 : (shift > 31 ? 31 : shift);
    const uint32_t sig = (mag & 0x7FFFFFu) | 0x800000u;
    code = (sig + (1u << (shift - 1)) - 1u + ((sig >> shift) & 1u)) >> shift;
  }
  if (FNUZ && code == 0u) return 0u;
  return static_cast<cache_t>(code | sign);
}
#else
#error "KVM_CACHE must be KVM_DTYPE or 3 .. 6"
#endif

// A K/V element as fp32: float(code) * scale for an fp8 cache (the oracle's order), else the value.
static inline float kv_value(cache_t x, float scale) { return FP8 ? cache_to_f(x) * scale : cache_to_f(x); }

constexpr float NEG_INF = -std::numeric_limits<float>::infinity();
// A NaN query row's output row is all NaN (what the math gives). The row's running sum carries the
// mark through the merges; NaN is tested on the bits, which no floating-point model folds away.
constexpr float QNAN = std::numeric_limits<float>::quiet_NaN();
static inline bool is_nan(float x) { return (sycl::bit_cast<uint32_t>(x) & 0x7fffffffu) > 0x7f800000u; }

// Vector width VW (elements per lane per load): the widest power of two with VW * sizeof(elem_t)
// <= 16 bytes dividing both D and DV, so every K and V row chunk is VW-aligned when the cache base
// is (the host checks the base pointer). NJ / NJV: chunks of SG * VW elements per K / V row.
constexpr int widest_vec() {
  int v = 16 / static_cast<int>(sizeof(elem_t));
  while (v > 1 && (D % v != 0 || DV % v != 0)) v /= 2;
  return v;
}
constexpr int VW = widest_vec();
constexpr int NJ = (D + SG * VW - 1) / (SG * VW);
constexpr int NJV = (DV + SG * VW - 1) / (SG * VW);
using vec_t = sycl::vec<elem_t, VW>;
using cvec_t = sycl::vec<cache_t, VW>;  // a K/V chunk: the same VW elements of the cache's type

// Local scratch of the end-of-pass merge: per sub-group and row, the accumulator [DV], max, sum.
constexpr int MERGE_STRIDE = DV + 2;
constexpr int LM_FLOATS = NSG * RB * MERGE_STRIDE;

// The key of a step lane l scores after the butterfly: bit t of l selects the upper half at step t.
static inline int key_of_lane(int lane) {
  int key = 0;
#pragma unroll
  for (int half = KB / 2, t = 0; half >= 1; half /= 2, ++t) key += ((lane >> t) & 1) * half;
  return key;
}

// The lane holding key j's score (bit reversal of j over log2(KB) bits; the inverse of key_of_lane).
constexpr int lane_of_key(int j) {
  int lane = 0;
  for (int half = KB / 2, t = 0; half >= 1; half /= 2, ++t) lane |= ((j / half) & 1) << t, j %= half;
  return lane;
}

// v[j] holds this lane's partial dot product for key j of the step; returns the full dot product of
// key key_of_lane(lane). log2(KB) halving exchanges (KB - 1 shuffles), then log2(SG / KB) sums.
static inline float reduce_scatter(sycl::sub_group sg, int lane, float (&v)[KB]) {
#pragma unroll
  for (int half = KB / 2, t = 0; half >= 1; half /= 2, ++t) {
    const bool upper = (lane >> t) & 1;
#pragma unroll
    for (int i = 0; i < KB / 2; ++i) {
      if (i < half) {
        const float send = upper ? v[i] : v[i + half];
        const float keep = upper ? v[i + half] : v[i];
        v[i] = keep + sycl::permute_group_by_xor(sg, send, 1 << t);
      }
    }
  }
  float s = v[0];
#pragma unroll
  for (int m = KB; m < SG; m <<= 1) s += sycl::permute_group_by_xor(sg, s, m);
  return s;
}

// Max / sum over the KB distinct keys of a step (lanes that differ only above bit log2(KB) agree).
static inline float step_max(sycl::sub_group sg, float x) {
#pragma unroll
  for (int m = 1; m < KB; m <<= 1) x = sycl::fmax(x, sycl::permute_group_by_xor(sg, x, m));
  return x;
}
static inline float step_sum(sycl::sub_group sg, float x) {
#pragma unroll
  for (int m = 1; m < KB; m <<= 1) x += sycl::permute_group_by_xor(sg, x, m);
  return x;
}

// The chunk as raw bits of its natural alignment: a load through raw_t tells the device compiler
// the address is VW * sizeof(elem_t)-aligned, so it emits one wide message per sub-group instead
// of 2-byte pieces (the host refuses a misaligned cache base).
constexpr int VBYTES = VW * static_cast<int>(sizeof(cache_t));
// BYTES (1, 2, 4, 8 or 16) of raw bits, a type of that natural alignment.
template <int BYTES>
using raw_bytes_t = std::conditional_t<BYTES == 16, sycl::vec<uint32_t, 4>,
                    std::conditional_t<BYTES == 8, sycl::vec<uint32_t, 2>,
                    std::conditional_t<BYTES == 4, uint32_t, std::conditional_t<BYTES == 2, uint16_t, uint8_t>>>>;
using raw_t = raw_bytes_t<VBYTES>;
static_assert(sizeof(raw_t) == sizeof(cvec_t), "raw_t must have the size of a chunk");

// One vector chunk of a cache row; zero when the row is masked (off < 0) or the chunk is past n.
static inline cvec_t load_chunk(const cache_t *row, int64_t off, int e, int n) {
  if (off < 0 || e >= n) return cvec_t(cache_t(0));
  return sycl::bit_cast<cvec_t>(*reinterpret_cast<const raw_t *>(row + off + e));
}

// ---------------------------------------------------------------------------------------------
// Sub-group matrix multiply-accumulate (cl_intel_subgroup_matrix_multiply_accumulate, sub-group 16):
// C[8][16] = A[8][16] x B[16][16] + C, 16-bit float sources (bf16 or fp16), fp32 accumulator.
// Fragment layout (the extension's specification), for lane n of the sub-group:
//   a (8 x 16-bit): component m is A[m][n];
//   b (8 x 32-bit): component i packs B[2i][n] (low 16 bits) and B[2i + 1][n] (high 16 bits);
//   c and the result (8 x fp32): component m is C[m][n].
// KVM_MMA == 2: the built-in itself (Intel GPUs whose sub-group size 16 has it: dpas on PVC);
// KVM_MMA == 1: the same layout computed with sub-group broadcasts (devices without the extension,
// e.g. the OpenCL CPU device); KVM_MMA == 0: no matrix path (the vector body below).
#ifndef KVM_MMA
#define KVM_MMA 0
#endif
#ifndef KVM_SPLIT_KEYS
#define KVM_SPLIT_KEYS (KVM_MMA == 2)
#endif

#if KVM_MMA == 2
extern "C" SYCL_EXTERNAL void __builtin_IB_lsc_prefetch_global_uchar(const __attribute__((opencl_global)) uint8_t *base,
                                                                      int imm_elem_off, int cache_opt);
#endif
// Each lane's cache row of E elements at p into the caches (L1 and L3), one 64-byte line per message on
// Intel GPUs (IGC's LSC prefetch, one byte per lane: no alignment needed; IGC's OpenCL prefetch emits
// no message), else sycl_ext_oneapi_prefetch.
static inline void prefetch_row(const cache_t *p) {
#if KVM_MMA == 2
  const auto g = sycl::address_space_cast<sycl::access::address_space::global_space, sycl::access::decorated::yes>(
                     reinterpret_cast<const uint8_t *>(p)).get_decorated();
  constexpr int LINES = (E * static_cast<int>(sizeof(cache_t)) + 63) / 64;
#pragma unroll
  for (int i = 0; i < LINES; ++i) __builtin_IB_lsc_prefetch_global_uchar(g, 64 * i, 4 /* L1C_L3C */);
#else
  syclexp::prefetch(const_cast<cache_t *>(p), E);
#endif
}
using mma_a_t = short __attribute__((ext_vector_type(8)));
using mma_b_t = int __attribute__((ext_vector_type(8)));
using mma_c_t = float __attribute__((ext_vector_type(8)));

#if KVM_MMA == 2
SYCL_EXTERNAL mma_c_t intel_sub_group_bf16_bf16_matrix_mad_k16(mma_a_t a, mma_b_t b, mma_c_t acc);
SYCL_EXTERNAL mma_c_t intel_sub_group_f16_f16_matrix_mad_k16(mma_a_t a, mma_b_t b, mma_c_t acc);
#endif

// A 16-bit matrix element (bf16 when BF16, else fp16) as fp32.
template <bool BF16>
static inline float mma_elem(uint32_t bits16) {
  if constexpr (BF16) return sycl::bit_cast<float>(bits16 << 16);
  else return static_cast<float>(sycl::bit_cast<sycl::half>(static_cast<uint16_t>(bits16)));
}

template <bool BF16>
static inline mma_c_t mma(sycl::sub_group sg, mma_a_t a, mma_b_t b, mma_c_t acc) {
#if KVM_MMA == 2
  (void)sg;
  if constexpr (BF16) return intel_sub_group_bf16_bf16_matrix_mad_k16(a, b, acc);
  else return intel_sub_group_f16_f16_matrix_mad_k16(a, b, acc);
#else
  // Rows (2r, 2r + 1) of lane k's a travel as one 32-bit word; lane n's b holds column n.
  uint32_t a_pairs[4];
#pragma unroll
  for (int r = 0; r < 4; ++r)
    a_pairs[r] = static_cast<uint16_t>(a[2 * r]) | (static_cast<uint32_t>(static_cast<uint16_t>(a[2 * r + 1])) << 16);
  float c[8];
#pragma unroll
  for (int m = 0; m < 8; ++m) c[m] = acc[m];
#pragma unroll
  for (int k = 0; k < 16; ++k) {
    const uint32_t word = static_cast<uint32_t>(b[k / 2]);
    const float bk = mma_elem<BF16>(k % 2 ? word >> 16 : word & 0xffffu);
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const uint32_t pair = sycl::select_from_group(sg, a_pairs[r], k);
      c[2 * r] += mma_elem<BF16>(pair & 0xffffu) * bk;
      c[2 * r + 1] += mma_elem<BF16>(pair >> 16) * bk;
    }
  }
  mma_c_t out;
#pragma unroll
  for (int m = 0; m < 8; ++m) out[m] = c[m];
  return out;
#endif
}

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
static inline int64_t clamp64(int64_t x, int64_t lo, int64_t hi) { return x < lo ? lo : (x > hi ? hi : x); }

// Everything one work-group needs to know about its tile; valid == false: nothing to do.
struct Tile {
  bool valid;
  int req, f0, nrows;
  int64_t q0, ctx;                       // first query row of the request; position of its first new token
  int k_lo, k_hi;                        // visible key positions [k_lo, k_hi) of the whole tile (this partition)
};

static inline Tile locate_tile(const int32_t *query_start_loc, const int32_t *seq_lens, const int32_t *tiles,
                               int64_t tile, int64_t num_tokens, int64_t bt_rows, int64_t bt_cols, int group,
                               int block_size, int window, bool causal) {
  Tile t{false, 0, 0, 0, 0, 0, 0, 0};
  t.req = tiles[2 * tile];
  t.f0 = tiles[2 * tile + 1];
  if (t.req < 0 || t.req >= bt_rows || t.f0 < 0) return t;
  const int64_t q0 = query_start_loc[t.req], q1 = query_start_loc[t.req + 1];
  if (q0 < 0 || q1 < q0 || q1 > num_tokens) return t;
  const int64_t qlen = q1 - q0;
  const int64_t nrows = min64(ROWS, qlen * group - t.f0);
  if (nrows <= 0) return t;
  t.q0 = q0;
  t.nrows = static_cast<int>(nrows);
  t.ctx = static_cast<int64_t>(seq_lens[t.req]) - qlen;
  const int64_t p_first = t.ctx + t.f0 / group;
  const int64_t p_last = t.ctx + (t.f0 + nrows - 1) / group;
  const int64_t k_max = bt_cols * block_size;  // the block table holds no key past this
  const int64_t lo = window > 0 ? p_first - window + 1 : 0;
  t.k_lo = static_cast<int>(clamp64(lo, 0, k_max));
  t.k_hi = static_cast<int>(clamp64(causal ? p_last + 1 : t.ctx + qlen, 0, k_max));
  t.valid = true;
  return t;
}

// The tile, KV head and split-KV partition of work-group `gid` (grid: tiles x KV heads [x num_parts]);
// split: the tile's key range cut to the partition's part_size keys.
struct GroupTile {
  Tile t;
  int h, part;
};

static inline GroupTile locate_group_tile(int64_t gid, bool split, int num_parts, int part_size, int num_kv_heads,
                                          const int32_t *query_start_loc, const int32_t *seq_lens,
                                          const int32_t *tiles, int64_t num_tokens, int64_t bt_rows, int64_t bt_cols,
                                          int group, int block_size, int window, bool causal) {
  GroupTile g;
  g.part = split ? static_cast<int>(gid % num_parts) : 0;
  if (split) gid /= num_parts;
  g.h = static_cast<int>(gid % num_kv_heads);
  g.t = locate_tile(query_start_loc, seq_lens, tiles, gid / num_kv_heads, num_tokens, bt_rows, bt_cols, group,
                    block_size, window, causal);
  if (g.t.valid && split) {
    const int64_t lo = static_cast<int64_t>(g.t.k_lo) + static_cast<int64_t>(g.part) * part_size;
    g.t.k_hi = static_cast<int>(min64(g.t.k_hi, lo + part_size));
    g.t.k_lo = static_cast<int>(min64(lo, g.t.k_hi));
  }
  return g;
}

// ---------------------------------------------------------------------------------------------
// One parameter list for both attention kernels and both bodies (the host passes the same arguments
// to either kernel); the kernels take the local scratch as an accessor, the bodies as a pointer.
#define KVM_ATTENTION_COMMON_PARAMS                                                                             \
  const elem_t *query, int64_t q_st, int64_t q_sh, int64_t num_tokens, const cache_t *cache, int64_t s_block,  \
      int64_t s_token, int64_t s_head, int64_t num_blocks, const int32_t *block_table, int64_t bt_stride,      \
      int64_t bt_rows, int64_t bt_cols, const int32_t *seq_lens, const int32_t *query_start_loc,               \
      const int32_t *tiles, elem_t *out, int64_t o_st, int64_t o_sh, float *part_acc, float *part_ml,          \
      int32_t num_parts, int32_t part_size, int32_t num_kv_heads, int32_t group, int32_t block_size,           \
      float scale, int32_t window, float softcap, const float *k_scale, const float *v_scale,                  \
      const float *sinks, const float *alibi, int32_t causal
#define KVM_ATTENTION_COMMON_ARGS                                                                               \
  query, q_st, q_sh, num_tokens, cache, s_block, s_token, s_head, num_blocks, block_table, bt_stride, bt_rows,  \
      bt_cols, seq_lens, query_start_loc, tiles, out, o_st, o_sh, part_acc, part_ml, num_parts, part_size,     \
      num_kv_heads, group, block_size, scale, window, softcap, k_scale, v_scale, sinks, alibi, causal
#define KVM_ATTENTION_PARAMS KVM_ATTENTION_COMMON_PARAMS, sycl::local_accessor<float, 1> lm
#define KVM_ATTENTION_BODY_PARAMS KVM_ATTENTION_COMMON_PARAMS, sycl::decorated_local_ptr<float> lm
#define KVM_ATTENTION_ARGS KVM_ATTENTION_COMMON_ARGS, lm.get_multi_ptr<sycl::access::decorated::yes>()

// What one work-group of either attention body knows before its key loop: its place in the
// sub-group, its tile / KV head / partition, and the per-KV-head constants.
struct WorkGroup {
  int lid, sg_id, lane;
  bool split;                           // part_acc != nullptr: write partition `part`'s partial results
  bool is_causal, use_alibi;            // uniform; constants (causal, no ALiBi) in the plain instantiation
  Tile t;
  int h, part, num_q_heads;
  const int32_t *bt;                    // the request's block-table row
  int64_t head_off, s_block, s_token, num_blocks;
  int block_size;
  float ks, vs;                         // fp8 caches: the KV head's K / V scales (else 1)

  // Cache offset (elements) of the row of key position k; -1: masked (outside [lo, hi) or a bad block id).
  int64_t key_offset(int k, int lo, int hi) const {
    if (k < lo || k >= hi) return -1;
    return slot_offset(k / block_size, k % block_size);
  }
  // Cache offset of slot `in` of block-table entry `blk`; -1: a bad block id.
  int64_t slot_offset(int blk, int in) const {
    const int32_t bid = bt[blk];
    if (bid < 0 || bid >= num_blocks) return -1;
    return static_cast<int64_t>(bid) * s_block + static_cast<int64_t>(in) * s_token + head_off;
  }
};

// The WorkGroup of the calling work-item (w.t.valid == false: the work-group has nothing to do).
template <bool TERMS>
static inline WorkGroup open_work_group(KVM_ATTENTION_COMMON_PARAMS) {
  auto it = syclext::this_work_item::get_nd_item<1>();
  auto sg = it.get_sub_group();
  WorkGroup w;
  w.lid = static_cast<int>(it.get_local_id(0));
  w.sg_id = static_cast<int>(sg.get_group_linear_id());
  w.lane = static_cast<int>(sg.get_local_linear_id());
  w.split = part_acc != nullptr;
  w.is_causal = !TERMS || causal != 0;
  w.use_alibi = TERMS && alibi != nullptr;
  const GroupTile g = locate_group_tile(it.get_group(0), w.split, num_parts, part_size, num_kv_heads,
                                        query_start_loc, seq_lens, tiles, num_tokens, bt_rows, bt_cols, group,
                                        block_size, window, w.is_causal);
  w.t = g.t;
  w.h = g.h;
  w.part = g.part;
  w.num_q_heads = num_kv_heads * group;
  w.bt = block_table + static_cast<int64_t>(w.t.valid ? w.t.req : 0) * bt_stride;
  w.head_off = static_cast<int64_t>(w.h) * s_head;
  w.s_block = s_block;
  w.s_token = s_token;
  w.num_blocks = num_blocks;
  w.block_size = block_size;
  w.ks = (FP8 && w.t.valid) ? k_scale[w.h] : 1.f;
  w.vs = (FP8 && w.t.valid) ? v_scale[w.h] : 1.f;
  return w;
}

// Sub-group scratch row of the merge: accumulator [DV], then the row's max and sum (NaN: a NaN query row).
static inline void store_row_stats(sycl::decorated_local_ptr<float> row, int lane, float m, float l, bool nan) {
  if (lane == 0) {
    row[DV] = m;
    row[DV + 1] = nan ? QNAN : l;
  }
}

// The end-of-pass merge, after every sub-group stored its rows: tile rows [first, first + nrows) of
// the pass; the partial results of row pr from key split g (of nslots) are in scratch row
// pr + g * stride. Writes out (normalised, the sink joined) or, split, the partition's unnormalised
// partials and (max, sum).
static inline void merge_pass(const WorkGroup &w, sycl::decorated_local_ptr<float> lm, int first, int nrows,
                              int stride, int nslots, int group, const float *sinks, elem_t *out, int64_t o_st,
                              int64_t o_sh, float *part_acc, float *part_ml, int num_parts) {
  sycl::group_barrier(syclext::this_work_item::get_work_group<1>());
  const Tile &t = w.t;
  for (int idx = w.lid; idx < nrows * DV; idx += WG) {
    const int pr = idx / DV, d = idx - pr * DV;
    const int flat = t.f0 + first + pr;
    const int64_t token = t.q0 + flat / group;
    const int qh = w.h * group + flat % group;
    // The sink joins where the row is normalised: here unsplit, in kvm_split_reduce when split.
    const float sink = (sinks != nullptr && !w.split) ? sinks[qh] : NEG_INF;
    float mx = sink;
    bool row_nan = false;
    for (int g = 0; g < nslots; ++g) {
      const auto row = lm + (pr + g * stride) * MERGE_STRIDE;
      mx = sycl::fmax(mx, row[DV]);
      row_nan |= is_nan(row[DV + 1]);
    }
    float sum = 0.f, a = 0.f;
    if (row_nan) {
      sum = QNAN;
      a = QNAN;
    } else if (mx != NEG_INF) {
      for (int g = 0; g < nslots; ++g) {
        const auto row = lm + (pr + g * stride) * MERGE_STRIDE;
        const float wt = row[DV] == NEG_INF ? 0.f : sycl::exp(row[DV] - mx);
        sum += row[DV + 1] * wt;
        a += row[d] * wt;
      }
      if (sink != NEG_INF) sum += sycl::exp(sink - mx);
    }
    if (w.split) {
      const int64_t prow = (token * w.num_q_heads + qh) * num_parts + w.part;
      part_acc[prow * DV + d] = a;
      if (d == 0) {
        part_ml[prow * 2 + 0] = mx;
        part_ml[prow * 2 + 1] = sum;
      }
    } else {
      out[token * o_st + qh * o_sh + d] = from_f(row_nan ? QNAN : sum > 0.f ? a / sum : 0.f);
    }
  }
}

// The attention body. part_acc != nullptr (split-KV): write the partial results of partition
// `part` of the key range instead of out (one body for both, so the device compiles it once).
template <bool TERMS>
static inline void attention_body(KVM_ATTENTION_BODY_PARAMS) {
  auto sg = syclext::this_work_item::get_sub_group();
  const WorkGroup w = open_work_group<TERMS>(KVM_ATTENTION_COMMON_ARGS);
  if (!w.t.valid) return;  // uniform over the work-group
  const Tile &t = w.t;
  const int h = w.h, sg_id = w.sg_id, lane = w.lane;
  const float ks = w.ks, vs = w.vs;
  const int my_key = key_of_lane(lane);
  const int step_keys = NSG * KB;
  const bool is_causal = w.is_causal, use_alibi = w.use_alibi;

  for (int rb0 = 0; rb0 < t.nrows; rb0 += RB) {
    const int nr = sycl::min(RB, t.nrows - rb0);
    // Queries of this pass's rows: lane chunks in the cache dtype (read once per pass).
    vec_t q[RB][NJ];
    int64_t qpos[RB];
    float slope[RB];
#pragma unroll
    for (int r = 0; r < RB; ++r) {
      const int flat = t.f0 + rb0 + r;
      const int64_t token = t.q0 + flat / group;
      const int qh = h * group + flat % group;
      qpos[r] = r < nr ? t.ctx + flat / group : std::numeric_limits<int64_t>::min();
      slope[r] = (use_alibi && r < nr) ? alibi[qh] : 0.f;
#pragma unroll
      for (int c = 0; c < NJ; ++c) {
        const int e = c * SG * VW + lane * VW;
#pragma unroll
        for (int i = 0; i < VW; ++i)
          q[r][c][i] = (r < nr && e < D) ? query[token * q_st + qh * q_sh + e + i] : elem_t(0);
      }
    }
    bool nan_row[RB];
#pragma unroll
    for (int r = 0; r < RB; ++r) {
      bool any = false;
#pragma unroll
      for (int c = 0; c < NJ; ++c)
#pragma unroll
        for (int i = 0; i < VW; ++i) any |= is_nan(to_f(q[r][c][i]));
      nan_row[r] = sycl::any_of_group(sg, any);
    }
    float m[RB], l[RB], acc[RB][NJV][VW];
#pragma unroll
    for (int r = 0; r < RB; ++r) {
      m[r] = NEG_INF;
      l[r] = 0.f;
#pragma unroll
      for (int c = 0; c < NJV; ++c)
#pragma unroll
        for (int i = 0; i < VW; ++i) acc[r][c][i] = 0.f;
    }

    auto key_offset = [&](int k) { return w.key_offset(k, t.k_lo, t.k_hi); };

    int k0 = t.k_lo + sg_id * KB;
    int64_t off = key_offset(k0 + (lane < KB ? lane : 0));
    for (; k0 < t.k_hi; k0 += step_keys) {
      // Prefetch the next step's rows (their block-table entries are read now, used next step).
      const int64_t next_off = key_offset(k0 + step_keys + (lane < KB ? lane : 0));
      if (lane < KB && next_off >= 0) syclexp::prefetch(const_cast<cache_t *>(cache + next_off), E);

      // The step's K rows: one vector load per lane per chunk, in the cache dtype.
      cvec_t k[KB][NJ];
#pragma unroll
      for (int j = 0; j < KB; ++j) {
        const int64_t o = sycl::select_from_group(sg, off, j);
#pragma unroll
        for (int c = 0; c < NJ; ++c) k[j][c] = load_chunk(cache, o, c * SG * VW + lane * VW, D);
      }
      const int64_t kpos = k0 + my_key;
      const bool key_ok = sycl::select_from_group(sg, off, my_key) >= 0;

      // Scores and the online softmax of every row of the pass over the step's KB keys (rows
      // unrolled with uniform guards, so every per-row value stays in registers).
      float p[RB];
#pragma unroll
      for (int r = 0; r < RB; ++r) {
        if (r < nr) {
          float part_dot[KB];
#pragma unroll
          for (int j = 0; j < KB; ++j) {
            float d = 0.f;
#pragma unroll
            for (int c = 0; c < NJ; ++c)
#pragma unroll
              for (int i = 0; i < VW; ++i) d += to_f(q[r][c][i]) * kv_value(k[j][c][i], ks);
            part_dot[j] = d;
          }
          float s = reduce_scatter(sg, lane, part_dot) * scale;
          if (softcap > 0.f) s = softcap * sycl::tanh(s / softcap);
          if (use_alibi) s += slope[r] * static_cast<float>(kpos - qpos[r]);
          const bool visible = key_ok && (!is_causal || kpos <= qpos[r]) && (window <= 0 || qpos[r] - kpos < window);
          s = visible ? s : NEG_INF;
          const float m_old = m[r];
          const float m_new = sycl::fmax(m_old, step_max(sg, s));
          p[r] = (m_new == NEG_INF || s == NEG_INF) ? 0.f : sycl::exp(s - m_new);
          const float alpha = m_new == NEG_INF ? 1.f : (m_old == NEG_INF ? 0.f : sycl::exp(m_old - m_new));
          l[r] = l[r] * alpha + step_sum(sg, p[r]);
          m[r] = m_new;
#pragma unroll
          for (int c = 0; c < NJV; ++c)
#pragma unroll
            for (int i = 0; i < VW; ++i) acc[r][c][i] *= alpha;
        }
      }
      // P.V: the step's V rows (loaded after the K registers are free), p broadcast per key.
#pragma unroll
      for (int j = 0; j < KB; ++j) {
        const int64_t o = sycl::select_from_group(sg, off, j);
        cvec_t v[NJV];
#pragma unroll
        for (int c = 0; c < NJV; ++c) v[c] = load_chunk(cache + D, o, c * SG * VW + lane * VW, DV);
#pragma unroll
        for (int r = 0; r < RB; ++r) {
          if (r < nr) {
            const float pj = sycl::select_from_group(sg, p[r], lane_of_key(j));
#pragma unroll
            for (int c = 0; c < NJV; ++c)
#pragma unroll
              for (int i = 0; i < VW; ++i) acc[r][c][i] += pj * kv_value(v[c][i], vs);
          }
        }
      }
      off = next_off;
    }

    // Merge the sub-groups' (max, sum, accumulator) per row through local memory.
    if (rb0 > 0) sycl::group_barrier(syclext::this_work_item::get_work_group<1>());  // scratch reuse
#pragma unroll
    for (int r = 0; r < RB; ++r) {
      if (r < nr) {
        auto row = lm + (sg_id * RB + r) * MERGE_STRIDE;
#pragma unroll
        for (int c = 0; c < NJV; ++c) {
          const int e = c * SG * VW + lane * VW;
#pragma unroll
          for (int i = 0; i < VW; ++i)
            if (e < DV) row[e + i] = acc[r][c][i];
        }
        store_row_stats(row, lane, m[r], l[r], nan_row[r]);
      }
    }
    merge_pass(w, lm, rb0, nr, RB, NSG, group, sinks, out, o_st, o_sh, part_acc, part_ml, num_parts);
  }
}

#if KVM_MMA
// ---------------------------------------------------------------------------------------------
// The attention body on the matrix built-in (KVM_MMA 1 or 2; fp16 / bf16 activations). A tile's
// rows form row groups of MR = 8 (the built-in's M): QK^T is S[8][16 keys] = Q[8][D] x K^T[D][16],
// P.V is O[8][DV] += P[8][16 keys] x V[16 keys][DV], both in 16-wide chunks of the head dimension.
// The S fragment (lane n holds key n of every row) is exactly the A fragment of P.V, so P never
// leaves the registers. Per 16-key step lane n reads the block-table entry of key n and then its
// key's K row (B of QK^T: lane n is column n); V rows are read by the whole sub-group, lane n taking
// consecutive columns of each row (B of P.V in a permuted column order, V_COL); the query fragments
// are read from local memory one chunk per call (Q_SLM).
// Sub-groups: RGP = min(row groups, NSG) row groups per pass; the NSG / RGP sub-groups of a row group
// split its visible keys in 16-key steps (decode: one row group, all sub-groups on its keys;
// prefill: one row group per sub-group, each reading the keys of its own causal range only). Each
// keeps its own online softmax; one group_barrier per pass merges them through local memory.
constexpr bool MMA_BF16 = KVM_DTYPE == 2;
static_assert(KVM_DTYPE == 1 || KVM_DTYPE == 2, "the matrix path takes fp16 / bf16 activations");
static_assert(SG == 16, "the matrix built-ins are used at sub-group size 16");
constexpr int MR = 8;                   // rows per row group (M of the built-in)
constexpr int KS = 16;                  // keys per step (N of QK^T, K of P.V)
constexpr int NC = (D + 15) / 16;       // 16-wide chunks of a Q / K row
constexpr int NCV = (DV + 15) / 16;     // 16-wide chunks of a V / output row
static_assert(16 % VW == 0, "a 16-element chunk is whole vector loads");
constexpr int MMA_LM_FLOATS = NSG * MR * MERGE_STRIDE;
// attention_body_mma's scratch: the rows of every key split but the first, which merges in its lanes
// (kvm_paged_attention and the *_terms kernels; the host sizes their local memory to it: lm_floats)
constexpr int MMA_DECODE_LM_FLOATS = (NSG - 1) * MR * MERGE_STRIDE;
// That scratch's row of key split `split` (>= 1), row group slot rgl of rgp, row m.
static inline sycl::decorated_local_ptr<float> decode_merge_row(sycl::decorated_local_ptr<float> lm, int split,
                                                                int rgp, int rgl, int m) {
  return lm + (((split - 1) * rgp + rgl) * MR + m) * MERGE_STRIDE;
}

// 16-bit matrix bits of an activation / of a cache element (fp8 codes convert exactly).
static inline uint32_t mm_bits(elem_t x) {
  if constexpr (KVM_DTYPE == 2) return x;
  else return sycl::bit_cast<uint16_t>(x);
}
static inline uint32_t mm_bits_of(float x) { return mm_bits(from_f(x)); }
static inline uint32_t cache_bits(cache_t x) {
#if defined(KVM_CACHE) && KVM_CACHE == 3
  if constexpr (MMA_BF16) return e4m3_bf16_bits(x);   // exact: no rounding through fp32
#endif
  if constexpr (FP8) return mm_bits_of(cache_to_f(x));
  else return mm_bits(x);
}

// A probability's 16-bit matrix bits, rounded to nearest even: the hardware's conversion where the matrix
// built-ins are (cl_intel_bfloat16_conversions; one instruction where mm_bits_of takes six), else mm_bits_of.
#if KVM_MMA == 2
SYCL_EXTERNAL uint16_t intel_convert_f32_to_bf16(float x);
#endif
static inline uint32_t p_bits(float p) {
#if KVM_MMA == 2
  if constexpr (MMA_BF16) return intel_convert_f32_to_bf16(p);
#endif
  return mm_bits_of(p);
}

// The B fragment of a lane's row of 16 probabilities (component i: key 2i's bits low, 2i + 1's high),
// filled a key pair at a time (p_pair) and read as the fragment (p_fragment). The GPU build converts
// into the 16-bit halves in place (packing words by shift and or costs IGC three more instructions per
// pair); the emulated build packs words (a vector of halves slows the CPU device's JIT build).
#if KVM_MMA == 2
using p_frag_t = uint16_t __attribute__((ext_vector_type(16)));
static inline void p_pair(p_frag_t &f, int i, float p0, float p1) {
  f[2 * i] = static_cast<uint16_t>(p_bits(p0));
  f[2 * i + 1] = static_cast<uint16_t>(p_bits(p1));
}
static inline mma_b_t p_fragment(const p_frag_t &f) { return sycl::bit_cast<mma_b_t>(f); }
#else
using p_frag_t = mma_b_t;
static inline void p_pair(p_frag_t &f, int i, float p0, float p1) {
  f[i] = static_cast<int>(p_bits(p0) | (p_bits(p1) << 16));
}
static inline mma_b_t p_fragment(const p_frag_t &f) { return f; }
#endif

// The B-operand word of two cache elements: a's bits low, b's high. e4m3 into bf16 converts both codes
// at once, one per 16-bit half (as e4m3_bf16_bits; no carry crosses the halves).
static inline uint32_t cache_pair_bits(cache_t a, cache_t b) {
#if defined(KVM_CACHE) && KVM_CACHE == 3
  if constexpr (MMA_BF16) {
    const uint32_t u = static_cast<uint32_t>(a) | (static_cast<uint32_t>(b) << 16);
    const uint32_t mag = u & 0x007F007Fu;
    const uint32_t sub = (((((mag >> 3) & 0x000F000Fu) + 0x000F000Fu) >> 4) & 0x00010001u) ^ 0x00010001u;
    const uint32_t pat = (mag << 4) + 0x3C003C00u + (sub << 7);
    const float lo = sycl::bit_cast<float>(pat << 16) - static_cast<float>(sub & 1u) * 0x1p-6f;
    const float hi = sycl::bit_cast<float>(pat & 0xFFFF0000u) - static_cast<float>(sub >> 16) * 0x1p-6f;
    const uint32_t bits = (sycl::bit_cast<uint32_t>(lo) >> 16) | (sycl::bit_cast<uint32_t>(hi) & 0xFFFF0000u) |
                          ((u & 0x00800080u) << 8);
    const uint32_t nan = (((mag + 0x00010001u) >> 7) & 0x00010001u) * 0xFFFFu;
    return (bits & ~nan) | (0x7FC07FC0u & nan);
  }
#endif
  return cache_bits(a) | (cache_bits(b) << 16);
}

// load_chunk without a divergent branch: a masked row (off < 0) reads the cache's first row and is
// zeroed by a select (the caller guarantees the cache holds a row). e is the same in every lane.
static inline cvec_t load_chunk_masked(const cache_t *row, int64_t off, int e, int n) {
  if (e >= n) return cvec_t(cache_t(0));
  const raw_t bits = *reinterpret_cast<const raw_t *>(row + (off >= 0 ? off : 0) + e);
  return sycl::bit_cast<cvec_t>(static_cast<raw_t>(bits & raw_t(off >= 0 ? ~0u : 0u)));
}

// P.V's B operand in a permuted column order: lane n's chunk c holds V column n * NCV + c (the
// accumulators follow the same order), so lane n reads consecutive elements of each V row: VG of them
// (KVM_VG, a power of two dividing NCV and VW) per load, VG chunks of B at a time.
#define V_COL(lane, c) ((lane) * NCV + (c))
#ifdef KVM_VG
constexpr int VG_WANTED = KVM_VG;
#else
constexpr int VG_WANTED = FP8 ? 2 : 4;   // fp8: 2-byte pieces keep both kernels free of spills on PVC
#endif
constexpr int widest_v_piece() {
  int v = VG_WANTED;
  while (v > 1 && (NCV % v != 0 || VW % v != 0)) v /= 2;
  return v;
}
constexpr int VG = widest_v_piece();
using vgvec_t = sycl::vec<cache_t, VG>;
using vgraw_t = raw_bytes_t<VG * static_cast<int>(sizeof(cache_t))>;
static_assert(sizeof(vgraw_t) == sizeof(vgvec_t), "vgraw_t must have the size of a V piece");

// VG elements [e, e + VG) of the V row at `off` (zero when off < 0 or e >= DV; e is a multiple of VG, so
// a piece is whole inside or outside the row), read without a divergent branch (as load_chunk_masked).
static inline vgvec_t load_v_piece(const cache_t *v, int64_t off, int e) {
  const bool ok = off >= 0 && (DV % (16 * NCV) == 0 || e < DV);
  const vgraw_t bits = *reinterpret_cast<const vgraw_t *>(v + (ok ? off + e : 0));
  return sycl::bit_cast<vgvec_t>(static_cast<vgraw_t>(bits & vgraw_t(ok ? ~0u : 0u)));
}

// Query fragments in local memory, over the merge scratch (when it is large enough: Q_SLM): row group
// slot g's chunk c holds lane k's row pairs (2r, 2r + 1) as 4 consecutive words, one 16-byte load.
constexpr bool Q_SLM = NSG * NC * 64 <= MMA_DECODE_LM_FLOATS;   // NC chunks x 16 lanes x 4 words per slot
static inline int q_frag_index(int slot, int c, int lane) { return ((slot * NC + c) * 16 + lane) * 4; }
static inline void store_q_frag(sycl::decorated_local_ptr<float> lm, int slot, int c, int lane, mma_a_t a) {
  sycl::vec<float, 4> w;
#pragma unroll
  for (int r = 0; r < 4; ++r)
    w[r] = sycl::bit_cast<float>(static_cast<uint32_t>(static_cast<uint16_t>(a[2 * r])) |
                                 (static_cast<uint32_t>(static_cast<uint16_t>(a[2 * r + 1])) << 16));
  w.store(q_frag_index(slot, c, lane) / 4, lm);
}
static inline mma_a_t load_q_frag(sycl::decorated_local_ptr<float> lm, int slot, int c, int lane) {
  sycl::vec<float, 4> w;
  w.load(q_frag_index(slot, c, lane) / 4, lm);
  mma_a_t a;
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const uint32_t bits = sycl::bit_cast<uint32_t>(static_cast<float>(w[r]));
    a[2 * r] = static_cast<short>(bits & 0xffffu);
    a[2 * r + 1] = static_cast<short>(bits >> 16);
  }
  return a;
}

// The end of a pass of attention_body_mma, in the first key split of a row group: its rows r0 .. r0 + nr - 1
// (its own partials in acc / mrow / lsum: lane n holds columns V_COL(n, c); the row statistics are
// uniform) merged with those the other kspl - 1 splits stored (split s, row m: scratch row
// ((s - 1) * rgp + rgl) * MR + m), normalised with the sink joined and written to out, or, split, the
// partition's unnormalised partials and (max, sum) (the sink then joins in kvm_split_reduce).
static inline void merge_rows_mma(const WorkGroup &w, sycl::decorated_local_ptr<float> lm, const mma_c_t (&acc)[NCV],
                                  const float (&mrow)[MR], const float (&lsum)[MR], uint32_t nan_rows, int r0, int nr,
                                  int rgl, int rgp, int kspl, int group, const float *sinks, elem_t *out,
                                  int64_t o_st, int64_t o_sh, float *part_acc, float *part_ml, int num_parts) {
  const Tile &t = w.t;
#pragma unroll
  for (int m = 0; m < MR; ++m) {
    if (m >= nr) continue;   // uniform
    const int flat = t.f0 + r0 + m;
    const int64_t token = t.q0 + flat / group;
    const int qh = w.h * group + flat % group;
    auto slot = [&](int s) { return decode_merge_row(lm, s, rgp, rgl, m); };
    const float sink = (sinks != nullptr && !w.split) ? sinks[qh] : NEG_INF;
    float mx = sycl::fmax(sink, mrow[m]);
    bool row_nan = ((nan_rows >> m) & 1u) != 0 || is_nan(lsum[m]);
    for (int s = 1; s < kspl; ++s) {
      mx = sycl::fmax(mx, slot(s)[DV]);
      row_nan |= is_nan(slot(s)[DV + 1]);
    }
    float a[NCV];
    float sum = 0.f;
    const float own = (row_nan || mrow[m] == NEG_INF) ? 0.f : sycl::exp(mrow[m] - mx);
#pragma unroll
    for (int c = 0; c < NCV; ++c) a[c] = acc[c][m] * w.vs * own;
    if (row_nan) {
      sum = QNAN;
    } else if (mx != NEG_INF) {
      sum = lsum[m] * own;
      for (int s = 1; s < kspl; ++s) {
        const auto row = slot(s);
        const float wt = row[DV] == NEG_INF ? 0.f : sycl::exp(row[DV] - mx);
        sum += row[DV + 1] * wt;
#pragma unroll
        for (int c = 0; c < NCV; ++c) {
          const int e = V_COL(w.lane, c);
          if (e < DV) a[c] += row[e] * wt;
        }
      }
      if (sink != NEG_INF) sum += sycl::exp(sink - mx);
    }
    const int64_t prow = (token * w.num_q_heads + qh) * num_parts + w.part;
#pragma unroll
    for (int c = 0; c < NCV; ++c) {
      const int e = V_COL(w.lane, c);
      if (e >= DV) continue;
      const float v = row_nan ? QNAN : a[c];
      if (w.split) part_acc[prow * DV + e] = v;
      else out[token * o_st + qh * o_sh + e] = from_f(row_nan ? QNAN : sum > 0.f ? v / sum : 0.f);
    }
    if (w.split && w.lane == 0) {
      part_ml[prow * 2 + 0] = mx;
      part_ml[prow * 2 + 1] = sum;
    }
  }
}

template <bool TERMS>
static inline void attention_body_mma(KVM_ATTENTION_BODY_PARAMS) {
  auto sg = syclext::this_work_item::get_sub_group();
  const WorkGroup w = open_work_group<TERMS>(KVM_ATTENTION_COMMON_ARGS);
  if (!w.t.valid) return;  // uniform over the work-group
  const Tile &t = w.t;
  const int h = w.h, sg_id = w.sg_id, lane = w.lane;
  const float ks = w.ks, vs = w.vs;
  const int nrg = (t.nrows + MR - 1) / MR;          // row groups of the tile
  const int rgp = sycl::min(nrg, NSG);              // row groups per pass
  const int kspl = NSG / rgp;                       // sub-groups splitting one row group's keys
  const int npass = (nrg + rgp - 1) / rgp;
  const int my_split = sg_id / rgp;
  const bool has_rows = num_blocks > 0;             // masked rows read row 0 (load_chunk_masked)
  const bool is_causal = w.is_causal, use_alibi = w.use_alibi;

  for (int pass = 0; pass < npass; ++pass) {
    const int rg = pass * rgp + sg_id % rgp;
    const bool active = my_split < kspl && rg < nrg;   // uniform over the sub-group
    const int r0 = rg * MR;                            // first row of the row group in the tile
    const int nr = active ? sycl::min(MR, t.nrows - r0) : 0;

    // Query fragments (A of QK^T): component m of chunk c is Q[row m][16 c + lane].
    mma_a_t qa[NC];
    int64_t qpos[MR];
    // Row m's query position relative to t.ctx. The key loop compares and subtracts positions as
    // 32-bit offsets from t.ctx (real positions are < 2^31, seq_lens being int32; with bad metadata
    // a wrapped offset only changes which of the range's keys count, never a read).
    int qtok[MR];
#pragma unroll
    for (int m = 0; m < MR; ++m) {
      const int flat = t.f0 + r0 + m;
      const int64_t token = t.q0 + flat / group;
      const int qh = h * group + flat % group;
      qpos[m] = m < nr ? t.ctx + flat / group : t.ctx;   // rows m >= nr see no key (the mask below)
      qtok[m] = m < nr ? flat / group : 0;
#pragma unroll
      for (int c = 0; c < NC; ++c) {
        const int e = c * 16 + lane;
        const elem_t x = (m < nr && e < D) ? query[token * q_st + qh * q_sh + e] : from_f(0.f);
        qa[c][m] = static_cast<short>(mm_bits(x));
      }
    }
    // NaN query rows: the row's output is NaN (marked through the merge, as in the vector body).
    uint32_t nan_rows = 0;
#pragma unroll
    for (int m = 0; m < MR; ++m) {
      bool row_nan = false;
#pragma unroll
      for (int c = 0; c < NC; ++c) {
        const int e = c * 16 + lane;
        row_nan |= m < nr && e < D && is_nan(mma_elem<MMA_BF16>(static_cast<uint16_t>(qa[c][m])));
      }
      if (sycl::any_of_group(sg, row_nan)) nan_rows |= 1u << m;
    }

    // The query fragments go to local memory (Q_SLM): the merge scratch is free during the key loop,
    // the sub-groups splitting a row group's keys share one copy, and the loop holds one chunk at a time.
    auto wg = syclext::this_work_item::get_work_group<1>();
    if constexpr (Q_SLM) {
      if (pass > 0) sycl::group_barrier(wg);   // the previous pass's merge has read the scratch
      if (active && my_split == 0) {
#pragma unroll
        for (int c = 0; c < NC; ++c) store_q_frag(lm, sg_id % rgp, c, lane, qa[c]);
      }
      sycl::group_barrier(wg);
    }

    // ALiBi: lane m < nr holds row m's slope (one register; each row's is broadcast in the key loop).
    float slope_lane = 0.f;
    if (use_alibi && lane < nr) slope_lane = alibi[h * group + (t.f0 + r0 + lane) % group];
    // This row group's visible keys: the tile's range narrowed to its own first / last position.
    int k_lo = t.k_lo, k_hi = t.k_lo;
    if (nr > 0) {
      const int64_t p_first = qpos[0], p_last = t.ctx + (t.f0 + r0 + nr - 1) / group;
      const int64_t lo = window > 0 ? p_first - window + 1 : 0;
      k_lo = static_cast<int>(clamp64(lo, t.k_lo, t.k_hi));
      k_hi = is_causal ? static_cast<int>(clamp64(p_last + 1, k_lo, t.k_hi)) : t.k_hi;
      if (!has_rows) k_hi = k_lo;
    }

    float mrow[MR], lsum[MR];                          // uniform: each step's sum is reduced at once
    mma_c_t acc[NCV];
#pragma unroll
    for (int m = 0; m < MR; ++m) {
      mrow[m] = NEG_INF;
      lsum[m] = 0.f;
    }
#pragma unroll
    for (int c = 0; c < NCV; ++c) acc[c] = mma_c_t(0.f);

    auto key_offset = [&](int k) { return w.key_offset(k, k_lo, k_hi); };

    const int step = kspl * KS;
    int k0 = k_lo + my_split * KS;
    int64_t off = key_offset(k0 + lane);
    for (; k0 < k_hi; k0 += step) {
      const int64_t next_off = key_offset(k0 + step + lane);
      if (next_off >= 0) prefetch_row(cache + next_off);

      // S = Q K^T over the step's 16 keys: lane n loads its key's K chunk (B: column n).
      mma_c_t s = mma_c_t(0.f);
#pragma unroll
      for (int c = 0; c < NC; ++c) {
        mma_b_t kb;
#pragma unroll
        for (int v = 0; v < 16 / VW; ++v) {
          const cvec_t x = load_chunk_masked(cache, off, c * 16 + v * VW, D);
#pragma unroll
          for (int i = 0; i < VW; i += 2)
            kb[(v * VW + i) / 2] = static_cast<int>(cache_pair_bits(x[i], x[i + 1]));
        }
        s = mma<MMA_BF16>(sg, Q_SLM ? load_q_frag(lm, sg_id % rgp, c, lane) : qa[c], kb, s);
      }

      // Online softmax per row (lane n: key k0 + n).
      const int64_t kpos = k0 + lane;
      const int krel = static_cast<int>(kpos - t.ctx);   // key position - t.ctx
      const bool key_ok = off >= 0;
      mma_a_t pa;
#pragma unroll
      for (int m = 0; m < MR; ++m) {
        float x = s[m] * ks * scale;
        if (softcap > 0.f) x = softcap * sycl::tanh(x / softcap);
        if (use_alibi) x += sycl::select_from_group(sg, slope_lane, m) * static_cast<float>(krel - qtok[m]);
        const bool visible = key_ok && m < nr && (!is_causal || krel <= qtok[m]) &&
                             (window <= 0 || qtok[m] - krel < window);
        x = visible ? x : NEG_INF;
        const float m_old = mrow[m];
        const float m_new = sycl::fmax(m_old, sycl::reduce_over_group(sg, x, sycl::maximum<float>()));
        const float p = (m_new == NEG_INF || x == NEG_INF) ? 0.f : sycl::exp(x - m_new);
        const float alpha = m_new == NEG_INF ? 1.f : (m_old == NEG_INF ? 0.f : sycl::exp(m_old - m_new));
        lsum[m] = lsum[m] * alpha + sycl::reduce_over_group(sg, p, sycl::plus<float>());
        mrow[m] = m_new;
#pragma unroll
        for (int c = 0; c < NCV; ++c) acc[c][m] *= alpha;
        pa[m] = static_cast<short>(p_bits(p));
      }

      // O += P V, VG chunks at a time: lane n reads VG consecutive elements of each key's V row
      // (columns n * NCV + g0 ...; see V_COL) and packs key pairs into the B fragments.
#pragma unroll
      for (int g0 = 0; g0 < NCV; g0 += VG) {
        const int e = lane * NCV + g0;
        mma_b_t vb[VG];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const vgvec_t lo = load_v_piece(cache + D, sycl::select_from_group(sg, off, 2 * i), e);
          const vgvec_t hi = load_v_piece(cache + D, sycl::select_from_group(sg, off, 2 * i + 1), e);
#pragma unroll
          for (int v = 0; v < VG; ++v) vb[v][i] = static_cast<int>(cache_pair_bits(lo[v], hi[v]));
        }
#pragma unroll
        for (int v = 0; v < VG; ++v) acc[g0 + v] = mma<MMA_BF16>(sg, pa, vb[v], acc[g0 + v]);
      }
      off = next_off;
    }

    // Merge the key splits of each row group: the splits after the first store their rows in local
    // memory (split s, row m: scratch row ((s - 1) * rgp + rgl) * MR + m), the first merges them in its lanes.
    const int rgl = sg_id % rgp;
    if (Q_SLM || pass > 0) sycl::group_barrier(wg);  // the scratch's readers (Q, the previous merge) are done
    if (active && my_split > 0) {
#pragma unroll
      for (int m = 0; m < MR; ++m) {
        if (m < nr) {
          auto row = decode_merge_row(lm, my_split, rgp, rgl, m);
#pragma unroll
          for (int c = 0; c < NCV; ++c) {
            const int e = V_COL(lane, c);
            if (e < DV) row[e] = acc[c][m] * vs;
          }
          store_row_stats(row, lane, mrow[m], lsum[m], (nan_rows >> m) & 1u);
        }
      }
    }
    if (kspl > 1) sycl::group_barrier(wg);
    if (active && my_split == 0)
      merge_rows_mma(w, lm, acc, mrow, lsum, nan_rows, r0, nr, rgl, rgp, kspl, group, sinks, out, o_st, o_sh,
                     part_acc, part_ml, num_parts);
  }
}

// ---------------------------------------------------------------------------------------------
// The rows-on-lanes matrix body (kvm_paged_prefill: tiles of more than MR rows, head sizes multiples
// of 16 up to 128). The sub-group's 16 lanes are 16 tile rows (a row group of PR), so each row's
// online softmax runs in its own lane with no cross-lane reduction:
//   S^T[8 keys][16 rows] = K[8 keys][D] x Q^T[D][16 rows]: A = the keys (component m: key m, lane k:
//     head dimension d(c, k) = 16 c + k of chunk c), B = the rows' query fragments (built once per
//     pass: lane n, component i packs Q[n][d(c, 2i)], Q[n][d(c, 2i + 1)]); two calls per chunk cover a
//     16-key step;
//   O^T[8 dims][16 rows] += V^T[8 dims][16 keys] x P^T[16 keys][16 rows]: A = lane k's own key's V
//     row, 8 consecutive dimensions (no packing, no broadcast), B = the row's probabilities packed by
//     key pairs in its own lane; DV / 8 accumulators, component m of accumulator j: dimension 8 j + m.
// Per 16-key step lane j reads the block-table entry of key j; key j's K row is read by the whole
// sub-group as block messages (lane k: dimensions 16 c + k), its A fragments are the keys' chunks
// regrouped. Causal / window masks are applied only on steps that cross a row's visible range.
// Sub-groups: RGQ = min(row groups, NSG) row groups per pass; KSQ sub-groups split a row group's keys
// (as many as the merge scratch holds: KSQ - 1 of them store their rows there, the first merges them
// in its lanes and writes the rows out, or the partition's partials when split).
constexpr bool PREFILL_MMA = D % 16 == 0 && DV % 16 == 0 && D <= 128 && DV <= 128 &&
                            ((ROWS + 15) / 16) * NC * 128 <= MMA_LM_FLOATS;   // Q fragments fit
constexpr int PR = 16;                  // rows of a row group: one per lane
constexpr float LOG2E = 1.4426950408889634f, LN2 = 0.6931471805599453f;
constexpr int NV8 = DV / 8;             // 8-dimension chunks of a V / output row
// The key splits' merge moves half of each row per round (DVH dimensions; DV is a multiple of 16 on
// this body), the first round with the row's max and sum: PREFILL_MERGE_STRIDE floats.
constexpr int DVH = DV / 2;
constexpr int PREFILL_MERGE_STRIDE = DVH + 2;
// kvm_paged_prefill's scratch on this body: the query fragments during the key loop, then the merge's
// NSG * MR rows (prefill_splits); the host sizes its local memory to it (prefill_lm_floats).
constexpr int PREFILL_Q_FLOATS = ((ROWS + 15) / 16) * NC * 128;
constexpr int MMA_PREFILL_LM_FLOATS = PREFILL_Q_FLOATS > NSG * MR * PREFILL_MERGE_STRIDE
                                          ? PREFILL_Q_FLOATS : NSG * MR * PREFILL_MERGE_STRIDE;
// K is read in pieces of NP chunks (fewer registers than whole rows); d(c, k) = k_dim(c, k), the head
// dimension of chunk c at lane (reduction index) k.
constexpr int NP = NC % 4 == 0 ? 4 : (NC % 2 == 0 ? 2 : 1);
constexpr int k_dim(int c, int k) { return 16 * c + k; }

// NP chunks of a K row, [16 NP c0, 16 NP (c0 + 1)), read by the whole sub-group as one block message:
// lane k gets element 16 i + k of the piece in component i (chunk c0 NP + i at lane k).
static inline sycl::vec<cache_t, NP> load_k_piece(const cache_t *row) {
  using namespace sycl::ext::oneapi::experimental;
  auto sg = syclext::this_work_item::get_sub_group();
  cache_t v[NP];
  const auto global = sycl::address_space_cast<sycl::access::address_space::global_space,
                                               sycl::access::decorated::yes>(const_cast<cache_t *>(row));
  group_load(sg, global.get_decorated(), sycl::span<cache_t, NP>(v, NP),
             properties{data_placement_striped, full_group, alignment<4>});
  sycl::vec<cache_t, NP> out;
#pragma unroll
  for (int i = 0; i < NP; ++i) out[i] = v[i];
  return out;
}

constexpr int pow2_piece(int n, int max_elems) {
  int p = 1;
  while (2 * p <= max_elems && n % (2 * p) == 0) p *= 2;
  return p;
}
// N consecutive cache elements at src into dst, in the widest aligned pieces (src is aligned to the
// piece: the row offsets are multiples of E and the lane offsets of the piece).
template <int N>
static inline void load_run(const cache_t *src, cache_t (&dst)[N]) {
  constexpr int P = pow2_piece(N, 16 / static_cast<int>(sizeof(cache_t)));
  using R = raw_bytes_t<P * static_cast<int>(sizeof(cache_t))>;
#pragma unroll
  for (int i = 0; i < N; i += P) {
    const auto v = sycl::bit_cast<sycl::vec<cache_t, P>>(*reinterpret_cast<const R *>(src + i));
#pragma unroll
    for (int q = 0; q < P; ++q) dst[i + q] = v[q];
  }
}

// The softcap in a key step: compiled out, compiled in, or applied when the argument is > 0.
enum { CAP_OFF, CAP_ON, CAP_ARG };
template <int CAP>
using cap_t = std::integral_constant<int, CAP>;

// tanh(y) = 1 - 2 / (e^(2y) + 1): one exp2, the native reciprocal and one Newton step (the softcap of the
// prefill body; absolute error about 1e-7, where the precise tanh costs ~100 instructions per score). The
// native reciprocal's precision is the device's: without the Newton step, the OpenCL CPU device on an AVX2
// host moved an fp16 output 2.4e-3 away from the oracle under a softcap of 8. y is capped at 16 (tanh(16)
// is 1.0f) so that e^(2y) stays finite for the Newton step.
static inline float tanh_exp2(float y) {
  const float d = sycl::exp2(sycl::fmin(y, 16.f) * (2.f * LOG2E)) + 1.f;
  float r = sycl::native::recip(d);
  r *= 2.f - d * r;
  return 1.f - 2.f * r;
}


// Query B fragments in the merge scratch: row group slot g's chunk c, lane n: 8 words.
static inline int qb_index(int slot, int c, int lane) { return ((slot * NC + c) * 16 + lane) * 8; }
using local_b = __attribute__((opencl_local)) mma_b_t;
static inline void store_qb(sycl::decorated_local_ptr<float> lm, int slot, int c, int lane, mma_b_t b) {
  *reinterpret_cast<local_b *>(lm.get_decorated() + qb_index(slot, c, lane)) = b;
}
static inline mma_b_t load_qb(sycl::decorated_local_ptr<float> lm, int slot, int c, int lane) {
  return *reinterpret_cast<const local_b *>(lm.get_decorated() + qb_index(slot, c, lane));
}

// Lane n's row (its key splits already merged: acc unscaled by the V scale, mx its max in natural-log
// units, l its sum), normalised with the row's sink and stored (or, split, stored as the partition's
// partials).
struct LaneRow {
  bool valid, nan;
  int64_t token;
  int qh;
};

static inline void store_lane_row(const WorkGroup &w, const LaneRow &r, const mma_c_t (&acc)[NV8], float mx,
                                  float l, const float *sinks, elem_t *out, int64_t o_st, int64_t o_sh,
                                  float *part_acc, float *part_ml, int num_parts) {
  if (!r.valid) return;
  const float sink = (sinks != nullptr && !w.split) ? sinks[r.qh] : NEG_INF;
  const float M = sycl::fmax(sink, mx);
  const bool row_nan = r.nan || is_nan(l);
  float wt = 0.f, sum = 0.f;
  if (!row_nan && M != NEG_INF) {
    wt = mx == NEG_INF ? 0.f : sycl::exp(mx - M);
    sum = l * wt;
    if (sink != NEG_INF) sum += sycl::exp(sink - M);
  }
  const bool zero = !row_nan && M == NEG_INF;
  const float inv = sum > 0.f ? 1.f / sum : 0.f;
  const int64_t prow = (r.token * w.num_q_heads + r.qh) * num_parts + w.part;
#pragma unroll
  for (int j = 0; j < NV8; ++j) {
#pragma unroll
    for (int m = 0; m < 8; ++m) {
      const int d = 8 * j + m;
      const float a = row_nan ? QNAN : zero ? 0.f : acc[j][m] * w.vs * wt;
      if (w.split) part_acc[prow * DV + d] = a;
      else out[r.token * o_st + r.qh * o_sh + d] = from_f(row_nan ? QNAN : a * inv);
    }
  }
  if (w.split) {
    part_ml[prow * 2 + 0] = M;
    part_ml[prow * 2 + 1] = row_nan ? QNAN : sum;
  }
}

// Key splits per row group: at most NSG / rgp sub-groups, and the merge scratch (NSG * MR rows of
// PREFILL_MERGE_STRIDE floats) holds the rows of all but the first split.
static inline int prefill_splits(int rgp) {
  int k = NSG / rgp;
  const int cap = 1 + NSG * MR / (rgp * PR);
  k = k < cap ? k : cap;
  return k < 5 ? (k < 1 ? 1 : k) : 5;
}

template <bool TERMS>
static inline void prefill_body_mma(KVM_ATTENTION_BODY_PARAMS) {
  static_assert(PREFILL_MMA, "the rows-on-lanes body takes head sizes that are multiples of 16, up to 128");
  static_assert(!TERMS, "kvm_paged_prefill_terms keeps the attention body (prefill_entry)");
  auto sg = syclext::this_work_item::get_sub_group();
  const WorkGroup w = open_work_group<TERMS>(KVM_ATTENTION_COMMON_ARGS);
  if (!w.t.valid) return;  // uniform over the work-group
  const Tile &t = w.t;
  const int h = w.h, sg_id = w.sg_id, lane = w.lane;
  const int nrg = (t.nrows + PR - 1) / PR;
  const int rgp = sycl::min(nrg, NSG);
  const int kspl = prefill_splits(rgp);
  const int npass = (nrg + rgp - 1) / rgp;
  const int my_split = sg_id / rgp;
  const bool has_rows = num_blocks > 0;
  const bool is_causal = w.is_causal, use_alibi = w.use_alibi;
  // Scores in log2 units: scale, softcap and ALiBi slopes times log2(e). The query fragments carry the
  // scale's sign (an exact sign flip of each element), so qk_scale2 >= 0.
  const float qk_scale2 = sycl::fabs(w.ks * scale * LOG2E), cap2 = softcap * LOG2E;
  const float inv_cap2 = softcap > 0.f ? 1.f / cap2 : 0.f;
  const uint32_t q_sign = scale < 0.f ? 0x80008000u : 0u;   // both 16-bit halves' sign bits
  auto wg = syclext::this_work_item::get_work_group<1>();

  for (int pass = 0; pass < npass; ++pass) {
    const int rgl = sg_id % rgp;
    const int rg = pass * rgp + rgl;
    const bool active = my_split < kspl && rg < nrg;   // uniform over the sub-group
    const int r0 = rg * PR;
    const int nr = active ? sycl::min(PR, t.nrows - r0) : 0;

    // This lane's row: its query as B fragments (chunk c, component i: dims d(c, 2i), d(c, 2i + 1)).
    LaneRow row{lane < nr, false, 0, 0};
    const int flat = t.f0 + r0 + lane;
    row.token = t.q0 + (row.valid ? flat / group : 0);
    row.qh = h * group + (row.valid ? flat % group : 0);
    const int qtok = row.valid ? flat / group : 0;     // position - t.ctx (32-bit offsets, as attention_body_mma)
    if (pass > 0) sycl::group_barrier(wg);   // the previous pass's merge has read the scratch
    // The query fragments go to local memory (the merge scratch, free during the key loop): the first
    // key split of each row group stores them, every split reads one chunk per pair of calls.
    {
      const elem_t *q = query + row.token * q_st + row.qh * q_sh;
      const uint32_t q_mask = row.valid ? ~0u : 0u;
      bool any_nan = false;
#pragma unroll
      for (int c = 0; c < NC; ++c) {
        mma_b_t words;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const elem_t lo = q[k_dim(c, 2 * i)], hi = q[k_dim(c, 2 * i + 1)];   // in bounds for every lane
          any_nan |= is_nan(to_f(lo)) || is_nan(to_f(hi));
          words[i] = static_cast<int>(((mm_bits(lo) | (mm_bits(hi) << 16)) ^ q_sign) & q_mask);
        }
        if (active && my_split == 0) store_qb(lm, rgl, c, lane, words);
      }
      row.nan = row.valid && any_nan;
    }
    const float slope2 = (use_alibi && row.valid) ? alibi[row.qh] * LOG2E : 0.f;
    // The row's visible keys, as offsets from t.ctx: [vis_lo, vis_lo + vis_width) (empty for no row).
    constexpr int FAR = 1 << 30;   // beyond any key offset (positions are < 2^30: the block table's width)
    const int vis_lo = !row.valid ? 0 : window > 0 ? qtok - window + 1 : -FAR;
    const uint32_t vis_width = !row.valid ? 0u : static_cast<uint32_t>((is_causal ? qtok + 1 : FAR) - vis_lo);

    // The row group's visible keys; the rows' extreme positions bound the steps that need a mask.
    int k_lo = t.k_lo, k_hi = t.k_lo, q_first = 0, q_last = 0;
    if (nr > 0) {
      q_first = (t.f0 + r0) / group;
      q_last = (t.f0 + r0 + nr - 1) / group;
      const int64_t lo = window > 0 ? t.ctx + q_first - window + 1 : 0;
      k_lo = static_cast<int>(clamp64(lo, t.k_lo, t.k_hi));
      k_hi = is_causal ? static_cast<int>(clamp64(t.ctx + q_last + 1, k_lo, t.k_hi)) : t.k_hi;
      if (!has_rows) k_hi = k_lo;
    }

    sycl::group_barrier(wg);                 // the query fragments are stored
    float mrow = NEG_INF, lsum = 0.f;
    mma_c_t acc[NV8];
#pragma unroll
    for (int j = 0; j < NV8; ++j) acc[j] = mma_c_t(0.f);

    // Lane j's key of the step walks the block table incrementally (no division in the loop).
    const int step = kspl * KS, bs = w.block_size;
    const int qs = step / bs, rs = step - qs * bs;
    int k0 = k_lo + my_split * KS;
    int kpos = k0 + lane, kblk = kpos / bs, kin = kpos - kblk * bs;
    auto offset_at = [&](int k, int blk, int in) -> int64_t {   // as WorkGroup::key_offset
      if (k >= k_hi) return -1;
      return w.slot_offset(blk, in);
    };
    int64_t off = offset_at(kpos, kblk, kin);
    // One 16-key step. masked: the step may hold keys some row must not see (a causal or window edge,
    // the range's end, a bad block id); an unmasked step's keys are all valid and visible to every row.
    // cap: CAP_OFF / CAP_ON leave the softcap out / apply it, CAP_ARG tests the argument. Either may be a
    // compile-time constant (std::integral_constant: the GPU build's loops each compile a copy without
    // the dead code) or a value known only at run time (one copy: the emulated build).
    auto key_step = [&](auto masked, auto cap) {
      const bool MASKED = masked;
      const int CAP = cap;
      int nin = kin + rs, nblk = kblk + qs;
      if (nin >= bs) {
        nin -= bs;
        ++nblk;
      }
      const int64_t next_off = offset_at(kpos + step, nblk, nin);
      kpos += step;
      kblk = nblk;
      kin = nin;
      if (next_off >= 0) prefetch_row(cache + next_off);
      const bool row_ok = !MASKED || off >= 0;             // a masked key reads row 0 (its score is masked)
      const int64_t row_off = row_ok ? off : 0;
      // V^T's A fragment of dimensions 8j..8j+7: lane k's own key's V row. A masked step zeroes the V of
      // an invalid key (row 0 may hold anything; a mask, not a select: with a select the OpenCL CPU
      // device computed wrong sums for the masked lanes).
      const int64_t v_off = row_off + D;
      const uint32_t v_mask = row_ok ? ~0u : 0u;
      auto load_va = [&](int j) {
        mma_a_t va;
        if constexpr (!FP8) {   // the 16 loaded bytes are the fragment (8 x 16 bits)
          const auto raw = *reinterpret_cast<const sycl::vec<uint32_t, 4> *>(cache + v_off + 8 * j);
          va = sycl::bit_cast<mma_a_t>(static_cast<sycl::vec<uint32_t, 4>>(raw & v_mask));
        } else {
          cache_t vp[8];
          load_run<8>(cache + v_off + 8 * j, vp);
#pragma unroll
          for (int m = 0; m < 8; ++m) va[m] = static_cast<short>(cache_bits(vp[m]) & v_mask);
        }
        return va;
      };

      // S^T for the step's two 8-key halves, a piece of NP chunks of all 16 keys' K rows at a time.
      mma_c_t s[2] = {mma_c_t(0.f), mma_c_t(0.f)};
#pragma unroll
      for (int piece = 0; piece < NC / NP; ++piece) {
        sycl::vec<cache_t, NP> kp[KS];
#pragma unroll
        for (int j = 0; j < KS; ++j)
          kp[j] = load_k_piece(cache + sycl::select_from_group(sg, row_off, j) + 16 * NP * piece);
#pragma unroll
        for (int i = 0; i < NP; ++i) {
          const mma_b_t qb = load_qb(lm, rgl, piece * NP + i, lane);
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            mma_a_t ka;
#pragma unroll
            for (int m = 0; m < 8; ++m) ka[m] = static_cast<short>(cache_bits(kp[8 * half + m][i]));
            s[half] = mma<MMA_BF16>(sg, ka, qb, s[half]);
          }
        }
      }

      // Online softmax of this lane's row over the step's 16 keys (key j: s[j / 8][j % 8]), in log2
      // units, so each probability is one exp2. The scores are x_j * xs: an unmasked step without
      // softcap or ALiBi keeps x_j = s_j and xs = qk_scale2 >= 0, so its max is the raw max times
      // qk_scale2 (multiplying by xs >= 0 keeps the order) and each probability one fma and one exp2.
      const bool plain = !MASKED && !use_alibi && CAP == CAP_OFF;
      const int krel0 = static_cast<int>(static_cast<int64_t>(k0) - t.ctx);
      float x[KS];
#pragma unroll
      for (int j = 0; j < KS; ++j) {
        float v = s[j / 8][j % 8];
        if (!plain) {
          v *= qk_scale2;
          if (CAP == CAP_ON || (CAP == CAP_ARG && softcap > 0.f)) v = cap2 * tanh_exp2(v * inv_cap2);
          if (use_alibi) v += slope2 * static_cast<float>(krel0 + j - qtok);
        }
        x[j] = v;
      }
      if (MASKED) {   // key j is visible when its block is valid and krel0 + j lies in the row's range
        const uint32_t ok = sycl::reduce_over_group(sg, off >= 0 ? 1u << lane : 0u, sycl::bit_or<uint32_t>());
        const uint32_t d0 = static_cast<uint32_t>(krel0 - vis_lo);
#pragma unroll
        for (int j = 0; j < KS; ++j) x[j] = (d0 + j < vis_width && ((ok >> j) & 1u)) ? x[j] : NEG_INF;
      }
      const float xs = plain ? qk_scale2 : 1.f;
      float smax = x[0];
#pragma unroll
      for (int j = 1; j < KS; ++j) smax = sycl::fmax(smax, x[j]);
      smax *= xs;
      const float m_new = sycl::fmax(mrow, smax);
      const float m_sub = m_new == NEG_INF ? 0.f : m_new;   // exp2(-inf - m_sub) = 0 for a masked key
      const float alpha = sycl::exp2(mrow - m_sub);          // 0 while the row has seen no key
      p_frag_t pf;
      float psum = 0.f;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const float p0 = sycl::exp2(sycl::fma(x[2 * i], xs, -m_sub)), p1 = sycl::exp2(sycl::fma(x[2 * i + 1], xs, -m_sub));
        psum += p0 + p1;
        p_pair(pf, i, p0, p1);
      }
      const mma_b_t pb = p_fragment(pf);
      lsum = lsum * alpha + psum;
      mrow = m_new;

      // O^T += V^T P^T, 8 dimensions per call.
#pragma unroll
      for (int j = 0; j < NV8; ++j) {
        // a fresh product per step, folded in with the rescale (one mad per element): IGC keeps the
        // accumulators in registers this way (accumulating in the built-in spilled ~7 KB at head 128)
        acc[j] = acc[j] * alpha + mma<MMA_BF16>(sg, load_va(j), pb, mma_c_t(0.f));
      }
      off = next_off;
      k0 += step;
    };
    // A step needs no mask when it starts at or past the window's edge for the row group's last row
    // (win_lo), its last key is at most the group's first row (causal) and inside the range (free_hi),
    // and every key's block is valid.
    const int64_t win_lo = window > 0 ? t.ctx + q_last - window + 1 : INT64_MIN;
    const int64_t causal_hi = is_causal ? t.ctx + q_first - KS + 1 : INT64_MAX;
    const int64_t free_hi = causal_hi < k_hi - KS ? causal_hi : static_cast<int64_t>(k_hi - KS);
    auto free_from_edge = [&] { return k0 <= free_hi && sycl::all_of_group(sg, off >= 0); };   // given k0 >= win_lo
#if KVM_SPLIT_KEYS
    // Three loops in sequence (FlashAttention's split): the masked steps before the window's edge; the
    // unmasked ones, the kernel's hot loop, in a copy with and one without the softcap; the rest (the
    // causal diagonal, the range's end, a bad block id), masked.
    while (k0 < k_hi && k0 < win_lo) key_step(std::true_type{}, cap_t<CAP_ARG>{});
    if (softcap > 0.f)
      while (free_from_edge()) key_step(std::false_type{}, cap_t<CAP_ON>{});
    else
      while (free_from_edge()) key_step(std::false_type{}, cap_t<CAP_OFF>{});
    while (k0 < k_hi) key_step(std::true_type{}, cap_t<CAP_ARG>{});
#else
    // One loop, one copy of the step, the same test per step (the emulated built-ins make each copy
    // costly for the OpenCL CPU device's JIT to build).
    while (k0 < k_hi)
      key_step(!(k0 >= win_lo && free_from_edge()), int(CAP_ARG));
#endif

    // Key splits after the first hand their rows to the first, which folds them into its own in its
    // lanes: two rounds of DVH dimensions each (the first also carries each row's max and sum), so the
    // scratch holds (kspl - 1) x rgp x PR rows of DVH + 2 floats.
    sycl::group_barrier(wg);                 // every split has read the query fragments
    float mx = mrow * LN2;
    if (kspl > 1) {
      const bool gives = active && my_split > 0 && row.valid, takes = active && my_split == 0 && row.valid;
      auto slot = [&](int split) { return lm + (((split - 1) * rgp + rgl) * PR + lane) * PREFILL_MERGE_STRIDE; };
      float e[5];   // kspl <= 5 (prefill_splits): each split's weight exp(M_g - M)
      float M = mx;
      auto merge_round = [&](auto round) {
        constexpr int HF = decltype(round)::value, J0 = HF * (NV8 / 2), J1 = J0 + NV8 / 2;
        if (gives) {
          auto r = slot(my_split);
#pragma unroll
          for (int j = J0; j < J1; ++j)
#pragma unroll
            for (int m = 0; m < 8; ++m) r[8 * (j - J0) + m] = acc[j][m];
          if constexpr (HF == 0) {
            r[DVH] = mx;
            r[DVH + 1] = row.nan ? QNAN : lsum;
          }
        }
        sycl::group_barrier(wg);
        if (takes) {
          if constexpr (HF == 0) {
            for (int g = 1; g < kspl; ++g) M = sycl::fmax(M, slot(g)[DVH]);
            e[0] = mx == NEG_INF ? 0.f : sycl::exp(mx - M);
            float l = lsum * e[0];
            for (int g = 1; g < kspl; ++g) {
              const auto r = slot(g);
              e[g] = r[DVH] == NEG_INF ? 0.f : sycl::exp(r[DVH] - M);
              l += r[DVH + 1] * e[g];
            }
            lsum = l;
          }
#pragma unroll
          for (int j = J0; j < J1; ++j) acc[j] = acc[j] * e[0];
          for (int g = 1; g < kspl; ++g) {
            const auto r = slot(g);
#pragma unroll
            for (int j = J0; j < J1; ++j)
#pragma unroll
              for (int m = 0; m < 8; ++m) acc[j][m] += r[8 * (j - J0) + m] * e[g];
          }
        }
      };
      merge_round(std::integral_constant<int, 0>{});
      sycl::group_barrier(wg);     // the second round overwrites the scratch
      merge_round(std::integral_constant<int, 1>{});
      mx = M;
    }
    if (active && my_split == 0)
      store_lane_row(w, row, acc, mx, lsum, sinks, out, o_st, o_sh, part_acc, part_ml, num_parts);
  }
}
#endif  // KVM_MMA

#ifndef KVM_MMA_PROBE
// ---------------------------------------------------------------------------------------------
// Kernel. Grid: nd_range<1>(num_tiles * num_kv_heads * num_parts * WG, WG), sub-groups of SG.
// tiles: int32 [num_tiles][2] = (request, first flattened row), built by the host.
// num_tokens: rows of query and out (and of the partial buffers); bt_rows / bt_cols: the block
// table's shape; num_blocks: blocks in the cache. lm: float[LM_FLOATS] local scratch.
// Unsplit: part_acc == part_ml == nullptr, num_parts == 1, writes out.
// Split-KV: out may be null; num_parts work-groups per (tile, KV head); partition p covers keys
// [k_lo + p * part_size, k_lo + (p + 1) * part_size) of the tile's visible range. Writes part_acc
// float [num_tokens][Hq][num_parts][DV] (unnormalised) and part_ml float [..][2] = (max, sum); an
// empty partition writes (-inf, 0) and a zero accumulator.
// sinks / alibi: fp32 [Hq] or nullptr (the split launch leaves sinks to kvm_split_reduce); causal:
// 0 = every row sees its request's seq_len keys. This kernel ignores alibi and causal (always
// causal); kvm_paged_attention_terms, the same arguments, applies them.
// The body both attention kernels instantiate: the matrix path for fp16 / bf16 (KVM_MMA), else the vector one.
#if KVM_MMA
#define KVM_ATTENTION_BODY attention_body_mma
#else
#define KVM_ATTENTION_BODY attention_body
#endif
// The attention kernels' properties: an nd-range kernel at sub-group size SG, with 256 registers
// (grf_size<256>) when KVM_LARGE_GRF.
#if KVM_LARGE_GRF
#define KVM_LARGE_GRF_PROPERTY SYCL_EXT_ONEAPI_FUNCTION_PROPERTY((sycl::ext::intel::experimental::grf_size<256>))
#else
#define KVM_LARGE_GRF_PROPERTY
#endif
#define KVM_ATTENTION_KERNEL                                                                 \
  extern "C" SYCL_EXT_ONEAPI_FUNCTION_PROPERTY((syclexp::nd_range_kernel<1>))               \
      SYCL_EXT_ONEAPI_FUNCTION_PROPERTY((syclexp::sub_group_size<SG>)) KVM_LARGE_GRF_PROPERTY

KVM_ATTENTION_KERNEL void kvm_paged_attention(KVM_ATTENTION_PARAMS) { KVM_ATTENTION_BODY<false>(KVM_ATTENTION_ARGS); }

// kvm_paged_prefill: the same arguments, launched by the host for the tiles of more than MR rows; the
// rows-on-lanes matrix body where the build has it (prefill_body_mma; not kvm_paged_prefill_terms),
// else the attention body.
template <bool TERMS>
static inline void prefill_entry(KVM_ATTENTION_BODY_PARAMS) {
#if KVM_MMA
  // ALiBi / non-causal (TERMS) keep the attention body: the rows-on-lanes body with those terms
  // spilled ~2 KB on PVC (IGC 1.0.12504)
  if constexpr (PREFILL_MMA && !TERMS) prefill_body_mma<TERMS>(KVM_ATTENTION_COMMON_ARGS, lm);
  else KVM_ATTENTION_BODY<TERMS>(KVM_ATTENTION_COMMON_ARGS, lm);
#else
  KVM_ATTENTION_BODY<TERMS>(KVM_ATTENTION_COMMON_ARGS, lm);
#endif
}

KVM_ATTENTION_KERNEL void kvm_paged_prefill(KVM_ATTENTION_PARAMS) { prefill_entry<false>(KVM_ATTENTION_ARGS); }

#if defined(KVM_TERMS) && KVM_TERMS
// The same with ALiBi and / or without the causal mask (see the top of this file).
KVM_ATTENTION_KERNEL void kvm_paged_attention_terms(KVM_ATTENTION_PARAMS) {
  KVM_ATTENTION_BODY<true>(KVM_ATTENTION_ARGS);
}

KVM_ATTENTION_KERNEL void kvm_paged_prefill_terms(KVM_ATTENTION_PARAMS) { prefill_entry<true>(KVM_ATTENTION_ARGS); }
#endif

// Combine the partitions of one (token, query head) per work-group:
// out = sum_p acc_p * exp(m_p - M) / (sum_p l_p * exp(m_p - M) [+ exp(sinks[qh] - M)]),
// M = max(max_p m_p [, sinks[qh]]); sinks: fp32 [num_q_heads] or nullptr.
// Grid: nd_range<1>(num_tokens * num_q_heads * wg, wg).
extern "C" SYCL_EXT_ONEAPI_FUNCTION_PROPERTY((syclexp::nd_range_kernel<1>))
void kvm_split_reduce(const float *part_acc, const float *part_ml, elem_t *out, int64_t o_st, int64_t o_sh,
                      int32_t num_q_heads, int32_t num_parts, const float *sinks) {
  auto it = syclext::this_work_item::get_nd_item<1>();
  const int64_t row = static_cast<int64_t>(it.get_group(0));
  const int64_t token = row / num_q_heads;
  const int qh = static_cast<int>(row % num_q_heads);
  const int lid = static_cast<int>(it.get_local_id(0));
  const int n = static_cast<int>(it.get_local_range(0));
  const float *ml = part_ml + row * num_parts * 2;
  const float sink = sinks != nullptr ? sinks[qh] : NEG_INF;
  float M = sink;
  for (int p = 0; p < num_parts; ++p) M = sycl::fmax(M, ml[2 * p]);
  float L = sink != NEG_INF ? sycl::exp(sink - M) : 0.f;
  bool row_nan = false;
  for (int p = 0; p < num_parts; ++p) row_nan |= is_nan(ml[2 * p + 1]);
  for (int p = 0; p < num_parts; ++p)
    if (ml[2 * p] != NEG_INF) L += ml[2 * p + 1] * sycl::exp(ml[2 * p] - M);
  const float inv = L > 0.f ? 1.f / L : 0.f;
  for (int d = lid; d < DV; d += n) {
    float a = 0.f;
    for (int p = 0; p < num_parts; ++p)
      if (ml[2 * p] != NEG_INF) a += part_acc[(row * num_parts + p) * DV + d] * sycl::exp(ml[2 * p] - M);
    out[token * o_st + qh * o_sh + d] = from_f(row_nan ? QNAN : a * inv);
  }
}

// write_kv: one work-item per (token, KV head, content element); a slot outside
// [0, num_blocks * block_size) (-1 = padding) is skipped. key [T][Hkv][D] with strides (k_st, k_sh,
// 1); value [T][Hkv][DV] with strides (v_st, v_sh, 1); T = num_tokens rows of key, value and
// slot_mapping. Grid: nd_range<1>(round_up(T * Hkv * E, wg), wg). Bit-exact copy (no conversion),
// or for an fp8 cache fp8(x / scale[h]) (k_scale / v_scale: fp32 [Hkv]; unused otherwise).
extern "C" SYCL_EXT_ONEAPI_FUNCTION_PROPERTY((syclexp::nd_range_kernel<1>))
void kvm_write_kv(const elem_t *key, int64_t k_st, int64_t k_sh, const elem_t *value, int64_t v_st, int64_t v_sh,
                  cache_t *cache, int64_t s_block, int64_t s_token, int64_t s_head, int64_t num_blocks,
                  const int64_t *slot_mapping, int64_t num_tokens, int32_t num_kv_heads, int32_t block_size,
                  const float *k_scale, const float *v_scale) {
  auto it = syclext::this_work_item::get_nd_item<1>();
  const int64_t i = static_cast<int64_t>(it.get_global_id(0));
  if (i >= num_tokens * num_kv_heads * E) return;
  const int e = static_cast<int>(i % E);
  const int64_t th = i / E;
  const int h = static_cast<int>(th % num_kv_heads);
  const int64_t t = th / num_kv_heads;
  const int64_t slot = slot_mapping[t];
  if (slot < 0 || slot / block_size >= num_blocks) return;
  const int64_t dst = (slot / block_size) * s_block + (slot % block_size) * s_token + h * s_head + e;
  cache[dst] = e < D ? cache_from(key[t * k_st + h * k_sh + e], FP8 ? k_scale[h] : 1.f)
                     : cache_from(value[t * v_st + h * v_sh + (e - D)], FP8 ? v_scale[h] : 1.f);
}

#else  // KVM_MMA_PROBE: only the probe kernel below
// The matrix built-in on raw fragments (tests/test_sycl_backend.py checks its layout): sub-group g
// reads lane n's a / b / c registers at [(g * 16 + n) * 8 + component] and writes the result there.
extern "C" SYCL_EXT_ONEAPI_FUNCTION_PROPERTY((syclexp::nd_range_kernel<1>))
SYCL_EXT_ONEAPI_FUNCTION_PROPERTY((syclexp::sub_group_size<16>))
void kvm_mma_probe(const int16_t *a, const int32_t *b, const float *c, float *d, int32_t bf16) {
  auto it = syclext::this_work_item::get_nd_item<1>();
  auto sg = it.get_sub_group();
  const int64_t base = static_cast<int64_t>(it.get_global_id(0)) * 8;
  mma_a_t fa;
  mma_b_t fb;
  mma_c_t fc;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    fa[i] = a[base + i];
    fb[i] = b[base + i];
    fc[i] = c[base + i];
  }
  const mma_c_t r = bf16 ? mma<true>(sg, fa, fb, fc) : mma<false>(sg, fa, fb, fc);
#pragma unroll
  for (int i = 0; i < 8; ++i) d[base + i] = r[i];
}
#endif
