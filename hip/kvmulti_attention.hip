// kvmulti HIP kernels: paged attention over the canonical KV-cache layout, its split-KV
// (partitioned) variant + reduce kernel, and write_kv.
//
// Canonical layout (kvmulti.layout): logical shape (num_blocks, block_size, num_kv_heads,
// head_size_k + head_size_v), K in [..., :head_size_k], V in [..., head_size_k:]. The physical order
// of the token/head dimensions (NHD or HND) is NOT assumed: every access goes through the named
// strides (block, token, head; dim stride is 1) in elements.
//
// One launch covers a whole mixed batch (varlen prefill, chunked prefill, decode, multi-token
// verification): the grid's x dimension runs over the batch's query tokens, and each block finds its
// request by binary search over query_start_loc. Request r's query tokens are the LAST
// q_len = qsl[r+1]-qsl[r] positions of its seq_lens[r] tokens; a query at position p attends causally
// to keys 0..p, and with a sliding window W only to keys p-W+1..p (blocks entirely outside the window
// are never read: their block-table entries may be garbage).
//
// Block = (up to 8 "rows" = query (token, head) pairs sharing one KV head and one request -- the
// heads of a GQA group x consecutive query tokens, see RowMap --, KV partition); kNumWarps*WAVE
// threads. Every K/V element a block reads serves all of its rows. The union of the rows' key ranges
// is streamed in tiles of one key per thread with an online softmax per row (running max / sum, fp32
// accumulation), each row masking the keys outside its own causal / window / partition range:
//   QK: each thread reads its key row once (16-byte loads when aligned) and computes the dot products
//       with the block's (pre-scaled) query rows in shared memory, applies softcap c*tanh(s/c);
//   block max/sum reductions (wave shuffles + shared memory) give every thread the same m, l per row;
//   PV: each thread owns head dims d = tid, tid+NT, ... and accumulates p_i * V[i][d] over the tile
//       for every row (V reads coalesced across threads).
// All loops that contain barriers or shuffles have block-uniform trip counts.
//
// Split-KV ("partitioned") decode: for long contexts with too few (token, head) blocks to fill the
// GPU, gridDim.z > 1 splits each key range into partitions of partition_size keys; each block writes
// its partial (normalised output, max, sum) to a float workspace and paged_attention_reduce_kernel
// combines them. The launcher (launcher.hip, kvmulti_hip_plan) decides when to split.
#pragma once

#include "kvmulti_common.h"

namespace kvmulti {

struct PagedAttentionParams {
  void* out;                     // [num_tokens, Hq, HS] (strided), query dtype
  const void* query;             // [num_tokens, Hq, HS] (strided), dim stride 1
  const void* kv_cache;          // canonical layout, cache dtype == query dtype
  const int* query_start_loc;    // [num_reqs + 1]
  const int* seq_lens;           // [num_reqs]
  const int* block_table;        // [num_reqs, bt_stride]
  float* part_out;               // split-KV only: [num_tokens, Hq, P, HS]
  float* part_max;               // split-KV only: [num_tokens, Hq, P]
  float* part_sum;               // split-KV only: [num_tokens, Hq, P]
  int64_t q_stride_token, q_stride_head;
  int64_t o_stride_token, o_stride_head;
  int64_t kv_stride_block, kv_stride_token, kv_stride_head;
  int64_t bt_stride;
  int num_reqs, num_tokens, num_q_heads, num_kv_heads, block_size;
  int sliding_window;            // 0 = none
  int partition_size;            // keys per partition (split-KV only)
  int num_partitions;            // gridDim.z; 1 = no split
  int kv_aligned16;              // cache base 16-byte aligned: K rows are read in 16-byte chunks
  float scale;
  float softcap;                 // 0 = none
};

struct WriteKVParams {
  const void* key;               // [num_tokens, Hkv, head_size] (strided)
  const void* value;             // [num_tokens, Hkv, head_size_v] (strided)
  void* kv_cache;
  const int64_t* slot_mapping;   // [num_tokens], -1 = skip
  int64_t k_stride_token, k_stride_head, k_stride_dim;
  int64_t v_stride_token, v_stride_head, v_stride_dim;
  int64_t kv_stride_block, kv_stride_token, kv_stride_head;
  int num_tokens, num_kv_heads, head_size, head_size_v, block_size;
};

// Which (query token, query head) pairs -- "rows" -- one attention block computes. All rows of a
// block share one KV head and one request, so every K/V element the block reads serves all of them:
// heads_per_block = min(group, R) heads of one GQA group x tokens_per_block = R / heads_per_block
// consecutive query tokens of one request (R = kMaxRows = 8). Block (x, y): x is the first query token
// of its token tile (blocks whose token does not start a tile exit at once), y = kv_head * chunks + chunk.
struct RowMap {
  int heads_per_block, tokens_per_block, chunks;
  __host__ __device__ RowMap(int num_q_heads, int num_kv_heads) {
    const int group = num_q_heads / num_kv_heads;
    heads_per_block = group < kMaxRows ? group : kMaxRows;
    tokens_per_block = kMaxRows / heads_per_block;
    chunks = (group + heads_per_block - 1) / heads_per_block;
  }
};

// Keys [x, y) visible to a query at position pos within partition part (x >= y: none).
__device__ __forceinline__ void key_range(const PagedAttentionParams& p, int pos, int part, int& x, int& y) {
  x = p.sliding_window > 0 ? max(0, pos - p.sliding_window + 1) : 0;
  y = pos + 1;
  if (p.num_partitions > 1) {
    x += part * p.partition_size;
    y = min(y, x + p.partition_size);
  }
}

template <typename T, int HS, int WAVE>
__device__ __forceinline__ void paged_attention_body(const PagedAttentionParams& p) {
  constexpr int NT = kNumWarps * WAVE;
  constexpr int DPT = (HS + NT - 1) / NT;  // output dims per thread
  constexpr int R = kMaxRows;
  const int tid = (int)threadIdx.x;
  const int token = (int)blockIdx.x;
  const int part = (int)blockIdx.z;

  __shared__ float q_s[R][HS];
  __shared__ float p_s[R][NT];
  __shared__ int64_t row_s[NT];
  __shared__ float red_s[R][kNumWarps];

  // Request of this token: the last r with query_start_loc[r] <= token (block-uniform).
  int lo = 0, hi = p.num_reqs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (p.query_start_loc[mid] <= token) lo = mid; else hi = mid - 1;
  }
  const int req = lo;
  const int q_begin = p.query_start_loc[req];
  const int q_end = p.query_start_loc[req + 1];
  const RowMap map(p.num_q_heads, p.num_kv_heads);
  if ((token - q_begin) % map.tokens_per_block != 0) return;  // another block covers this token (uniform)
  const int group = p.num_q_heads / p.num_kv_heads;
  const int kv_head = (int)blockIdx.y / map.chunks;
  const int head0 = kv_head * group + ((int)blockIdx.y % map.chunks) * map.heads_per_block;
  const int nheads = min(map.heads_per_block, kv_head * group + group - head0);
  const int ntok = min(map.tokens_per_block, q_end - token);
  const int rows = nheads * ntok;  // row r = (token + r / nheads, head0 + r % nheads); block-uniform
  const int pos0 = p.seq_lens[req] - (q_end - q_begin) + (token - q_begin);  // position of `token`

  // Rows of token tq (= r / nheads) see keys [x, y) = key_range(tq): causal, sliding window, this
  // block's partition. The union [kv_lo, kv_hi) over the block's tokens is contiguous (ranges shift by
  // at most one key per token) and every key in it is visible to some row, so its block-table entry is
  // real. Ranges are recomputed per token inside the loops (a few scalar ops) rather than kept in
  // 2 x 8 scalar registers, which made gfx90a spill.
  int kv_lo = 0x7fffffff, kv_hi = 0;
  for (int tq = 0; tq < ntok; ++tq) {
    int x, y;
    key_range(p, pos0 + tq, part, x, y);
    if (x < y) {
      kv_lo = min(kv_lo, x);
      kv_hi = max(kv_hi, y);
    }
  }
  const T* cache = static_cast<const T*>(p.kv_cache) + (int64_t)kv_head * p.kv_stride_head;
  const int* bt = p.block_table + (int64_t)req * p.bt_stride;

  if (kv_lo >= kv_hi) {  // no row sees a key in this partition (uniform): contributes nothing
    for (int i = tid; i < rows * HS; i += NT) {
      const int r = i / HS, d = i % HS;
      const int tok = token + r / nheads, head = head0 + r % nheads;
      if (p.num_partitions > 1) {
        const int64_t idx = ((int64_t)tok * p.num_q_heads + head) * p.num_partitions + part;
        if (d == 0) {
          p.part_max[idx] = -FLT_MAX;
          p.part_sum[idx] = 0.f;
        }
        p.part_out[idx * HS + d] = 0.f;
      } else {
        static_cast<T*>(p.out)[(int64_t)tok * p.o_stride_token + (int64_t)head * p.o_stride_head + d] =
            Cvt<T>::from(0.f);
      }
    }
    return;
  }

  for (int i = tid; i < rows * HS; i += NT) {
    const int r = i / HS, d = i % HS;
    const int tok = token + r / nheads, head = head0 + r % nheads;
    const T* q = static_cast<const T*>(p.query) + (int64_t)tok * p.q_stride_token + (int64_t)head * p.q_stride_head;
    q_s[r][d] = Cvt<T>::to(q[d]) * p.scale;
  }
  __syncthreads();

  float m[R], l[R], acc[R][DPT];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    m[r] = -FLT_MAX;
    l[r] = 0.f;
#pragma unroll
    for (int j = 0; j < DPT; ++j) acc[r][j] = 0.f;
  }
  const bool aligned = p.kv_aligned16 != 0;

  for (int t0 = kv_lo; t0 < kv_hi; t0 += NT) {  // uniform trip count
    const int t = t0 + tid;
    float s[R];
    unsigned visible = 0u;  // bit r: key t is in row r's range
#pragma unroll
    for (int r = 0; r < R; ++r) s[r] = -FLT_MAX;
    if (t < kv_hi) {
      const int64_t blk = bt[t / p.block_size];  // t is visible to some row: its block is real
      const int64_t row = blk * p.kv_stride_block + (int64_t)(t % p.block_size) * p.kv_stride_token;
      row_s[tid] = row;
      dot_rows<T, HS, R>(&q_s[0][0], cache + row, aligned, rows, s);
      // Tokens tq (rows tq * nheads ...) whose key_range(pos0 + tq, part) holds t: an interval
      // [lo_tq, hi_tq], in closed form (ranges are nondecreasing in tq).
      const int W = p.sliding_window, ps = p.partition_size;
      const int tp = p.num_partitions > 1 ? t - part * ps : t;  // t relative to the partition start
      int lo_tq = t - pos0;                                      // causal: t <= pos0 + tq
      int hi_tq = tp < 0 ? -1 : (W > 0 ? tp - pos0 + W - 1 : ntok - 1);
      if (p.num_partitions > 1 && tp >= ps) {                   // t >= start + ps for small tq
        if (W > 0) lo_tq = max(lo_tq, tp - ps - pos0 + W);
        else hi_tq = -1;
      }
      lo_tq = max(lo_tq, 0);
      hi_tq = min(hi_tq, ntok - 1);
      if (lo_tq <= hi_tq)
        visible = ((1u << ((hi_tq + 1) * nheads)) - 1u) & ~((1u << (lo_tq * nheads)) - 1u);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        if (p.softcap > 0.f) s[r] = p.softcap * tanhf(s[r] / p.softcap);
        if (!((visible >> r) & 1u)) s[r] = -FLT_MAX;  // masked for this row
      }
    }
    float m_new[R], e[R], alpha[R];
#pragma unroll
    for (int r = 0; r < R; ++r) m_new[r] = s[r];
    block_reduce_rows<WAVE, kNumWarps, true, R>(m_new, rows, red_s);
#pragma unroll
    for (int r = 0; r < R; ++r) {
      m_new[r] = fmaxf(m[r], m_new[r]);
      e[r] = ((visible >> r) & 1u) ? __expf(s[r] - m_new[r]) : 0.f;
      if (r < rows) p_s[r][tid] = e[r];
    }
    block_reduce_rows<WAVE, kNumWarps, false, R>(e, rows, red_s);  // also publishes p_s, row_s
#pragma unroll
    for (int r = 0; r < R; ++r) {
      alpha[r] = __expf(m[r] - m_new[r]);  // 1 while a row has seen no key yet (both -FLT_MAX)
      l[r] = l[r] * alpha[r] + e[r];
      m[r] = m_new[r];
    }
    const int n = min(NT, kv_hi - t0);
#pragma unroll
    for (int j = 0; j < DPT; ++j) {
      const int d = tid + j * NT;
      if (d < HS) {
#pragma unroll
        for (int r = 0; r < R; ++r) acc[r][j] *= alpha[r];
        for (int i = 0; i < n; ++i) {
          const float v = Cvt<T>::to(cache[row_s[i] + HS + d]);
#pragma unroll
          for (int r = 0; r < R; ++r)
            if (r < rows) acc[r][j] += p_s[r][i] * v;
        }
      }
    }
    __syncthreads();  // p_s / row_s are rewritten by the next tile
  }

#pragma unroll
  for (int r = 0; r < R; ++r) {
    if (r >= rows) continue;
    const int tok = token + r / nheads, head = head0 + r % nheads;
    const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
    if (p.num_partitions > 1) {
      const int64_t idx = ((int64_t)tok * p.num_q_heads + head) * p.num_partitions + part;
      if (tid == 0) {
        p.part_max[idx] = m[r];
        p.part_sum[idx] = l[r];
      }
#pragma unroll
      for (int j = 0; j < DPT; ++j) {
        const int d = tid + j * NT;
        if (d < HS) p.part_out[idx * HS + d] = acc[r][j] * inv;
      }
    } else {
      T* o = static_cast<T*>(p.out) + (int64_t)tok * p.o_stride_token + (int64_t)head * p.o_stride_head;
#pragma unroll
      for (int j = 0; j < DPT; ++j) {
        const int d = tid + j * NT;
        if (d < HS) o[d] = Cvt<T>::from(acc[r][j] * inv);
      }
    }
  }
}

// grid (num_tokens, num_kv_heads * RowMap::chunks, num_partitions), block kNumWarps * WAVE threads, no
// dynamic shared memory.
template <typename T, int HS, int WAVE>
__global__ void __launch_bounds__(kNumWarps * WAVE, 1) paged_attention_kernel(const PagedAttentionParams p) {
  if constexpr (wave_matches_target<WAVE>()) paged_attention_body<T, HS, WAVE>(p);
}

// Combines the partitions of the split-KV path. grid (num_tokens, num_q_heads), any block size,
// dynamic shared memory: num_partitions floats.
template <typename T>
__global__ void __launch_bounds__(256) paged_attention_reduce_kernel(const PagedAttentionParams p, int head_size) {
  HIP_DYNAMIC_SHARED(float, w_s)
  const int tid = (int)threadIdx.x, nt = (int)blockDim.x;
  const int token = (int)blockIdx.x, head = (int)blockIdx.y;
  const int P = p.num_partitions;
  const int64_t base = ((int64_t)token * p.num_q_heads + head) * P;
  float gmax = -FLT_MAX;
  for (int i = 0; i < P; ++i)
    if (p.part_sum[base + i] > 0.f) gmax = fmaxf(gmax, p.part_max[base + i]);
  for (int i = tid; i < P; i += nt) {
    const float s = p.part_sum[base + i];
    w_s[i] = s > 0.f ? s * __expf(p.part_max[base + i] - gmax) : 0.f;
  }
  __syncthreads();
  float total = 0.f;
  for (int i = 0; i < P; ++i) total += w_s[i];
  const float inv = total > 0.f ? 1.f / total : 0.f;
  T* op = static_cast<T*>(p.out) + (int64_t)token * p.o_stride_token + (int64_t)head * p.o_stride_head;
  for (int d = tid; d < head_size; d += nt) {
    float o = 0.f;
    for (int i = 0; i < P; ++i) o += w_s[i] * p.part_out[(base + i) * head_size + d];
    op[d] = Cvt<T>::from(o * inv);
  }
}

// Writes the new tokens' K and V into their slots. grid (num_tokens), any block size; slot -1 skipped.
template <typename T>
__global__ void __launch_bounds__(256) write_kv_kernel(const WriteKVParams p) {
  const int tok = (int)blockIdx.x;
  const int64_t slot = p.slot_mapping[tok];
  if (slot < 0) return;  // padding token (uniform: no barriers in this kernel)
  const int64_t blk = slot / p.block_size, off = slot % p.block_size;
  T* dst = static_cast<T*>(p.kv_cache) + blk * p.kv_stride_block + off * p.kv_stride_token;
  const T* key = static_cast<const T*>(p.key) + (int64_t)tok * p.k_stride_token;
  const T* value = static_cast<const T*>(p.value) + (int64_t)tok * p.v_stride_token;
  const int nk = p.num_kv_heads * p.head_size;
  for (int i = (int)threadIdx.x; i < nk; i += (int)blockDim.x) {
    const int h = i / p.head_size, d = i % p.head_size;
    dst[h * p.kv_stride_head + d] = key[h * p.k_stride_head + d * p.k_stride_dim];
  }
  const int nv = p.num_kv_heads * p.head_size_v;
  for (int i = (int)threadIdx.x; i < nv; i += (int)blockDim.x) {
    const int h = i / p.head_size_v, d = i % p.head_size_v;
    dst[h * p.kv_stride_head + p.head_size + d] = value[h * p.v_stride_head + d * p.v_stride_dim];
  }
}

}  // namespace kvmulti
