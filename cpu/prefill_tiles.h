// Many-row work items (prefill, and verification with more rows per KV head than the direct path
// takes): the query rows are the SIMD lanes. Included by attention_kernel.h (uses its loads, exp,
// dot2_bf16 and key_rows); compiled once per ISA like it.
//
// An item's rows of one KV head (Mh = tokens x G, token-major: row t x G + g) are held transposed,
// one lane per row: Qt[d][row]. A key's scores for a vector of rows are then FMAs (or bf16 dots) of
// Qt's vectors with the key's element broadcast from its row: no per-key lane reduction, and every
// K element is loaded once per key tile for all rows of the item. The softmax runs per lane (running
// max and sum per row vector); P.V accumulates O transposed, Ot[dv][row], from the probability
// vectors times V's element broadcast. Keys go in tiles of kTileKeys: a tile no row can see (causal,
// window) is skipped whole, and only a tile that crosses a row's limit is masked; inside it, the
// register tiles no row of their block sees are skipped too, and (causal) those every row of their
// block sees take the unmasked epilogue (block_keys).
// Two arithmetic modes, one code:
//  - bf16 dots (KV_DIRECT_DOT, bf16 query over a bf16 cache or an fp8 one, widened to bf16 exactly):
//    a 32-bit lane holds an element pair. Qt holds the query's pairs (d, d + 1), a K pair is
//    broadcast straight from the cache row, P holds the probabilities of keys (2k, 2k + 1) rounded to
//    bf16, and V's rows of those keys are interleaved word by word once per tile.
//  - fp32 FMAs otherwise: K / V rows straight from an fp32 cache, else widened once per tile.
// fp8 caches: the widened values are value / fp8_unit; the per-head k_scale (and the unit) go into
// the query scale, v_scale into the output rows, as on the other paths.

// Register tiles: RB row vectors x tile_keys<RB>() keys (in P.V: head dims) of accumulators.
// AVX-512 (32 vector registers): 16 accumulators, in blocks of 4, 2 or 1 row vectors. AVX2 and SSE
// (16 registers): 12 in blocks of 3 row vectors, whose 3 query (probability) vectors and a broadcast
// fill the rest, and 8 in blocks of 2; fewer than 8 independent FMAs would wait on their latency.
template <int RB> constexpr int tile_keys() { return KV_W == 16 ? 16 / RB : (RB == 1 ? 8 : 4); }
// Keys of a tile are padded to whole multiples of this (every tile_keys<RB>() divides it).
constexpr int kTileAcc = KV_W == 16 ? 16 : 8;
// Row vectors of one KV head's rows at most (kTileMaxRows in kvmulti_cpu.h); items with more rows
// per KV head take the row-block path.
constexpr int kTileRowVecs = kTileMaxRows / KV_W;

struct TileCtx {
  int Mr;                   // rows rounded up to whole vectors: the row stride of Qt, St, Pp, Ot
  int D, Dv;
  const void* const* k;    // [npad] K rows: fp32, or bf16 in dot mode (padding keys: a zero row)
  const void* const* v;    // [npad] V rows (fp32 mode)
  const uint32_t* vpair;   // dot mode: [npad / 2][Dv] bf16 pairs (V[2k][dv], V[2k + 1][dv])
  int c0, n, npad;         // first key position, keys, keys padded to whole register tiles
  bool need_mask, causal;
  int window;
  float softcap;
  float qk_scale;          // the scale the QK epilogue applies to the scores it stores
  float exp_scale;         // the scale the softmax applies to St's scores (dot mode: the query scale where the
                           // epilogue leaves them unscaled, a positive scale without softcap or ALiBi), else 1
  const vi* pos;           // [Mr / KV_W] each lane's row position
  float* St;               // [npad][Mr] scores, then (fp32 mode) probabilities
  uint32_t* Pp;            // dot mode: [npad / 2][Mr] probability pairs of keys (2k, 2k + 1)
  const vf* slope;         // [Mr / KV_W] each lane's ALiBi slope, or nullptr
  const void* const* pf;   // the next tile's [pf_n] K/V rows of pf_lines cache lines, prefetched during this
  int pf_n, pf_lines;      // tile's first row block's QK (a burst ahead of the tile lost lines), or nullptr
};

// exp(x) for x = s c - mc <= 0, c and mc in log2 units (c = scale x log2 e), at the precision of a
// probability rounded to bf16 afterwards (relative error below 6e-6, against bf16's 2^-9); 0 for
// -inf, and for NaN as vexp_nonpos gives. AVX-512: y = s c - mc by one FMA, clamped at -159 (2^y is
// then below the smallest denormal), 2^frac by a degree-5 polynomial on [-1/2, 1/2], scaled by
// vscalefps: 10 instructions against vexp_nonpos's 17 and the scaling.
#if KV_W == 16 && !defined(KV_PORTABLE_VECTORS)
static KV_INLINE vf vexp2_scaled_bf16(vf s, vf c, vf mc) {
  const __m512 y = _mm512_max_ps(_mm512_fmsub_ps((__m512)s, (__m512)c, (__m512)mc), _mm512_set1_ps(-159.0f));
  const __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(y, n);
  __m512 p = _mm512_set1_ps(1.3333558146e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108665e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650696e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718056e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return (vf)_mm512_scalef_ps(p, n);
}
#else
static KV_INLINE vf vexp2_scaled_bf16(vf s, vf c, vf mc) { return vexp_nonpos((s * c - mc) * 0.693147180559945309f); }
#endif

// Probabilities of keys 2k (p0) and 2k + 1 (p1) as bf16 pairs, p0 in each word's low half, rounded
// to nearest even (p >= 0 or a quiet NaN: no overflow).
static KV_INLINE vu bf16_pairs(vf p0, vf p1) {
#if defined(KV_BF16DOT)
  // vcvtne2ps2bf16 gives [p0's 16 | p1's 16]; vpermw interleaves them.
  alignas(64) static const uint16_t interleave[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                      8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i both = (__m512i)_mm512_cvtne2ps_pbh((__m512)p1, (__m512)p0);
  return (vu)_mm512_permutexvar_epi16(_mm512_load_si512(interleave), both);
#else
  vu b0 = (vu)p0, b1 = (vu)p1;
  b0 = (b0 + 0x7fffu + ((b0 >> 16) & 1u)) >> 16;
  b1 = (b1 + 0x7fffu + ((b1 >> 16) & 1u)) & 0xffff0000u;
  return b0 | b1;
#endif
}

static inline uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
static KV_INLINE uint32_t load_u32(const void* p) {
  uint32_t x;
  __builtin_memcpy(&x, p, 4);
  return x;
}

// tile_qk's epilogue for a register tile with a mask, softcap or ALiBi: acc's scores scaled, capped,
// biased and, with need_mask, masked (-inf) into St; m: the running max of row vectors [rv0, rv0 + RB).
template <int RB, int KB>
static KV_INLINE void tile_qk_edge(const TileCtx& t, const vf (&acc)[KB][RB], int rv0, int j0, vf (&m)[RB],
                                   bool need_mask) {
  const vf ninf = vsplat(-std::numeric_limits<float>::infinity());
  const bool causal = t.causal;
  const int Mr = t.Mr, window = t.window, n = t.n, c0 = t.c0;
  const float qs = t.qk_scale, cap = t.softcap;
  const vf* const slope = t.slope;
  const vi* const pos_v = t.pos;
  float* const St = t.St;
#pragma GCC unroll 16
  for (int j = 0; j < KB; ++j) {
    const int key = c0 + j0 + j;
#pragma GCC unroll 4
    for (int b = 0; b < RB; ++b) {
      vf s = acc[j][b] * qs;
      if (cap > 0.0f) s = cap * vtanh(s * (1.0f / cap));
      if (slope) s += slope[rv0 + b] * __builtin_convertvector(visplat(key) - pos_v[rv0 + b], vf);
      if (need_mask) {
        const vi pos = pos_v[rv0 + b];
        vi valid = visplat(j0 + j < n ? -1 : 0);
        if (causal) valid &= visplat(key) <= pos;
        if (window > 0) valid &= (pos - key) < window;
        if (window > 0 && !causal) valid &= (visplat(key) - pos) < window;   // both sides
        s = valid ? s : ninf;
      }
      vstore(St + (j0 + j) * Mr + (rv0 + b) * KV_W, s);
      m[b] = vmax(m[b], s);
    }
  }
}

// Scores of keys [j0, j0 + KB) for row vectors [rv0, rv0 + RB) into St; mx: running max per row vector;
// mask: some row may not see some of these keys (tile_qk_edge masks them).
// tile_qk and tile_pv are functions of their own: inlined into tile_step, they shared its register
// allocation and kept the P.V operands on the stack.
template <bool DOT, int RB, int KB>
static KV_NOINLINE void tile_qk(const TileCtx& t, const void* Qt, int rv0, int j0, vf* mx, bool mask) {
  const int Mr = t.Mr;
  vf acc[KB][RB];
#pragma GCC unroll 16
  for (int j = 0; j < KB; ++j)
#pragma GCC unroll 4
    for (int b = 0; b < RB; ++b) acc[j][b] = vsplat(0.0f);
  if constexpr (DOT) {
#if KV_DIRECT_DOT
    const uint32_t* q = static_cast<const uint32_t*>(Qt) + rv0 * KV_W;
    const uint16_t* kr[KB];
#pragma GCC unroll 16
    for (int j = 0; j < KB; ++j) kr[j] = static_cast<const uint16_t*>(t.k[j0 + j]);
    for (int p = 0; p < t.D / 2; ++p) {
      vu qv[RB];
#pragma GCC unroll 4
      for (int b = 0; b < RB; ++b) __builtin_memcpy(&qv[b], q + p * Mr + b * KV_W, sizeof(vu));
#pragma GCC unroll 16
      for (int j = 0; j < KB; ++j) {
        const vu kk = vu{} + load_u32(kr[j] + 2 * p);
#pragma GCC unroll 4
        for (int b = 0; b < RB; ++b) acc[j][b] = dot2_bf16(acc[j][b], qv[b], kk);
      }
    }
#endif
  } else {
    const float* q = static_cast<const float*>(Qt) + rv0 * KV_W;
    const float* kr[KB];
#pragma GCC unroll 16
    for (int j = 0; j < KB; ++j) kr[j] = static_cast<const float*>(t.k[j0 + j]);
    for (int d = 0; d < t.D; ++d) {
      vf qv[RB];
#pragma GCC unroll 4
      for (int b = 0; b < RB; ++b) qv[b] = vload(q + d * Mr + b * KV_W);
#pragma GCC unroll 16
      for (int j = 0; j < KB; ++j) {
        const vf kk = vsplat(kr[j][d]);
#pragma GCC unroll 4
        for (int b = 0; b < RB; ++b) acc[j][b] += qv[b] * kk;
      }
    }
  }
  // The epilogue reads t's fields once (a store to St could alias them, and they would be reloaded
  // and retested for every score); a tile with no mask, softcap or ALiBi takes a branch-free copy.
  float* const St = t.St;
  vf m[RB];
#pragma GCC unroll 4
  for (int b = 0; b < RB; ++b) m[b] = mx[rv0 + b];
  const float qs = t.qk_scale, cap = t.softcap;
  if (!mask && cap <= 0.0f && t.slope == nullptr) {
#pragma GCC unroll 16
    for (int j = 0; j < KB; ++j)
#pragma GCC unroll 4
      for (int b = 0; b < RB; ++b) {
        const vf s = qs == 1.0f ? acc[j][b] : acc[j][b] * qs;
        vstore(St + (j0 + j) * Mr + (rv0 + b) * KV_W, s);
        m[b] = vmax(m[b], s);
      }
  } else {
    tile_qk_edge<RB, KB>(t, acc, rv0, j0, m, mask);
  }
#pragma GCC unroll 4
  for (int b = 0; b < RB; ++b) mx[rv0 + b] = m[b];
}

// Ot[d0, d0 + DB) of row vectors [rv0, rv0 + RB): rescaled by alpha, plus P.V of the tile's keys.
template <bool DOT, int RB, int DB>
static KV_NOINLINE void tile_pv(const TileCtx& t, float* Ot, int rv0, int d0, const vf* alpha, int lo, int hi) {
  const int Mr = t.Mr;
  vf acc[DB][RB];
#pragma GCC unroll 16
  for (int i = 0; i < DB; ++i)
#pragma GCC unroll 4
    for (int b = 0; b < RB; ++b) acc[i][b] = vload(Ot + (d0 + i) * Mr + (rv0 + b) * KV_W) * alpha[rv0 + b];
  if constexpr (DOT) {
#if KV_DIRECT_DOT
    for (int kp = lo / 2; kp < hi / 2; ++kp) {
      vu p[RB];
#pragma GCC unroll 4
      for (int b = 0; b < RB; ++b) __builtin_memcpy(&p[b], t.Pp + kp * Mr + (rv0 + b) * KV_W, sizeof(vu));
      const uint32_t* v = t.vpair + kp * t.Dv + d0;
#pragma GCC unroll 16
      for (int i = 0; i < DB; ++i) {
        const vu vv = vu{} + v[i];
#pragma GCC unroll 4
        for (int b = 0; b < RB; ++b) acc[i][b] = dot2_bf16(acc[i][b], p[b], vv);
      }
    }
#endif
  } else {
    for (int j = lo; j < hi; ++j) {
      vf p[RB];
#pragma GCC unroll 4
      for (int b = 0; b < RB; ++b) p[b] = vload(t.St + j * Mr + (rv0 + b) * KV_W);
      const float* v = static_cast<const float*>(t.v[j]) + d0;
#pragma GCC unroll 16
      for (int i = 0; i < DB; ++i) {
        const vf vv = vsplat(v[i]);
#pragma GCC unroll 4
        for (int b = 0; b < RB; ++b) acc[i][b] += p[b] * vv;
      }
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < DB; ++i)
#pragma GCC unroll 4
    for (int b = 0; b < RB; ++b) vstore(Ot + (d0 + i) * Mr + (rv0 + b) * KV_W, acc[i][b]);
}

// The tile's keys [lo, hi) outside which no row of vectors [rv0, rv0 + RB) sees one (causal, window),
// in whole register tiles (tile_keys<RB>() keys): those outside are skipped, their probabilities are 0.
// all: keys [0, all) are real keys every row of the block sees (the whole tile where it needs no mask;
// causal without a window: up to the block's first row), whose register tiles need no mask.
template <int RB> static inline void block_keys(const TileCtx& t, int rv0, int& lo, int& hi, int& all) {
  constexpr int step = tile_keys<RB>();
  lo = 0;
  hi = t.npad;
  all = t.need_mask ? 0 : t.npad;
  if (!t.need_mask || (!t.causal && t.window <= 0)) return;
  int pmin = std::numeric_limits<int>::max(), pmax = std::numeric_limits<int>::min();
  for (int b = 0; b < RB; ++b)
    for (int L = 0; L < KV_W; ++L) {
      pmin = std::min(pmin, int(t.pos[rv0 + b][L]));
      pmax = std::max(pmax, int(t.pos[rv0 + b][L]));
    }
  if (t.causal && t.window <= 0) all = std::max(0, std::min(t.n, pmin - t.c0 + 1));   // seen by every row
  if (t.causal) hi = std::min(hi, pmax - t.c0 + 1);
  else hi = std::min(hi, pmax + t.window - t.c0);
  if (t.window > 0) lo = std::max(lo, pmin - t.window + 1 - t.c0);
  lo = std::min(lo, t.npad) / step * step;
  hi = std::max(lo, (std::max(hi, 0) + step - 1) / step * step);
}

// Scores of one key tile for row vectors [rv0, rv0 + RB), keys [lo, hi) (block_keys; the softmax and
// P.V read no other key of these rows).
// With pf (the first block): the next tile's rows j0 .. j0 + KB prefetched beside each register tile.
template <bool DOT, int RB>
static inline void tile_rows(const TileCtx& t, const void* Qt, int rv0, vf* mx, int lo, int hi, int all, bool pf) {
  constexpr int KB = tile_keys<RB>();
  auto ahead = [&](int j0, int j1) {
    j1 = std::min(j1, t.pf_n);
    if (j1 > j0) prefetch_rows_any(t.pf, j0, j1 - j0, t.pf_lines);
  };
  pf = pf && t.pf != nullptr;
  if (pf) ahead(0, lo);
  for (int j0 = lo; j0 < hi; j0 += KB) {
    if (pf) ahead(j0, j0 + KB);
    tile_qk<DOT, RB, KB>(t, Qt, rv0, j0, mx, j0 + KB > all);
  }
  if (pf) ahead(hi, t.pf_n);
}
template <bool DOT, int RB>
static inline void tile_rows_pv(const TileCtx& t, float* Ot, int rv0, const vf* alpha, int lo, int hi) {
  constexpr int DB = tile_keys<RB>();
  int d0 = 0;
  for (; d0 + DB <= t.Dv; d0 += DB) tile_pv<DOT, RB, DB>(t, Ot, rv0, d0, alpha, lo, hi);
  for (; d0 < t.Dv; ++d0) tile_pv<DOT, RB, 1>(t, Ot, rv0, d0, alpha, lo, hi);
}

template <bool DOT>
static void tile_step(const TileCtx& t, const void* Qt, float* Ot, int RV, vf* m, vf* l) {
  const vf ninf = vsplat(-std::numeric_limits<float>::infinity());
  vf mx[kTileRowVecs];
  for (int rv = 0; rv < RV; ++rv) mx[rv] = ninf;
  // Row vectors in register tiles: AVX-512 of 4 (then 2, 1) vectors; otherwise of 3 and 2 (1 alone).
  auto each_block = [&](auto&& fn) {
    int rv = 0;
    if constexpr (KV_W == 16) {
      for (; rv + 4 <= RV; rv += 4) fn(std::integral_constant<int, 4>{}, rv);
    } else {
      const int twos = RV == 1 ? 0 : (3 - RV % 3) % 3;   // RV = 3 a + 2 twos
      for (; rv + 3 <= RV - 2 * twos; rv += 3) fn(std::integral_constant<int, 3>{}, rv);
    }
    for (; rv + 2 <= RV; rv += 2) fn(std::integral_constant<int, 2>{}, rv);
    if (rv < RV) fn(std::integral_constant<int, 1>{}, rv);
  };
  int lo[kTileRowVecs], hi[kTileRowVecs];   // the keys of each row vector's block
  each_block([&](auto rb, int rv) {
    constexpr int RB = decltype(rb)::value;
    int all;   // keys [0, all) need no mask in this block
    block_keys<RB>(t, rv, lo[rv], hi[rv], all);
    std::fill(lo + rv + 1, lo + rv + RB, lo[rv]);
    std::fill(hi + rv + 1, hi + rv + RB, hi[rv]);
    tile_rows<DOT, RB>(t, Qt, rv, mx, lo[rv], hi[rv], all, rv == 0);
  });
  vf alpha[kTileRowVecs];
  // Dot mode: p = 2^(s c - msub log2 e), c = exp_scale x log2 e.
  const float log2e = 1.44269504088896341f;
  const vf c = vsplat(t.exp_scale * log2e);
  for (int rv = 0; rv < RV; ++rv) {
    if (t.exp_scale != 1.0f) mx[rv] *= t.exp_scale;   // exp_scale > 0: the max of the scaled scores
    const vf mnew = vmax(m[rv], mx[rv]);
    // A row with nothing visible yet (max -inf) subtracts 0: its scores are all -inf, so its p are 0;
    // exp(-inf - -inf) is NaN, which vexp_nonpos turns into 0 like -inf (O and l are 0 there anyway).
    const vf msub = mnew == ninf ? vsplat(0.0f) : mnew;
    alpha[rv] = vexp_nonpos(m[rv] - mnew);
    const vf mc = msub * log2e;
    vf sum = vsplat(0.0f);
    for (int j = lo[rv]; j < hi[rv]; j += 2) {   // lo, hi even: whole register tiles
      float* s0 = t.St + j * t.Mr + rv * KV_W;
      if constexpr (DOT) {
        const vf p0 = vexp2_scaled_bf16(vload(s0), c, mc), p1 = vexp2_scaled_bf16(vload(s0 + t.Mr), c, mc);
        sum += p0 + p1;
        const vu w = bf16_pairs(p0, p1);
        __builtin_memcpy(t.Pp + (j / 2) * t.Mr + rv * KV_W, &w, sizeof w);
      } else {
        const vf p0 = vexp_nonpos(vload(s0) - msub), p1 = vexp_nonpos(vload(s0 + t.Mr) - msub);
        sum += p0 + p1;
        vstore(s0, p0);
        vstore(s0 + t.Mr, p1);
      }
    }
    l[rv] = l[rv] * alpha[rv] + sum;
    m[rv] = mnew;
  }
  each_block([&](auto rb, int rv) { tile_rows_pv<DOT, decltype(rb)::value>(t, Ot, rv, alpha, lo[rv], hi[rv]); });
}

// dst[0:n] = the bf16 bits of src[0:n] (fp8: exact; value / fp8_unit as load_vec gives it).
template <int CT> static inline void widen_bf16(const typename Elem<CT>::T* src, int n, uint16_t* dst) {
  int d = 0;
  for (; d + KV_W <= n; d += KV_W) {
    const vh h = __builtin_convertvector((vu)load_vec<CT>(src + d) >> 16, vh);
    __builtin_memcpy(dst + d, &h, sizeof h);
  }
  for (; d < n; ++d) dst[d] = uint16_t(f32_bits(load_one<CT>(src + d)) >> 16);
}
// dst[dv] = a[dv] | b[dv] << 16 for dv < n (bf16 rows of two keys, word-interleaved).
static inline void interleave_rows(const uint16_t* a, const uint16_t* b, int n, uint32_t* dst) {
  int d = 0;
  for (; d + KV_W <= n; d += KV_W) {
    vh ha, hb;
    __builtin_memcpy(&ha, a + d, sizeof ha);
    __builtin_memcpy(&hb, b + d, sizeof hb);
    const vu w = __builtin_convertvector(ha, vu) | (__builtin_convertvector(hb, vu) << 16);
    __builtin_memcpy(dst + d, &w, sizeof w);
  }
  for (; d < n; ++d) dst[d] = uint32_t(a[d]) | (uint32_t(b[d]) << 16);
}

// ---- KV_W x KV_W transposes of 32-bit words: the many-row path's query rows in, its output rows out ----
// Stage B swaps the off-diagonal B x B blocks of every 2B x 2B block of the matrix r[row][lane];
// after the stages B = 1, 2, ..., KV_W / 2, r[i][l] holds what r[l][i] held.
template <int B, int... I> static inline vu tr_mask(bool second, std::integer_sequence<int, I...>) {
  return second ? vu{uint32_t((I & B) == 0 ? I + B : KV_W + I)...} : vu{uint32_t((I & B) == 0 ? I : KV_W + I - B)...};
}
template <int B = 1> static KV_INLINE void transpose_words(vu (&r)[KV_W]) {
  if constexpr (B < KV_W) {
    const vu lo = tr_mask<B>(false, std::make_integer_sequence<int, KV_W>{});
    const vu hi = tr_mask<B>(true, std::make_integer_sequence<int, KV_W>{});
#pragma GCC unroll 16
    for (int i = 0; i < KV_W; ++i)
      if ((i & B) == 0) {
        const vu a = r[i], b = r[i + B];
        r[i] = __builtin_shuffle(a, b, lo);
        r[i + B] = __builtin_shuffle(a, b, hi);
      }
    transpose_words<2 * B>(r);
  }
}

// p[0:n] = v[0:n] in dtype DT (n <= KV_W), rounded to nearest even as store_one does.
template <int DT> static inline void store_vec(typename Elem<DT>::T* p, vf v, int n) {
  if constexpr (DT == kF32) {
    if (n == KV_W) vstore(p, v);
    else for (int i = 0; i < n; ++i) p[i] = v[i];
  } else if constexpr (DT == kBF16) {
    const vu u = (vu)v;
    const vu nan = (u & 0x7fffffffu) > 0x7f800000u;   // all-ones lanes: quiet NaN, as f32_to_bf16
    const vu b = ((u + 0x7fffu + ((u >> 16) & 1u)) >> 16 & ~nan) | ((u >> 16 | 0x40u) & nan);
    const vh h = __builtin_convertvector(b, vh);
    if (n == KV_W) __builtin_memcpy(p, &h, sizeof h);
    else for (int i = 0; i < n; ++i) p[i] = h[i];
  } else {
    for (int i = 0; i < n; ++i) p[i] = f32_to_f16(v[i]);
  }
}

static_assert(kTileKeys % kTileAcc == 0, "a key tile is whole register tiles");
static_assert(tile_keys<1>() % 2 == 0 && tile_keys<2>() % 2 == 0 && tile_keys<KV_W == 16 ? 4 : 3>() % 2 == 0,
              "register tiles hold whole key pairs (the softmax and the bf16 P.V take keys two at a time)");

template <int QT, int CT, bool DOT>
static void run_item_rows_t(const AttnParams& P, const WorkItem& it, float* ws) {
  using T = typename Elem<CT>::T;
  using QE = typename Elem<QT>::T;
  constexpr bool fp8 = is_fp8(CT);
  const int D = P.head_size, Dv = P.head_size_v, G = P.num_q_heads / P.num_kv_heads;
  const int Mh = it.num_tokens * G, RV = int((Mh + KV_W - 1) / KV_W), Mr = RV * KV_W;
  const int dvp = int(round_up(Dv, KV_W)), M = it.num_heads * Mh;
  const float ninf = -std::numeric_limits<float>::infinity();
  // Workspace (kvmulti_cpu.h's tile_workspace_floats): Qt, Ot, St, Pp, widened K, widened V (or V pairs), zero row.
  float* Qt = ws;
  float* Ot = Qt + int64_t(D) * Mr;
  float* St = Ot + int64_t(Dv) * Mr;
  uint32_t* Pp = reinterpret_cast<uint32_t*>(St + int64_t(kTileKeys) * Mr);
  float* Kw = reinterpret_cast<float*>(Pp + int64_t(kTileKeys / 2) * Mr);
  float* Vw = Kw + int64_t(kTileKeys) * D;
  float* zero = Vw + int64_t(kTileKeys) * Dv;
  std::memset(zero, 0, sizeof(float) * std::max(D, Dv));
  uint16_t* Kb = reinterpret_cast<uint16_t*>(Kw);                       // dot mode: widened K (fp8)
  uint32_t* Vi = reinterpret_cast<uint32_t*>(Vw);                       // dot mode: V pairs
  uint16_t* Vb = reinterpret_cast<uint16_t*>(Vi + int64_t(kTileKeys / 2) * Dv);   // dot mode: widened V (fp8)

  const vi lane = viota();
  vi pos[kTileRowVecs];
  vf m[kTileRowVecs], l[kTileRowVecs];
  const int last_tok = it.num_tokens - 1;
  for (int rv = 0; rv < RV; ++rv) {
    const vi rr = lane + rv * KV_W;
    pos[rv] = it.pos0 + ((rr < Mh ? rr : visplat(Mh - 1)) / G);
  }
  const int p_lo = it.pos0, p_hi = it.pos0 + last_tok;
  const T* cache = static_cast<const T*>(P.cache);
  const QE* query = static_cast<const QE*>(P.query);
  QE* out = static_cast<QE*>(P.out);
  const int row_lines = int(((D + Dv) * sizeof(T) + 63) / 64);
  const int q_lines = int((D * sizeof(QE) + 63) / 64), o_lines = int((Dv * sizeof(QE) + 63) / 64);
  const int32_t* table = P.block_table + int64_t(it.req) * P.bt_stride;

  for (int hh = 0; hh < it.num_heads; ++hh) {
    const int kvh = it.kv_head + hh;
    const float q_scale = P.scale * (fp8 ? P.k_scale[kvh] * fp8_unit<CT>() : 1.0f);
    // Dot mode leaves a positive scale to the softmax's exponent where no softcap or ALiBi follows it.
    const bool unscaled = DOT && q_scale > 0.0f && !(P.softcap > 0.0f) && !P.alibi;
    vf slope[kTileRowVecs];
    if (P.alibi) {
      float lanes[KV_W];
      for (int rv = 0; rv < RV; ++rv) {
        for (int L = 0; L < KV_W; ++L) lanes[L] = P.alibi[kvh * G + std::min(rv * KV_W + L, Mh - 1) % G];
        slope[rv] = vload(lanes);
      }
    }
    // Qt (fp32 mode: pre-scaled) and the running max / sum; padding lanes are zero rows. Blocks of
    // KV_W rows x KV_W words (bf16 pairs in dot mode, fp32 values otherwise) are transposed in registers.
    // The next block's rows are prefetched while one block is transposed.
    const int qwords = DOT ? D / 2 : D;
    // Row pointers of block rv's rows (row rr: query token rr / G, head kvh x G + rr % G); nullptr past Mh.
    auto block_rows = [&](auto* base, int64_t s_token, int64_t s_head, int rv, auto** rows) {
      for (int i = 0; i < KV_W; ++i) {
        const int rr = rv * KV_W + i;
        rows[i] = rr < Mh ? base + int64_t(it.q_row0 + rr / G) * s_token + int64_t(kvh * G + rr % G) * s_head : nullptr;
      }
    };
    auto query_rows = [&](int rv, const QE** src) { block_rows(query, P.q_stride_token, P.q_stride_head, rv, src); };
    const QE* next[KV_W];
    query_rows(0, next);
    for (int rv = 0; rv < RV; ++rv) {
      const QE* src[KV_W];
      std::copy(next, next + KV_W, src);
      if (rv + 1 < RV) {
        query_rows(rv + 1, next);
        prefetch_rows_any(reinterpret_cast<const void* const*>(next), 0, std::min(KV_W, Mh - (rv + 1) * KV_W), q_lines);
      }
      vu nan = vu{};
      for (int w0 = 0; w0 < qwords; w0 += KV_W) {
        const int nw = std::min(KV_W, qwords - w0);
        vu r[KV_W];
        for (int i = 0; i < KV_W; ++i) {
          r[i] = vu{};
          if (src[i] == nullptr) continue;
          if constexpr (DOT) {
            const uint16_t* q = src[i] + 2 * w0;   // bf16 pairs as they are stored
            if (nw == KV_W) __builtin_memcpy(&r[i], q, sizeof(vu));
            else for (int j = 0; j < nw; ++j) r[i][j] = load_u32(q + 2 * j);
          } else if (nw == KV_W) {
            r[i] = (vu)load_vec<QT>(src[i] + w0);
          } else {
            float tail[KV_W] = {};
            convert_row<QT>(src[i] + w0, nw, tail);
            __builtin_memcpy(&r[i], tail, sizeof tail);
          }
        }
        transpose_words(r);
        for (int j = 0; j < nw; ++j) {
          if constexpr (DOT) {
            nan |= ((r[j] & 0x7fffu) > 0x7f80u) | (((r[j] >> 16) & 0x7fffu) > 0x7f80u);
            __builtin_memcpy(reinterpret_cast<uint32_t*>(Qt) + int64_t(w0 + j) * Mr + rv * KV_W, &r[j], sizeof(vu));
          } else {
            const vf q = (vf)r[j];
            nan |= (vu)(q != q);
            vstore(Qt + int64_t(w0 + j) * Mr + rv * KV_W, q * q_scale);
          }
        }
      }
      m[rv] = vsplat(ninf);
      // A NaN query row gives an all-NaN output row; the running sum carries the mark.
      l[rv] = (vf)((vu)vsplat(std::numeric_limits<float>::quiet_NaN()) & nan);
    }
    std::memset(Ot, 0, sizeof(float) * int64_t(Dv) * Mr);

    const int64_t head_off = int64_t(kvh) * P.s_head;
    const T* rows[2][kTileKeys];
    const void* kp[kTileKeys];
    const void* vp[kTileKeys];
    int cur = 0;
    key_rows<T>(P, table, head_off, it.k_lo, std::min(kTileKeys, it.k_hi - it.k_lo), rows[0]);
    for (int c0 = it.k_lo; c0 < it.k_hi; c0 += kTileKeys, cur ^= 1) {
      const int n = std::min(kTileKeys, it.k_hi - c0);
      const int cn = c0 + kTileKeys, nn = std::min(kTileKeys, it.k_hi - cn);
      // The next tile's rows, looked up now; their lines are requested while this tile runs (or at once,
      // if this tile is skipped).
      if (nn > 0) key_rows<T>(P, table, head_off, cn, nn, rows[cur ^ 1]);
      const void* const* pf =
          KV_PREFETCH && P.prefetch && nn > 0 ? reinterpret_cast<const void* const*>(rows[cur ^ 1]) : nullptr;
      const bool skip = (P.causal && c0 > p_hi)                          // after every row
                        || (P.window > 0 && p_lo - (c0 + n - 1) >= P.window)  // left of every row's window
                        || (!P.causal && P.window > 0 && c0 - p_hi >= P.window);  // right of every row's window
      if (skip) {
        if (pf) prefetch_rows_any(pf, 0, nn, row_lines);
        continue;
      }
      const int npad = int(round_up(n, kTileAcc));
      const T* const* raw = rows[cur];
      for (int j = 0; j < n; ++j) {
        const T* row = raw[j];
        if constexpr (DOT) {
          if constexpr (fp8) {
            widen_bf16<CT>(row, D, Kb + j * D);
            kp[j] = Kb + j * D;
            widen_bf16<CT>(row + D, Dv, Vb + j * Dv);
          } else {
            kp[j] = row;
          }
        } else if constexpr (CT == kF32) {
          kp[j] = row;
          vp[j] = row + D;
        } else {
          convert_row<CT>(row, D, Kw + j * D);
          convert_row<CT>(row + D, Dv, Vw + j * Dv);
          kp[j] = Kw + j * D;
          vp[j] = Vw + j * Dv;
        }
      }
      for (int j = n; j < npad; ++j) kp[j] = vp[j] = zero;
      if constexpr (DOT) {
        const uint16_t* z = reinterpret_cast<const uint16_t*>(zero);
        auto vrow = [&](int j) -> const uint16_t* {
          if (j >= n) return z;
          return fp8 ? Vb + j * Dv : reinterpret_cast<const uint16_t*>(raw[j] + D);
        };
        for (int j = 0; j < npad; j += 2) interleave_rows(vrow(j), vrow(j + 1), Dv, Vi + (j / 2) * Dv);
      }
      TileCtx t{Mr, D, Dv, kp, vp, Vi, c0, n, npad,
                npad > n || (P.causal && c0 + n - 1 > p_lo) || (P.window > 0 && p_hi - c0 >= P.window) ||
                    (!P.causal && P.window > 0 && c0 + n - 1 - p_lo >= P.window),
                P.causal, P.window, P.softcap, unscaled || !DOT ? 1.0f : q_scale, unscaled ? q_scale : 1.0f,
                pos, St, Pp, P.alibi ? slope : nullptr, pf, nn, row_lines};
      tile_step<DOT>(t, Qt, Ot, RV, m, l);
    }

    // Output rows (or the partition's O, m, l), head-major without padding rows: blocks of KV_W rows x
    // KV_W dimensions of Ot transposed back in registers.
    // The next block's output rows are prefetched while one block is written.
    const float vs = fp8 ? P.v_scale[kvh] * fp8_unit<CT>() : 1.0f;
    auto out_rows = [&](int rv, QE** dst) { block_rows(out, P.o_stride_token, P.o_stride_head, rv, dst); };
    QE* next_out[KV_W];
    if (it.partial == nullptr) out_rows(0, next_out);
    for (int rv = 0; rv < RV; ++rv) {
      float mrow[KV_W], lrow[KV_W];   // block rv's running max / sum, one lane per row
      vstore(mrow, m[rv]);
      vstore(lrow, l[rv]);
      const int rows = std::min(KV_W, Mh - rv * KV_W);
      QE* dst[KV_W];
      float factor[KV_W];
      if (it.partial == nullptr) {
        std::copy(next_out, next_out + rows, dst);
        if (rv + 1 < RV) {
          out_rows(rv + 1, next_out);
          prefetch_rows_any(reinterpret_cast<const void* const*>(next_out), 0, std::min(KV_W, Mh - (rv + 1) * KV_W), o_lines);
        }
      }
      for (int i = 0; i < rows; ++i) {
        const int rr = rv * KV_W + i, r = hh * Mh + rr;
        if (it.partial != nullptr) {
          it.partial[int64_t(M) * dvp + r] = mrow[i];
          it.partial[int64_t(M) * dvp + M + r] = lrow[i];
          factor[i] = vs;
        } else {
          factor[i] = vs * row_inverse(P, kvh * G + rr % G, mrow[i], lrow[i]);
        }
      }
      for (int d0 = 0; d0 < dvp; d0 += KV_W) {
        const int nd = std::min(KV_W, Dv - d0);
        vu r[KV_W];
        for (int j = 0; j < KV_W; ++j) r[j] = j < nd ? (vu)vload(Ot + int64_t(d0 + j) * Mr + rv * KV_W) : vu{};
        transpose_words(r);
        for (int i = 0; i < rows; ++i) {
          const vf o = (vf)r[i] * factor[i];
          if (it.partial != nullptr) vstore(it.partial + int64_t(hh * Mh + rv * KV_W + i) * dvp + d0, o);   // zero past Dv
          else store_vec<QT>(dst[i] + d0, o, nd);
        }
      }
    }
  }
}

// The many-row path of one item: bf16 dots where the query is bf16 over a bf16 or fp8 cache.
template <int QT, int CT> static void run_item_rows(const AttnParams& P, const WorkItem& it, float* ws) {
  constexpr bool dot = KV_DIRECT_DOT && QT == kBF16 && (CT == kBF16 || is_fp8(CT));
  if (dot && P.head_size % 2 == 0) run_item_rows_t<QT, CT, dot>(P, it, ws);
  else run_item_rows_t<QT, CT, false>(P, it, ws);
}
