// kvmulti SYCL kernels: paged attention and write_kv over the canonical KV-cache layout.
//
// SYCL 2020 C++ with free-function kernels (sycl_ext_oneapi_free_function_kernels). This file is
// the one source of truth; it is compiled at RUN TIME by the oneAPI kernel_compiler extension
// (create_kernel_bundle_from_source(ctx, source_language::sycl, src) + build) for the device that
// runs it, with these build options (kvmulti/backends/sycl.py passes them):
//
//   -DKVM_DTYPE=0|1|2       element type of cache, query, key, value and out: fp32, fp16, bf16
//   -DKVM_HEAD_SIZE=D       key/query head size
//   -DKVM_HEAD_SIZE_V=DV    value head size
//   -DKVM_ROWS=R            (query token, query head) rows per work-group tile
//   -DKVM_KC=KC             keys per chunk staged in local memory
//   -DKVM_WG=WG             work-group size of the attention kernels
//
// Cache addressing (named strides, in elements): element d of K of (block, token, kv head) is at
// cache[block * s_block + token * s_token + head * s_head + d]; V follows at + D. Both physical
// orders (NHD, HND) differ only in s_token / s_head.
//
// Attention: one work-group per (tile, KV head[, KV partition]). A tile is up to R consecutive rows
// of a request's flattened (query token, query head-in-group) space, so GQA groups of any size and
// any mix of prefill / chunked prefill / decode / multi-token verification share one launch. The
// work-group loops over the visible key range in chunks of KC keys: K/V chunk and the score tile
// live in local memory (plain local_accessor arguments), the online softmax runs one row per
// sub-group with sub-group max/sum reductions, and each work-item keeps its share of the fp32
// output accumulator in registers. Keys outside the causal / sliding-window range of a tile are
// never visited, so block-table entries for blocks wholly outside the window are never read.
//
// Split-KV (long contexts, few work-groups): the same body over one partition of the key range
// writes an unnormalised partial output + (max, sum) per row; kvm_split_reduce combines them.

#include <sycl/sycl.hpp>

#include <cstdint>
#include <limits>

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
#ifndef KVM_KC
#define KVM_KC 32
#endif
#ifndef KVM_WG
#define KVM_WG 128
#endif

constexpr int D = KVM_HEAD_SIZE;
constexpr int DV = KVM_HEAD_SIZE_V;
constexpr int E = D + DV;               // content elements per (token, head)
constexpr int ROWS = KVM_ROWS;
constexpr int KC = KVM_KC;
constexpr int WG = KVM_WG;
constexpr int KCP = KC + 1;             // padded row of the transposed K tile (fewer bank conflicts)
constexpr int ACC_PER = (ROWS * DV + WG - 1) / WG;

// Local-memory carve-up of the float scratch (the host sizes the accessor with the same numbers).
constexpr int LM_Q = 0;                         // [ROWS][D]   scaled queries
constexpr int LM_K = LM_Q + ROWS * D;           // [D][KCP]    keys of the chunk, transposed
constexpr int LM_V = LM_K + D * KCP;            // [KC][DV]    values of the chunk
constexpr int LM_S = LM_V + KC * DV;            // [ROWS][KC]  scores, then probabilities
constexpr int LM_M = LM_S + ROWS * KC;          // [ROWS] running max
constexpr int LM_L = LM_M + ROWS;               // [ROWS] running sum
constexpr int LM_A = LM_L + ROWS;               // [ROWS] rescale factor of this chunk
constexpr int LM_FLOATS = LM_A + ROWS;

static_assert(D > 0 && DV > 0, "head sizes must be positive");
static_assert(WG % 8 == 0, "work-group size must be a multiple of 8");

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

constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

// ---------------------------------------------------------------------------------------------
// The shared attention body. SPLIT: write partial results of partition `part` of the key range.
template <bool SPLIT>
static inline void attention_body(const elem_t *query, int64_t q_st, int64_t q_sh, const elem_t *cache,
                                  int64_t s_block, int64_t s_token, int64_t s_head, const int32_t *block_table,
                                  int64_t bt_stride, const int32_t *seq_lens, const int32_t *query_start_loc,
                                  const int32_t *tiles, elem_t *out, int64_t o_st, int64_t o_sh, float *part_acc,
                                  float *part_ml, int32_t num_parts, int32_t part_size, int32_t num_kv_heads,
                                  int32_t group, int32_t block_size, float scale, int32_t window, float softcap,
                                  sycl::decorated_local_ptr<float> lm,
                                  sycl::decorated_local_ptr<int64_t> loff) {
  auto it = syclext::this_work_item::get_nd_item<1>();
  auto wg = it.get_group();
  auto sg = it.get_sub_group();
  const int lid = static_cast<int>(it.get_local_id(0));
  const int sg_id = static_cast<int>(sg.get_group_linear_id());
  const int n_sg = static_cast<int>(sg.get_group_linear_range());
  const int lane = static_cast<int>(sg.get_local_linear_id());
  const int sg_size = static_cast<int>(sg.get_local_linear_range());

  int64_t gid = static_cast<int64_t>(it.get_group(0));
  const int part = SPLIT ? static_cast<int>(gid % num_parts) : 0;
  if (SPLIT) gid /= num_parts;
  const int h = static_cast<int>(gid % num_kv_heads);
  const int64_t tile = gid / num_kv_heads;

  const int req = tiles[2 * tile];
  const int f0 = tiles[2 * tile + 1];                // first flattened row of the tile
  const int q0 = query_start_loc[req];
  const int qlen = query_start_loc[req + 1] - q0;
  const int seq = seq_lens[req];
  const int ctx = seq - qlen;                        // position of the request's first new token
  const int nrows = sycl::min(ROWS, qlen * group - f0);
  const int p_first = ctx + f0 / group;
  const int p_last = ctx + (f0 + nrows - 1) / group;
  int k_lo = window > 0 ? sycl::max(0, p_first - window + 1) : 0;
  int k_hi = p_last + 1;                              // causal
  const int num_q_heads = num_kv_heads * group;

  if (SPLIT) {
    const int lo = k_lo + part * part_size;
    k_hi = sycl::min(k_hi, lo + part_size);
    k_lo = lo;
    if (k_lo >= k_hi) {  // empty partition (uniform over the work-group): neutral partial result
      for (int idx = lid; idx < nrows * DV; idx += WG) {
        const int r = idx / DV, d = idx - r * DV, flat = f0 + r;
        const int64_t row = static_cast<int64_t>(q0 + flat / group) * num_q_heads + h * group + flat % group;
        part_acc[(row * num_parts + part) * DV + d] = 0.f;
        if (d == 0) {
          part_ml[(row * num_parts + part) * 2 + 0] = NEG_INF;
          part_ml[(row * num_parts + part) * 2 + 1] = 0.f;
        }
      }
      return;
    }
  }

  // Typed local-space pointers (not generic ones): local memory accesses stay local on every device.
  auto q_lm = lm + LM_Q, k_lm = lm + LM_K, v_lm = lm + LM_V, s_lm = lm + LM_S;
  auto m_lm = lm + LM_M, l_lm = lm + LM_L, a_lm = lm + LM_A;

  // Scaled queries of the tile -> local memory (rows past nrows are zero).
  for (int idx = lid; idx < ROWS * D; idx += WG) {
    const int r = idx / D, d = idx - r * D;
    float v = 0.f;
    if (r < nrows) {
      const int flat = f0 + r;
      const int64_t token = q0 + flat / group;
      const int qh = h * group + flat % group;
      v = to_f(query[token * q_st + qh * q_sh + d]) * scale;
    }
    q_lm[idx] = v;
  }
  for (int r = lid; r < ROWS; r += WG) {
    m_lm[r] = NEG_INF;
    l_lm[r] = 0.f;
  }
  float acc[ACC_PER];
#pragma unroll
  for (int e = 0; e < ACC_PER; ++e) acc[e] = 0.f;

  const int32_t *bt = block_table + static_cast<int64_t>(req) * bt_stride;
  const int64_t head_off = static_cast<int64_t>(h) * s_head;

  for (int k0 = k_lo; k0 < k_hi; k0 += KC) {
    const int nk = sycl::min(KC, k_hi - k0);
    // Cache offsets of the chunk's keys: only block-table entries of positions in [k_lo, k_hi) are read.
    for (int j = lid; j < KC; j += WG) {
      const int pos = k0 + j;
      loff[j] = j < nk ? static_cast<int64_t>(bt[pos / block_size]) * s_block +
                             static_cast<int64_t>(pos % block_size) * s_token + head_off
                       : 0;
    }
    sycl::group_barrier(wg);

    for (int idx = lid; idx < KC * D; idx += WG) {
      const int j = idx / D, d = idx - j * D;
      k_lm[d * KCP + j] = j < nk ? to_f(cache[loff[j] + d]) : 0.f;
    }
    for (int idx = lid; idx < KC * DV; idx += WG) {
      const int j = idx / DV, d = idx - j * DV;
      v_lm[idx] = j < nk ? to_f(cache[loff[j] + D + d]) : 0.f;
    }
    sycl::group_barrier(wg);

    // Score tile: causal + sliding-window mask, softcap.
    for (int idx = lid; idx < nrows * KC; idx += WG) {
      const int r = idx / KC, j = idx - r * KC;
      const int kpos = k0 + j;
      const int qpos = ctx + (f0 + r) / group;
      float s = NEG_INF;
      if (j < nk && kpos <= qpos && (window <= 0 || qpos - kpos < window)) {
        const auto qr = q_lm + r * D;    // same row for neighbouring work-items: broadcast
        const auto kc = k_lm + j;         // neighbouring work-items read neighbouring keys
        float dot = 0.f;
#pragma unroll 8
        for (int d = 0; d < D; ++d) dot += qr[d] * kc[d * KCP];
        if (softcap > 0.f) dot = softcap * sycl::tanh(dot / softcap);
        s = dot;
      }
      s_lm[idx] = s;
    }
    sycl::group_barrier(wg);

    // Online softmax: one row per sub-group, sub-group reductions over the chunk's columns.
    for (int r = sg_id; r < nrows; r += n_sg) {
      float cmax = NEG_INF;
      for (int j = lane; j < KC; j += sg_size) cmax = sycl::fmax(cmax, s_lm[r * KC + j]);
      cmax = sycl::reduce_over_group(sg, cmax, sycl::maximum<float>());
      const float m_old = m_lm[r];
      const float m_new = sycl::fmax(m_old, cmax);
      float psum = 0.f;
      for (int j = lane; j < KC; j += sg_size) {
        const float s = s_lm[r * KC + j];
        const float p = (m_new == NEG_INF || s == NEG_INF) ? 0.f : sycl::exp(s - m_new);
        s_lm[r * KC + j] = p;
        psum += p;
      }
      psum = sycl::reduce_over_group(sg, psum, sycl::plus<float>());
      if (lane == 0) {
        const float alpha = (m_new == NEG_INF) ? 1.f : (m_old == NEG_INF ? 0.f : sycl::exp(m_old - m_new));
        m_lm[r] = m_new;
        l_lm[r] = l_lm[r] * alpha + psum;
        a_lm[r] = alpha;
      }
    }
    sycl::group_barrier(wg);

    // acc[r][d] = acc * alpha[r] + sum_j p[r][j] * v[j][d]
#pragma unroll
    for (int e = 0; e < ACC_PER; ++e) {
      const int idx = lid + e * WG;
      if (idx < nrows * DV) {
        const int r = idx / DV, d = idx - r * DV;
        const auto pr = s_lm + r * KC;
        float a = acc[e] * a_lm[r];
        for (int j = 0; j < nk; ++j) a += pr[j] * v_lm[j * DV + d];
        acc[e] = a;
      }
    }
    sycl::group_barrier(wg);  // the next chunk overwrites the local tiles
  }

#pragma unroll
  for (int e = 0; e < ACC_PER; ++e) {
    const int idx = lid + e * WG;
    if (idx < nrows * DV) {
      const int r = idx / DV, d = idx - r * DV, flat = f0 + r;
      const int64_t token = q0 + flat / group;
      const int qh = h * group + flat % group;
      if (SPLIT) {
        const int64_t row = token * num_q_heads + qh;
        part_acc[(row * num_parts + part) * DV + d] = acc[e];
        if (d == 0) {
          part_ml[(row * num_parts + part) * 2 + 0] = m_lm[r];
          part_ml[(row * num_parts + part) * 2 + 1] = l_lm[r];
        }
      } else {
        const float l = l_lm[r];
        out[token * o_st + qh * o_sh + d] = from_f(l > 0.f ? acc[e] / l : 0.f);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Kernels. Grid: nd_range<1>(num_tiles * num_kv_heads [* num_parts] * WG, WG).
// tiles: int32 [num_tiles][2] = (request, first flattened row), built by the host.
// lm: float[LM_FLOATS] local scratch, loff: int64[KC] local cache offsets of the chunk's keys.

extern "C" SYCL_EXT_ONEAPI_FUNCTION_PROPERTY((syclexp::nd_range_kernel<1>))
void kvm_paged_attention(const elem_t *query, int64_t q_st, int64_t q_sh, const elem_t *cache, int64_t s_block,
                         int64_t s_token, int64_t s_head, const int32_t *block_table, int64_t bt_stride,
                         const int32_t *seq_lens, const int32_t *query_start_loc, const int32_t *tiles, elem_t *out,
                         int64_t o_st, int64_t o_sh, int32_t num_kv_heads, int32_t group, int32_t block_size,
                         float scale, int32_t window, float softcap, sycl::local_accessor<float, 1> lm,
                         sycl::local_accessor<int64_t, 1> loff) {
  attention_body<false>(query, q_st, q_sh, cache, s_block, s_token, s_head, block_table, bt_stride, seq_lens,
                        query_start_loc, tiles, out, o_st, o_sh, nullptr, nullptr, 1, 0, num_kv_heads, group,
                        block_size, scale, window, softcap,
                        lm.get_multi_ptr<sycl::access::decorated::yes>(),
                        loff.get_multi_ptr<sycl::access::decorated::yes>());
}

// Split-KV variant: grid has num_parts work-groups per (tile, KV head); partition p covers keys
// [k_lo + p * part_size, k_lo + (p + 1) * part_size) of the tile's visible range. Writes
// part_acc float [T][Hq][num_parts][DV] (unnormalised) and part_ml float [T][Hq][num_parts][2].
extern "C" SYCL_EXT_ONEAPI_FUNCTION_PROPERTY((syclexp::nd_range_kernel<1>))
void kvm_paged_attention_split(const elem_t *query, int64_t q_st, int64_t q_sh, const elem_t *cache,
                               int64_t s_block, int64_t s_token, int64_t s_head, const int32_t *block_table,
                               int64_t bt_stride, const int32_t *seq_lens, const int32_t *query_start_loc,
                               const int32_t *tiles, float *part_acc, float *part_ml, int32_t num_parts,
                               int32_t part_size, int32_t num_kv_heads, int32_t group, int32_t block_size,
                               float scale, int32_t window, float softcap, sycl::local_accessor<float, 1> lm,
                               sycl::local_accessor<int64_t, 1> loff) {
  attention_body<true>(query, q_st, q_sh, cache, s_block, s_token, s_head, block_table, bt_stride, seq_lens,
                       query_start_loc, tiles, nullptr, 0, 0, part_acc, part_ml, num_parts, part_size,
                       num_kv_heads, group, block_size, scale, window, softcap,
                       lm.get_multi_ptr<sycl::access::decorated::yes>(),
                       loff.get_multi_ptr<sycl::access::decorated::yes>());
}

// Combine the partitions of one (token, query head) per work-group:
// out = sum_p acc_p * exp(m_p - M) / sum_p l_p * exp(m_p - M), M = max_p m_p.
// Grid: nd_range<1>(num_tokens * num_q_heads * wg, wg).
extern "C" SYCL_EXT_ONEAPI_FUNCTION_PROPERTY((syclexp::nd_range_kernel<1>))
void kvm_split_reduce(const float *part_acc, const float *part_ml, elem_t *out, int64_t o_st, int64_t o_sh,
                      int32_t num_q_heads, int32_t num_parts) {
  auto it = syclext::this_work_item::get_nd_item<1>();
  const int64_t row = static_cast<int64_t>(it.get_group(0));
  const int64_t token = row / num_q_heads;
  const int qh = static_cast<int>(row % num_q_heads);
  const int lid = static_cast<int>(it.get_local_id(0));
  const int n = static_cast<int>(it.get_local_range(0));
  const float *ml = part_ml + row * num_parts * 2;
  float M = NEG_INF;
  for (int p = 0; p < num_parts; ++p) M = sycl::fmax(M, ml[2 * p]);
  float L = 0.f;
  for (int p = 0; p < num_parts; ++p)
    if (ml[2 * p] != NEG_INF) L += ml[2 * p + 1] * sycl::exp(ml[2 * p] - M);
  const float inv = L > 0.f ? 1.f / L : 0.f;
  for (int d = lid; d < DV; d += n) {
    float a = 0.f;
    for (int p = 0; p < num_parts; ++p)
      if (ml[2 * p] != NEG_INF) a += part_acc[(row * num_parts + p) * DV + d] * sycl::exp(ml[2 * p] - M);
    out[token * o_st + qh * o_sh + d] = from_f(a * inv);
  }
}

// write_kv: one work-item per (token, KV head, content element); slot -1 (any negative) is skipped.
// key [T][Hkv][D] with strides (k_st, k_sh, 1); value [T][Hkv][DV] with strides (v_st, v_sh, 1).
// Grid: nd_range<1>(round_up(T * Hkv * E, wg), wg). Bit-exact copy (no conversion).
extern "C" SYCL_EXT_ONEAPI_FUNCTION_PROPERTY((syclexp::nd_range_kernel<1>))
void kvm_write_kv(const elem_t *key, int64_t k_st, int64_t k_sh, const elem_t *value, int64_t v_st, int64_t v_sh,
                  elem_t *cache, int64_t s_block, int64_t s_token, int64_t s_head, const int64_t *slot_mapping,
                  int64_t num_tokens, int32_t num_kv_heads, int32_t block_size) {
  auto it = syclext::this_work_item::get_nd_item<1>();
  const int64_t i = static_cast<int64_t>(it.get_global_id(0));
  if (i >= num_tokens * num_kv_heads * E) return;
  const int e = static_cast<int>(i % E);
  const int64_t th = i / E;
  const int h = static_cast<int>(th % num_kv_heads);
  const int64_t t = th / num_kv_heads;
  const int64_t slot = slot_mapping[t];
  if (slot < 0) return;
  const int64_t dst = (slot / block_size) * s_block + (slot % block_size) * s_token + h * s_head + e;
  cache[dst] = e < D ? key[t * k_st + h * k_sh + e] : value[t * v_st + h * v_sh + (e - D)];
}
