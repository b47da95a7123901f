// kvmulti HIP prefill kernel, FMA tile engine: the prefill kernel's path where no matrix instruction serves the
// step -- RDNA2 and NVIDIA (through hip/compat) for every query type, RDNA3 / RDNA4 for fp32 queries,
// the harness with MFMA / WMMA disabled -- at heads up to 128 over a cache of the query's type.
//
// The work-group's 64 rows (prefill_task) share each tile of KT keys: its K and V rows are read from global
// memory in 16-byte chunks (wave w loads keys w KT / 4 .. (w + 1) KT / 4 - 1 of the tile, the next tile's
// loads in flight while the current one's PV computes), widened to fp32 once and stored in LDS, where every wave
// reads them. Wave w owns rows 16 w .. 16 w + 15; lane (g, x) = (lane / NG, lane % NG) of its 4 row groups of
// NG lanes holds rows 16 w + 4 g .. 16 w + 4 g + 3 and, for them, the head dims of the 4-dim chunks x, x + NG,
// .. (CPL of them) of the pre-scaled query and of the output accumulators, all in registers:
//   * QK: per step of KS = NG / 2 keys, each lane forms its chunks' partial dot products for its 4 rows x KS
//     keys (one 16-byte LDS read of K per key and chunk, used for 4 rows), and a butterfly reduce-scatter over
//     the row group's NG lanes leaves lane x the finished scores of 2 of the rows (rh, rh + 1) of one key:
//     every exponential is computed once per score;
//   * the online softmax: a row's tile maximum is a butterfly over the row group; its running sum stays a
//     per-lane partial, summed once at the end;
//   * PV: each lane accumulates its chunks of its 4 rows from each key's V row (one 16-byte LDS read per key
//     and chunk, used for 4 rows), the key's probabilities taken by shuffles from the lane that holds them.
// Tiles none of a wave's rows sees are skipped by that wave (it still stores its share of the tile); tiles
// visible to every row of the group run without masks (TileOrder). Waves never combine: each finishes and
// writes its own rows.
#pragma once

#include "kvmulti_attention.hip"

namespace kvmulti {

// What the FMA tile engine serves: heads up to 128 (head 256's accumulators and query would take 256 registers
// per lane) over a cache of the query's type. fp8 caches keep the attention kernel: with their codes staged
// (tiles of 32 - 64 keys for 2 K and 2 V loads per lane), gfx1100 spilled 5 - 52 registers at every head.
template <typename T, typename C, int HS>
__host__ __device__ constexpr bool fma_tile_path() {
  return HS <= 128 && !is_fp8<C>();
}

// Keys per tile: from 8 up to 64, doubled while a lane would issue fewer than 2 K (and 2 V) loads per tile and
// the tile's fp32 K + V still fit 32 KiB of LDS. LCH: a cache row's 16-byte chunks.
__host__ __device__ constexpr int fma_tile_keys(int lch, int hs, int wave) {
  int kt = 8;
  while (kt < 64 && kt / kNumWarps * lch <= wave && 2 * (2 * kt) * hs * 4 <= 32768) kt *= 2;
  return kt;
}

template <typename C, int HS, int WAVE>
struct FmaTileGeom {
  static constexpr int MR = 4;                   // rows per lane
  static constexpr int NG = WAVE * MR / 16;      // lanes per row group: 8 (wave32), 16 (wave64)
  static constexpr int NCH = HS / 4;             // 4-dim chunks of a row in LDS (fp32)
  static constexpr int CPL = (NCH + NG - 1) / NG;  // chunks per lane: x + NG c
  static constexpr int EPC = 16 / (int)sizeof(C);  // cache elements per 16-byte load
  static constexpr int LCH = HS / EPC;           // loads per cache row
  static constexpr int KT = fma_tile_keys(LCH, HS, WAVE);
  static constexpr int WKEYS = KT / kNumWarps;   // keys of a tile each wave loads
  static constexpr int LPT = (WKEYS * LCH + WAVE - 1) / WAVE;  // K (and V) loads per lane and tile
  static constexpr int KS = NG / 2;              // keys per QK step
  static constexpr int NSTEP = KT / KS;
  static constexpr int N = MR * KS;              // partial scores per lane and step, key-major (key MR + row)
  static constexpr int NF = N / NG;              // finished scores per lane and step: 2 rows of one key
  static_assert(HS % EPC == 0 && KT % KS == 0 && NF == 2, "FMA tile geometry");
};

template <typename C, int HS, int WAVE>
struct FmaTileShared {
  using Geo = FmaTileGeom<C, HS, WAVE>;
  Float4 k[Geo::KT][Geo::NCH];   // the tile's K rows, fp32 (fp8: the codes' values, unscaled)
  Float4 v[Geo::KT][Geo::NCH];
  RowInfo<kPrefillRows> ri;
};

// The loads of the tile at key t0 (wave w: keys t0 + w WKEYS ..; tt: their block-table entries). Every lane
// calls it (key_row shuffles); a lane past the wave's chunks loads its last one again.
template <typename C, int HS, int WAVE, bool ALIGNED>
__device__ __forceinline__ void fma_tile_load(const PagedAttentionParams& p, const BlockTask& b, const C* cache,
                                              const TileTable& tt, float inv_bs, int t0,
                                              Chunk16 (&kr)[FmaTileGeom<C, HS, WAVE>::LPT],
                                              Chunk16 (&vr)[FmaTileGeom<C, HS, WAVE>::LPT]) {
  using Geo = FmaTileGeom<C, HS, WAVE>;
  const int lane = (int)threadIdx.x % WAVE, wkey = Geo::WKEYS * ((int)threadIdx.x / WAVE);
#pragma unroll
  for (int s = 0; s < Geo::LPT; ++s) {
    const int j = min(lane + WAVE * s, Geo::WKEYS * Geo::LCH - 1);
    bool unused;
    const C* row = key_row<WAVE>(p, b, cache, tt.entry, tt.ws, inv_bs, t0 + wkey + j / Geo::LCH, unused);
    kr[s] = load_chunk<C, ALIGNED>(row + (j % Geo::LCH) * Geo::EPC);
    vr[s] = load_chunk<C, ALIGNED>(row + HS + (j % Geo::LCH) * Geo::EPC);
  }
}

// Stores the loaded chunks into the LDS tile, widened to fp32.
template <typename C, int HS, int WAVE>
__device__ __forceinline__ void fma_tile_store(FmaTileShared<C, HS, WAVE>& sh,
                                               const Chunk16 (&kr)[FmaTileGeom<C, HS, WAVE>::LPT],
                                               const Chunk16 (&vr)[FmaTileGeom<C, HS, WAVE>::LPT]) {
  using Geo = FmaTileGeom<C, HS, WAVE>;
  constexpr int F4 = Geo::EPC / 4;  // Float4s per chunk
  const int lane = (int)threadIdx.x % WAVE, wkey = Geo::WKEYS * ((int)threadIdx.x / WAVE);
#pragma unroll
  for (int s = 0; s < Geo::LPT; ++s) {
    const int j = lane + WAVE * s;
    if (Geo::WKEYS * Geo::LCH % WAVE == 0 || j < Geo::WKEYS * Geo::LCH) {
      const int key = wkey + j / Geo::LCH, c0 = (j % Geo::LCH) * F4;
#pragma unroll
      for (int f = 0; f < F4; ++f) {
        Float4 kf, vf;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          kf.v[e] = piece_elem<C, 4>(kr[s].w, 4 * f + e);
          vf.v[e] = piece_elem<C, 4>(vr[s].w, 4 * f + e);
        }
        sh.k[key][c0 + f] = kf;
        sh.v[key][c0 + f] = vf;
      }
    }
  }
}

// A lane's state across the tiles: its 4 rows' pre-scaled query chunks, output accumulators, running max and
// partial sum, and the wave's live key range.
template <typename C, int HS, int WAVE>
struct FmaTileRows {
  using Geo = FmaTileGeom<C, HS, WAVE>;
  float q[Geo::MR][Geo::CPL][4];
  float acc[Geo::MR][Geo::CPL][4];
  float m[Geo::MR];     // the rows' running maxima (every lane of the row group holds all 4)
  float l[Geo::NF];     // partial sums of the lane's rows rh, rh + 1 over the keys it holds
  int lo_min, hi_max;   // the wave's live rows see keys [lo_min, hi_max) only
};

// One tile at key t0 for the calling wave; between(): called after the softmax, before PV (the next tile's
// loads: their registers are not live during QK). MASKED: per-key visibility from the rows' ranges; TERMS:
// softcap and ALiBi as the parameters say (otherwise neither).
template <typename C, int HS, int WAVE, bool MASKED, bool TERMS, typename Between>
__device__ __forceinline__ void fma_tile(const PagedAttentionParams& p, const FmaTileShared<C, HS, WAVE>& sh,
                                         FmaTileRows<C, HS, WAVE>& w, int t0, const Between& between) {
  using Geo = FmaTileGeom<C, HS, WAVE>;
  constexpr int MR = Geo::MR, NG = Geo::NG, NCH = Geo::NCH, CPL = Geo::CPL, KS = Geo::KS, N = Geo::N;
  constexpr int NSTEP = Geo::NSTEP, NF = Geo::NF;
  const int lane = (int)threadIdx.x % WAVE, x = lane % NG, gbase = lane - x;
  const int row0 = 16 * ((int)threadIdx.x / WAVE) + MR * (lane / NG);  // the lane's first row of the task
  const int first = scatter_first<N, NG>(x);
  const int own = first / MR, rh = first % MR;  // the lane's key of each step and its first row there
  float sc[NSTEP][NF];
#pragma unroll
  for (int st = 0; st < NSTEP; ++st) {
    float s[N];
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) {
      pass_fence();  // one key's reads and FMAs at a time (hoisted together, the keys' operands spill on AMD)
      float d[MR] = {};
#pragma unroll
      for (int c = 0; c < CPL; ++c) {
        const int ch = x + NG * c;
        // a padding chunk (its query chunk is zeros) reads the key's last one: non-finite there, it makes the
        // key's score non-finite anyway
        const Float4 kf = sh.k[st * KS + kk][NCH % NG == 0 || ch < NCH ? ch : NCH - 1];
#pragma unroll
        for (int i = 0; i < MR; ++i)
#pragma unroll
          for (int e = 0; e < 4; ++e) d[i] += w.q[i][c][e] * kf.v[e];
      }
#pragma unroll
      for (int i = 0; i < MR; ++i) s[kk * MR + i] = d[i];
    }
    reduce_scatter<WAVE, NG / 2, N, N>(s, lane);
#pragma unroll
    for (int f = 0; f < NF; ++f) {
      float z = s[f];
      const int t = t0 + st * KS + own;
      if constexpr (MASKED || TERMS) {
        const int r = row0 + rh + f;
        const float bias = TERMS ? sh.ri.slope[r] * (float)(t - sh.ri.qpos[r]) : 0.f;
        z = finish_score(p, z, 1.f, bias, !MASKED || (t >= sh.ri.lo[r] && t < sh.ri.hi[r]));
      }
      sc[st][f] = z;
    }
  }
  // the 4 rows' tile maxima: the lane's own 2 in their places, a butterfly over the row group
  float own_max[NF], mx[MR];
#pragma unroll
  for (int f = 0; f < NF; ++f) {
    own_max[f] = sc[0][f];
#pragma unroll
    for (int st = 1; st < NSTEP; ++st) own_max[f] = fmaxf(own_max[f], sc[st][f]);
  }
#pragma unroll
  for (int i = 0; i < MR; ++i) mx[i] = (i & ~(NF - 1)) == rh ? own_max[i % NF] : -INFINITY;
#pragma unroll
  for (int mask = 1; mask < NG; mask <<= 1) {
    float other[MR];
    shfl_xor_n<WAVE, MR>(mx, other, mask);
#pragma unroll
    for (int i = 0; i < MR; ++i) mx[i] = fmaxf(mx[i], other[i]);
  }
  float alpha[MR];
#pragma unroll
  for (int i = 0; i < MR; ++i) {
    const float m_new = fmaxf(w.m[i], mx[i]);
    alpha[i] = __expf(w.m[i] - m_new);
    w.m[i] = m_new;
#pragma unroll
    for (int c = 0; c < CPL; ++c)
#pragma unroll
      for (int e = 0; e < 4; ++e) w.acc[i][c][e] *= alpha[i];
  }
#pragma unroll
  for (int f = 0; f < NF; ++f) {  // the lane's scores' probabilities and its rows' partial sums
#if KVM_AMDGPU_DEVICE
    // as selects, clang 15 turns these into an index of w's arrays, which go to scratch on gfx10
    const float m_row = lane_pick(rh != 0, w.m[NF + f], w.m[f]), a_row = lane_pick(rh != 0, alpha[NF + f], alpha[f]);
#else  // nvcc: the selects (through lane_pick it spilled at 16-bit heads 64 / 128)
    const float m_row = rh ? w.m[NF + f] : w.m[f], a_row = rh ? alpha[NF + f] : alpha[f];
#endif
    float sum = 0.f;
#pragma unroll
    for (int st = 0; st < NSTEP; ++st) {
      sc[st][f] = __expf(sc[st][f] - m_row);
      sum += sc[st][f];
    }
    w.l[f] = w.l[f] * a_row + sum;
  }
  between();
#pragma unroll
  for (int st = 0; st < NSTEP; ++st) {
    const WaveView<WAVE, float, NF> pv(sc[st]);
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) {
      pass_fence();
      float pr[MR];
#pragma unroll
      for (int i = 0; i < MR; ++i) pr[i] = pv.read(gbase + scatter_holder<N, NG, NF>(kk * MR + i), i % NF);
#pragma unroll
      for (int c = 0; c < CPL; ++c) {
        const int ch = x + NG * c;
        const Float4 vf = sh.v[st * KS + kk][NCH % NG == 0 || ch < NCH ? ch : NCH - 1];
#pragma unroll
        for (int i = 0; i < MR; ++i)
#pragma unroll
          for (int e = 0; e < 4; ++e) w.acc[i][c][e] += pr[i] * vf.v[e];
      }
    }
  }
}

// The loop's state between tiles: the current tile's chunks (loaded, to be stored), the next tile's
// block-table entries.
template <typename C, int HS, int WAVE>
struct FmaTilePipe {
  Chunk16 kr[FmaTileGeom<C, HS, WAVE>::LPT], vr[FmaTileGeom<C, HS, WAVE>::LPT];
  TileTable next;
};

// Tiles ord(from) .. ord(to - 1): store the loaded tile, barrier, compute (waves whose rows see the tile) with
// the next tile's loads and the block-table entries of the one after it issued between QK and PV, barrier.
template <typename C, int HS, int WAVE, bool ALIGNED, bool MASKED, bool TERMS>
__device__ __forceinline__ void fma_tiles(const PagedAttentionParams& p, const BlockTask& b, const C* cache,
                                          FmaTileShared<C, HS, WAVE>& sh, FmaTilePipe<C, HS, WAVE>& pipe,
                                          FmaTileRows<C, HS, WAVE>& w, int from, int to, int base,
                                          const TileOrder& ord, float inv_bs) {
  using Geo = FmaTileGeom<C, HS, WAVE>;
  constexpr int KT = Geo::KT;
  const int lane = (int)threadIdx.x % WAVE, wkey = Geo::WKEYS * ((int)threadIdx.x / WAVE);
  const int* bt_lane = b.bt + lane;
  for (int k = from; k < to; ++k) {
    const int t0 = base + ord(k) * KT;
    fma_tile_store<C, HS, WAVE>(sh, pipe.kr, pipe.vr);
    __syncthreads();
#if KVM_AMDGPU_DEVICE
    if constexpr (ALIGNED && !MASKED && !TERMS) asm volatile("; kvmulti-hot-loop");  // compile_check's marker
#endif
    const auto next = [&]() {  // in flight while this tile's PV computes
      if (k + 1 < ord.ntiles) {
        fma_tile_load<C, HS, WAVE, ALIGNED>(p, b, cache, pipe.next, inv_bs, base + ord(k + 1) * KT, pipe.kr,
                                            pipe.vr);
        if (k + 2 < ord.ntiles) pipe.next = tile_table(p, bt_lane, base + ord(k + 2) * KT + wkey, inv_bs, lane);
      }
    };
    if (t0 < w.hi_max && t0 + KT > w.lo_min) {  // some row of this wave sees a key of the tile
      fma_tile<C, HS, WAVE, MASKED, TERMS>(p, sh, w, t0, next);
      count_fma_tile(lane);
    } else {
      next();
    }
    __syncthreads();  // the next store rewrites the tile
  }
}

// Writes the lane's rows: normalised (with the attention sink in the denominator) to the output, or as split-KV
// partials. l: the rows' sums over the row group; v_scale: fp8 caches' value scale (1 otherwise).
template <typename T, typename C, int HS, int WAVE>
__device__ __forceinline__ void fma_tile_write(const PagedAttentionParams& p, const BlockTask& b,
                                               const FmaTileRows<C, HS, WAVE>& w,
                                               const float (&l)[FmaTileGeom<C, HS, WAVE>::MR],
                                               float v_scale) {
  using Geo = FmaTileGeom<C, HS, WAVE>;
  constexpr int MR = Geo::MR, NG = Geo::NG, NCH = Geo::NCH, CPL = Geo::CPL;
  const int lane = (int)threadIdx.x % WAVE, x = lane % NG;
  const int row0 = 16 * ((int)threadIdx.x / WAVE) + MR * (lane / NG);
#pragma unroll
  for (int i = 0; i < MR; ++i) {
    const int r = row0 + i;
    if (r >= b.rows) continue;
    const int tok = b.token + r / b.nheads, head = b.head0 + r % b.nheads;
    const float sink = p.sinks && p.num_partitions == 1 ? __expf(p.sinks[head] - w.m[i]) : 0.f;
    const float f = l[i] > 0.f ? v_scale / (l[i] + sink) : 0.f;
    if (p.num_partitions > 1) {
      const int64_t idx = ((int64_t)tok * p.num_q_heads + head) * p.num_partitions + b.part;
      if (x == 0) {
        p.part_max[idx] = l[i] > 0.f ? w.m[i] : -FLT_MAX;
        p.part_sum[idx] = l[i];
      }
#pragma unroll
      for (int c = 0; c < CPL; ++c) {
        const int ch = x + NG * c;
        if (NCH % NG == 0 || ch < NCH) {
#pragma unroll
          for (int e = 0; e < 4; ++e) p.part_out[idx * HS + 4 * ch + e] = w.acc[i][c][e] * f;
        }
      }
    } else {
      T* o = static_cast<T*>(p.out) + (int64_t)tok * p.o_stride_token + (int64_t)head * p.o_stride_head;
#pragma unroll
      for (int c = 0; c < CPL; ++c) {
        const int ch = x + NG * c;
        if (NCH % NG == 0 || ch < NCH) {
#pragma unroll
          for (int e = 0; e < 4; ++e) o[4 * ch + e] = Cvt<T>::from(w.acc[i][c][e] * f);
        }
      }
    }
  }
}

// T: the query's and output's type; C: the cache's (T, or an fp8 type). ALIGNED, TERMS as in fma_tiles.
template <typename T, typename C, int HS, int WAVE, bool ALIGNED, bool TERMS>
__device__ __forceinline__ void prefill_fma_tiles_run(const PagedAttentionParams& p, const BlockTask& b,
                                                      FmaTileShared<C, HS, WAVE>& sh) {
  using Geo = FmaTileGeom<C, HS, WAVE>;
  constexpr int MR = Geo::MR, NG = Geo::NG, NCH = Geo::NCH, CPL = Geo::CPL, KT = Geo::KT;
  const int lane = (int)threadIdx.x % WAVE, warp = (int)threadIdx.x / WAVE, x = lane % NG;
  const int row0 = 16 * warp + MR * (lane / NG);
  FmaTileRows<C, HS, WAVE> w;
  // fp8 caches: scores are q . float(code) x k_scale, outputs sum p float(code) x v_scale
  const float q_scale = p.scale * (is_fp8<C>() ? p.k_scale[b.kv_head] : 1.f);
#pragma unroll
  for (int i = 0; i < MR; ++i) {
    const int r = row0 + i;
    const T* q = nullptr;
    if (r < b.rows)
      q = static_cast<const T*>(p.query) + (int64_t)(b.token + r / b.nheads) * p.q_stride_token +
          (int64_t)(b.head0 + r % b.nheads) * p.q_stride_head;
#pragma unroll
    for (int c = 0; c < CPL; ++c) {
      const int ch = x + NG * c;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        w.q[i][c][e] = q && ch < NCH ? Cvt<T>::to(q[4 * ch + e]) * q_scale : 0.f;
        w.acc[i][c][e] = 0.f;
      }
    }
    w.m[i] = -FLT_MAX;
  }
#pragma unroll
  for (int f = 0; f < Geo::NF; ++f) w.l[f] = 0.f;
  {  // the wave's live rows' key range, from its 16 rows (lane % 16)
    const int r = 16 * warp + lane % 16;
    const bool live = r < b.rows && sh.ri.lo[r] < sh.ri.hi[r];
    w.lo_min = -wave_max_int<WAVE>(live ? -sh.ri.lo[r] : -0x7fffffff);
    w.hi_max = wave_max_int<WAVE>(live ? sh.ri.hi[r] : -0x7fffffff);
  }
  int base;
  const TileOrder ord = task_tiles<KT>(b, base);
  const float inv_bs = 1.f / (float)p.block_size;
  const C* cache = static_cast<const C*>(p.kv_cache) + (int64_t)b.kv_head * p.kv_stride_head;
  const int* bt_lane = b.bt + lane;
  const int wkey = Geo::WKEYS * warp;
  FmaTilePipe<C, HS, WAVE> pipe;
  const TileTable first = tile_table(p, bt_lane, base + ord(0) * KT + wkey, inv_bs, lane);
  fma_tile_load<C, HS, WAVE, ALIGNED>(p, b, cache, first, inv_bs, base + ord(0) * KT, pipe.kr, pipe.vr);
  pipe.next = ord.ntiles > 1 ? tile_table(p, bt_lane, base + ord(1) * KT + wkey, inv_bs, lane) : first;
  fma_tiles<C, HS, WAVE, ALIGNED, true, TERMS>(p, b, cache, sh, pipe, w, 0, ord.masked(), base, ord, inv_bs);
  fma_tiles<C, HS, WAVE, ALIGNED, false, TERMS>(p, b, cache, sh, pipe, w, ord.masked(), ord.ntiles, base, ord,
                                                 inv_bs);
  // the rows' sums over the row group (lane x holds the partial sums of rows rh, rh + 1)
  const int rh = scatter_first<Geo::N, NG>(x) % MR;
  float l[MR];
#pragma unroll
  for (int i = 0; i < MR; ++i) l[i] = (i & ~(Geo::NF - 1)) == rh ? w.l[i % Geo::NF] : 0.f;
#pragma unroll
  for (int mask = 1; mask < NG; mask <<= 1) {
    float other[MR];
    shfl_xor_n<WAVE, MR>(l, other, mask);
#pragma unroll
    for (int i = 0; i < MR; ++i) l[i] += other[i];
  }
#pragma unroll
  for (int i = 0; i < MR; ++i) {  // a row with no visible key may have taken unmasked tiles
    const int r = row0 + i;
    if (r >= b.rows || sh.ri.lo[r] >= sh.ri.hi[r]) l[i] = 0.f;
  }
  fma_tile_write<T, C, HS, WAVE>(p, b, w, l, is_fp8<C>() ? p.v_scale[b.kv_head] : 1.f);
}

template <typename T, typename C, int HS, int WAVE>
__device__ void prefill_fma_tiles_body(const PagedAttentionParams& p, const BlockTask& b) {
  __shared__ FmaTileShared<C, HS, WAVE> sh;
  publish_row_ranges<kPrefillRows>(p, b, sh.ri);  // + barrier
  const bool terms = p.softcap > 0.f || p.alibi_slopes;
  if (p.kv_aligned16) {
    if (terms) prefill_fma_tiles_run<T, C, HS, WAVE, true, true>(p, b, sh);
    else prefill_fma_tiles_run<T, C, HS, WAVE, true, false>(p, b, sh);
  } else {
    if (terms) prefill_fma_tiles_run<T, C, HS, WAVE, false, true>(p, b, sh);
    else prefill_fma_tiles_run<T, C, HS, WAVE, false, false>(p, b, sh);
  }
}

}  // namespace kvmulti
