// kvmulti HIP prefill kernel: paged attention for steps with long queries (the launcher picks it when the
// step's longest query reaches its threshold; decodes and short queries of the same step run in it too).
//
// Work-group = kNumWarps waves = kPrefillRows (64) query rows -- (token, head) pairs of one request and one
// KV head: min(group, 64) heads of a GQA group x 64 / that many consecutive tokens (RowMap) --, wave w
// owning rows 16 w .. 16 w + 15. The union of the rows' visible keys is cut into tiles of KT keys (64; 32
// when a 64-key K + V tile would not fit 32 KiB of LDS; 128 over fp8 codes at head 64); tiles outside the union (before a sliding window,
// after the causal end of the last token) are never visited. Per tile every thread of the group issues
// its share of the tile's K and V loads (16-byte chunks), the group stores them ONCE in LDS -- K as rows,
// V transposed (a head dim's keys contiguous, so a P V operand is one 8-byte read; 16 bytes for fp32), fp8
// codes widened to 16-bit values on the way -- and all four waves read them from there: S^T = K Q^T and
// O += P V as v_mfma_f32_16x16x16{f16,bf16_1k} tiles with the lane roles of the decode engine
// (mfma_stream) -- fp32 queries over an fp32 or fp8 cache (codes widened to fp32 when staged):
// v_mfma_f32_16x16x4f32 tiles, 4 k-steps per 16 head dims or 4 keys, with the same D layout --, the online
// softmax in registers.
// The next tile's loads are issued right after the barrier that publishes the current one (its block-table
// entries one tile earlier still), so they are in flight while the waves compute. A wave skips a tile none of its rows
// sees (no MFMA). Tiles visible to every row of the group run a loop without masks (the prompt's body:
// the hot loop); the others (the diagonal, a sliding window's edge) mask per key. A block id outside the
// cache is read as block 0 (memory-safe; such metadata may give wrong numbers), and keys outside the
// group's range read the kernel's zero row (key_row).
//
// Grid x enumerates token tiles request by request: request r owns tiles F(r) .. F(r) + ceil(q_len / tpb)
// - 1 with F(r) = floor(qsl[r] / tpb) + r (tpb: tokens per tile), so F is strictly increasing and a
// request's tiles never overlap the next one's; at most one block per request finds no tokens. Grid x
// = ceil(num_tokens / tpb) + num_reqs covers every tile.
//
// Where no matrix instruction serves the step (RDNA2, NVIDIA through hip/compat; RDNA3 / RDNA4 for fp32 queries;
// the harness with MFMA / WMMA disabled) the same tasks run on the FMA tile engine (kvmulti_prefill_fma.hip) at
// heads up to 128 over a cache of the query's type; the rest on wave64 without MFMA (the harness: head 256, fp8
// caches) through the decode kernel's FMA engine, the 64 rows taken in slices of rows_per_block rows.
#pragma once

#include "kvmulti_attention.hip"

namespace kvmulti {


// First grid-x tile of a request whose queries start at token q (floor division).
__host__ __device__ __forceinline__ long long prefill_first_tile(int q, int r, int tokens_per_tile) {
  const long long f = q >= 0 ? q / tokens_per_tile : -(((long long)-q + tokens_per_tile - 1) / tokens_per_tile);
  return f + r;
}

// The block's task: grid x -> (request, first token) as above. Block-uniform.
__device__ __forceinline__ TaskKind prefill_task(const PagedAttentionParams& p, BlockTask& b) {
  const RowMap map(p.num_q_heads, p.num_kv_heads, kPrefillRows);
  const int tpt = map.tokens_per_block;
  const long long x = blockIdx.x;
  init_task(p, map, 0, b);
  int lo = 0, hi = p.num_reqs - 1;  // the last r with F(r) <= x
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (prefill_first_tile(p.query_start_loc[mid], mid, tpt) <= x) lo = mid; else hi = mid - 1;
  }
  const int q_begin = p.query_start_loc[lo], q_end = p.query_start_loc[lo + 1];
  const long long token = (long long)q_begin + (x - prefill_first_tile(q_begin, lo, tpt)) * tpt;
  if (q_begin < 0 || token < q_begin || token >= q_end || token >= p.num_tokens) return TaskKind::kCovered;
  b.token = (int)token;
  b.req = lo;
  if (b.req >= p.bt_rows) {  // the tokens' rows get zeros
    b.ntok = min(tpt, min(q_end, p.num_tokens) - b.token);
    b.rows = b.nheads * b.ntok;
    return TaskKind::kInvalid;
  }
  fill_task(p, b, tpt, q_begin, q_end);
  return TaskKind::kCompute;
}

// Instantiations with the prefill kernel's MFMA path (on MFMA targets, wave64): 16-bit queries over a 16-bit
// or fp8 cache (v_mfma_f32_16x16x16{f16,bf16_1k}); fp32 queries over an fp32 or fp8 cache
// (v_mfma_f32_16x16x4f32: fp32 operands, so the scores and P V keep fp32's precision).
template <typename T, typename C, int WAVE>
__host__ __device__ constexpr bool prefill_mfma_path() {
  return WAVE == 64;
}

// Instantiations with the prefill kernel's WMMA path (on WMMA targets, wave32): 16-bit queries over a cache of
// their type, heads up to 128. Head 256 keeps the attention kernel: its accumulators alone take 128 VGPRs per
// lane (16 rows on 32 lanes). So do fp8 caches: at the tiles whose registers fit (those of the 16-bit cache),
// a thread keeps one 16-byte K and one V load in flight (the compile check wants 4); the tiles with 2 + 2
// (twice the keys) spilled on gfx1100 at heads 80 - 128 and on gfx1201 at head 96.
template <typename T, typename C, int HS>
__host__ __device__ constexpr bool prefill_wmma_path() {
  return sizeof(T) == 2 && !is_fp8<C>() && HS <= 128;
}

// x as a per-lane (VGPR) value when ON: a block-uniform value that the tile loop only feeds to per-lane
// arithmetic then takes no SGPRs there (over fp8 caches the loop is short of them; bt_lane is one such value).
template <bool ON, typename X>
__device__ __forceinline__ X lane_value(X x) {
#if KVM_AMDGPU_DEVICE
  if constexpr (ON) asm("" : "+v"(x));
#endif
  return x;
}

template <int WAVE>
__device__ __forceinline__ int wave_max_int(int v) {
#pragma unroll
  for (int m = 1; m < WAVE; m <<= 1) v = max(v, __shfl_xor(v, m, WAVE));
  return v;
}

// The block-table entries of the keys a wave loads from key t0 on: lane i holds entry t0 / block_size + i
// (-1 past the table), ws = the first entry's first key. A wave loads at most WAVE keys of a tile (t0: the
// tile's first key, or its own first key in a tile of more than WAVE keys), which span at most WAVE entries.
struct TileTable {
  int entry, ws;
};
// bt_lane: the request's table row + lane, a per-lane pointer (kept in VGPRs: the loop is short of SGPRs).
__device__ __forceinline__ TileTable tile_table(const PagedAttentionParams& p, const int* bt_lane, int t0,
                                                float inv_bs, int lane) {
  int r;
  const int e0 = window_entry(p, 0, inv_bs, t0, r);
  return TileTable{e0 + lane < p.bt_cols ? load_global(bt_lane + e0) : -1, e0 * p.block_size};
}

// The order the tiles are processed in (the online softmax takes any): the masked ones first -- before
// the fully visible range [full_lo, full_hi), then after it -- then the fully visible ones.
struct TileOrder {
  int ntiles, full_lo, full_hi;
  __device__ int masked() const { return ntiles - (full_hi - full_lo); }
  __device__ int operator()(int k) const {
    const int na = full_lo, nm = masked();
    return k < na ? k : k < nm ? full_hi + (k - na) : full_lo + (k - nm);
  }
};

// The task's tiles of KT keys from key base = kv_lo rounded down to KT, in TileOrder: [full_lo, full_hi) are
// visible to every row that sees any key (no mask: the prompt's body); the others -- before a sliding
// window's edge, the diagonal -- mask per key.
template <int KT>
__device__ __forceinline__ TileOrder task_tiles(const BlockTask& b, int& base) {
  base = b.kv_lo / KT * KT;
  const int ntiles = (b.kv_hi - base + KT - 1) / KT;
  int full_lo = ntiles, full_hi = ntiles;
  if (b.all_lo < b.all_hi) {
    full_lo = min(ntiles, (b.all_lo - base + KT - 1) / KT);
    full_hi = max(full_lo, min(ntiles, (b.all_hi - base) / KT));
  }
  return TileOrder{ntiles, full_lo, full_hi};
}

#if KVMULTI_HAS_MFMA || KVMULTI_HAS_WMMA
// The element type of the LDS tiles: the cache's, or for an fp8 cache the query's type (codes are widened
// once per tile when staged, so the waves' hot loop reads K / V like a cache of the query's type).
template <typename T, typename C>
using PrefillElem = typename std::conditional<is_fp8<C>(), T, C>::type;
// V's: for a 16-bit query fp8 codes widen to fp16 whichever its type (every value of the four formats is an fp16
// value), and P V runs on the fp16 MFMA with P in fp16 (p in [0, 1]: at least bf16's precision down to
// 2^-14) -- a bf16 query saves the fp16 -> bf16 step on V; for an fp32 query to fp32, as K.
template <typename T, typename C>
using PrefillVElem = typename std::conditional<is_fp8<C>(), typename std::conditional<sizeof(T) == 4, T, __half>::type,
                                               C>::type;

// The MFMA operand of one lane and k-step: 16-bit L: a Frag (4 K-elements, v_mfma_f32_16x16x16); fp32 L:
// one value (v_mfma_f32_16x16x4f32).
template <typename L>
using PrefillOp = typename std::conditional<sizeof(L) == 4, float, Frag>::type;

// d += A B, one k-step of the prefill's MFMA on L operands (all 64 lanes).
template <typename L>
__device__ __forceinline__ mfma_f32x4 prefill_mfma(const PrefillOp<L>& a, const PrefillOp<L>& b, mfma_f32x4 d) {
  if constexpr (sizeof(L) == 4) return __builtin_amdgcn_mfma_f32_16x16x4f32(a, b, d, 0, 0, 0);
  else return mfma_16x16x16<L>(a, b, d);
}

// LDS tile geometry of the MFMA path (L: the LDS element type). A key's row (K or V) takes ROWB bytes: its
// NCH 16-byte chunks, chunk ch stored at position ch ^ (key & SWZ) when NCH is a power of two (the 16 keys a
// K read touches land in different banks), else after a 16-byte pad per row. TPK threads load one key's row.
// KTM: the largest tile (64 keys; 128 where prefill_kt_max allows it). WAVE: the lanes per wave (64: MFMA,
// 32: WMMA), which sets the loading threads' share of a tile.
template <typename L, int HS, int KTM = 64, int WAVE = 64>
struct PrefillGeom {
  static constexpr int ES = (int)sizeof(L);                     // bytes per element: 2, or 4 (fp32)
  static constexpr int NCH = MfmaGeom<L, HS>::NCH;
  static constexpr int QKC = MfmaGeom<L, HS>::QKC;              // K / Q chunks per lane (chunks 4u + g)
  // MFMA k-steps per K / Q chunk: 16-bit: FPC fragments of 4 dims; fp32: 4 steps of one dim each
  static constexpr int QST = ES == 4 ? 4 : MfmaGeom<L, HS>::FPC;
  static constexpr int PST = ES == 4 ? 4 : 1;                    // P V k-steps per 4 keys
  // fp32 rows of 20 / 24 chunks (heads 80 / 96) are laid out as 32 (head 128's rows)
  static constexpr int LNC = ES == 4 && (NCH & (NCH - 1)) != 0 ? 32 : NCH;
  static constexpr bool kPow2 = (LNC & (LNC - 1)) == 0;
  static constexpr int SWZ = kPow2 ? (LNC < 16 ? LNC : 16) - 1 : 0;
  static constexpr int ROWB = 16 * LNC + (kPow2 ? 0 : 16);
  // K + V of a tile in at most 32 KiB: KTM keys (128 or 64), else 32, else 16
  static constexpr int KT = KTM >= 128 && 2 * 128 * ROWB <= 32768 ? 128
                            : KTM >= 64 && 2 * 64 * ROWB <= 32768 ? 64
                            : KTM >= 32 && 2 * 32 * ROWB <= 32768 ? 32 : 16;
  static constexpr int NSUB = KT / 16;
  static constexpr int TPK = kNumWarps * WAVE / KT;              // threads per key: 1, 2, 4, 8 or 16
  // the first key of wave w's loads (wave w loads keys WKEYS w .. WKEYS (w + 1) - 1 of a tile)
  static constexpr int WKEYS = WAVE / TPK;
  // rows of V^T: the head dims, for fp32 up to a whole number of chunks per loading thread (PrefillLoad::PAD)
  static constexpr int VD = ES == 4 ? 4 * ((NCH + TPK - 1) / TPK * TPK) : HS;
  __device__ static int offset(int key, int ch) { return key * ROWB + 16 * (ch ^ (key & SWZ)); }
  // The same for a chunk ch = 4 u + g of a K read (u a constant): the lane's part repeats every SWZ + 1
  // chunks, the rest is an immediate offset (4 address registers instead of QKC)
  __device__ static int k_offset(int key, int u, int g) {
    static_assert(SWZ == 0 || SWZ >= 3, "g must not carry out of the swizzled bits");
    return key * ROWB + 16 * ((4 * u) & ~SWZ) + 16 * ((((4 * u) & SWZ) + g) ^ (key & SWZ));
  }
  // V is stored transposed: row d (a head dim) holds the tile's KT keys (VRS bytes), its groups of 4 keys
  // (4 ES bytes: one PV B operand read) at position group ^ ((d / 8) & VSW), so the 16 dims n a PV read
  // touches hit different banks.
  static constexpr int VRS = ES * KT;
  static constexpr int VSW = (KT / 4 < 16 ? KT / 4 : 16) - 1;
  __device__ static int voffset(int dim, int key) { return dim * VRS + ((ES * key) ^ (4 * ES * ((dim / 8) & VSW))); }
};

// The largest tile of a cache type and head size: 128 keys for fp8 codes at head 64 (64-byte rows: a 64-key
// tile would give each thread one K and one V load, 32 bytes in flight per lane), else 64. The WMMA engine
// (WAVE 32, 16-bit caches, half of wave64's threads loading a tile): the smallest tile with 2 K and 2 V
// loads per thread -- 32 keys, 16 at head 128 --, as a larger tile's loads in flight and scores would not fit
// the registers next to the accumulators (gfx11 spilled).
template <typename C, int HS, int WAVE = 64>
__host__ __device__ constexpr int prefill_kt_max() {
  return WAVE == 32 ? (HS >= 128 ? 16 : 32) : is_fp8<C>() && HS == 64 ? 128 : 64;
}

// The global-load side of a tile: a cache row (K or V) of C is LNCH 16-byte chunks (fp8: 16 codes each,
// WIDEN = 2 LDS chunks once widened to 16 bits, 4 to fp32); thread tid < NLT loads chunks tid % TPK + TPK i
// of key tid / TPK. fp8 codes for fp32 tiles: half the geometry's threads per key (the first two waves load,
// 2 x 16-byte K and V loads each in flight instead of 1).
template <typename C, int HS, typename L, int WAVE = 64>
struct PrefillLoad {
  static constexpr int KTM = prefill_kt_max<C, HS, WAVE>();
  static constexpr int TPK = PrefillGeom<L, HS, KTM, WAVE>::TPK / (is_fp8<C>() && sizeof(L) == 4 ? 2 : 1);
  static constexpr int NLT = PrefillGeom<L, HS, KTM, WAVE>::KT * TPK;
  __device__ static bool loads(int tid) { return NLT == kNumWarps * WAVE || tid < NLT; }
  static constexpr int EPC = 16 / (int)sizeof(C);
  static constexpr int LNCH = HS / EPC;
  static constexpr int CPT = (LNCH + TPK - 1) / TPK;             // K (and V) chunks per thread and tile
  static constexpr int WIDEN = (int)(sizeof(L) / sizeof(C));
  // fp32 caches: a thread past the row's chunks loads and stores the row's last chunk again (into the
  // padded layout) instead of branching around it
  static constexpr bool PAD = sizeof(C) == 4 && LNCH % TPK != 0;
  __device__ static bool has(int ch) { return LNCH % TPK == 0 || PAD || ch < LNCH; }
  __device__ static int src(int ch) { return PAD ? min(ch, LNCH - 1) : ch; }
};

template <typename L, int HS, int KTM = 64>
struct PrefillShared {
  alignas(16) uint8_t k[PrefillGeom<L, HS, KTM>::KT * PrefillGeom<L, HS, KTM>::ROWB];
  alignas(16) uint8_t v[PrefillGeom<L, HS, KTM>::VD * PrefillGeom<L, HS, KTM>::VRS];   // V^T
};

// Issues the loads of the tile at key t0 (PrefillLoad's chunks of every thread, K and V). Every lane calls
// it (key_row shuffles).
template <typename C, int HS, typename L, bool ALIGNED, int WAVE = 64>
__device__ __forceinline__ void prefill_load(const PagedAttentionParams& p, const BlockTask& b, const C* cache,
                                             const TileTable& tt, float inv_bs, int t0,
                                             Chunk16 (&kr)[PrefillLoad<C, HS, L, WAVE>::CPT],
                                             Chunk16 (&vr)[PrefillLoad<C, HS, L, WAVE>::CPT]) {
  using PL = PrefillLoad<C, HS, L, WAVE>;
  const int tid = (int)threadIdx.x;
  if (!PL::loads(tid)) return;  // wave-uniform
  bool unused;
  const C* row = key_row<WAVE>(p, b, cache, tt.entry, tt.ws, inv_bs, t0 + tid / PL::TPK, unused);
#pragma unroll
  for (int i = 0; i < PL::CPT; ++i) {
    const int ch = tid % PL::TPK + PL::TPK * i;
    if (PL::has(ch)) {
      kr[i] = load_chunk<C, ALIGNED>(row + PL::src(ch) * PL::EPC);
      vr[i] = load_chunk<C, ALIGNED>(row + HS + PL::src(ch) * PL::EPC);
    }
  }
}

// Codes 2j, 2j + 1 (bytes 2j, 2j + 1 of word x) as an fp8 pair (bits 8..15 and 24..31): one v_perm_b32.
__device__ __forceinline__ uint32_t fp8_pair_of(uint32_t x, int j) {
#if KVM_AMDGPU_DEVICE
  return __builtin_amdgcn_perm(x, x, j ? 0x030C020Cu : 0x010C000Cu);
#else
  return j ? ((x >> 8) & 0xFF00u) | (x & 0xFF000000u) : ((x & 0xFFu) << 8) | ((x & 0xFF00u) << 16);
#endif
}

// Half `half` (codes 8 half .. 8 half + 7) of a chunk of 16 fp8 codes as 8 values of T, in order.
template <typename C, typename T>
__device__ __forceinline__ Chunk16 widen_half_chunk(const Chunk16& c, int half) {
  Chunk16 o;
#pragma unroll
  for (int i = 0; i < 4; ++i) o.w[i] = widen_pair<C, T>(fp8_pair_of(c.w[2 * half + i / 2], i % 2));
  return o;
}

// Quarter q (codes 4 q .. 4 q + 3) of a chunk of 16 fp8 codes as 4 fp32 values, in order (exact: through
// the fp16 widening).
template <typename C>
__device__ __forceinline__ Chunk16 widen_quarter_chunk_f32(const Chunk16& c, int q) {
  Chunk16 o;
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const uint32_t h = widen_pair<C, __half>(fp8_pair_of(c.w[q], j));
    o.w[2 * j] = __float_as_uint(__half2float(__ushort_as_half((unsigned short)(h & 0xFFFFu))));
    o.w[2 * j + 1] = __float_as_uint(__half2float(__ushort_as_half((unsigned short)(h >> 16))));
  }
  return o;
}

// Stores the loaded chunks of this thread in LDS; fp8 codes widened on the way (K to L, V to VL), once per
// tile.
template <typename C, int HS, typename L, typename VL, int WAVE = 64>
__device__ __forceinline__ void prefill_store(PrefillShared<L, HS, PrefillLoad<C, HS, L, WAVE>::KTM>& sh,
                                              const Chunk16 (&kr)[PrefillLoad<C, HS, L, WAVE>::CPT],
                                              const Chunk16 (&vr)[PrefillLoad<C, HS, L, WAVE>::CPT]) {
  using PL = PrefillLoad<C, HS, L, WAVE>;
  using PG = PrefillGeom<L, HS, PL::KTM, WAVE>;
  constexpr int LE = 16 / PG::ES;   // elements per LDS chunk
  const int tid = (int)threadIdx.x, key = tid / PL::TPK;
  if (!PL::loads(tid)) return;  // wave-uniform
#pragma unroll
  for (int i = 0; i < PL::CPT; ++i) {
    const int ch = tid % PL::TPK + PL::TPK * i;
    if (PL::has(ch)) {
#pragma unroll
      for (int h = 0; h < PL::WIDEN; ++h) {  // LDS chunk lc = WIDEN ch + h: head dims LE lc .. LE lc + LE - 1
        const int lc = PL::WIDEN * ch + h;
        Chunk16 kw = kr[i], vw = vr[i];
        if constexpr (PL::WIDEN == 2) {
          kw = widen_half_chunk<C, L>(kr[i], h);
          vw = widen_half_chunk<C, VL>(vr[i], h);
        } else if constexpr (PL::WIDEN == 4) {
          kw = widen_quarter_chunk_f32<C>(kr[i], h);
          vw = widen_quarter_chunk_f32<C>(vr[i], h);
        }
        *reinterpret_cast<Chunk16*>(sh.k + PG::offset(key, lc)) = kw;
#pragma unroll
        for (int j = 0; j < LE; ++j) {
          uint8_t* dst = sh.v + PG::voffset(LE * lc + j, key);
          if constexpr (PG::ES == 4) *reinterpret_cast<uint32_t*>(dst) = vw.w[j];
          else *reinterpret_cast<unsigned short*>(dst) = (unsigned short)(vw.w[j / 2] >> (16 * (j % 2)));
        }
      }
    }
  }
}

// An MFMA fragment read from LDS with one 8-byte load.
struct alignas(8) Frag2 {
  uint32_t w[2];
};

// Two probabilities as the MFMA's 16-bit operand pair (low half: a), rounded to nearest even.
template <typename T>
__device__ __forceinline__ uint32_t pack_p(float a, float b) {
  if constexpr (std::is_same<T, hip_bfloat16>::value) {
    // p is in [0, 1] or NaN (canonical): the rounding add neither overflows nor turns NaN into a number
    const uint32_t ua = __float_as_uint(a), ub = __float_as_uint(b);
    const uint32_t ra = ua + 0x7FFFu + ((ua >> 16) & 1u), rb = ub + 0x7FFFu + ((ub >> 16) & 1u);
    return pair_halves(ra, rb, 1);
  } else {
    return (uint32_t)Bits16<T>::of(a) | ((uint32_t)Bits16<T>::of(b) << 16);
  }
}

// A lane's Q operands: [u][h] = k-step h of its chunk 4u + g.
template <typename L, int HS>
using PrefillQ = PrefillOp<L>[PrefillGeom<L, HS>::QKC][PrefillGeom<L, HS>::QST];

// K operand of QK k-step h of a lane's K chunk (16-bit: fragment h as loaded; fp32: element h).
template <typename L>
__device__ __forceinline__ PrefillOp<L> k_operand(const Chunk16& c, int h) {
  if constexpr (sizeof(L) == 4) return __uint_as_float(c.w[h]);
  else return k_fragment<L, L>(c, h);
}

// What one lane reads of V^T for a P V step group: keys 4g .. 4g + 3 of one head dim (8 or 16 bytes).
template <typename VL>
using PrefillVRead = typename std::conditional<sizeof(VL) == 4, Chunk16, Frag2>::type;

// P and V operands of P V k-step e (< PST) from the lane's probabilities pe (keys 4g .. 4g + 3) and its V^T
// read: 16-bit: one step over the 4 keys (P rounded to VL); fp32: key 4g + e per step.
template <typename VL>
__device__ __forceinline__ PrefillOp<VL> p_operand(const float (&pe)[4], int e) {
  if constexpr (sizeof(VL) == 4) return pe[e];
  else return Frag{{pack_p<VL>(pe[0], pe[1]), pack_p<VL>(pe[2], pe[3])}};
}
template <typename VL>
__device__ __forceinline__ PrefillOp<VL> v_operand(const PrefillVRead<VL>& r, int e) {
  if constexpr (sizeof(VL) == 4) return __uint_as_float(r.w[e]);
  else return Frag{{r.w[0], r.w[1]}};
}

// What a wave needs to know about its rows inside the tile loop.
struct PrefillRows {
  int rlo, rhi;          // this lane's row (n): its visible keys
  int lo_min, hi_max;    // the wave's live rows: a tile outside [lo_min, hi_max) is skipped
  float cap_scale;       // softcap: the tanh argument per raw dot product (score scale / softcap)
  float exp_scale;       // log2(e) per unit of the scores the softmax runs on (raw dot products, or capped)
  float score_unit;      // those scores -> the softmax's natural units (split-KV partials' max)
  float alibi_unit;      // ALiBi: this lane's row's slope in those score units (0 without ALiBi)
  int qpos;              // this lane's row's query position (the ALiBi distance's origin)
};

// One tile of the wave: S^T, masks (MASKED only), online softmax, P V. Lane roles as in mfma_stream; L, VL:
// the element types of the K and V tiles in LDS (QK runs on L's MFMA, P V on VL's). SOFTCAP: 1 = on, 0 = off,
// -1 = p.softcap decides at run time. ALIBI: add the rows' ALiBi bias (a separate instantiation: the plain
// loop keeps its instruction count). KTM: PrefillGeom's; a 128-key tile is taken as two 64-key steps (k0 = 0,
// 64: the step's first key in the LDS tile; t0: its key), which keeps the scores of one step in registers.
template <typename T, typename L, typename VL, int HS, bool MASKED, int SOFTCAP, bool ALIBI, int KTM = 64>
__device__ __forceinline__ void prefill_tile(const PagedAttentionParams& p, const PrefillShared<L, HS, KTM>& sh,
                                             const PrefillRows& w, int t0, float& m, float& l,
                                             mfma_f32x4 (&acc)[MfmaGeom<L, HS>::PVC][8],
                                             const PrefillQ<L, HS>& qf, int k0 = 0) {
  using G = MfmaGeom<L, HS>;
  using PG = PrefillGeom<L, HS, KTM>;
  constexpr int WAVE = 64, NSUB = PG::NSUB < 4 ? PG::NSUB : 4, QKC = PG::QKC, QST = PG::QST, PVC = G::PVC, NCH = G::NCH;
  const int lane = (int)threadIdx.x % WAVE, n = lane % 16, g = lane / 16;
  const Chunk16 zero = {{0u, 0u, 0u, 0u}};
  float s[NSUB][4];
  float tmax = -INFINITY;
  const bool softcap = SOFTCAP > 0 || (SOFTCAP < 0 && p.softcap > 0.f);
#pragma unroll
  for (int sub = 0; sub < NSUB; ++sub) {
    mfma_f32x4 d = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int u = 0; u < QKC; ++u) {
      const int ch = 4 * u + g;
      const int key = k0 + 16 * sub + n;
      const Chunk16 kc = ch < NCH ? *reinterpret_cast<const Chunk16*>(
                                        sh.k + (PG::ES == 4 ? PG::k_offset(key, u, g) : PG::offset(key, ch)))
                                  : zero;
#pragma unroll
      for (int h = 0; h < QST; ++h) d = prefill_mfma<L>(k_operand<L>(kc, h), qf[u][h], d);
      if constexpr (PG::ES == 4 && HS > 128) {
        if (u % 4 == 3) sched_fence();
      }
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float x = d[e];  // raw (without softcap: the scale is applied in the exponent)
      if (SOFTCAP > 0 || (SOFTCAP < 0 && softcap)) x = p.softcap * softcap_tanh(x * w.cap_scale);
      const int t = t0 + 16 * sub + 4 * g + e;
      if constexpr (ALIBI) x = fmaf(w.alibi_unit, (float)(t - w.qpos), x);  // after softcap, before the mask
      if constexpr (MASKED) {  // keys outside this lane's row range
        bool vis = t >= w.rlo && t < w.rhi;
        x = vis ? x : -INFINITY;
      }
      s[sub][e] = x;
      tmax = fmaxf(tmax, x);
    }
    sched_fence();
  }
  tmax = wave_max_from<WAVE, 16>(tmax);
  const float m_new = fmaxf(m, tmax);
  const float alpha = fast_exp2((m - m_new) * w.exp_scale);
  m = m_new;
  // m in the exponent's units, finite (m = -FLT_MAX before any visible key: -inf would make -inf + inf)
  const float ms = fmaxf(m * w.exp_scale, -FLT_MAX);
  l *= alpha;
#pragma unroll
  for (int r = 0; r < 4; ++r) {  // acc rows 4g + r: that row's alpha lives in lane 4g + r
    const float a = __shfl(alpha, 4 * g + r, WAVE);
#pragma unroll
    for (int u = 0; u < PVC; ++u)
#pragma unroll
      for (int c = 0; c < 8; ++c) acc[u][c][r] *= a;
  }
#pragma unroll
  for (int sub = 0; sub < NSUB; ++sub) {
    float pe[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      pe[e] = fast_exp2(fmaf(s[sub][e], w.exp_scale, -ms));
      l += pe[e];
    }
    // PV B operands (u, c): V[keys 4g .. 4g + 3][head dim 8 (n + 16u) + c], 4 keys of V^T. A lane past the
    // head's pieces (n + 16u >= HS / 8) reads another piece: its output column is dropped.
#pragma unroll
    for (int u = 0; u < PVC; ++u) {
      const int piece = min(n + 16 * u, HS / 8 - 1);
      const uint8_t* vrow = sh.v + PG::voffset(8 * piece, k0 + 16 * sub + 4 * g);
#pragma unroll
      for (int c = 0; c < 8; ++c) {
        const PrefillVRead<VL> vf = *reinterpret_cast<const PrefillVRead<VL>*>(vrow + c * PG::VRS);
#pragma unroll
        for (int e = 0; e < PG::PST; ++e)
          acc[u][c] = prefill_mfma<VL>(p_operand<VL>(pe, e), v_operand<VL>(vf, e), acc[u][c]);
        if constexpr (sizeof(VL) == 4 && HS > 128) {
          if (c % 4 == 3) sched_fence();
        }
      }
    }
    sched_fence();
  }
}

// ---- the WMMA engine (wave32: RDNA3 / RDNA4, and the harness)
// Register types of the 16x16x16 WMMA builtins: C/D 8 x fp32; A/B 16 x 16-bit on gfx11, 8 on gfx12.
#if defined(KVMULTI_HIP_CPU_HARNESS)
typedef ::kvcpu::f32x8 wmma_f32x8;
#else
typedef float wmma_f32x8 __attribute__((ext_vector_type(8)));
#endif

// The WMMA operand layout: 11 (gfx11: a lane holds all 16 K-elements of its A row / B column, lanes 16-31
// repeating lanes 0-15), 12 (gfx12: lane l + 16 h holds K-elements 4h .. 4h + 3 and 8 + 4h .. 11 + 4h). A
// compile-time constant on device passes, the emulated family on the harness.
__device__ __forceinline__ int wmma_family() {
#if defined(KVMULTI_HIP_CPU_HARNESS)
  return ::kvcpu::wmma_family();
#elif defined(__GFX12__)
  return 12;
#else
  return 11;
#endif
}

// Whether the WMMA engine may run (harness: kvcpu_set_wmma_family(0) turns it off).
__device__ __forceinline__ bool wmma_enabled() { return wmma_family() != 0; }

// Row (M index) of D element r in lane group g = lane / 16 (the column is lane % 16).
__device__ __forceinline__ int wmma_drow(int family, int g, int r) { return family == 11 ? 2 * r + g : 8 * g + r; }

// A or B operand of one lane: 16 K-elements (gfx11) or 8 (gfx12: w[0..3]), 16 bits each, in order.
struct WFrag {
  uint32_t w[8];
};

// c += A * B for one 16 x 16 x 16 tile (v_wmma_f32_16x16x16_f16 / _bf16); all 32 lanes.
template <typename T>
__device__ __forceinline__ wmma_f32x8 wmma_16x16x16(const WFrag& a, const WFrag& b, wmma_f32x8 c) {
  constexpr bool F16 = std::is_same<T, __half>::value;
#if defined(KVMULTI_HIP_CPU_HARNESS)
  using H8 = typename std::conditional<F16, ::kvcpu::f16x8, ::kvcpu::bf16x8>::type;
  using H16 = typename std::conditional<F16, ::kvcpu::f16x16, ::kvcpu::bf16x16>::type;
  if (::kvcpu::wmma_family() == 12) {
    H8 x, y;
    __builtin_memcpy(&x, &a, 16);
    __builtin_memcpy(&y, &b, 16);
    if constexpr (F16) return __builtin_amdgcn_wmma_f32_16x16x16_f16_w32_gfx12(x, y, c);
    else return __builtin_amdgcn_wmma_f32_16x16x16_bf16_w32_gfx12(x, y, c);
  }
  H16 x, y;
  __builtin_memcpy(&x, &a, 32);
  __builtin_memcpy(&y, &b, 32);
  if constexpr (F16) return __builtin_amdgcn_wmma_f32_16x16x16_f16_w32(x, y, c);
  else return __builtin_amdgcn_wmma_f32_16x16x16_bf16_w32(x, y, c);
#elif defined(__GFX12__)
  typedef _Float16 h8 __attribute__((ext_vector_type(8)));
  typedef short s8 __attribute__((ext_vector_type(8)));
  if constexpr (F16) {
    h8 x, y;
    __builtin_memcpy(&x, &a, 16);
    __builtin_memcpy(&y, &b, 16);
    return __builtin_amdgcn_wmma_f32_16x16x16_f16_w32_gfx12(x, y, c);
  } else {
    s8 x, y;
    __builtin_memcpy(&x, &a, 16);
    __builtin_memcpy(&y, &b, 16);
    return __builtin_amdgcn_wmma_f32_16x16x16_bf16_w32_gfx12(x, y, c);
  }
#elif defined(__GFX11__)
  typedef _Float16 h16 __attribute__((ext_vector_type(16)));
  typedef short s16 __attribute__((ext_vector_type(16)));
  if constexpr (F16) {
    h16 x, y;
    __builtin_memcpy(&x, &a, 32);
    __builtin_memcpy(&y, &b, 32);
    return __builtin_amdgcn_wmma_f32_16x16x16_f16_w32(x, y, c);
  } else {
    s16 x, y;
    __builtin_memcpy(&x, &a, 32);
    __builtin_memcpy(&y, &b, 32);
    return __builtin_amdgcn_wmma_f32_16x16x16_bf16_w32(x, y, c);
  }
#else
  static_assert(sizeof(T) == 0, "WMMA on a target without it");
  return c;
#endif
}

// The WMMA engine's Q rows in LDS, wave w's 16 rows at q[w] (unscaled, zeros past the task's rows), read per
// 16-dim step as the B operand of S^T: in registers, a lane's Q operands and accumulators of 16 rows on 32
// lanes would spill at head 128. A row is padded by 16 bytes, so the 16 rows one read touches hit different
// banks.
template <int HS>
struct PrefillWmmaQShared {
  static constexpr int ROWB = 2 * HS + 16;
  alignas(16) uint8_t q[kNumWarps][16 * ROWB];
};

// One tile of a wave on the WMMA engine: prefill_tile's contract, on 32 lanes. Lane (n, g) = lane % 16,
// lane / 16. S^T = K Q^T per 16-key sub-tile and 16 head dims: A = key n's K dims, B = row n's Q dims (the
// same dims: gfx11 all 16 per lane, gfx12 the lane group's 8 -- a permutation of the K index both
// operands follow); D element e = S^T[key wmma_drow(g, e)][row n]. O += P V per 16 keys and 16 head dims:
// A = row n's probabilities, B = head dim column n's V, both with key k at K-element k on gfx11 (the
// lane's 8 scores and its partner lane's (lane ^ 16) 8 interleaved, a shuffle of 4 words), key 8 g + e at
// element e on gfx12 (the lane's own scores); acc[v] element r = O[row wmma_drow(g, r)][dim 16 v + n].
template <typename T, typename L, typename VL, int HS, bool MASKED, int SOFTCAP, bool ALIBI, int KTM = 64>
__device__ __forceinline__ void prefill_wmma_tile(const PagedAttentionParams& p, const PrefillShared<L, HS, KTM>& sh,
                                                  const PrefillRows& w, int t0, float& m, float& l,
                                                  wmma_f32x8 (&acc)[HS / 16], const uint8_t* qrow,
                                                  int k0 = 0) {
  using PG = PrefillGeom<L, HS, KTM, 32>;
  static_assert(PG::ES == 2 && HS % 16 == 0, "16-bit tiles, whole 16-dim steps");
  constexpr int WAVE = 32, NSUB = PG::NSUB < 4 ? PG::NSUB : 4, QS = HS / 16;
  const int lane = (int)threadIdx.x % WAVE, n = lane % 16, g = lane / 16;
  const int fam = wmma_family();
  float s[NSUB][8];
  float tmax = -INFINITY;
  const bool softcap = SOFTCAP > 0 || (SOFTCAP < 0 && p.softcap > 0.f);
#pragma unroll
  for (int sub = 0; sub < NSUB; ++sub) {
    wmma_f32x8 d = {};
    const int key = k0 + 16 * sub + n;
#pragma unroll
    for (int st = 0; st < QS; ++st) {
      WFrag kf;
      const Chunk16 c0 = *reinterpret_cast<const Chunk16*>(sh.k + PG::offset(key, 2 * st + (fam == 11 ? 0 : g)));
#pragma unroll
      for (int i = 0; i < 4; ++i) kf.w[i] = c0.w[i];
      if (fam == 11) {
        const Chunk16 c1 = *reinterpret_cast<const Chunk16*>(sh.k + PG::offset(key, 2 * st + 1));
#pragma unroll
        for (int i = 0; i < 4; ++i) kf.w[4 + i] = c1.w[i];
      } else {
#pragma unroll
        for (int i = 0; i < 4; ++i) kf.w[4 + i] = 0u;
      }
      WFrag qf;  // row n's dims 16 st + k (gfx11, k < 16) or 16 st + 8 g + k (gfx12, k < 8)
      const Chunk16 q0 = *reinterpret_cast<const Chunk16*>(qrow + 32 * st + (fam == 11 ? 0 : 16 * g));
#pragma unroll
      for (int i = 0; i < 4; ++i) qf.w[i] = q0.w[i];
      if (fam == 11) {
        const Chunk16 q1 = *reinterpret_cast<const Chunk16*>(qrow + 32 * st + 16);
#pragma unroll
        for (int i = 0; i < 4; ++i) qf.w[4 + i] = q1.w[i];
      } else {
#pragma unroll
        for (int i = 0; i < 4; ++i) qf.w[4 + i] = 0u;
      }
      d = wmma_16x16x16<L>(kf, qf, d);
      sched_fence();  // one step's K and Q reads in flight: no VGPRs for more
    }
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      float x = d[e];  // raw (without softcap: the scale is applied in the exponent)
      if (SOFTCAP > 0 || (SOFTCAP < 0 && softcap)) x = p.softcap * softcap_tanh(x * w.cap_scale);
      const int t = t0 + 16 * sub + wmma_drow(fam, g, e);
      if constexpr (ALIBI) x = fmaf(w.alibi_unit, (float)(t - w.qpos), x);  // after softcap, before the mask
      if constexpr (MASKED) {  // keys outside this lane's row range
        const bool vis = t >= w.rlo && t < w.rhi;
        x = vis ? x : -INFINITY;
      }
      s[sub][e] = x;
      tmax = fmaxf(tmax, x);
    }
    sched_fence();
  }
  tmax = wave_max_from<WAVE, 16>(tmax);
  const float m_new = fmaxf(m, tmax);
  const float alpha = fast_exp2((m - m_new) * w.exp_scale);
  m = m_new;
  // m in the exponent's units, finite (m = -FLT_MAX before any visible key: -inf would make -inf + inf)
  const float ms = fmaxf(m * w.exp_scale, -FLT_MAX);
  l *= alpha;
#pragma unroll
  for (int r = 0; r < 8; ++r) {  // acc element r: row wmma_drow(g, r), whose alpha lives in that lane
    const float a = __shfl(alpha, wmma_drow(fam, g, r), WAVE);
#pragma unroll
    for (int v = 0; v < QS; ++v) acc[v][r] *= a;
  }
#pragma unroll
  for (int sub = 0; sub < NSUB; ++sub) {
    float pe[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      pe[e] = fast_exp2(fmaf(s[sub][e], w.exp_scale, -ms));
      l += pe[e];
    }
    uint32_t mine[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) mine[j] = pack_p<VL>(pe[2 * j], pe[2 * j + 1]);
    WFrag pf;
    if (fam == 11) {  // mine[j]: keys 4j + g, 4j + 2 + g; the partner's the other two of keys 4j .. 4j + 3
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const uint32_t other = __shfl_xor(mine[j], 16, WAVE);
        const uint32_t w0 = g ? other : mine[j], w1 = g ? mine[j] : other;
        pf.w[2 * j] = pair_halves(w0, w1, 0);
        pf.w[2 * j + 1] = pair_halves(w0, w1, 1);
      }
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        pf.w[j] = mine[j];
        pf.w[4 + j] = 0u;
      }
    }
    // B operand v: V[the sub-tile's keys][head dim 16 v + n] from V^T, 4 keys per 8-byte read.
#pragma unroll
    for (int v = 0; v < QS; ++v) {
      WFrag vf;
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        if (fam == 11 || q < 2) {
          const int kq = fam == 11 ? 4 * q : 8 * g + 4 * q;
          const Frag2 r = *reinterpret_cast<const Frag2*>(sh.v + PG::voffset(16 * v + n, k0 + 16 * sub + kq));
          vf.w[2 * q] = r.w[0];
          vf.w[2 * q + 1] = r.w[1];
        } else {
          vf.w[2 * q] = vf.w[2 * q + 1] = 0u;
        }
      }
      acc[v] = wmma_16x16x16<VL>(pf, vf, acc[v]);
      sched_fence();
    }
    sched_fence();
  }
}

// The loop's state between tiles: the current tile's chunks (loaded, to be stored), the next tile's
// block-table entries.
template <typename C, int HS, typename L, int WAVE = 64>
struct PrefillPipe {
  Chunk16 kr[PrefillLoad<C, HS, L, WAVE>::CPT], vr[PrefillLoad<C, HS, L, WAVE>::CPT];
  TileTable next;
};

// Tiles ord(from) .. ord(to - 1) of the task: store the loaded tile, barrier, issue the next tile's K/V
// loads and the block-table entries of the one after it, compute, barrier. MASKED / SOFTCAP / ALIBI as in
// prefill_tile; WAVE 64: the MFMA engine (prefill_tile), 32: the WMMA engine (prefill_wmma_tile), whose
// accumulators ACC and Q operands QF these are.
template <typename T, typename C, int HS, bool ALIGNED, bool MASKED, int SOFTCAP, bool ALIBI, int WAVE,
          typename L, typename ACC, typename QF>
__device__ __forceinline__ void prefill_tiles(const PagedAttentionParams& p, const BlockTask& b,
                                              PrefillShared<L, HS, prefill_kt_max<C, HS, WAVE>()>& sh,
                                              PrefillPipe<C, HS, L, WAVE>& pipe, const PrefillRows& w, int from,
                                              int to, int base, const TileOrder& ord, float inv_bs,
                                              float& m, float& l, ACC& acc, const QF& qf) {
  constexpr int KTM = prefill_kt_max<C, HS, WAVE>(), KT = PrefillGeom<L, HS, KTM, WAVE>::KT;
  constexpr int WKEYS = PrefillGeom<L, HS, KTM, WAVE>::WKEYS;
  const int lane = (int)threadIdx.x % WAVE, ntiles = ord.ntiles;
  const int wkey = KT > WAVE ? WKEYS * ((int)threadIdx.x / WAVE) : 0;  // the wave's first key in a tile
  const int* bt_lane = b.bt + lane;
  // in VGPRs over an fp8 cache, see prefill_mfma_run
  const C* cache = lane_value<is_fp8<C>()>(static_cast<const C*>(p.kv_cache) + (int64_t)b.kv_head * p.kv_stride_head);
  for (int k = from; k < to; ++k) {
    const int t0 = base + ord(k) * KT, t1 = t0 + KT;
    prefill_store<C, HS, L, PrefillVElem<T, C>, WAVE>(sh, pipe.kr, pipe.vr);
    __syncthreads();
#if KVM_AMDGPU_DEVICE
    if constexpr (ALIGNED && !MASKED && SOFTCAP == 0 && !ALIBI) asm volatile("; kvmulti-hot-loop");  // compile_check's marker
#endif
    if (k + 1 < ntiles) {  // in flight while this tile computes
      prefill_load<C, HS, L, ALIGNED, WAVE>(p, b, cache, pipe.next, inv_bs, base + ord(k + 1) * KT, pipe.kr, pipe.vr);
      if (k + 2 < ntiles) pipe.next = tile_table(p, bt_lane, base + ord(k + 2) * KT + wkey, inv_bs, lane);
    }
#pragma unroll
    for (int k0 = 0; k0 < KT; k0 += 64) {  // 64-key steps of a 128-key tile
      const int s0 = t0 + k0, s1 = KT > 64 ? s0 + 64 : t1;
      if (s0 < w.hi_max && s1 > w.lo_min) {  // some row of this wave sees a key of the step
        if constexpr (WAVE == 64)
          prefill_tile<T, L, PrefillVElem<T, C>, HS, MASKED, SOFTCAP, ALIBI, KTM>(p, sh, w, s0, m, l, acc, qf, k0);
        else
          prefill_wmma_tile<T, L, PrefillVElem<T, C>, HS, MASKED, SOFTCAP, ALIBI, KTM>(p, sh, w, s0, m, l, acc, qf,
                                                                                     k0);
      }
    }
    __syncthreads();  // the next store rewrites the tile
  }
}

// A block-uniform 8-byte value copied into VGPRs (opaque to the compiler, so it does not keep the scalar
// copy live across the tile loops).
template <typename X>
__device__ __forceinline__ X in_vgprs(X x) {
#if KVM_AMDGPU_DEVICE
  static_assert(sizeof(X) == 8, "8-byte values");
  uint32_t w[2];
  __builtin_memcpy(w, &x, 8);
  asm volatile("v_mov_b32 %0, %1" : "=v"(w[0]) : "s"(w[0]));
  asm volatile("v_mov_b32 %0, %1" : "=v"(w[1]) : "s"(w[1]));
  __builtin_memcpy(&x, w, 8);
#endif
  return x;
}

// What the epilogue of prefill_mfma_run reads of the parameters: read where used (VG false; from the kernel's
// argument segment, see kernel_params), or (VG: fp32 queries over an fp8 cache) copied into VGPRs at the start
// (kept as scalars across the tile loops, they spilled 22-24 SGPRs on gfx90a).
template <bool VG>
struct PrefillEpilogue {
  const PagedAttentionParams& p;
  __device__ explicit PrefillEpilogue(const PagedAttentionParams& params) : p(params) {}
  __device__ void* out() const { return p.out; }
  __device__ GlobalPtr<float> part_out() const { return global_ptr(p.part_out); }
  __device__ GlobalPtr<float> part_max() const { return global_ptr(p.part_max); }
  __device__ GlobalPtr<float> part_sum() const { return global_ptr(p.part_sum); }
  __device__ GlobalPtr<const float> sinks() const { return global_ptr(p.sinks); }
  __device__ int64_t o_stride_token() const { return p.o_stride_token; }
  __device__ int64_t o_stride_head() const { return p.o_stride_head; }
};
template <>
struct PrefillEpilogue<true> {
  void* out_;
  float *part_out_, *part_max_, *part_sum_;
  const float* sinks_;
  int64_t o_stride_token_, o_stride_head_;
  __device__ explicit PrefillEpilogue(const PagedAttentionParams& p)
      : out_(in_vgprs(p.out)), part_out_(in_vgprs(p.part_out)), part_max_(in_vgprs(p.part_max)),
        part_sum_(in_vgprs(p.part_sum)), sinks_(in_vgprs(p.sinks)), o_stride_token_(in_vgprs(p.o_stride_token)),
        o_stride_head_(in_vgprs(p.o_stride_head)) {}
  __device__ void* out() const { return out_; }
  __device__ GlobalPtr<float> part_out() const { return global_ptr(part_out_); }
  __device__ GlobalPtr<float> part_max() const { return global_ptr(part_max_); }
  __device__ GlobalPtr<float> part_sum() const { return global_ptr(part_sum_); }
  __device__ GlobalPtr<const float> sinks() const { return global_ptr(sinks_); }
  __device__ int64_t o_stride_token() const { return o_stride_token_; }
  __device__ int64_t o_stride_head() const { return o_stride_head_; }
};

// The accumulators and Q operands of a lane: MFMA (WAVE 64) or WMMA (WAVE 32, 16-bit L only).
template <typename L, int HS, int WAVE>
struct PrefillRegs {
  mfma_f32x4 acc[MfmaGeom<L, HS>::PVC][8];
  PrefillQ<L, HS> qf;
  static constexpr int kRows = 4;   // accumulator elements (D rows) per lane
};
template <typename L, int HS>
struct PrefillRegs<L, HS, 32> {
  wmma_f32x8 acc[HS / 16];
  const uint8_t* qf;   // this lane's row of PrefillWmmaQShared
  static constexpr int kRows = 8;
};

// T: the query's and output's type (fp16 / bf16 / fp32); C: the cache's (T, or an fp8 type); L: the LDS
// tiles'. WAVE 64: the MFMA engine; 32: the WMMA engine (16-bit T).
template <typename T, typename C, int HS, bool ALIGNED, int SOFTCAP, bool ALIBI, int WAVE = 64,
          typename L = PrefillElem<T, C>>
__device__ __forceinline__ void prefill_mfma_run(const PagedAttentionParams& p, const BlockTask& b,
                                                 PrefillShared<L, HS, prefill_kt_max<C, HS, WAVE>()>& sh,
                                                 uint8_t* qlds) {
  using G = MfmaGeom<L, HS>;
  using PG = PrefillGeom<L, HS, prefill_kt_max<C, HS, WAVE>(), WAVE>;
  constexpr int QKC = PG::QKC, QST = PG::QST, PVC = G::PVC, EPC = G::EPC, KT = PG::KT;
  static_assert(WAVE == 64 || PG::ES == 2, "the WMMA engine takes 16-bit tiles");
  const int tid = (int)threadIdx.x, lane = tid % WAVE, warp = tid / WAVE;
  const int n = lane % 16, g = lane / 16;
  const int row = 16 * warp + n;  // this lane's row of the task (S^T's N index n)
  const bool has_row = row < b.rows;
  const PrefillEpilogue<sizeof(T) == 4 && is_fp8<C>()> ep(p);
  PrefillRows w;
  w.rlo = w.rhi = 0;
  if (has_row) key_range(p, b, row / b.nheads, w.rlo, w.rhi);
  const bool live = has_row && w.rlo < w.rhi;
  w.lo_min = -wave_max_int<WAVE>(live ? -w.rlo : -0x7fffffff);
  w.hi_max = wave_max_int<WAVE>(live ? w.rhi : -0x7fffffff);
  const float score_scale = is_fp8<C>() ? p.scale * global_ptr(p.k_scale)[b.kv_head] : p.scale;
  constexpr float kLog2e = 1.4426950408889634f;
  w.cap_scale = score_scale * p.inv_softcap;
  w.score_unit = SOFTCAP > 0 || (SOFTCAP < 0 && p.softcap > 0.f) ? 1.f : score_scale;
  w.exp_scale = kLog2e * w.score_unit;
  w.qpos = has_row ? query_pos(b, row / b.nheads) : 0;
  w.alibi_unit = ALIBI && has_row ? global_ptr(p.alibi_slopes)[b.head0 + row % b.nheads] / w.score_unit : 0.f;
  // Q operands (B of S^T = K Q^T) of the lane's row, unscaled; rows past b.rows are zero.
  PrefillRegs<L, HS, WAVE> regs;
  auto& qf = regs.qf;
  auto& acc = regs.acc;
  const T* q = nullptr;
  if (has_row)
    q = static_cast<const T*>(p.query) + (int64_t)(b.token + row / b.nheads) * p.q_stride_token +
        (int64_t)(b.head0 + row % b.nheads) * p.q_stride_head;
  if constexpr (WAVE == 32) {  // lane (n, g) stores half g of row n's Q (bit patterns)
    constexpr int QW = HS / 4;   // 32-bit words per half row
    const uint32_t* qw = reinterpret_cast<const uint32_t*>(q);
    uint8_t* dst = qlds + n * PrefillWmmaQShared<HS>::ROWB;
    for (int i = 0; i < QW; ++i) {
      uint32_t bits = 0u;
      if (q) __builtin_memcpy(&bits, qw + QW * g + i, 4);
      *reinterpret_cast<uint32_t*>(dst + 4 * (QW * g + i)) = bits;
    }
    wave_sync();
    qf = dst;
  } else {
#pragma unroll
    for (int u = 0; u < QKC; ++u)
#pragma unroll
      for (int h = 0; h < QST; ++h) {
        if constexpr (PG::ES == 4) {  // head dim 4 (4u + g) + h
          const int d = EPC * (4 * u + g) + h;
          qf[u][h] = q && d < HS ? Cvt<T>::to(q[d]) : 0.f;
        } else {
#pragma unroll
          for (int i = 0; i < 2; ++i) {
            const int d0 = EPC * (4 * u + g) + qk_dim<L>(h, 2 * i), d1 = EPC * (4 * u + g) + qk_dim<L>(h, 2 * i + 1);
            uint32_t bits = 0u;
            if (q && d0 < HS) {
              const unsigned short* qh = reinterpret_cast<const unsigned short*>(q);
              bits = (uint32_t)qh[d0] | ((uint32_t)qh[d1] << 16);
            }
            qf[u][h].w[i] = bits;
          }
        }
      }
  }
  float m = -FLT_MAX, l = 0.f;
  if constexpr (WAVE == 32) {
#pragma unroll
    for (int v = 0; v < HS / 16; ++v) acc[v] = wmma_f32x8{};
  } else {
#pragma unroll
    for (int u = 0; u < PVC; ++u)
#pragma unroll
      for (int c = 0; c < 8; ++c) acc[u][c] = mfma_f32x4{0.f, 0.f, 0.f, 0.f};
  }

  int base;
  const TileOrder ord = task_tiles<KT>(b, base);
  const int ntiles = ord.ntiles;
  // The loads' addressing (block table, key -> row) is per-lane arithmetic on these block-uniform values:
  // over an fp8 cache the loop takes them as VGPRs (pl, bl, inv_bs): it is short of SGPRs there. At head
  // 256, short of VGPRs too, only the 64-bit ones (the strides; the cache pointer in prefill_tiles).
  constexpr bool LV = is_fp8<C>() && HS < 256, LV64 = is_fp8<C>();
  PagedAttentionParams pl = p;
  pl.block_size = lane_value<LV>(p.block_size);
  pl.bt_cols = lane_value<LV>(p.bt_cols);
  pl.num_blocks = lane_value<LV>(p.num_blocks);
  pl.kv_stride_block = lane_value<LV64>(p.kv_stride_block);
  pl.kv_stride_token = lane_value<LV64>(p.kv_stride_token);
  BlockTask bl = b;
  bl.kv_lo = lane_value<LV>(b.kv_lo);
  bl.kv_hi = lane_value<LV>(b.kv_hi);
  const float inv_bs = lane_value<LV>(1.f / (float)p.block_size);
  const C* cache = static_cast<const C*>(p.kv_cache) + (int64_t)b.kv_head * p.kv_stride_head;
  const int* bt_lane = b.bt + lane;
  PrefillPipe<C, HS, L, WAVE> pipe;
  const int wkey = KT > WAVE ? PG::WKEYS * warp : 0;  // the wave's first key in a tile
  const TileTable first = tile_table(pl, bt_lane, base + ord(0) * KT + wkey, inv_bs, lane);
  prefill_load<C, HS, L, ALIGNED, WAVE>(pl, bl, cache, first, inv_bs, base + ord(0) * KT, pipe.kr, pipe.vr);
  pipe.next = ntiles > 1 ? tile_table(pl, bt_lane, base + ord(1) * KT + wkey, inv_bs, lane) : first;
  prefill_tiles<T, C, HS, ALIGNED, true, SOFTCAP, ALIBI, WAVE>(pl, bl, sh, pipe, w, 0, ord.masked(), base, ord,
                                                               inv_bs, m, l, acc, qf);
  prefill_tiles<T, C, HS, ALIGNED, false, SOFTCAP, ALIBI, WAVE>(pl, bl, sh, pipe, w, ord.masked(), ntiles, base,
                                                                ord, inv_bs, m, l, acc, qf);

  l = wave_sum_from<WAVE, 16>(l);
  if (!live) {  // a row with no visible key (e.g. outside this partition) may have taken unmasked tiles
    m = -FLT_MAX;
    l = 0.f;
  }
  // fp8 caches: values read as float(code) * v_scale, so the accumulated P V gets v_scale once
  const float v_scale = is_fp8<C>() ? global_ptr(p.v_scale)[b.kv_head] : 1.f;
  constexpr int RPL = PrefillRegs<L, HS, WAVE>::kRows;
  int fam = 0;
  if constexpr (WAVE == 32) fam = wmma_family();
#pragma unroll
  for (int r = 0; r < RPL; ++r) {  // acc element r: row dr of the wave, whose m, l (rm, rl) live in lane dr
    const int dr = WAVE == 64 ? 4 * g + r : wmma_drow(fam, g, r);
    const float rm = __shfl(m, dr, WAVE), rl = __shfl(l, dr, WAVE);
    const int rr = 16 * warp + dr;
    if (rr >= b.rows) continue;
    const int tok = b.token + rr / b.nheads, head = b.head0 + rr % b.nheads;
    // the attention sink joins the denominator here unless the reduce kernel adds it after the merge
    const float sink = ep.sinks() && p.num_partitions == 1 ? __expf(ep.sinks()[head] - rm * w.score_unit) : 0.f;
    const float f = rl > 0.f ? v_scale / (rl + sink) : 0.f;
    if (p.num_partitions > 1) {
      const int64_t idx = ((int64_t)tok * p.num_q_heads + head) * p.num_partitions + b.part;
      if (n == 0) {
        ep.part_max()[idx] = rl > 0.f ? rm * w.score_unit : -FLT_MAX;
        ep.part_sum()[idx] = rl;
      }
      if constexpr (WAVE == 32) {
#pragma unroll
        for (int v = 0; v < HS / 16; ++v) ep.part_out()[idx * HS + 16 * v + n] = rl > 0.f ? acc[v][r] * f : 0.f;
      } else {
#pragma unroll
        for (int u = 0; u < PVC; ++u)
#pragma unroll
          for (int c = 0; c < 8; ++c) {
            const int d = 8 * (n + 16 * u) + c;
            if (d < HS) ep.part_out()[idx * HS + d] = rl > 0.f ? acc[u][c][r] * f : 0.f;
          }
      }
    } else {
      T* o = static_cast<T*>(ep.out()) + (int64_t)tok * ep.o_stride_token() + (int64_t)head * ep.o_stride_head();
      if constexpr (WAVE == 32) {
#pragma unroll
        for (int v = 0; v < HS / 16; ++v)
          store_global(o + 16 * v + n, Cvt<T>::from(rl > 0.f ? acc[v][r] * f : 0.f));
      } else {
#pragma unroll
        for (int u = 0; u < PVC; ++u)
#pragma unroll
          for (int c = 0; c < 8; ++c) {
            const int d = 8 * (n + 16 * u) + c;
            if (d < HS) store_global(o + d, Cvt<T>::from(rl > 0.f ? acc[u][c][r] * f : 0.f));
          }
      }
    }
  }
}

// One LDS tile for both address paths (16-byte vector loads or element loads of a misaligned cache); ALiBi
// takes its own instantiations (softcap decided at run time there), over 16-bit and fp8 caches.
// WAVE 64: the MFMA engine, 32: the WMMA engine.
template <typename T, typename C, int HS, int WAVE = 64>
__device__ void prefill_mfma_body(const PagedAttentionParams& p, const BlockTask& b) {
  __shared__ PrefillShared<PrefillElem<T, C>, HS, prefill_kt_max<C, HS, WAVE>()> sh;
  uint8_t* qlds = nullptr;  // the wave's Q rows (WMMA)
  if constexpr (WAVE == 32) {
    __shared__ PrefillWmmaQShared<HS> qs;
    qlds = qs.q[threadIdx.x / WAVE];
  }
  const bool softcap = p.softcap > 0.f;
  if (p.alibi_slopes) {
    if (p.kv_aligned16) prefill_mfma_run<T, C, HS, true, -1, true, WAVE>(p, b, sh, qlds);
    else prefill_mfma_run<T, C, HS, false, -1, true, WAVE>(p, b, sh, qlds);
  } else if (p.kv_aligned16) {
    if (softcap) prefill_mfma_run<T, C, HS, true, 1, false, WAVE>(p, b, sh, qlds);
    else prefill_mfma_run<T, C, HS, true, 0, false, WAVE>(p, b, sh, qlds);
  } else {
    if (softcap) prefill_mfma_run<T, C, HS, false, 1, false, WAVE>(p, b, sh, qlds);
    else prefill_mfma_run<T, C, HS, false, 0, false, WAVE>(p, b, sh, qlds);
  }
}
#endif  // KVMULTI_HAS_MFMA || KVMULTI_HAS_WMMA

}  // namespace kvmulti

#include "kvmulti_prefill_fma.hip"

namespace kvmulti {

// The task's rows in slices of the decode kernel's FMA engine's R rows (head 256 without MFMA: the harness).
template <typename T, typename C, int HS, int WAVE>
__device__ void prefill_fma_body(const PagedAttentionParams& p, const BlockTask& b) {
  constexpr int R = rows_per_block<T, WAVE, C>(), NT = kNumWarps * WAVE;
  for (int r0 = 0; r0 < b.rows; r0 += R) {
    BlockTask s = b;
    s.row0 = r0;
    s.rows = min(R, b.rows - r0);
    task_key_union(p, s);
    if (s.kv_lo >= s.kv_hi) write_empty_rows<T, HS, NT>(p, s);
    else fma_body<T, C, HS, WAVE, R>(p, s);
    __syncthreads();  // the next slice rewrites fma_body's LDS
  }
}

// grid (ceil(num_tokens / tpt) + num_reqs, num_kv_heads * RowMap::chunks, num_partitions) with RowMap over
// kPrefillRows rows (tpt: its tokens_per_block), block kNumWarps * WAVE threads, no dynamic shared memory.
// T: query and output type; C: cache element type (T, or an fp8 type).
template <typename T, typename C, int HS, int WAVE>
__global__ void __launch_bounds__(kNumWarps * WAVE, 2) paged_prefill_kernel(const PagedAttentionParams p) {
  if (!wave_matches_target<WAVE>()) return;
  constexpr int NT = kNumWarps * WAVE;
  static_assert(2 * HS * sizeof(C) <= sizeof(kZeroRow), "kZeroRow must cover a K + V row");
  BlockTask b;
  const TaskKind kind = prefill_task(p, b);
  if (kind == TaskKind::kCovered) return;
  if (kind == TaskKind::kInvalid || b.kv_lo >= b.kv_hi) {
    write_empty_rows<T, HS, NT>(p, b);
    return;
  }
#if KVMULTI_HAS_MFMA
  if constexpr (WAVE == 64 && prefill_mfma_path<T, C, WAVE>()) {
    if (mfma_enabled()) {
      prefill_mfma_body<T, C, HS>(kernel_params(p), b);
      return;
    }
  }
#endif
#if KVMULTI_HAS_WMMA
  if constexpr (WAVE == 32 && prefill_wmma_path<T, C, HS>()) {
    if (wmma_enabled()) {
      prefill_mfma_body<T, C, HS, 32>(kernel_params(p), b);
      return;
    }
  }
#endif
#if KVMULTI_HAS_MFMA && !defined(KVMULTI_HIP_CPU_HARNESS)
  if constexpr (WAVE == 64) return;  // the MFMA engine served every wave64 task above
#endif
  if constexpr (fma_tile_path<T, C, HS>()) prefill_fma_tiles_body<T, C, HS, WAVE>(p, b);
  else prefill_fma_body<T, C, HS, WAVE>(p, b);
}

}  // namespace kvmulti
