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
// to keys 0..p, and with a sliding window W only to keys p-W+1..p. Blocks entirely outside the window
// may hold garbage block-table entries: the kernel reads K/V only for the tiles covering the visible
// keys (a tile may start up to KT-1 keys before the window and end past the last visible key; those
// keys are masked and read a zero row instead of the cache -- whatever bytes the cache holds there, no
// key outside the block's range reaches the output, see key_row -- and any block id outside
// [0, num_blocks) is replaced by block 0 before it forms an address).
//
// Block = (R "rows" = query (token, head) pairs sharing one KV head and one request -- the heads of a
// GQA group x consecutive query tokens, see RowMap; R = 16 for fp16 / bf16 queries on wave64, else 8 --, KV
// partition); kNumWarps waves. Every K/V element a block reads serves all of its rows. The union of the
// rows' key ranges is cut into tiles of KT keys; each wave streams its own contiguous share of the tiles
// with its own online softmax per row (running max / sum, fp32 accumulation), so the hot loop has no
// block barrier; the waves' partial results are combined once at the end through LDS.
// Block-table entries are read once per window of WAVE entries (one 4-byte load per lane, outside the
// tile loop) and handed to the lanes that need them with shuffles -- or, on the MFMA engine when the block
// size is a multiple of 16, read out of the window as one wave-uniform scalar per 16-key sub-tile.
//
// Two tile engines, chosen at compile time per target (and at run time on the CPU harness):
//   * MFMA (CDNA2/3, fp16 / bf16 queries, wave64): K and V are loaded straight into matrix-fragment
//     registers with 16-byte loads; S^T = K Q^T and O += P V run as v_mfma_f32_16x16x16{f16,bf16_1k} tiles
//     (S^T's output layout is exactly P's operand layout for PV, so no transpose is needed). An fp8
//     cache's codes are widened to the query's type (exactly) as the fragments are formed, its V rows
//     staged in LDS first (16-byte loads; a fragment's 8 codes per key would be an 8-byte load), and its
//     scales applied outside the MFMAs (k_scale with the score scale, v_scale with the output's);
//   * FMA (fp32, RDNA wave32, NVIDIA, GCN without MFMA): lane groups over keys; each lane reads its
//     pieces of a key's K and V rows into registers, the group's dot products finish in a butterfly
//     reduce-scatter and the softmax's exchanges are shuffles; no LDS in the tile loop but the
//     (broadcast) query reads. See the engine's section below.
//
// Split-KV ("partitioned") decode: for long contexts with too few (token, head) blocks to fill the
// GPU, gridDim.z > 1 splits each key range into partitions of partition_size keys; each block writes
// its partial (normalised output, max, sum) to a float workspace and paged_attention_reduce_kernel
// combines them. The launcher (launcher.hip, kvmulti_hip_plan) decides when to split.
//
// Memory safety: whatever the metadata says, no kernel reads or writes outside the query / output /
// cache / metadata / workspace tensors. A request whose query rows are not [qsl[r], qsl[r+1]) within
// the query rows, or whose index is past the block table's rows, is skipped; keys past the table width
// (bt_cols * block_size) are never visible; a block id outside [0, num_blocks) masks its keys (they are
// read from block 0 instead); write_kv skips slots outside [0, num_blocks * block_size).
#pragma once

#include "kvmulti_common.h"

namespace kvmulti {

struct PagedAttentionParams {
  void* out;                     // [num_query_rows, Hq, HS] (strided), query dtype
  const void* query;             // [num_query_rows, Hq, HS] (strided), dim stride 1
  const void* kv_cache;          // canonical layout, cache dtype == query dtype or fp8, num_blocks blocks
  const int* query_start_loc;    // [num_reqs + 1]
  const int* seq_lens;           // [num_reqs]
  const int* block_table;        // [bt_rows, bt_stride], bt_cols entries used per row
  float* part_out;               // split-KV only: [num_tokens, Hq, P, HS]
  float* part_max;               // split-KV only: [num_tokens, Hq, P]
  float* part_sum;               // split-KV only: [num_tokens, Hq, P]
  int64_t q_stride_token, q_stride_head;
  int64_t o_stride_token, o_stride_head;
  int64_t kv_stride_block, kv_stride_token, kv_stride_head;
  int64_t bt_stride;
  int num_reqs, num_tokens, num_q_heads, num_kv_heads, block_size;
  int bt_rows, bt_cols, num_blocks;  // bounds of the block table and of the cache
  int sliding_window;            // 0 = none
  int partition_size;            // keys per partition (split-KV only)
  int num_partitions;            // gridDim.z; 1 = no split
  int kv_aligned16;              // cache base and strides 16-byte aligned: 16-byte vector loads
  float scale;
  float softcap;                 // 0 = none
  float inv_softcap;             // 1 / softcap (0 when none)
  const float* k_scale;          // fp8 caches: [num_kv_heads] (keys read as float(k) * k_scale); else unused
  const float* v_scale;          // fp8 caches: [num_kv_heads]
  const float* sinks;            // [num_q_heads] attention-sink logits (join each row's denominator once), or null
  const float* alibi_slopes;     // [num_q_heads]: score += slope * (key pos - query pos), or null
  int causal;                    // 0: every row sees all seq_len keys of its request
};

// The kernel's parameters p (its only argument) read again from its argument segment on AMD device passes:
// loads where the values are used, instead of the scalars the compiler loads at the kernel's entry and keeps
// live across the tile loops (clang-19 spilled them on gfx942). Their pointers are generic ones there: accesses
// through them take global_ptr.
__device__ __forceinline__ const PagedAttentionParams& kernel_params(const PagedAttentionParams& p) {
#if KVM_AMDGPU_DEVICE
  (void)p;
  auto k = (const __attribute__((address_space(4))) PagedAttentionParams*)__builtin_amdgcn_kernarg_segment_ptr();
  asm("" : "+s"(k));  // not the argument's pointer: no load through it merges with the entry's
  return *(const PagedAttentionParams*)k;
#else
  return p;
#endif
}

// x as a pointer into global memory: global, not flat, loads and stores through it.
#if KVM_AMDGPU_DEVICE
template <typename X>
using GlobalPtr = __attribute__((address_space(1))) X*;
#else
template <typename X>
using GlobalPtr = X*;
#endif
template <typename X>
__device__ __forceinline__ GlobalPtr<X> global_ptr(X* x) {
  return (GlobalPtr<X>)x;
}
// *src and *dst = v through global_ptr, as bits (T may be a class type: __half, hip_bfloat16).
template <typename T>
using GlobalBits = typename std::conditional<sizeof(T) == 2, unsigned short, uint32_t>::type;
template <typename T>
__device__ __forceinline__ T load_global(const T* src) {
  static_assert(sizeof(T) == sizeof(GlobalBits<T>), "2- or 4-byte values");
  const GlobalBits<T> u = *global_ptr(reinterpret_cast<const GlobalBits<T>*>(src));
  T v;
  __builtin_memcpy(&v, &u, sizeof(T));
  return v;
}
template <typename T>
__device__ __forceinline__ void store_global(T* dst, T v) {
  static_assert(sizeof(T) == sizeof(GlobalBits<T>), "2- or 4-byte values");
  GlobalBits<T> u;
  __builtin_memcpy(&u, &v, sizeof(T));
  *global_ptr(reinterpret_cast<GlobalBits<T>*>(dst)) = u;
}

struct WriteKVParams {
  const void* key;               // [num_tokens, Hkv, head_size] (strided)
  const void* value;             // [num_tokens, Hkv, head_size_v] (strided)
  void* kv_cache;
  const int64_t* slot_mapping;   // [num_tokens], outside [0, num_blocks * block_size) = skip
  int64_t k_stride_token, k_stride_head, k_stride_dim;
  int64_t v_stride_token, v_stride_head, v_stride_dim;
  int64_t kv_stride_block, kv_stride_token, kv_stride_head;
  int num_tokens, num_kv_heads, head_size, head_size_v, block_size, num_blocks;
  const float* k_scale;          // fp8 caches: [num_kv_heads] (stores fp8(k / k_scale)); else unused
  const float* v_scale;          // fp8 caches: [num_kv_heads]
};

// Which (query token, query head) pairs -- "rows" -- one attention block computes. All rows of a
// block share one KV head and one request, so every K/V element the block reads serves all of them:
// heads_per_block = min(group, R) heads of one GQA group x tokens_per_block = R / heads_per_block
// consecutive query tokens of one request. Block (x, y): x is the first query token of its token
// tile (blocks whose token does not start a tile exit at once), y = kv_head * chunks + chunk.
struct RowMap {
  int heads_per_block, tokens_per_block, chunks;
  __host__ __device__ RowMap(int num_q_heads, int num_kv_heads, int rows_per_block) {
    const int group = num_q_heads / num_kv_heads;
    heads_per_block = group < rows_per_block ? group : rows_per_block;
    tokens_per_block = rows_per_block / heads_per_block;
    chunks = (group + heads_per_block - 1) / heads_per_block;
  }
};

// What one attention block computes; all fields block-uniform. Row r = (token + (row0 + r) / nheads,
// head0 + (row0 + r) % nheads) for r < rows (row0: a slice of a larger task, see the prefill kernel).
struct BlockTask {
  int token, req, part, nheads, head0, kv_head, rows, ntok, row0;
  int kv_lo, kv_hi;   // union of the rows' visible keys (empty: kv_lo >= kv_hi)
  int all_lo, all_hi; // keys visible to every row that sees any (empty: all_lo >= all_hi)
  int kmax;           // keys addressable through the block table: bt_cols * block_size (clamped)
  long long pos0;     // position of `token` in its sequence (any value for invalid metadata)
  int seq_len;        // the request's seq_lens entry (the end of a non-causal row's keys)
  const int* bt;      // this request's block-table row
};

// Keys [x, y) visible to the query tokens tq of a block: causal, sliding window, partition, table width.
__device__ __forceinline__ void key_range(const PagedAttentionParams& p, const BlockTask& b, int tq, int& x,
                                          int& y) {
  const long long pos = b.pos0 + tq;
  long long lo = p.sliding_window > 0 ? pos - p.sliding_window + 1 : 0;
  long long hi = p.causal ? pos + 1 : (long long)b.seq_len;
  if (lo < 0) lo = 0;
  if (p.num_partitions > 1) {
    lo += (long long)b.part * p.partition_size;
    if (hi > lo + p.partition_size) hi = lo + p.partition_size;
  }
  if (hi > b.kmax) hi = b.kmax;
  if (lo > b.kmax) lo = b.kmax;
  if (hi < lo) hi = lo;  // empty (lo >= 0 here: never a negative key)
  x = (int)lo;
  y = (int)hi;
}

// What block_task found: compute the task, nothing to do (another block covers this token), or
// metadata out of bounds for this token (the block writes zeros / empty partials for its own rows).
enum class TaskKind { kCompute, kCovered, kInvalid };

// Union [kv_lo, kv_hi) of the visible keys of the task's rows row0 .. row0 + rows - 1 (contiguous: ranges
// shift by at most one key per token; empty: kv_lo >= kv_hi) and their intersection [all_lo, all_hi)
// over the rows that see any key.
__device__ __forceinline__ void task_key_union(const PagedAttentionParams& p, BlockTask& b) {
  b.kv_lo = b.all_hi = 0x7fffffff;
  b.kv_hi = b.all_lo = 0;
  if (b.rows <= 0) return;
  const int first = b.row0 / b.nheads, last = (b.row0 + b.rows - 1) / b.nheads;
#pragma unroll 1  // block-uniform set-up; unrolled (up to 64 tokens), its 64-bit scalars spill SGPRs
  for (int tq = first; tq <= last; ++tq) {
    int x, y;
    key_range(p, b, tq, x, y);
    if (x < y) {
      b.kv_lo = min(b.kv_lo, x);
      b.kv_hi = max(b.kv_hi, y);
      b.all_lo = max(b.all_lo, x);
      b.all_hi = min(b.all_hi, y);
    }
  }
}

// The rest of a task whose request (b.req, rows [q_begin, q_end)) and first token are known: up to
// tokens_per_block tokens from b.token, their positions, the table row and the key union.
__device__ __forceinline__ void fill_task(const PagedAttentionParams& p, BlockTask& b, int tokens_per_block,
                                          int q_begin, int q_end) {
  b.ntok = min(tokens_per_block, min(q_end, p.num_tokens) - b.token);
  b.rows = b.nheads * b.ntok;
  b.seq_len = p.seq_lens[b.req];
  b.pos0 = (long long)b.seq_len - ((long long)q_end - q_begin) + (b.token - q_begin);
  const long long kmax = (long long)p.bt_cols * p.block_size;
  b.kmax = (int)(kmax < 0 ? 0 : (kmax > 0x3fffffff ? 0x3fffffff : kmax));
  b.bt = p.block_table + (int64_t)b.req * p.bt_stride;
  task_key_union(p, b);
}

// The block's heads and partition (grid y, z), first token `token`, one empty row of work so far.
__device__ __forceinline__ void init_task(const PagedAttentionParams& p, const RowMap& map, int token, BlockTask& b) {
  b.token = token;
  b.part = (int)blockIdx.z;
  const int group = p.num_q_heads / p.num_kv_heads;
  b.kv_head = (int)blockIdx.y / map.chunks;
  b.head0 = b.kv_head * group + ((int)blockIdx.y % map.chunks) * map.heads_per_block;
  b.nheads = min(map.heads_per_block, b.kv_head * group + group - b.head0);
  b.ntok = 1;
  b.row0 = 0;
  b.rows = b.nheads;
  b.kv_lo = 0;
  b.kv_hi = 0;
}

// Fills the block's task from the metadata. Block-uniform.
template <int R>
__device__ __forceinline__ TaskKind block_task(const PagedAttentionParams& p, BlockTask& b) {
  const RowMap map(p.num_q_heads, p.num_kv_heads, R);
  init_task(p, map, (int)blockIdx.x, b);
  if (b.token >= p.num_tokens) return TaskKind::kCovered;
  int lo = 0, hi = p.num_reqs - 1;  // the last r with query_start_loc[r] <= token
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (p.query_start_loc[mid] <= b.token) lo = mid; else hi = mid - 1;
  }
  b.req = lo;
  const int q_begin = p.query_start_loc[b.req];
  const int q_end = p.query_start_loc[b.req + 1];
  if (q_begin < 0 || b.token < q_begin || b.token >= q_end || b.req >= p.bt_rows) return TaskKind::kInvalid;
  if ((b.token - q_begin) % map.tokens_per_block != 0) return TaskKind::kCovered;
  fill_task(p, b, map.tokens_per_block, q_begin, q_end);
  return TaskKind::kCompute;
}

// A block none of whose rows sees a key of its partition: writes zeros (output or partial).
template <typename T, int HS, int NT>
__device__ void write_empty_rows(const PagedAttentionParams& p, const BlockTask& b) {
  for (int i = (int)threadIdx.x; i < b.rows * HS; i += NT) {
    const int r = i / HS, d = i % HS;
    const int tok = b.token + (b.row0 + r) / b.nheads, head = b.head0 + (b.row0 + r) % b.nheads;
    if (p.num_partitions > 1) {
      const int64_t idx = ((int64_t)tok * p.num_q_heads + head) * p.num_partitions + b.part;
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
}

// What a block's row needs besides its query: its visible keys [lo, hi) and its ALiBi bias slope * (t - qpos)
// for key t (slope 0 without ALiBi).
template <int R>
struct RowInfo {
  int lo[R], hi[R], qpos[R];
  float slope[R];
};

// Position of the query token tq of the block, clamped to int (any value for invalid metadata).
__device__ __forceinline__ int query_pos(const BlockTask& b, int tq) {
  const long long pos = b.pos0 + tq;
  return (int)(pos < -0x3fffffff ? -0x3fffffff : pos > 0x3fffffff ? 0x3fffffff : pos);
}

// Per-row key ranges and ALiBi terms of the block in shared memory (rows >= b.rows: empty). Ends with a barrier.
template <int R>
__device__ __forceinline__ void publish_row_ranges(const PagedAttentionParams& p, const BlockTask& b,
                                                   RowInfo<R>& ri) {
  const int r = (int)threadIdx.x;
  if (r < R) {
    int x = 0, y = 0, qpos = 0;
    float slope = 0.f;
    if (r < b.rows) {
      key_range(p, b, (b.row0 + r) / b.nheads, x, y);
      qpos = query_pos(b, (b.row0 + r) / b.nheads);
      if (p.alibi_slopes) slope = global_ptr(p.alibi_slopes)[b.head0 + (b.row0 + r) % b.nheads];
    }
    ri.lo[r] = x;
    ri.hi[r] = y;
    ri.qpos[r] = qpos;
    ri.slope[r] = slope;
  }
  __syncthreads();
}

// The attention-sink logit row r of the block adds to its softmax denominator: -inf (nothing) without
// sinks, past the block's rows, or on the split-KV path (the reduce kernel adds it once, after the merge).
__device__ __forceinline__ float row_sink(const PagedAttentionParams& p, const BlockTask& b, int r) {
  if (!p.sinks || p.num_partitions > 1 || r >= b.rows) return -INFINITY;
  return global_ptr(p.sinks)[b.head0 + (b.row0 + r) % b.nheads];
}

// Tiles of KT keys, aligned to multiples of KT, covering [kv_lo, kv_hi); wave `warp` takes the
// contiguous share [first, last) of them.
template <int KT>
struct TileRange {
  int base, first, last;
  __device__ TileRange(const BlockTask& b, int warp) {
    base = b.kv_lo / KT * KT;
    const int n = (b.kv_hi - base + KT - 1) / KT;
    first = (int)((long long)n * warp / kNumWarps);
    last = (int)((long long)n * (warp + 1) / kNumWarps);
  }
};

// Block-table window: lane i holds entry win * WAVE + i of the request's row (-1 past the table width).
template <int WAVE>
__device__ __forceinline__ int load_bt_window(const PagedAttentionParams& p, const BlockTask& b, int win, int lane) {
  const long long i = (long long)win * WAVE + lane;
  return i < p.bt_cols ? b.bt[i] : -1;
}

// Zeros in place of a cache row (K and V of one KV head, up to 2 x 256 fp32 elements): what a key
// outside its block's range [kv_lo, kv_hi) reads (see key_row). Internal linkage: each translation unit
// of a build that splits the kernels (the CPU harness's, see launcher.hip) holds its own.
static __device__ Chunk16 kZeroRow[128];

// Key t of the block-table window starting at key ws: its entry q (the return value) and offset r in that
// block, through a float reciprocal (inv_bs = 1 / block_size) plus a one-step fix-up: exact for
// 0 <= t - ws < WAVE * block_size (the launcher bounds block_size), a few VALU ops instead of an integer
// division.
__device__ __forceinline__ int window_entry(const PagedAttentionParams& p, int ws, float inv_bs, int t, int& r) {
  const int bs = p.block_size, tr = t - ws;
  int q = (int)((float)tr * inv_bs);
  r = tr - q * bs;
  const bool under = r < 0;  // selects, not branches
  q -= under ? 1 : 0;
  r += under ? bs : 0;
  const bool over = r >= bs;
  q += over ? 1 : 0;
  r -= over ? bs : 0;
  return q;
}

// Address of the row (K then V, of the cache's KV head `cache` points at) of key t of the block-table
// window that starts at key ws = win * WAVE * block_size, whose entry i lane i holds (bt_win); a block
// id outside [0, num_blocks) gives block 0 and valid = false. A key outside the block's range
// [kv_lo, kv_hi) -- tiles are whole, so the first and last tiles hold some: slots before a sliding
// window, the unwritten tail of the last block, slots of blocks the table names past the range --
// reads kZeroRow instead: its score is masked (-inf by select, p = 0), but 0 x V is NaN for a
// non-finite V, and such slots may hold anything. Every lane calls key_row (a shuffle); key_row_at is its
// second half, for a caller that knows the block id blk and the offset r of key t in that block.
template <typename C>
__device__ __forceinline__ const C* key_row_at(const PagedAttentionParams& p, const BlockTask& b, const C* cache,
                                               int blk, int r, int t, bool& valid) {
  valid = blk >= 0 && blk < p.num_blocks;
  // blk, r >= 0 and the strides are positive: unsigned 32 x 64-bit products
  const int64_t row = (int64_t)((uint64_t)(uint32_t)(valid ? blk : 0) * (uint64_t)p.kv_stride_block +
                                (uint64_t)(uint32_t)r * (uint64_t)p.kv_stride_token);
  const bool in_range = (unsigned)(t - b.kv_lo) < (unsigned)(b.kv_hi - b.kv_lo);
  return in_range ? cache + row : reinterpret_cast<const C*>(kZeroRow);  // a select, not a branch
}

template <int WAVE, typename C>
__device__ __forceinline__ const C* key_row(const PagedAttentionParams& p, const BlockTask& b, const C* cache,
                                            int bt_win, int ws, float inv_bs, int t, bool& valid) {
  int r;
  const int q = window_entry(p, ws, inv_bs, t, r);
  return key_row_at(p, b, cache, __shfl(bt_win, q, WAVE), r, t, valid);
}

// Cross-wave combine: every wave has per-row (m, l) and unnormalised accumulators; the block's result
// is sum_w acc_w * exp(m_w - M) / (L + exp(sink - M)) with M = max_w m_w, L = sum_w l_w exp(m_w - M) and
// sink the row's attention-sink logit (-inf: none). Waves publish m, l (lanes holding them call with
// publish = true), then add their scaled accumulators into o_s in turn.
template <int R>
struct Combine {
  float m[kNumWarps][R], l[kNumWarps][R];
};
template <int R>
__device__ __forceinline__ float combine_factor(const Combine<R>& c, int warp, int r, float& M, float& L,
                                                float sink = -INFINITY) {
  M = -FLT_MAX;
#pragma unroll
  for (int w = 0; w < kNumWarps; ++w) M = fmaxf(M, c.m[w][r]);
  L = 0.f;
#pragma unroll
  for (int w = 0; w < kNumWarps; ++w) L += c.l[w][r] * __expf(c.m[w][r] - M);
  const float denom = L + __expf(sink - M);
  return L > 0.f ? __expf(c.m[warp][r] - M) / denom : 0.f;
}

// Writes the block's normalised rows from o_s ([R][HS] floats) to the output or the split-KV workspace.
template <typename T, int HS, int NT, int R>
__device__ void write_rows(const PagedAttentionParams& p, const BlockTask& b, const float (*o_s)[HS],
                           const Combine<R>& c) {
  for (int i = (int)threadIdx.x; i < b.rows * HS; i += NT) {
    const int r = i / HS, d = i % HS;
    const int tok = b.token + (b.row0 + r) / b.nheads, head = b.head0 + (b.row0 + r) % b.nheads;
    if (p.num_partitions > 1) {
      const int64_t idx = ((int64_t)tok * p.num_q_heads + head) * p.num_partitions + b.part;
      if (d == 0) {
        float M, L;
        (void)combine_factor<R>(c, 0, r, M, L);
        global_ptr(p.part_max)[idx] = M;
        global_ptr(p.part_sum)[idx] = L;
      }
      global_ptr(p.part_out)[idx * HS + d] = o_s[r][d];
    } else {
      store_global(static_cast<T*>(p.out) + (int64_t)tok * p.o_stride_token + (int64_t)head * p.o_stride_head + d,
                   Cvt<T>::from(o_s[r][d]));
    }
  }
}

// Score post-processing shared by both engines: scale (p.scale, times k_scale where the MFMA engine
// leaves it out of the dot product), softcap, the ALiBi bias (0 without), mask (-inf: p = 0 below).
__device__ __forceinline__ float finish_score(const PagedAttentionParams& p, float s, float score_scale,
                                              float bias, bool visible) {
  s *= score_scale;
  if (p.softcap > 0.f) s = p.softcap * softcap_tanh(s * p.inv_softcap);
  s += bias;
  return visible ? s : -INFINITY;
}

// ============================================================================ FMA engine
// Lane groups over keys. A group of G lanes holds one key's K and V rows, lane j of the group the
// pieces j, j + G, ... of PIECE head dims each (one 16-byte load per piece; fp32: two; fp8: one 8-byte
// load), read from global memory straight into registers; the wave's KP = WAVE / G groups take KP keys
// per pass and NP passes make a tile of KT = KP x NP keys, all of whose loads are issued before its
// arithmetic. The query (pre-scaled) and the output accumulators of the lane's dims stay in registers
// for all R rows, so the tile loop touches no shared memory:
//   * QK: each lane forms its dims' partial dot products for the tile's N = NP x R (pass, row) scores of
//     its group's keys, and a butterfly reduce-scatter over the group leaves lane j the NF = N / G
//     consecutive finished scores from scatter_first(j) (one, duplicated, when N < G): every exponential
//     is computed once per score, not once per lane;
//   * online softmax: a row's tile maximum is a butterfly over the lanes holding that row for the other
//     passes and groups (lane masks G / NP .. WAVE / 2); the rows' rescale factors and probabilities
//     reach the lanes that need them by shuffles (WaveView);
//   * PV: each lane accumulates its dims of every row from its group's key.
// The groups' and then the waves' partial results are combined once, after the last tile.
__host__ __device__ constexpr int pow2_at_least(int n) {
  int g = 1;
  while (g < n) g *= 2;
  return g;
}

template <typename C, int HS, int WAVE, int R>
struct FmaGeom {
  static constexpr int PIECE = 8;                                    // head dims per piece
  static constexpr int PIECES = HS / PIECE;
  static constexpr int G = pow2_at_least(PIECES) < WAVE ? pow2_at_least(PIECES) : WAVE;  // lanes per key
  static constexpr int CPL = (PIECES + G - 1) / G;                   // pieces per lane
  static constexpr int KP = WAVE / G;                                // keys per pass
  static constexpr int WORDS = PIECE * (int)sizeof(C) / 4;           // 32-bit words per piece
  static constexpr int LOADS = CPL * (WORDS > 4 ? WORDS / 4 : 1);     // K (or V) loads per lane and pass
  // passes per tile: 4 loads per lane in flight (K and V of 2 passes; 1 of fp32 pieces, two loads each)
  static constexpr int NP = LOADS >= 2 ? 1 : 2;
  static constexpr int KT = KP * NP;                                 // keys per tile
  static constexpr int N = NP * R;                                   // scores per group and tile
  static constexpr int NF = N >= G ? N / G : 1;                      // scores per lane
  static_assert(HS % PIECE == 0 && KT <= WAVE, "FMA engine geometry");
};

// The first score index (pass-major, i x R + r) lane j of a group of G holds after the reduce-scatter of N
// scores (it holds NF consecutive ones), and the lane holding score idx (the lowest, when duplicated).
template <int N, int G>
__host__ __device__ constexpr int scatter_first(int j) {
  int first = 0, n = N;
  for (int m = G / 2; m >= 1; m >>= 1) {
    if (n >= 2) {
      if (j & m) first += n / 2;
      n /= 2;
    }
  }
  return first;
}
template <int N, int G, int NF>
__host__ __device__ constexpr int scatter_holder(int idx) {
  for (int j = 0; j < G; ++j)
    if (scatter_first<N, G>(j) == idx - idx % NF) return j;
  return 0;
}

// Butterfly reduce-scatter of v[0 .. NN) over the lane masks M, M / 2, .., 1: each stage keeps the half
// the lane's bit M selects and adds the partner's copy of it; once one value is left, the stages sum it.
template <int WAVE, int M, int NN, int N>
__device__ __forceinline__ void reduce_scatter(float (&v)[N], int lane) {
  if constexpr (M >= 1) {
    constexpr int H = NN >= 2 ? NN / 2 : 1;
    const bool up = (lane & M) != 0;
    float send[H], recv[H];
    if constexpr (NN >= 2) {
#pragma unroll
      for (int k = 0; k < H; ++k) send[k] = lane_pick(up, v[k], v[k + H]);
      shfl_xor_n<WAVE, H>(send, recv, M);
#pragma unroll
      for (int k = 0; k < H; ++k) v[k] = lane_pick(up, v[k + H], v[k]) + recv[k];
    } else {
      send[0] = v[0];
      shfl_xor_n<WAVE, 1>(send, recv, M);
      v[0] += recv[0];
    }
    reduce_scatter<WAVE, M / 2, H, N>(v, lane);
  }
}

// Keeps the compiler from hoisting the loop-invariant shared-memory reads of the query out of the tile loop
// (it would keep them in registers, which the accumulators need): a compiler-only memory clobber.
// On AMD GPUs also a scheduling barrier: each pass's shuffles and conversions stay in their pass instead of
// all passes' being hoisted together (their registers live at once).
__device__ __forceinline__ void pass_fence() {
#if defined(__HIP_DEVICE_COMPILE__) || defined(__CUDA_ARCH__)
  asm volatile("" ::: "memory");
#endif
#if KVM_AMDGPU_DEVICE
  __builtin_amdgcn_sched_barrier(0);
#endif
}

// 8 bytes of a row, one vector load (fp8 pieces).
struct alignas(8) Chunk8 {
  uint32_t w[2];
};

// The WORDS 32-bit words of the piece at p: 16-byte chunks (load_chunk), or one 8-byte piece of fp8 codes;
// vector loads when ALIGNED, else element loads.
template <typename C, int WORDS, bool ALIGNED>
__device__ __forceinline__ void load_piece(const C* __restrict__ p, uint32_t (&w)[WORDS]) {
  if constexpr (WORDS % 4 == 0) {
#pragma unroll
    for (int i = 0; i < WORDS / 4; ++i) {
      const Chunk16 c = load_chunk<C, ALIGNED>(p + i * (16 / sizeof(C)));
#pragma unroll
      for (int k = 0; k < 4; ++k) w[4 * i + k] = c.w[k];
    }
  } else {
    static_assert(WORDS == 2 && sizeof(C) == 1, "an 8-byte piece of fp8 codes");
    if constexpr (ALIGNED) {
      const Chunk8 c = *reinterpret_cast<const Chunk8*>(p);
      w[0] = c.w[0];
      w[1] = c.w[1];
    } else {
      const uint8_t* b = reinterpret_cast<const uint8_t*>(p);
#pragma unroll
      for (int i = 0; i < 2; ++i)
        w[i] = (uint32_t)b[4 * i] | ((uint32_t)b[4 * i + 1] << 8) | ((uint32_t)b[4 * i + 2] << 16) |
               ((uint32_t)b[4 * i + 3] << 24);
    }
  }
}

// Element e of a piece as fp32 (fp8: the code's value, unscaled).
template <typename C, int WORDS>
__device__ __forceinline__ float piece_elem(const uint32_t (&w)[WORDS], int e) {
  if constexpr (sizeof(C) == 4) {
    return __uint_as_float(w[e]);
  } else if constexpr (sizeof(C) == 2) {
    const uint32_t h = (w[e >> 1] >> (16 * (e & 1))) & 0xffffu;
    if constexpr (std::is_same<C, __half>::value) return __half2float(__ushort_as_half((unsigned short)h));
    else return __uint_as_float(h << 16);
  } else {
    return fp8_to_float<C>((w[e >> 2] >> (8 * (e & 3))) & 0xffu);
  }
}

// 4 floats, one 16-byte shared-memory access.
struct alignas(16) Float4 {
  float v[4];
};

template <typename C, int HS, int WAVE, int R>
struct FmaShared {
  using Geo = FmaGeom<C, HS, WAVE, R>;
  // the block's query rows, pre-scaled: q[r][c][h][j] = dims 4h .. 4h + 3 of piece j + c G of row r, so the
  // lanes of a group read consecutive 16 bytes and the groups the same ones (a broadcast)
  Float4 q[R][Geo::CPL][2][Geo::G];
  float o[R][HS];  // the combined output rows
  RowInfo<R> ri;
  Combine<R> comb;
};

// What a lane needs of each of its NF scores: the pass (its group's key t0 + pass x KP + group) and the row's
// visible keys [lo, hi) and ALiBi terms.
template <int NF>
struct OwnScores {
  int pass[NF], lo[NF], hi[NF], qpos[NF];
  float slope[NF];
};

template <typename C, int HS, int WAVE, int R, bool ALIGNED>
__device__ __forceinline__ void fma_stream(const PagedAttentionParams& params, const BlockTask& b,
                                           const FmaShared<C, HS, WAVE, R>& sh,
                                           const OwnScores<FmaGeom<C, HS, WAVE, R>::NF>& own,
                                           float (&m_own)[FmaGeom<C, HS, WAVE, R>::NF],
                                           float (&l_own)[FmaGeom<C, HS, WAVE, R>::NF],
                                           float (&acc)[R][FmaGeom<C, HS, WAVE, R>::CPL][8]) {
  using Geo = FmaGeom<C, HS, WAVE, R>;
  constexpr int G = Geo::G, CPL = Geo::CPL, KP = Geo::KP, NP = Geo::NP, KT = Geo::KT, N = Geo::N, NF = Geo::NF;
  constexpr int PIECE = Geo::PIECE, WORDS = Geo::WORDS;
  const PagedAttentionParams p = params;  // read once, before the loop (params may be kernel_params')
  const int lane = (int)threadIdx.x % WAVE, warp = (int)threadIdx.x / WAVE;
  const int j = lane % G, base = lane - j, grp = lane / G;
  const C* cache = static_cast<const C*>(p.kv_cache) + (int64_t)b.kv_head * p.kv_stride_head;
  const TileRange<KT> tiles(b, warp);
  const int win_keys = WAVE * p.block_size;  // keys per block-table window (a multiple of KT)
  const float inv_bs = 1.f / (float)p.block_size;
  for (int tile = tiles.first; tile < tiles.last;) {  // windows (uniform per wave)
    const int win = (tiles.base + tile * KT) / win_keys;
    const int bt_win[1] = {load_bt_window<WAVE>(p, b, win, lane)};
    const int ws = win * win_keys, win_end = ws + win_keys;
    for (; tile < tiles.last && tiles.base + tile * KT < win_end; ++tile) {  // the hot loop
      const int t0 = tiles.base + tile * KT;
#if KVM_AMDGPU_DEVICE
      if constexpr (ALIGNED) asm volatile("; kvmulti-hot-loop");  // compile_check's marker
#endif
      // the rows of the group's NP keys t0 + i KP + grp, and all their loads
      int entry[NP], off[NP];
#pragma unroll
      for (int i = 0; i < NP; ++i) entry[i] = window_entry(p, ws, inv_bs, t0 + i * KP + grp, off[i]);
      uint32_t kw[NP][CPL][WORDS], vw[NP][CPL][WORDS];
      unsigned okmask = 0;
      {
        const WaveView<WAVE, int, 1> bt(bt_win);
#pragma unroll
        for (int i = 0; i < NP; ++i) {
          bool ok;
          const C* row = key_row_at(p, b, cache, bt.read(entry[i], 0), off[i], t0 + i * KP + grp, ok);
          okmask |= ok ? 1u << i : 0u;
#pragma unroll
          for (int c = 0; c < CPL; ++c) {
            // a padding lane (u past the row: heads 80, 96) loads the last piece and masks it to zeros, so
            // every lane's loads stay unconditional
            const int u = j + c * G, uc = u < Geo::PIECES ? u : Geo::PIECES - 1;
            load_piece<C, WORDS, ALIGNED>(row + uc * PIECE, kw[i][c]);
            load_piece<C, WORDS, ALIGNED>(row + HS + uc * PIECE, vw[i][c]);
          }
        }
      }
      if constexpr (Geo::PIECES % G != 0) {
        // 8-byte pieces (fp8): every load issued before the masks wait for one (else the compiler waits
        // for the first pass's K before it issues the second pass's loads)
        if constexpr (WORDS == 2) pass_fence();
#pragma unroll
        for (int i = 0; i < NP; ++i)
#pragma unroll
          for (int c = 0; c < CPL; ++c) {
            const uint32_t keep = j + c * G < Geo::PIECES ? ~0u : 0u;
#pragma unroll
            for (int k = 0; k < WORDS; ++k) {
              kw[i][c][k] &= keep;
              vw[i][c][k] &= keep;
            }
          }
      }
      // QK partials of the lane's dims, then the group's reduce-scatter
      float s[N];
#pragma unroll
      for (int i = 0; i < NP; ++i) {
        pass_fence();
        float kf[CPL][PIECE];
#pragma unroll
        for (int c = 0; c < CPL; ++c)
#pragma unroll
          for (int e = 0; e < PIECE; ++e) kf[c][e] = piece_elem<C, WORDS>(kw[i][c], e);
#pragma unroll
        for (int r = 0; r < R; ++r) {
          float d = 0.f;
#pragma unroll
          for (int c = 0; c < CPL; ++c)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const Float4 qc = sh.q[r][c][h][j];
#pragma unroll
              for (int e = 0; e < 4; ++e) d += qc.v[e] * kf[c][4 * h + e];
            }
          s[i * R + r] = d;
        }
      }
      reduce_scatter<WAVE, G / 2, N, N>(s, lane);
      float so[NF], mx[NF];
#pragma unroll
      for (int f = 0; f < NF; ++f) {
        const int t = t0 + own.pass[f] * KP + grp;
        const bool vis = ((okmask >> own.pass[f]) & 1u) && t >= own.lo[f] && t < own.hi[f];
        so[f] = mx[f] = finish_score(p, s[f], 1.f, own.slope[f] * (float)(t - own.qpos[f]), vis);
      }
      butterfly<WAVE, G / NP, true>(mx);  // each score's row maximum over the tile
      float alpha[NF], prob[NF];
#pragma unroll
      for (int f = 0; f < NF; ++f) {
        const float m_new = fmaxf(m_own[f], mx[f]);
        alpha[f] = __expf(m_own[f] - m_new);
        m_own[f] = m_new;
        prob[f] = __expf(so[f] - m_new);
        l_own[f] = l_own[f] * alpha[f] + prob[f];
      }
      {
        const WaveView<WAVE, float, NF> av(alpha);
#pragma unroll
        for (int r = 0; r < R; ++r) {
          const float a = av.read(base + scatter_holder<N, G, NF>(r), r % NF);
#pragma unroll
          for (int c = 0; c < CPL; ++c)
#pragma unroll
            for (int e = 0; e < PIECE; ++e) acc[r][c][e] *= a;
        }
      }
      const WaveView<WAVE, float, NF> pv(prob);
#pragma unroll
      for (int i = 0; i < NP; ++i) {
        pass_fence();
        float vf[CPL][PIECE];
#pragma unroll
        for (int c = 0; c < CPL; ++c)
#pragma unroll
          for (int e = 0; e < PIECE; ++e) vf[c][e] = piece_elem<C, WORDS>(vw[i][c], e);
#pragma unroll
        for (int r = 0; r < R; ++r) {
          const float pr = pv.read(base + scatter_holder<N, G, NF>(i * R + r), (i * R + r) % NF);
#pragma unroll
          for (int c = 0; c < CPL; ++c)
#pragma unroll
            for (int e = 0; e < PIECE; ++e) acc[r][c][e] += pr * vf[c][e];
        }
      }
    }
  }
}

// T: the query's and output's type; C: the cache's (T, or an fp8 type).
template <typename T, typename C, int HS, int WAVE, int R>
__device__ void fma_body(const PagedAttentionParams& p, const BlockTask& b) {
  using Geo = FmaGeom<C, HS, WAVE, R>;
  constexpr int G = Geo::G, CPL = Geo::CPL, NP = Geo::NP, N = Geo::N, NF = Geo::NF, PIECE = Geo::PIECE;
  constexpr int NT = kNumWarps * WAVE;
  __shared__ FmaShared<C, HS, WAVE, R> sh;
  const int tid = (int)threadIdx.x, lane = tid % WAVE, warp = tid / WAVE;
  const int j = lane % G, base = lane - j, grp = lane / G;
  // fp8 caches: scores are q . float(code) x k_scale, outputs sum p float(code) x v_scale
  const float k_scale = is_fp8<C>() ? global_ptr(p.k_scale)[b.kv_head] : 1.f;
  const float v_scale = is_fp8<C>() ? global_ptr(p.v_scale)[b.kv_head] : 1.f;
  const float q_scale = p.scale * k_scale;
  for (int i = tid; i < R * CPL * 2 * G * 4; i += NT) {
    const int k = i % 4, jj = i / 4 % G, h = i / (4 * G) % 2, c = i / (8 * G) % CPL, r = i / (8 * G * CPL);
    const int u = jj + c * G, d = u * PIECE + 4 * h + k;
    float x = 0.f;
    if (r < b.rows && u < Geo::PIECES) {
      const int tok = b.token + (b.row0 + r) / b.nheads, head = b.head0 + (b.row0 + r) % b.nheads;
      x = Cvt<T>::to(load_global(static_cast<const T*>(p.query) + (int64_t)tok * p.q_stride_token +
                                 (int64_t)head * p.q_stride_head + d)) * q_scale;
    }
    sh.q[r][c][h][jj].v[k] = x;
  }
  publish_row_ranges<R>(p, b, sh.ri);  // + barrier: q visible
  float acc[R][CPL][PIECE];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int c = 0; c < CPL; ++c)
#pragma unroll
      for (int e = 0; e < PIECE; ++e) acc[r][c][e] = 0.f;
  OwnScores<NF> own;
  float m_own[NF], l_own[NF];
#pragma unroll
  for (int f = 0; f < NF; ++f) {
    const int idx = scatter_first<N, G>(j) + f, row = idx % R;
    own.pass[f] = idx / R;
    own.lo[f] = sh.ri.lo[row];
    own.hi[f] = sh.ri.hi[row];
    own.qpos[f] = sh.ri.qpos[row];
    own.slope[f] = sh.ri.slope[row];
    m_own[f] = -FLT_MAX;
    l_own[f] = 0.f;
  }
  if (p.kv_aligned16) fma_stream<C, HS, WAVE, R, true>(p, b, sh, own, m_own, l_own, acc);
  else fma_stream<C, HS, WAVE, R, false>(p, b, sh, own, m_own, l_own, acc);

  butterfly<WAVE, G / NP, false>(l_own);  // a row's sum over the passes and groups
  {  // the accumulators summed over the groups
    float flat[R * CPL * PIECE];
#pragma unroll
    for (int i = 0; i < R * CPL * PIECE; ++i) flat[i] = acc[i / (CPL * PIECE)][i / PIECE % CPL][i % PIECE];
    butterfly<WAVE, G, false>(flat);
#pragma unroll
    for (int i = 0; i < R * CPL * PIECE; ++i) acc[i / (CPL * PIECE)][i / PIECE % CPL][i % PIECE] = flat[i];
  }
  float mr[R], lr[R];
  {
    const WaveView<WAVE, float, NF> mv(m_own);
#pragma unroll
    for (int r = 0; r < R; ++r) mr[r] = mv.read(base + scatter_holder<N, G, NF>(r), r % NF);
  }
  {
    const WaveView<WAVE, float, NF> lv(l_own);
#pragma unroll
    for (int r = 0; r < R; ++r) lr[r] = lv.read(base + scatter_holder<N, G, NF>(r), r % NF);
  }
  if (lane == 0) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      sh.comb.m[warp][r] = mr[r];
      sh.comb.l[warp][r] = lr[r];
    }
  }
  __syncthreads();
  float fct[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    float M, L;
    fct[r] = combine_factor<R>(sh.comb, warp, r, M, L, row_sink(p, b, r)) * v_scale;
  }
  for (int w = 0; w < kNumWarps; ++w) {
    if (warp == w && grp == 0) {
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int c = 0; c < CPL; ++c) {
          const int u = j + c * G;
          if (u < Geo::PIECES) {
#pragma unroll
            for (int e = 0; e < PIECE; ++e) {
              const int d = u * PIECE + e;
              sh.o[r][d] = (w == 0 ? 0.f : sh.o[r][d]) + acc[r][c][e] * fct[r];
            }
          }
        }
    }
    __syncthreads();
  }
  write_rows<T, HS, NT, R>(p, b, sh.o, sh.comb);
}

// ============================================================================ MFMA engine
#if KVMULTI_HAS_MFMA || KVMULTI_HAS_WMMA
// Fragment geometry for 16-bit queries, wave64, 16 rows (the N dimension of S^T = K Q^T). C: the cache's
// element type -- the query's, or fp8 codes, widened to the query's type when the fragments are formed.
template <typename C, int HS>
struct MfmaGeom {
  static constexpr int EPC = 16 / (int)sizeof(C);   // cache elements per 16-byte chunk: 8 (16-bit), 16 (fp8)
  static constexpr int NCH = HS / EPC;              // 16-byte chunks per row
  static constexpr int QKC = (NCH + 3) / 4;         // K / Q chunks per lane: lane group g holds chunks 4u + g
  static constexpr int FPC = EPC / 4;               // QK fragments (4 head dims each) per chunk
  static constexpr int PVC = (HS / 8 + 15) / 16;    // V pieces (8 head dims) per lane and key: lane n, n + 16u
  // 16-key sub-tiles per iteration: each iteration issues 4 to 16 16-byte loads per lane (head 256: one
  // sub-tile, more would spill)
  static constexpr int NSUB = HS > 128 ? 1 : 2;
  static constexpr int KT = 16 * NSUB;
  // 16-byte V loads per lane and sub-tile: 16-bit caches load each lane's pieces of its 4 keys; fp8 caches
  // load the sub-tile's 16 rows (consecutive lanes: consecutive 16 bytes of consecutive rows) for LDS.
  static constexpr int VIN = is_fp8<C>() ? (16 * NCH + 63) / 64 : 4 * PVC;
};

template <int HS>
struct MfmaShared {
  union alignas(16) OutOrV {
    float o[16][HS];                 // after the loop: the block's combined output rows
    uint8_t v[kNumWarps][16][HS];    // fp8 caches, in the loop: each wave's V sub-tile (codes, [key][dim])
  } ov;                              // the same size: fp8 staging adds no LDS to the 16-bit engine's
  RowInfo<16> ri;
  Combine<16> comb;
};

// Head dim, within a lane's K / Q chunk, of element e (< 4) of QK fragment h. 16-bit chunks are used as
// loaded: 4h + e. An fp8 word (4 codes, dims 4h .. 4h+3) is widened as the pairs (codes 0, 2) and
// (codes 1, 3) -- (w << 8) and w masked to their odd bytes: two ops, no byte shuffles --, a permutation of
// the MFMA's K index that the Q fragments follow.
template <typename C>
__host__ __device__ constexpr int qk_dim(int h, int e) {
  return 4 * h + (is_fp8<C>() ? ((e & 1) << 1) | (e >> 1) : e);
}

// QK fragment h of a lane's K chunk: two words of a 16-bit chunk as loaded, or word h of an fp8 chunk
// (16 codes) widened in qk_dim's order.
template <typename T, typename C>
__device__ __forceinline__ Frag k_fragment(const Chunk16& c, int h) {
  if constexpr (is_fp8<C>()) {
    const uint32_t w = c.w[h];
    return Frag{{widen_pair_scaled<C, T>((w << 8) & 0xFF00FF00u), widen_pair_scaled<C, T>(w & 0xFF00FF00u)}};
  } else {
    return Frag{{c.w[2 * h], c.w[2 * h + 1]}};
  }
}

__device__ __forceinline__ uint32_t byte_of(const Chunk16& c, int e) { return (c.w[e >> 2] >> (8 * (e & 3))) & 0xffu; }

// B fragment of PV MFMA (u, c): V[keys 4g .. 4g+3][head dim c of piece u] from the lane's pieces vc[e][u]
// of keys 4g + e -- 8 values of T, or for fp8 8 codes (words 0, 1) gathered into pairs and widened.
template <typename T, typename C, int PVC>
__device__ __forceinline__ Frag v_fragment(const Chunk16 (&vc)[4][PVC], int u, int c) {
  if constexpr (is_fp8<C>()) {
    return Frag{{widen_pair_scaled<C, T>((byte_of(vc[0][u], c) << 8) | (byte_of(vc[1][u], c) << 24)),
                 widen_pair_scaled<C, T>((byte_of(vc[2][u], c) << 8) | (byte_of(vc[3][u], c) << 24))}};
  } else {
    return Frag{{pair_halves(vc[0][u].w[c >> 1], vc[1][u].w[c >> 1], c & 1),
                 pair_halves(vc[2][u].w[c >> 1], vc[3][u].w[c >> 1], c & 1)}};
  }
}

// Rows of the 16 keys [t, t + 16) of a sub-tile (t a multiple of 16): through the block-table window's
// shuffles (key_row; any block size) or, when WHOLE (block_size a multiple of 16, so the sub-tile lies in
// one block), from one wave-uniform block id read out of the window with wave_read_lane -- a scalar, no
// LDS traffic. Every lane must construct it; rows(j, valid) is key t + j's row (key_row's contract).
template <typename C, bool WHOLE>
struct SubTileRows {
  const PagedAttentionParams& p;
  const BlockTask& b;
  const C* cache;
  int bt_win, ws, t, blk, r0;
  float inv_bs;
  __device__ SubTileRows(const PagedAttentionParams& p_, const BlockTask& b_, const C* cache_, int bt_win_, int ws_,
                         float inv_bs_, int t_)
      : p(p_), b(b_), cache(cache_), bt_win(bt_win_), ws(ws_), t(t_), blk(0), r0(0), inv_bs(inv_bs_) {
    if constexpr (WHOLE) blk = wave_read_lane(bt_win, window_entry(p, ws, inv_bs, t, r0));
  }
  // WHOLE: the sub-tile's block id and first key's offset in it, as another SubTileRows found them
  __device__ SubTileRows(const PagedAttentionParams& p_, const BlockTask& b_, const C* cache_, int blk_, int r0_, int t_)
      : p(p_), b(b_), cache(cache_), bt_win(0), ws(0), t(t_), blk(blk_), r0(r0_), inv_bs(0.f) {}
  __device__ __forceinline__ const C* operator()(int j, bool& valid) const {
    if constexpr (WHOLE) return key_row_at(p, b, cache, blk, r0 + j, t + j, valid);
    else return key_row<64>(p, b, cache, bt_win, ws, inv_bs, t + j, valid);
  }
};

// Issues the V loads of the 16-key sub-tile whose rows `rows` gives (MfmaGeom::VIN per lane) and sets ok[e]:
// key 4g + e of the sub-tile has a valid block id. 16-bit caches: vin[e * PVC + u] = piece n + 16u of key
// 4g + e. fp8 caches (a piece would be an 8-byte load): vin[j] = chunk 64 j + lane of the sub-tile's 16 x NCH
// chunks, for v_subtile to stage in LDS.
template <typename C, int HS, bool ALIGNED, bool WHOLE>
__device__ __forceinline__ void load_v_subtile(const SubTileRows<C, WHOLE>& rows,
                                               Chunk16 (&vin)[MfmaGeom<C, HS>::VIN], bool (&ok)[4]) {
  using G = MfmaGeom<C, HS>;
  constexpr int WAVE = 64, NCH = G::NCH, PVC = G::PVC, EPC = G::EPC;
  const int lane = (int)threadIdx.x % WAVE, n = lane % 16, g = lane / 16;
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const C* row = rows(4 * g + e, ok[e]);
    if constexpr (!is_fp8<C>()) {
#pragma unroll
      for (int u = 0; u < PVC; ++u) {
        const int ch = n + 16 * u;
        // a padding piece (ch >= NCH: output dims past HS, never written) loads the row's last piece: no
        // divergent branch around the load
        vin[e * PVC + u] = load_chunk<C, ALIGNED>(row + HS + (ch < NCH ? ch : NCH - 1) * EPC);
      }
    }
  }
  if constexpr (is_fp8<C>()) {
#pragma unroll
    for (int j = 0; j < G::VIN; ++j) {
      const int c = 64 * j + lane;
      const int kk = (c < 16 * NCH ? c : 0) / NCH, ch = c % NCH;
      bool unused;
      const C* row = rows(kk, unused);
      vin[j] = load_chunk<C, ALIGNED>(row + HS + ch * EPC);  // c >= 16 NCH: a chunk of key 0, not staged
    }
  }
}

// The lane's V pieces of the sub-tile: vc[e][u] = head dims 8 (n + 16u) .. +7 of key 4g + e (16-bit
// caches: as loaded; fp8: the wave writes the sub-tile's rows to its LDS buffer vs ([16][HS] codes), then
// every lane reads its pieces back, 8 codes = words 0, 1 of vc[e][u]). Every lane must call it.
template <typename C, int HS>
__device__ __forceinline__ void v_subtile(const Chunk16 (&vin)[MfmaGeom<C, HS>::VIN], uint8_t* vs,
                                          Chunk16 (&vc)[4][MfmaGeom<C, HS>::PVC]) {
  using G = MfmaGeom<C, HS>;
  constexpr int PVC = G::PVC;
  const int lane = (int)threadIdx.x % 64, n = lane % 16, g = lane / 16;
  if constexpr (!is_fp8<C>()) {
#pragma unroll
    for (int e = 0; e < 4; ++e)
#pragma unroll
      for (int u = 0; u < PVC; ++u) vc[e][u] = vin[e * PVC + u];
  } else {
    struct alignas(8) Piece {
      uint32_t w[2];
    };
#pragma unroll
    for (int j = 0; j < G::VIN; ++j) {
      const int c = 64 * j + lane;
      if (c < 16 * G::NCH) *reinterpret_cast<Chunk16*>(vs + 16 * c) = vin[j];
    }
    wave_sync();
#pragma unroll
    for (int e = 0; e < 4; ++e)
#pragma unroll
      for (int u = 0; u < PVC; ++u) {
        const int piece = n + 16 * u;
        Piece codes = {{0u, 0u}};
        if (piece < HS / 8) codes = *reinterpret_cast<const Piece*>(vs + (4 * g + e) * HS + 8 * piece);
        vc[e][u] = Chunk16{{codes.w[0], codes.w[1], 0u, 0u}};
      }
    wave_sync();  // the next sub-tile rewrites this wave's buffer
  }
}

// One tile's registers between its loads and its MFMAs: K chunks, V loads, key validity per sub-tile.
template <typename C, int HS>
struct MfmaTile {
  using G = MfmaGeom<C, HS>;
  Chunk16 kc[G::NSUB][G::QKC], vin[G::NSUB][G::VIN];
  bool ok[G::NSUB][4];
  int blk[G::NSUB], r0[G::NSUB];  // per sub-tile: block id, offset of its first key (SubTileRows, WHOLE)
};

// Waits for the prologue's loads of a rotated loop (once per window): otherwise LLVM folds the two loads
// feeding each loop-carried register (prologue's, previous trip's) into one load at the loop head, which
// undoes the rotation.
template <typename C, int HS>
__device__ __forceinline__ void pin_tile(MfmaTile<C, HS>& x) {
#if KVM_AMDGPU_DEVICE
  using G = MfmaGeom<C, HS>;
#pragma unroll
  for (int sub = 0; sub < G::NSUB; ++sub) {
#pragma unroll
    for (int u = 0; u < G::QKC; ++u)
#pragma unroll
      for (int w = 0; w < 4; ++w) asm volatile("" : "+v"(x.kc[sub][u].w[w]));
#pragma unroll
    for (int j = 0; j < G::VIN; ++j)
#pragma unroll
      for (int w = 0; w < 4; ++w) asm volatile("" : "+v"(x.vin[sub][j].w[w]));
  }
#else
  (void)x;
#endif
}

// A scheduling fence on AMD GPUs: the machine scheduler moves no instruction across it (decode: the next
// tile's K loads stay ahead of the softmax; prefill: each sub-tile's LDS reads stay next to its MFMAs
// instead of all of a tile's being hoisted, fewer registers live); nothing elsewhere.
__device__ __forceinline__ void sched_fence() {
#if KVM_AMDGPU_DEVICE
  __builtin_amdgcn_sched_barrier(0);
#endif
}

// Issues the K loads (mfma_load_k) / the V loads and key validity (mfma_load_v) of the tile at key t0 into
// x (no wait: the registers fill while other work runs); mfma_load_v after mfma_load_k of the same tile.
template <typename C, int HS, bool ALIGNED, bool WHOLE>
__device__ __forceinline__ void mfma_load_k(const PagedAttentionParams& p, const BlockTask& b, const C* cache,
                                            int bt_win, int ws, float inv_bs, int t0, MfmaTile<C, HS>& x) {
  using G = MfmaGeom<C, HS>;
  const int lane = (int)threadIdx.x % 64, n = lane % 16, g = lane / 16;
#pragma unroll
  for (int sub = 0; sub < G::NSUB; ++sub) {
    const SubTileRows<C, WHOLE> rows(p, b, cache, bt_win, ws, inv_bs, t0 + 16 * sub);
    x.blk[sub] = rows.blk;
    x.r0[sub] = rows.r0;
    bool unused;
    const C* krow = rows(n, unused);
#pragma unroll
    for (int u = 0; u < G::QKC; ++u) {
      const int ch = 4 * u + g;
      // a padding chunk (ch >= NCH) meets zero Q dims: it loads the row's last chunk (finite, or the
      // row's score is non-finite anyway), no divergent branch around the load
      x.kc[sub][u] = load_chunk<C, ALIGNED>(krow + (ch < G::NCH ? ch : G::NCH - 1) * G::EPC);
    }
  }
}

template <typename C, int HS, bool ALIGNED, bool WHOLE>
__device__ __forceinline__ void mfma_load_v(const PagedAttentionParams& p, const BlockTask& b, const C* cache,
                                            int bt_win, int ws, float inv_bs, int t0, MfmaTile<C, HS>& x) {
#pragma unroll
  for (int sub = 0; sub < MfmaGeom<C, HS>::NSUB; ++sub) {
    // WHOLE: the block ids mfma_load_k found for the same tile (scalars, not looked up again)
    const SubTileRows<C, WHOLE> rows = WHOLE ? SubTileRows<C, WHOLE>(p, b, cache, x.blk[sub], x.r0[sub], t0 + 16 * sub)
                                             : SubTileRows<C, WHOLE>(p, b, cache, bt_win, ws, inv_bs, t0 + 16 * sub);
    load_v_subtile<C, HS, ALIGNED, WHOLE>(rows, x.vin[sub], x.ok[sub]);
  }
}

// Lane roles (lane = n + 16 * g, n < 16, g < 4) in the 16x16x16 layouts (A[i][k]: lane i + 16 (k/4),
// B[k][j]: lane j + 16 (k/4), D[i][j]: lane j + 16 (i/4), element = k%4 resp. i%4):
//   S^T = K Q^T (M = keys, N = rows, K = head dims): lane (n, g) holds K[key n] and Q[row n] dims
//     EPC (4u + g) + qk_dim(h, 0..3) for MFMA (u, h) -- chunk 4u + g of the row, 16 bytes = EPC / 4
//     MFMAs (16-bit: 8 dims, 2 MFMAs; fp8: 16 codes, 4 MFMAs, widened) -- and receives
//     S^T[keys 4g .. 4g+3][row n];
//   O += P V (M = rows, N = head dims, K = keys): lane (n, g) holds P[row n][keys 4g .. 4g+3] (exactly
//     what it received from S^T) and V[keys 4g .. 4g+3][dim 8 (n + 16u) + c] for MFMA (u, c) -- piece
//     n + 16u of four rows: for 16-bit caches a 16-byte load in which consecutive lanes read consecutive
//     16 bytes, for fp8 8 codes read back from LDS (v_subtile), widened by v_fragment --, and receives
//     O[rows 4g .. 4g+3][dim 8 (n + 16u) + c].
// fp8 caches: the fragments hold the codes' values; k_scale joins the score scale here and v_scale
// the output's normalisation (mfma_body): the KV head, hence both scales, is constant in a block.
// The MFMAs and the online softmax of the tile at key t0 whose loads x holds (lane roles above).
// after_qk() runs once the QK MFMAs have read x.kc and x.ok, after_pv() once the PV MFMAs have read x.vin
// (a rotated loop issues the next tile's loads there).
template <typename T, typename C, int HS, typename AfterQK, typename AfterPV>
__device__ __forceinline__ void mfma_tile(const PagedAttentionParams& p, const MfmaTile<C, HS>& x, int t0, int rlo,
                                          int rhi, float slope, int qpos, float score_scale, uint8_t* vs,
                                          float& m, float& l,
                                          mfma_f32x4 (&acc)[MfmaGeom<C, HS>::PVC][8],
                                          const Frag (&qf)[MfmaGeom<C, HS>::QKC][MfmaGeom<C, HS>::FPC],
                                          AfterQK&& after_qk, AfterPV&& after_pv) {
  using G = MfmaGeom<C, HS>;
  constexpr int WAVE = 64, NSUB = G::NSUB, QKC = G::QKC, FPC = G::FPC, PVC = G::PVC;
  const int lane = (int)threadIdx.x % WAVE, g = lane / 16;
  // 1. S^T = K Q^T per 16-key sub-tile, scores, masks, tile max per row.
  float s[NSUB][4];
  float tmax = -INFINITY;
#pragma unroll
  for (int sub = 0; sub < NSUB; ++sub) {
    mfma_f32x4 d = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int u = 0; u < QKC; ++u)
#pragma unroll
      for (int h = 0; h < FPC; ++h) d = mfma_16x16x16<T>(k_fragment<T, C>(x.kc[sub][u], h), qf[u][h], d);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int t = t0 + 16 * sub + 4 * g + e;
      s[sub][e] = finish_score(p, d[e], score_scale, slope * (float)(t - qpos), x.ok[sub][e] && t >= rlo && t < rhi);
      tmax = fmaxf(tmax, s[sub][e]);
    }
  }
  after_qk();
  // 2. Online softmax: row n's max over the 4 lanes g holding its keys.
  tmax = wave_max_from<WAVE, 16>(tmax);
  const float m_new = fmaxf(m, tmax);
  const float alpha = __expf(m - m_new);
  m = m_new;
  l *= alpha;
#pragma unroll
  for (int r = 0; r < 4; ++r) {  // acc rows 4g + r: that row's alpha lives in lane 4g + r
    const float a = __shfl(alpha, 4 * g + r, WAVE);
#pragma unroll
    for (int u = 0; u < PVC; ++u)
#pragma unroll
      for (int c = 0; c < 8; ++c) acc[u][c][r] *= a;
  }
  // 3. O += P V per 16-key sub-tile.
#pragma unroll
  for (int sub = 0; sub < NSUB; ++sub) {
    float pe[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      pe[e] = __expf(s[sub][e] - m);
      l += pe[e];
    }
    const Frag pa = {{(uint32_t)Bits16<T>::of(pe[0]) | ((uint32_t)Bits16<T>::of(pe[1]) << 16),
                      (uint32_t)Bits16<T>::of(pe[2]) | ((uint32_t)Bits16<T>::of(pe[3]) << 16)}};
    Chunk16 vc[4][PVC];
    v_subtile<C, HS>(x.vin[sub], vs, vc);
#pragma unroll
    for (int u = 0; u < PVC; ++u)
#pragma unroll
      for (int c = 0; c < 8; ++c) acc[u][c] = mfma_16x16x16<T>(pa, v_fragment<T, C>(vc, u, c), acc[u][c]);
  }
  after_pv();
}

// A wave's tiles, per block-table window. WHOLE (block_size a multiple of 16, SubTileRows: the block ids are
// wave-uniform scalars, no shuffles): a rotated loop over one register set -- a tile's QK MFMAs are followed
// by the next tile's K loads into the same registers, its PV MFMAs by the next tile's V loads, so at the
// loop head the next tile's loads are in flight (the window's last tile loads itself again). Otherwise each
// iteration issues every K and V load of a tile, then computes it.
template <typename T, typename C, int HS, bool ALIGNED, bool WHOLE>
__device__ __forceinline__ void mfma_stream(const PagedAttentionParams& p, const BlockTask& b, MfmaShared<HS>& sh,
                                            int rlo, int rhi, float slope, int qpos, float& m, float& l,
                                            mfma_f32x4 (&acc)[MfmaGeom<C, HS>::PVC][8],
                                            const Frag (&qf)[MfmaGeom<C, HS>::QKC][MfmaGeom<C, HS>::FPC]) {
  using G = MfmaGeom<C, HS>;
  constexpr int WAVE = 64, KT = G::KT;
  const int lane = (int)threadIdx.x % WAVE, warp = (int)threadIdx.x / WAVE;
  const C* cache = static_cast<const C*>(p.kv_cache) + (int64_t)b.kv_head * p.kv_stride_head;
  // scores: (q . k) * scale with k = float(code) * k_scale for fp8 caches, i.e. (q . fragment) * (scale *
  // k_scale * widen_pair_unit)
  const float score_scale = is_fp8<C>() ? p.scale * (p.k_scale[b.kv_head] * widen_pair_unit<C, T>()) : p.scale;
  uint8_t* vs = &sh.ov.v[warp][0][0];
  const TileRange<KT> tiles(b, warp);
  const int win_keys = WAVE * p.block_size;  // keys per block-table window (a multiple of KT)
  const float inv_bs = 1.f / (float)p.block_size;
  for (int tile = tiles.first; tile < tiles.last;) {  // windows (uniform per wave)
    const int win = (tiles.base + tile * KT) / win_keys;
    const int bt_win = load_bt_window<WAVE>(p, b, win, lane);
    const int ws = win * win_keys, win_end = ws + win_keys;
    if constexpr (WHOLE) {
      const int end = min(tiles.last, (win_end - tiles.base) / KT);  // the window's tiles: [tile, end)
      MfmaTile<C, HS> x;
      const int tf = tiles.base + tile * KT;
      mfma_load_k<C, HS, ALIGNED, WHOLE>(p, b, cache, bt_win, ws, inv_bs, tf, x);
      mfma_load_v<C, HS, ALIGNED, WHOLE>(p, b, cache, bt_win, ws, inv_bs, tf, x);
      pin_tile(x);
      for (; tile < end; ++tile) {  // the hot loop
#if KVM_AMDGPU_DEVICE
        if constexpr (ALIGNED) asm volatile("; kvmulti-hot-loop");  // compile_check's marker
#endif
        const int t0 = tiles.base + tile * KT;
        const int tn = tile + 1 < end ? t0 + KT : t0;  // the last tile loads itself again (cache hits)
        mfma_tile<T, C, HS>(
            p, x, t0, rlo, rhi, slope, qpos, score_scale, vs, m, l, acc, qf,
            [&] {
              mfma_load_k<C, HS, ALIGNED, WHOLE>(p, b, cache, bt_win, ws, inv_bs, tn, x);
              sched_fence();  // issue them before the softmax and the PV fragments wait for V
            },
            [&] { mfma_load_v<C, HS, ALIGNED, WHOLE>(p, b, cache, bt_win, ws, inv_bs, tn, x); });
      }
    } else {
      for (; tile < tiles.last && tiles.base + tile * KT < win_end; ++tile) {
        const int t0 = tiles.base + tile * KT;
        MfmaTile<C, HS> x;
        mfma_load_k<C, HS, ALIGNED, WHOLE>(p, b, cache, bt_win, ws, inv_bs, t0, x);
        mfma_load_v<C, HS, ALIGNED, WHOLE>(p, b, cache, bt_win, ws, inv_bs, t0, x);
        mfma_tile<T, C, HS>(p, x, t0, rlo, rhi, slope, qpos, score_scale, vs, m, l, acc, qf, [] {}, [] {});
      }
    }
  }
}

// T: the query's and output's type (fp16 / bf16); C: the cache's (T, or an fp8 type).
template <typename T, typename C, int HS>
__device__ void mfma_body(const PagedAttentionParams& p, const BlockTask& b) {
  using G = MfmaGeom<C, HS>;
  constexpr int WAVE = 64, NT = kNumWarps * WAVE, QKC = G::QKC, FPC = G::FPC, PVC = G::PVC, EPC = G::EPC;
  __shared__ MfmaShared<HS> sh;
  const int tid = (int)threadIdx.x, lane = tid % WAVE, warp = tid / WAVE;
  const int n = lane % 16, g = lane / 16;
  publish_row_ranges<16>(p, b, sh.ri);
  const int rlo = sh.ri.lo[n], rhi = sh.ri.hi[n], qpos = sh.ri.qpos[n];
  const float slope = sh.ri.slope[n];
  // Q fragments (B operand of S^T = K Q^T) of row n, unscaled; rows past b.rows are zero.
  Frag qf[QKC][FPC];
  const T* q = nullptr;
  if (n < b.rows)
    q = static_cast<const T*>(p.query) + (int64_t)(b.token + n / b.nheads) * p.q_stride_token +
        (int64_t)(b.head0 + n % b.nheads) * p.q_stride_head;
#pragma unroll
  for (int u = 0; u < QKC; ++u)
#pragma unroll
    for (int h = 0; h < FPC; ++h)
#pragma unroll
      for (int w = 0; w < 2; ++w) {
        const int d0 = EPC * (4 * u + g) + qk_dim<C>(h, 2 * w), d1 = EPC * (4 * u + g) + qk_dim<C>(h, 2 * w + 1);
        uint32_t bits = 0u;
        if (q && d0 < HS) {  // d0, d1 < HS together: chunks are whole
          const unsigned short* qh = reinterpret_cast<const unsigned short*>(q);
          bits = (uint32_t)qh[d0] | ((uint32_t)qh[d1] << 16);
        }
        qf[u][h].w[w] = bits;
      }
  float m = -FLT_MAX, l = 0.f;
  mfma_f32x4 acc[PVC][8];
#pragma unroll
  for (int u = 0; u < PVC; ++u)
#pragma unroll
    for (int c = 0; c < 8; ++c) acc[u][c] = mfma_f32x4{0.f, 0.f, 0.f, 0.f};
  // Block size a multiple of 16 and an aligned cache (the serving case): a 16-key sub-tile lies in one block,
  // its block id a wave-uniform scalar. Anything else takes the shuffles and the unaligned loads: a third
  // instantiation (aligned, shuffled) spilled 2 - 6 SGPRs of the kernel on gfx90a.
  if (p.kv_aligned16 && p.block_size % 16 == 0)
    mfma_stream<T, C, HS, true, true>(p, b, sh, rlo, rhi, slope, qpos, m, l, acc, qf);
  else
    mfma_stream<T, C, HS, false, false>(p, b, sh, rlo, rhi, slope, qpos, m, l, acc, qf);

  l = wave_sum_from<WAVE, 16>(l);
  if (g == 0) {
    sh.comb.m[warp][n] = m;
    sh.comb.l[warp][n] = l;
  }
  __syncthreads();  // also: every wave is done with its V buffer, which sh.ov.o overlays
  // fp8 caches: values read as float(code) * v_scale, so the accumulated P V (of fragments: values divided
  // by widen_pair_unit) gets v_scale * widen_pair_unit once
  const float v_scale = is_fp8<C>() ? p.v_scale[b.kv_head] * widen_pair_unit<C, T>() : 1.f;
  float f[4];
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    float M, L;
    f[r] = combine_factor<16>(sh.comb, warp, 4 * g + r, M, L, row_sink(p, b, 4 * g + r)) * v_scale;
  }
  for (int w = 0; w < kNumWarps; ++w) {
    if (warp == w) {
#pragma unroll
      for (int u = 0; u < PVC; ++u)
#pragma unroll
        for (int c = 0; c < 8; ++c) {
          const int d = 8 * (n + 16 * u) + c;
          if (d < HS) {
#pragma unroll
            for (int r = 0; r < 4; ++r)
              sh.ov.o[4 * g + r][d] = (w == 0 ? 0.f : sh.ov.o[4 * g + r][d]) + acc[u][c][r] * f[r];
          }
        }
    }
    __syncthreads();
  }
  write_rows<T, HS, NT, 16>(p, b, sh.ov.o, sh.comb);
}
#endif  // KVMULTI_HAS_MFMA || KVMULTI_HAS_WMMA

// grid (num_tokens, num_kv_heads * RowMap::chunks, num_partitions), block kNumWarps * WAVE threads, no
// dynamic shared memory. T: query and output type; C: cache element type (T, or an fp8 type).
template <typename T, typename C, int HS, int WAVE>
__global__ void __launch_bounds__(kNumWarps * WAVE, 2) paged_attention_kernel(const PagedAttentionParams p) {
  if (!wave_matches_target<WAVE>()) return;
  constexpr int R = rows_per_block<T, WAVE, C>();
  constexpr int NT = kNumWarps * WAVE;
  static_assert(2 * HS * sizeof(C) <= sizeof(kZeroRow), "kZeroRow must cover a K + V row");
  BlockTask b;
  const TaskKind kind = block_task<R>(p, b);
  if (kind == TaskKind::kCovered) return;
  if (kind == TaskKind::kInvalid || b.kv_lo >= b.kv_hi) {  // no row sees a key in this partition
    write_empty_rows<T, HS, NT>(p, b);
    return;
  }
#if KVMULTI_HAS_MFMA
  if constexpr (R == 16) {
    if (mfma_enabled()) {
      mfma_body<T, C, HS>(p, b);
      return;
    }
  }
#endif
  // wave64 over fp8 codes (fp32 queries) the engine is short of SGPRs under clang-19: the parameters are read
  // where used (with hipcc's clang 15, which keeps them in SGPRs, gfx90a spilled VGPRs at head 64 then)
#if defined(__clang_major__) && __clang_major__ >= 16
  constexpr bool kReread = WAVE == 64 && is_fp8<C>();
#else
  constexpr bool kReread = false;
#endif
  fma_body<T, C, HS, WAVE, R>(kReread ? kernel_params(p) : p, b);
}

// Dynamic shared memory of paged_attention_reduce_kernel: num_partitions floats rounded up to whole
// 16-byte words, because the compiler may read a loop's tail over w_s as one 16-byte load (nvcc for
// sm_90 does: compute-sanitizer flags the bytes past an unrounded allocation).
inline size_t reduce_shared_bytes(int num_partitions) {
  return (size_t)((num_partitions + 3) / 4) * 4 * sizeof(float);
}

// Combines the partitions of the split-KV path. grid (num_tokens, num_q_heads), any block size,
// dynamic shared memory: reduce_shared_bytes(num_partitions).
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
  if (p.sinks) total += __expf(p.sinks[head] - gmax);  // the sink joins the merged denominator once
  const float inv = total > 0.f ? 1.f / total : 0.f;
  T* op = static_cast<T*>(p.out) + (int64_t)token * p.o_stride_token + (int64_t)head * p.o_stride_head;
  for (int d = tid; d < head_size; d += nt) {
    float o = 0.f;
    for (int i = 0; i < P; ++i) o += w_s[i] * p.part_out[(base + i) * head_size + d];
    op[d] = Cvt<T>::from(o * inv);
  }
}

// Writes the new tokens' K and V into their slots. grid (num_tokens), any block size; slot -1 (and any
// slot outside [0, num_blocks * block_size)) skipped. T: key/value type; C: cache element type (T, or
// an fp8 type: stores fp8(x / scale[head]) by kvmulti/fp8.py's rule, an IEEE fp32 division).
template <typename C, typename T>
__device__ __forceinline__ C cache_element(T x, const float* scale, int head) {
  if constexpr (is_fp8<C>()) return Cvt<C>::from(Cvt<T>::to(x) / scale[head]);
  else return x;
}

template <typename T, typename C>
__global__ void __launch_bounds__(256) write_kv_kernel(const WriteKVParams p) {
  const int tok = (int)blockIdx.x;
  const int64_t slot = p.slot_mapping[tok];
  // padding token (-1) or a slot outside the cache: skipped (uniform: no barriers in this kernel)
  if (slot < 0 || slot / p.block_size >= p.num_blocks) return;
  const int64_t blk = slot / p.block_size, off = slot % p.block_size;
  C* dst = static_cast<C*>(p.kv_cache) + blk * p.kv_stride_block + off * p.kv_stride_token;
  const T* key = static_cast<const T*>(p.key) + (int64_t)tok * p.k_stride_token;
  const T* value = static_cast<const T*>(p.value) + (int64_t)tok * p.v_stride_token;
  const int nk = p.num_kv_heads * p.head_size;
  for (int i = (int)threadIdx.x; i < nk; i += (int)blockDim.x) {
    const int h = i / p.head_size, d = i % p.head_size;
    dst[h * p.kv_stride_head + d] = cache_element<C>(key[h * p.k_stride_head + d * p.k_stride_dim], p.k_scale, h);
  }
  const int nv = p.num_kv_heads * p.head_size_v;
  for (int i = (int)threadIdx.x; i < nv; i += (int)blockDim.x) {
    const int h = i / p.head_size_v, d = i % p.head_size_v;
    dst[h * p.kv_stride_head + p.head_size + d] =
        cache_element<C>(value[h * p.v_stride_head + d * p.v_stride_dim], p.v_scale, h);
  }
}

}  // namespace kvmulti
