// kvmulti native CPU paged attention: torch binding, work planning, OpenMP scheduling, the
// log-sum-exp merge of context partitions, write_kv, and run-time ISA dispatch.
//
// The cache is the canonical kvmulti layout, read in place through the NAMED strides passed from
// Python (block, token, head; content contiguous, K then V) -- never repacked or copied.
// Work: for each request, its query tokens are cut into tiles (decode: one token; verification /
// prefill: up to ~64 rows = tokens x query heads per KV head), each tile x KV head is a work item
// over the key positions it can see; a long key range is split into partitions that run as
// separate items (so few long decodes still use every thread) and are merged with a log-sum-exp
// reduction. Items run largest first under dynamic OpenMP scheduling.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "kvmulti_cpu.h"
#include "torch_ops.h"

namespace {
// The kernels use as many threads as torch's intra-op pool (torch.set_num_threads), not their own
// OpenMP runtime's default: an engine that pins torch to N threads gets N here too.
int torch_threads() { return std::max(1, at::get_num_threads()); }
}  // namespace

namespace kvmulti_cpu {
namespace {

enum Isa : int { kGeneric = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3 };

bool cpu_has(Isa isa) {
#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
  __builtin_cpu_init();
  if (isa == kAvx512Bf16 && !(__builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512vbmi")))
    return false;
  if (isa == kAvx512 || isa == kAvx512Bf16)
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  if (isa == kAvx2)
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#endif
  return isa == kGeneric;
}

RunItemFn kernel_of(Isa isa) {
  switch (isa) {
    case kAvx512Bf16: return run_item_avx512bf16();
    case kAvx512: return run_item_avx512();
    case kAvx2: return run_item_avx2();
    default: return run_item_generic();
  }
}
int lanes_of(Isa isa) {
  switch (isa) {
    case kAvx512Bf16: return lanes_avx512bf16();
    case kAvx512: return lanes_avx512();
    case kAvx2: return lanes_avx2();
    default: return lanes_generic();
  }
}
const char* isa_name(int isa) {
  return isa == kAvx512Bf16 ? "avx512bf16" : isa == kAvx512 ? "avx512" : isa == kAvx2 ? "avx2" : "generic";
}

WidenFp8Fn widen_fp8_of(Isa isa) {
  switch (isa) {
    case kAvx512Bf16: return widen_fp8_avx512bf16();
    case kAvx512: return widen_fp8_avx512();
    case kAvx2: return widen_fp8_avx2();
    default: return widen_fp8_generic();
  }
}

bool usable(Isa isa) { return kernel_of(isa) != nullptr && cpu_has(isa); }

constexpr Isa kIsasBestFirst[] = {kAvx512Bf16, kAvx512, kAvx2, kGeneric};

Isa best_isa() {
  for (Isa isa : kIsasBestFirst)
    if (usable(isa)) return isa;
  return kGeneric;
}

int dtype_code(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return kF32;
    case at::kHalf: return kF16;
    case at::kBFloat16: return kBF16;
    default: TORCH_CHECK(false, "kvmulti native CPU attention: unsupported dtype ", t.scalar_type());
  }
  return kF32;
}

// The cache's DType: the activation dtypes, or the fp8 formats.
int cache_dtype_code(const at::Tensor& t) {
  if (t.scalar_type() == at::kFloat8_e4m3fn) return kE4M3;
  if (t.scalar_type() == at::kFloat8_e5m2) return kE5M2;
  return dtype_code(t);
}

// A contiguous fp32 CPU tensor of at least `count` values (one per head), or nullptr when absent.
const float* per_head_floats(const c10::optional<at::Tensor>& values, int64_t count, const char* name,
                             const char* heads) {
  if (!values.has_value()) return nullptr;
  const at::Tensor& t = *values;
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == 1 && t.is_contiguous() &&
                  t.size(0) >= count,
              name, " must be a contiguous fp32 CPU tensor of ", heads, " values");
  return t.data_ptr<float>();
}

// An fp8 cache's per-head scale: required, at least num_kv_heads values; its data pointer.
const float* fp8_scale(const c10::optional<at::Tensor>& scale, int64_t num_kv_heads, const char* name) {
  TORCH_CHECK(scale.has_value(), name, " is required for an fp8 cache");
  return per_head_floats(scale, num_kv_heads, name, "num_kv_heads");
}

}  // namespace

namespace {

// This thread's kernel scratch of at least `floats` floats, kept between calls (no allocation or
// clearing per call): run_item initialises every part of it it reads. KV_WS_POISON fills it with
// NaN before each call instead, for tests that prove that.
float* thread_workspace(int64_t floats) {
  thread_local std::vector<float> ws;
  if (int64_t(ws.size()) < floats) ws.resize(static_cast<size_t>(floats));
#ifdef KV_WS_POISON
  std::fill(ws.begin(), ws.end(), std::numeric_limits<float>::quiet_NaN());
#endif
  return ws.data();
}

// The largest element offset (+1) the kernel may touch in a cache of these strides, or -1 on overflow.
int64_t cache_extent(int64_t num_blocks, int64_t block_size, int64_t num_kv_heads, int64_t s_block, int64_t s_token,
                     int64_t s_head, int64_t row) {
  if (num_blocks <= 0) return 0;
  return (num_blocks - 1) * s_block + (block_size - 1) * s_token + (num_kv_heads - 1) * s_head + row;
}

// Elements from data_ptr() to the last element of t, +1 (t's strides must be non-negative).
int64_t tensor_span(const at::Tensor& t) {
  if (t.numel() == 0) return 0;
  int64_t span = 1;
  for (int64_t d = 0; d < t.dim(); ++d) {
    TORCH_CHECK(t.stride(d) >= 0, "negative strides are not supported");
    span += (t.size(d) - 1) * t.stride(d);
  }
  return span;
}

// The query tiles of one request, each with the key range its rows can see. Metadata is not trusted:
// a request whose query rows leave [0, num_query_rows) or are not ordered is skipped, the key range is
// clipped to [0, table_cols x block_size), and positions are computed in 64 bits.
struct Tile { int req, q_row0, ntok, pos0, lo, hi; };
std::vector<Tile> plan_tiles(const int32_t* qsl, const int32_t* seq, int num_reqs, int64_t num_query_rows,
                             int64_t table_rows, int64_t table_cols, int block_size, int window, bool causal,
                             int tile_tokens) {
  std::vector<Tile> tiles;
  const int64_t max_keys = table_cols * block_size;
  for (int r = 0; r < num_reqs && r < table_rows; ++r) {
    const int64_t q0 = qsl[r], q1 = qsl[r + 1];
    if (q0 < 0 || q1 <= q0 || q1 > num_query_rows) continue;
    const int64_t qlen = q1 - q0, first = int64_t(seq[r]) - qlen;
    for (int64_t t0 = 0; t0 < qlen; t0 += tile_tokens) {
      const int64_t nt = std::min<int64_t>(tile_tokens, qlen - t0);
      const int64_t p0 = first + t0, p1 = p0 + nt - 1;
      const int64_t lo = std::max<int64_t>(0, window > 0 ? p0 - window + 1 : 0);
      // A negative seq_len (corrupt metadata) gives no keys: [0, 0), never a negative table column.
      // Non-causal rows see the window on both sides, so a windowed tile ends window - 1 keys after p1.
      const int64_t right = causal ? p1 + 1 : window > 0 ? std::min<int64_t>(seq[r], p1 + window) : seq[r];
      const int64_t hi = std::max<int64_t>(0, std::min<int64_t>(max_keys, right));
      if (p0 < INT32_MIN / 2 || p1 > INT32_MAX / 2) continue;   // positions the kernel's int math cannot hold
      tiles.push_back({r, int(q0 + t0), int(nt), int(p0), int(std::min(lo, hi)), int(hi)});
    }
  }
  return tiles;
}

}  // namespace

// isa: -1 = best available, else 0 generic / 1 avx2 / 2 avx512 / 3 avx512bf16 (must be usable).
// partition_len: 0 = automatic, else keys per context partition.
// The bounds of every tensor come from the tensors themselves (query / out rows, block-table rows and
// columns, cache blocks); metadata values never index outside them (see plan_tiles, rows_of).
void paged_attention(const at::Tensor& query, const at::Tensor& kv_cache, at::Tensor& out,
                     const at::Tensor& block_table, const at::Tensor& query_start_loc_cpu,
                     const at::Tensor& seq_lens_cpu, int64_t s_block, int64_t s_token, int64_t s_head,
                     int64_t head_size, int64_t head_size_v, int64_t num_kv_heads, int64_t block_size,
                     double scale, int64_t window, double softcap, bool causal, int64_t partition_len,
                     int64_t isa_req, const c10::optional<at::Tensor>& k_scale,
                     const c10::optional<at::Tensor>& v_scale,
                     const c10::optional<at::Tensor>& sinks,
                     const c10::optional<at::Tensor>& alibi_slopes) {
  TORCH_CHECK(query.device().is_cpu() && kv_cache.device().is_cpu() && out.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(query.dim() == 3 && out.dim() == 3 && block_table.dim() == 2 && kv_cache.dim() >= 1,
              "query/out [T, H, D], block_table [R, W]");
  TORCH_CHECK((query.size(2) <= 1 || query.stride(2) == 1) && (out.size(2) <= 1 || out.stride(2) == 1),
              "query/out need a contiguous last dimension");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && (block_table.size(1) <= 1 || block_table.stride(1) == 1),
              "block_table must be int32 with contiguous rows");
  TORCH_CHECK(query_start_loc_cpu.scalar_type() == at::kInt && seq_lens_cpu.scalar_type() == at::kInt, "int32 lens");
  TORCH_CHECK(query_start_loc_cpu.is_contiguous() && seq_lens_cpu.is_contiguous(), "contiguous lens");
  const int cache_dtype = cache_dtype_code(kv_cache);
  TORCH_CHECK((is_fp8(cache_dtype) || query.scalar_type() == kv_cache.scalar_type()) &&
                  out.scalar_type() == query.scalar_type(), "dtype mismatch");
  TORCH_CHECK(num_kv_heads > 0 && block_size > 0 && head_size > 0 && head_size_v > 0 &&
              query.size(1) % num_kv_heads == 0, "bad head counts or sizes");
  TORCH_CHECK(query.size(2) >= head_size && out.size(2) >= head_size_v && out.size(1) >= query.size(1) &&
              out.size(0) >= query.size(0), "query/out smaller than the head sizes / rows");
  TORCH_CHECK(s_block >= 0 && s_token >= 0 && s_head >= 0, "negative strides");
  const int64_t num_blocks = kv_cache.size(0);
  TORCH_CHECK(cache_extent(num_blocks, block_size, num_kv_heads, s_block, s_token, s_head, head_size + head_size_v) <=
                  tensor_span(kv_cache),
              "the cache strides reach outside kv_cache");
  const Isa isa = isa_req < 0 ? best_isa() : Isa(isa_req);
  TORCH_CHECK(usable(isa), "ISA ", isa_name(isa), " is not available here");
  const RunItemFn run = kernel_of(isa);
  const int lanes = lanes_of(isa);

  AttnParams P;
  P.query = query.data_ptr();
  P.q_stride_token = query.stride(0);
  P.q_stride_head = query.stride(1);
  P.cache = kv_cache.data_ptr();
  P.s_block = s_block;
  P.s_token = s_token;
  P.s_head = s_head;
  P.out = out.data_ptr();
  P.o_stride_token = out.stride(0);
  P.o_stride_head = out.stride(1);
  P.block_table = block_table.data_ptr<int32_t>();
  P.bt_stride = block_table.stride(0);
  P.num_blocks = int(std::min<int64_t>(num_blocks, INT32_MAX));
  P.head_size = int(head_size);
  P.head_size_v = int(head_size_v);
  P.num_q_heads = int(query.size(1));
  P.num_kv_heads = int(num_kv_heads);
  P.block_size = int(block_size);
  P.dtype = dtype_code(query);
  P.cache_dtype = cache_dtype;
  P.k_scale = is_fp8(cache_dtype) ? fp8_scale(k_scale, num_kv_heads, "k_scale") : nullptr;
  P.v_scale = is_fp8(cache_dtype) ? fp8_scale(v_scale, num_kv_heads, "v_scale") : nullptr;
  P.scale = float(scale);
  P.window = window > 0 ? int(std::min<int64_t>(window, INT32_MAX / 4)) : 0;
  P.softcap = softcap > 0 ? float(softcap) : 0.0f;
  P.causal = causal;
  P.sinks = per_head_floats(sinks, query.size(1), "sinks", "num_q_heads");
  P.alibi = per_head_floats(alibi_slopes, query.size(1), "alibi_slopes", "num_q_heads");

  const int G = P.num_q_heads / P.num_kv_heads;
  // Query tokens per item: KV_ITEM_ROWS rows (tokens x G) per KV head. A prefill item's per-row set-up
  // (query in, output out) and per-key-tile work (block-table lookups, bf16 V pairs) are shared by
  // its rows; more rows also mean wider causal diagonals and fewer items to balance (measurements:
  // CHANGELOG.md).
#ifndef KV_ITEM_ROWS
#define KV_ITEM_ROWS 128
#endif
  const int tile_tokens = std::max(1, KV_ITEM_ROWS / G);
  const int num_reqs = int(std::min<int64_t>(seq_lens_cpu.size(0), query_start_loc_cpu.size(0) - 1));
  const int32_t* qsl = query_start_loc_cpu.data_ptr<int32_t>();
  const int32_t* seq = seq_lens_cpu.data_ptr<int32_t>();
  const int nthreads = torch_threads();

  const std::vector<Tile> tiles = plan_tiles(qsl, seq, num_reqs, query.size(0), block_table.size(0),
                                             block_table.size(1), P.block_size, P.window, causal, tile_tokens);
  if (tiles.empty()) return;
  // KV heads per item. NHD: one (items over all KV heads, each token row read once, were slower).
  // HND: a block holds each head's rows as one run of
  // block_size x (D + Dv) elements, heads one after another; items take as many heads (a divisor of
  // num_kv_heads) as make those runs at least KV_ITEM_HEAD_RUN bytes together, so small blocks are read
  // in longer sequential runs.
#ifndef KV_ITEM_HEAD_RUN
#define KV_ITEM_HEAD_RUN 8192
#endif
  int heads_per_item = 1;
  if (s_head > s_token) {
    const int64_t run = block_size * (head_size + head_size_v) * kv_cache.element_size();
    while (heads_per_item < P.num_kv_heads && heads_per_item * run < KV_ITEM_HEAD_RUN) {
      ++heads_per_item;
      while (P.num_kv_heads % heads_per_item != 0) ++heads_per_item;
    }
  }
  int64_t total_keys = 0, work = 0;  // work: (query row, key) pairs over all KV heads
  for (const Tile& t : tiles) {
    total_keys += int64_t(t.hi - t.lo) * P.num_kv_heads;
    work += int64_t(t.hi - t.lo) * P.num_kv_heads * t.ntok * G;
  }

  // Software prefetch only when the call reads more than KV_PREFETCH_MIN_BYTES of K/V: below that it
  // gained nothing cold and cost its instructions hot (measurements: CHANGELOG.md).
#ifndef KV_PREFETCH_MIN_BYTES
#define KV_PREFETCH_MIN_BYTES (512 << 10)
#endif
  P.prefetch = total_keys * (head_size + head_size_v) * int64_t(kv_cache.element_size()) > KV_PREFETCH_MIN_BYTES;

  int64_t part = partition_len;
  if (part <= 0) {  // aim for >= 8 items per thread, partitions of at least 512 keys x heads
    part = std::max<int64_t>(512, (total_keys + 8 * nthreads - 1) / (8 * nthreads)) / heads_per_item;
  }
  part = round_up(std::max<int64_t>(part, 1), kChunk);

  const int dvp = int(round_up(P.head_size_v, lanes));
  std::vector<WorkItem> items;
  struct Merge { int tile, kv_head, num_heads, first_item, nparts; };
  std::vector<Merge> merges;
  std::vector<int64_t> part_offsets;  // per item: offset into partial buffer or -1
  int64_t partial_floats = 0;
  int max_rows = 0;
  for (int ti = 0; ti < int(tiles.size()); ++ti) {
    const Tile& t = tiles[ti];
    const int rows = t.ntok * G;
    max_rows = std::max(max_rows, rows);
    const int span = t.hi - t.lo;
    const int nparts = span > 0 ? int((span + part - 1) / part) : 1;   // an empty range still writes its rows
    for (int h = 0; h < P.num_kv_heads; h += heads_per_item) {
      if (nparts > 1) merges.push_back({ti, h, heads_per_item, int(items.size()), nparts});
      for (int p = 0; p < nparts; ++p) {
        const int lo = int(std::min<int64_t>(t.hi, t.lo + p * part)), hi = int(std::min<int64_t>(t.hi, t.lo + (p + 1) * part));
        WorkItem it{t.req, h, heads_per_item, t.q_row0, t.ntok, t.pos0, lo, std::max(lo, hi), nullptr};
        items.push_back(it);
        if (nparts > 1) {
          part_offsets.push_back(partial_floats);
          partial_floats += int64_t(rows) * heads_per_item * (dvp + 2);
        } else {
          part_offsets.push_back(-1);
        }
      }
    }
  }
  std::vector<float> partial(static_cast<size_t>(std::max<int64_t>(partial_floats, 1)));
  for (size_t i = 0; i < items.size(); ++i)
    if (part_offsets[i] >= 0) items[i].partial = partial.data() + part_offsets[i];

  // Largest first, so dynamic scheduling balances; an item's size is its visible (token, key) pairs
  // (a causal prefill tile's tokens see different numbers of keys).
  std::vector<int64_t> size(items.size());
  for (size_t i = 0; i < items.size(); ++i) {
    const WorkItem& w = items[i];
    int64_t pairs = 0;
    for (int t = 0; t < w.num_tokens; ++t) {
      const int64_t p = int64_t(w.pos0) + t;
      const int64_t lo = P.window > 0 ? std::max<int64_t>(w.k_lo, p - P.window + 1) : w.k_lo;
      const int64_t hi = causal ? std::min<int64_t>(w.k_hi, p + 1)
                         : P.window > 0 ? std::min<int64_t>(w.k_hi, p + P.window) : w.k_hi;
      pairs += std::max<int64_t>(0, hi - lo);
    }
    size[i] = pairs;
  }
  std::vector<int> order(items.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = int(i);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return size[a] > size[b]; });

  const int64_t ws_floats = workspace_floats(max_rows, heads_per_item, P.head_size, P.head_size_v, lanes);
  const int n_items = int(items.size());
  // A thread per KV_MIN_THREAD_WORK (query row, key) pairs at most: waking a sleeping OpenMP team
  // costs more than a small call's arithmetic. In vLLM's engine on the tiny target (fp32, 2 threads,
  // layers apart by the model's other work), batch 1 (~230 pairs) took 18-20 us on 2 threads and
  // 11 us on 1; batch 8 (~1800 pairs) 43-46 us on 2 and 54-55 us on 1.
#ifndef KV_MIN_THREAD_WORK
#define KV_MIN_THREAD_WORK 512
#endif
  const int team = int(std::min<int64_t>({nthreads, n_items, std::max<int64_t>(1, work / KV_MIN_THREAD_WORK)}));
  // Dynamic scheduling, each thread claiming its next item one ahead, so that the item it runs knows
  // its successor and prefetches that one's first chunks (WorkItem::next).
  std::atomic<int> claimed{0};
  auto run_claimed = [&](float* ws) {
    int cur = claimed.fetch_add(1, std::memory_order_relaxed);
    for (bool first = true; cur < n_items; first = false) {
      const int nxt = claimed.fetch_add(1, std::memory_order_relaxed);
      WorkItem item = items[order[cur]];
      item.next = nxt < n_items ? &items[order[nxt]] : nullptr;
      item.prefetched = !first;
      run(P, item, ws);
      cur = nxt;
    }
  };
  if (team <= 1) {
    run_claimed(thread_workspace(ws_floats + 16));
  } else {
#pragma omp parallel num_threads(team)
    run_claimed(thread_workspace(ws_floats + 16));
  }

  if (merges.empty()) return;
  // Log-sum-exp merge of the partitions of each (tile, KV heads); partial rows are head-major.
  const int Dv = P.head_size_v;
  auto merge_one = [&](const Merge& mg) {
    const Tile& t = tiles[mg.tile];
    const int rows_h = t.ntok * G, rows = rows_h * mg.num_heads;
    std::vector<float> acc(static_cast<size_t>(Dv));
    for (int r = 0; r < rows; ++r) {
      float mx = -std::numeric_limits<float>::infinity();
      for (int p = 0; p < mg.nparts; ++p) {
        const float* base = items[mg.first_item + p].partial;
        mx = std::max(mx, base[int64_t(rows) * dvp + r]);
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      float lsum = 0.0f;
      bool nan_row = false;   // a partition's running sum is NaN for a NaN query row: all-NaN output
      for (int p = 0; p < mg.nparts; ++p) {
        const float l = items[mg.first_item + p].partial[int64_t(rows) * dvp + rows + r];
        nan_row |= l != l;
      }
      if (nan_row) lsum = std::numeric_limits<float>::quiet_NaN();
      else if (mx != -std::numeric_limits<float>::infinity()) {
        for (int p = 0; p < mg.nparts; ++p) {
          const float* base = items[mg.first_item + p].partial;
          const float m = base[int64_t(rows) * dvp + r], l = base[int64_t(rows) * dvp + rows + r];
          if (m == -std::numeric_limits<float>::infinity()) continue;
          const float w = std::exp(m - mx);
          lsum += l * w;
          const float* o = base + int64_t(r) * dvp;
          for (int d = 0; d < Dv; ++d) acc[d] += o[d] * w;
        }
      }
      const int hh = r / rows_h, rr = r % rows_h;
      const int tok = rr / G, h = (mg.kv_head + hh) * G + rr % G;
      const float inv = row_inverse(P, h, mx, lsum);   // the sink joins once, after the merge
      const int64_t off = int64_t(t.q_row0 + tok) * P.o_stride_token + int64_t(h) * P.o_stride_head;
      if (P.dtype == kF32) {
        float* dst = static_cast<float*>(P.out) + off;
        for (int d = 0; d < Dv; ++d) dst[d] = acc[d] * inv;
      } else {
        uint16_t* dst = static_cast<uint16_t*>(P.out) + off;
        for (int d = 0; d < Dv; ++d) dst[d] = P.dtype == kBF16 ? f32_to_bf16(acc[d] * inv) : f32_to_f16(acc[d] * inv);
      }
    }
  };
  const int n_merges = int(merges.size());
  const int merge_team = std::min(nthreads, n_merges);
  if (merge_team <= 1) {
    for (const Merge& mg : merges) merge_one(mg);
  } else {
#pragma omp parallel for schedule(dynamic, 1) num_threads(merge_team)
    for (int i = 0; i < n_merges; ++i) merge_one(merges[i]);
  }
}

// What both KV writes share: the checks, then row(dst, k_row, v_row, h) for every (token, KV head)
// whose slot lies in [0, kv_cache.size(0) x block_size) (-1 and every other slot skip); dst is the
// element offset of that row in the cache. Tokens past key's / value's rows are not read.
struct KVRows {
  int64_t T, H, num_slots, block_size, s_block, s_token, s_head, head_size, head_size_v, es;
  const char* k;
  const char* v;   // nullptr for a latent (keys-only) cache
  int64_t ks0, ks1, vs0, vs1;
  const int64_t* slots;

  template <class Row> void for_each(Row&& row) const {
    auto one = [&](int64_t t) {
      const int64_t slot = slots[t];
      if (slot < 0 || slot >= num_slots) return;
      const int64_t blk = slot / block_size, off = slot % block_size;
      for (int64_t h = 0; h < H; ++h)
        row(blk * s_block + off * s_token + h * s_head, k + (t * ks0 + h * ks1) * es,
            v ? v + (t * vs0 + h * vs1) * es : nullptr, h);
    };
    const int team = torch_threads();
    if (T * H * (head_size + head_size_v) * es < (1 << 20) || team <= 1) {
      for (int64_t t = 0; t < T; ++t) one(t);
    } else {
#pragma omp parallel for schedule(static) num_threads(team)
      for (int64_t t = 0; t < T; ++t) one(t);
    }
  }
};

static KVRows kv_rows(const at::Tensor& key, const at::Tensor& value, const at::Tensor& kv_cache,
                      const at::Tensor& slot_mapping, int64_t s_block, int64_t s_token, int64_t s_head,
                      int64_t head_size, int64_t head_size_v, int64_t block_size) {
  TORCH_CHECK(key.dim() == 3 && value.dim() == 3 && kv_cache.dim() >= 1, "key/value [T, H, D]");
  TORCH_CHECK((key.size(2) <= 1 || key.stride(2) == 1) && (head_size_v <= 1 || value.stride(2) == 1),
              "key/value need a contiguous last dim");
  TORCH_CHECK(value.scalar_type() == key.scalar_type(), "key and value dtypes differ");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(), "slot_mapping int64");
  TORCH_CHECK(block_size > 0 && head_size >= 0 && head_size_v >= 0 && key.size(2) >= head_size &&
              (head_size_v == 0 || (value.size(2) >= head_size_v && value.size(1) >= key.size(1))),
              "key/value smaller than the head sizes");
  TORCH_CHECK(s_block >= 0 && s_token >= 0 && s_head >= 0, "negative strides");
  const int64_t num_blocks = kv_cache.size(0), H = key.size(1);
  TORCH_CHECK(cache_extent(num_blocks, block_size, H, s_block, s_token, s_head, head_size + head_size_v) <=
                  tensor_span(kv_cache),
              "the cache strides (or key's head count) reach outside kv_cache");
  int64_t T = std::min<int64_t>(slot_mapping.size(0), key.size(0));
  if (head_size_v) T = std::min<int64_t>(T, value.size(0));
  return KVRows{T, H, num_blocks * block_size, block_size, s_block, s_token, s_head, head_size, head_size_v,
                key.element_size(), static_cast<const char*>(key.data_ptr()),
                head_size_v ? static_cast<const char*>(value.data_ptr()) : nullptr, key.stride(0), key.stride(1),
                head_size_v ? value.stride(0) : 0, head_size_v ? value.stride(1) : 0,
                slot_mapping.data_ptr<int64_t>()};
}

// Write token t's K (and V) rows to slot slot_mapping[t] through the named strides (see KVRows).
void write_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache,
              const at::Tensor& slot_mapping, int64_t s_block, int64_t s_token, int64_t s_head,
              int64_t head_size, int64_t head_size_v, int64_t block_size) {
  TORCH_CHECK(key.scalar_type() == kv_cache.scalar_type(), "dtype mismatch");
  const KVRows w = kv_rows(key, value, kv_cache, slot_mapping, s_block, s_token, s_head, head_size, head_size_v,
                           block_size);
  const int64_t es = w.es;
  char* cache = static_cast<char*>(kv_cache.data_ptr());
  w.for_each([&](int64_t dst, const char* k, const char* v, int64_t) {
    std::memcpy(cache + dst * es, k, size_t(head_size * es));
    if (v) std::memcpy(cache + (dst + head_size) * es, v, size_t(head_size_v * es));
  });
}

// write_kv for an fp8 cache: each element is quantised by kvmulti/fp8.py's rule (fp32 division by its
// head's scale, clamp, round to nearest even); key/value are fp32, fp16 or bf16. Slots as in write_kv.
void write_kv_fp8(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache,
                  const at::Tensor& slot_mapping, int64_t s_block, int64_t s_token, int64_t s_head,
                  int64_t head_size, int64_t head_size_v, int64_t block_size, const at::Tensor& k_scale,
                  const at::Tensor& v_scale) {
  const int cache_dtype = cache_dtype_code(kv_cache);
  TORCH_CHECK(is_fp8(cache_dtype), "write_kv_fp8 needs an fp8 cache");
  const int kdt = dtype_code(key);
  const KVRows w = kv_rows(key, value, kv_cache, slot_mapping, s_block, s_token, s_head, head_size, head_size_v,
                           block_size);
  const float* ks = fp8_scale(k_scale, w.H, "k_scale");
  const float* vs = head_size_v ? fp8_scale(v_scale, w.H, "v_scale") : nullptr;
  uint8_t* cache = static_cast<uint8_t*>(kv_cache.data_ptr());
  auto quantize_row = [&](const char* src, int64_t n, float scale, uint8_t* dst) {
    for (int64_t d = 0; d < n; ++d) {
      float x;
      if (kdt == kF32) std::memcpy(&x, src + d * 4, 4);
      else {
        uint16_t h;
        std::memcpy(&h, src + d * 2, 2);
        x = kdt == kBF16 ? bf16_to_f32(h) : f16_to_f32(h);
      }
      dst[d] = quantize_fp8(x, scale, cache_dtype);
    }
  };
  w.for_each([&](int64_t dst, const char* k, const char* v, int64_t h) {
    quantize_row(k, head_size, ks[h], cache + dst);
    if (v) quantize_row(v, head_size_v, vs[h], cache + dst + head_size);
  });
}

// fp8 codes -> fp32 through one ISA variant's vector loads (tests compare them with torch's conversion).
at::Tensor fp8_to_f32(const at::Tensor& codes, const std::string& isa_name_wanted, bool lut) {
  Isa isa = kGeneric;
  for (int i = 0; i < 4; ++i)
    if (isa_name_wanted == isa_name(i)) isa = Isa(i);
  TORCH_CHECK(isa_name_wanted == isa_name(isa) && usable(isa), "ISA ", isa_name_wanted, " is not available here");
  at::Tensor out = at::empty({codes.numel()}, codes.options().dtype(at::kFloat));
  TORCH_CHECK(widen_fp8_of(isa)(cache_dtype_code(codes), static_cast<const uint8_t*>(codes.data_ptr()),
                                int(codes.numel()), out.data_ptr<float>(), lut),
              "ISA ", isa_name_wanted, " has no fp8 byte tables");
  return out;
}

std::vector<std::string> available_isas() {
  std::vector<std::string> out;
  for (Isa isa : kIsasBestFirst)
    if (usable(isa)) out.push_back(isa_name(isa));
  return out;
}

std::vector<std::string> fp8_lut_isas() {
  std::vector<std::string> out;
  const uint8_t code = 0;
  float value;
  for (Isa isa : kIsasBestFirst)
    if (usable(isa) && widen_fp8_of(isa)(kE5M2, &code, 1, &value, true)) out.push_back(isa_name(isa));
  return out;
}

}  // namespace kvmulti_cpu

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "kvmulti native CPU paged attention";
  m.def("paged_attention", &kvmulti_cpu::paged_attention, "paged attention over the canonical layout");
  m.def("write_kv", &kvmulti_cpu::write_kv, "write K/V rows to their slots (-1 skips)");
  m.def("write_kv_fp8", &kvmulti_cpu::write_kv_fp8, "quantise K/V rows into an fp8 cache's slots (-1 skips)");
  m.def("quantize_fp8", [](const at::Tensor& x, double scale, const at::Tensor& like) {
    TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous fp32");
    const int dt = kvmulti_cpu::cache_dtype_code(like);
    TORCH_CHECK(kvmulti_cpu::is_fp8(dt), "like: an fp8 tensor");
    at::Tensor q = at::empty(x.sizes(), x.options().dtype(like.scalar_type()));
    const float* src = x.data_ptr<float>();
    uint8_t* dst = static_cast<uint8_t*>(q.data_ptr());
    for (int64_t i = 0; i < x.numel(); ++i) dst[i] = kvmulti_cpu::quantize_fp8(src[i], float(scale), dt);
    return q;
  }, "the scalar quantiser write_kv_fp8 uses (tests)");
  m.def("fp8_to_f32", [](const at::Tensor& codes, const std::string& isa, bool lut) {
    TORCH_CHECK(kvmulti_cpu::is_fp8(kvmulti_cpu::cache_dtype_code(codes)) && codes.is_contiguous(), "fp8 codes");
    return kvmulti_cpu::fp8_to_f32(codes, isa, lut);
  }, "fp8 codes widened by an ISA variant's in-register loads, or (lut) its byte tables (tests)",
  py::arg("codes"), py::arg("isa"), py::arg("lut") = false);
  m.def("fp8_lut_isas", &kvmulti_cpu::fp8_lut_isas,
        "usable variants whose direct path widens fp8 through byte tables, best first (tests)");
  m.def("available_isas", &kvmulti_cpu::available_isas, "usable kernels here, best first");
  m.def("best_isa", []() { return std::string(kvmulti_cpu::isa_name(kvmulti_cpu::best_isa())); });
  m.def("num_threads", []() { return torch_threads(); });
  m.def("lanes", [](const std::string& isa) {
    for (int i = 0; i < 4; ++i)
      if (isa == kvmulti_cpu::isa_name(i)) return kvmulti_cpu::lanes_of(kvmulti_cpu::Isa(i));
    return 0;
  }, "fp32 lanes of an ISA variant (0: unknown name)");
  kvmulti_cpu::bind_prepared_step(m);
}
