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
// window) is skipped whole, and only a tile that crosses a row's limit is masked.
// Two arithmetic modes, one code:
//  - bf16 dots (KV_DIRECT_DOT, bf16 query over a bf16 cache or an fp8 one, widened to bf16 exactly):
//    a 32-bit lane holds an element pair. Qt holds the query's pairs (d, d + 1), a K pair is
//    broadcast straight from the cache row, P holds the probabilities of keys (2k, 2k + 1) rounded to
//    bf16, and V's rows of those keys are interleaved word by word once per tile.
//  - fp32 FMAs otherwise: K / V rows straight from an fp32 cache, else widened once per tile.
// fp8 caches: the widened values are value / fp8_unit; the per-head k_scale (and the unit) go into
// the query scale, v_scale into the output rows, as on the other paths.

// Accumulators of one register tile (AVX-512 has 32 vector registers; AVX2 and SSE 16).
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
  float softcap, qk_scale;
  const vi* pos;           // [Mr / KV_W] each lane's row position
  float* St;               // [npad][Mr] scores, then (fp32 mode) probabilities
  uint32_t* Pp;            // dot mode: [npad / 2][Mr] probability pairs of keys (2k, 2k + 1)
  const vf* slope;         // [Mr / KV_W] each lane's ALiBi slope, or nullptr
};

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

// Scores of keys [j0, j0 + KB) for row vectors [rv0, rv0 + RB) into St; mx: running max per row vector.
// tile_qk and tile_pv are functions of their own: inlined into tile_step, they shared its register
// allocation and kept the P.V operands on the stack.
template <bool DOT, int RB, int KB>
static KV_NOINLINE void tile_qk(const TileCtx& t, const void* Qt, int rv0, int j0, vf* mx) {
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
  const vf ninf = vsplat(-std::numeric_limits<float>::infinity());
#pragma GCC unroll 16
  for (int j = 0; j < KB; ++j) {
    const int key = t.c0 + j0 + j;
#pragma GCC unroll 4
    for (int b = 0; b < RB; ++b) {
      vf s = acc[j][b];
      if (t.qk_scale != 1.0f) s *= t.qk_scale;
      if (t.softcap > 0.0f) s = t.softcap * vtanh(s * (1.0f / t.softcap));
      if (t.slope) s += t.slope[rv0 + b] * __builtin_convertvector(visplat(key) - t.pos[rv0 + b], vf);
      if (t.need_mask) {
        const vi pos = t.pos[rv0 + b];
        vi valid = visplat(j0 + j < t.n ? -1 : 0);
        if (t.causal) valid &= visplat(key) <= pos;
        if (t.window > 0) valid &= (pos - key) < t.window;
        if (t.window > 0 && !t.causal) valid &= (visplat(key) - pos) < t.window;   // both sides
        s = valid ? s : ninf;
      }
      vstore(t.St + (j0 + j) * Mr + (rv0 + b) * KV_W, s);
      mx[rv0 + b] = vmax(mx[rv0 + b], s);
    }
  }
}

// Ot[d0, d0 + DB) of row vectors [rv0, rv0 + RB): rescaled by alpha, plus P.V of the tile's keys.
template <bool DOT, int RB, int DB>
static KV_NOINLINE void tile_pv(const TileCtx& t, float* Ot, int rv0, int d0, const vf* alpha) {
  const int Mr = t.Mr;
  vf acc[DB][RB];
#pragma GCC unroll 16
  for (int i = 0; i < DB; ++i)
#pragma GCC unroll 4
    for (int b = 0; b < RB; ++b) acc[i][b] = vload(Ot + (d0 + i) * Mr + (rv0 + b) * KV_W) * alpha[rv0 + b];
  if constexpr (DOT) {
#if KV_DIRECT_DOT
    for (int kp = 0; kp < t.npad / 2; ++kp) {
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
    for (int j = 0; j < t.npad; ++j) {
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

// QK, softmax and P.V of one key tile for all RV row vectors of one KV head.
template <bool DOT, int RB>
static inline void tile_rows(const TileCtx& t, const void* Qt, float* Ot, int rv0, vf* mx) {
  constexpr int KB = kTileAcc / RB;
  for (int j0 = 0; j0 < t.npad; j0 += KB) tile_qk<DOT, RB, KB>(t, Qt, rv0, j0, mx);
}
template <bool DOT, int RB>
static inline void tile_rows_pv(const TileCtx& t, float* Ot, int rv0, const vf* alpha) {
  constexpr int DB = kTileAcc / RB;
  int d0 = 0;
  for (; d0 + DB <= t.Dv; d0 += DB) tile_pv<DOT, RB, DB>(t, Ot, rv0, d0, alpha);
  for (; d0 < t.Dv; ++d0) tile_pv<DOT, RB, 1>(t, Ot, rv0, d0, alpha);
}

template <bool DOT>
static void tile_step(const TileCtx& t, const void* Qt, float* Ot, int RV, vf* m, vf* l) {
  const vf ninf = vsplat(-std::numeric_limits<float>::infinity());
  vf mx[kTileRowVecs];
  for (int rv = 0; rv < RV; ++rv) mx[rv] = ninf;
  // Row vectors in register tiles of 4 (then 2, 1) vectors.
  auto each_block = [&](auto&& fn) {
    int rv = 0;
    for (; rv + 4 <= RV; rv += 4) fn(std::integral_constant<int, 4>{}, rv);
    if (RV - rv >= 2) { fn(std::integral_constant<int, 2>{}, rv); rv += 2; }
    if (RV - rv == 1) fn(std::integral_constant<int, 1>{}, rv);
  };
  each_block([&](auto rb, int rv) { tile_rows<DOT, decltype(rb)::value>(t, Qt, Ot, rv, mx); });
  vf alpha[kTileRowVecs];
  for (int rv = 0; rv < RV; ++rv) {
    const vf mnew = vmax(m[rv], mx[rv]);
    // A row with nothing visible yet (max -inf) subtracts 0: its scores are all -inf, so its p are 0;
    // exp(-inf - -inf) is NaN, which vexp_nonpos turns into 0 like -inf (O and l are 0 there anyway).
    const vf msub = mnew == ninf ? vsplat(0.0f) : mnew;
    alpha[rv] = vexp_nonpos(m[rv] - mnew);
    vf sum = vsplat(0.0f);
    for (int j = 0; j < t.npad; j += 2) {
      float* s0 = t.St + j * t.Mr + rv * KV_W;
      const vf p0 = vexp_nonpos(vload(s0) - msub), p1 = vexp_nonpos(vload(s0 + t.Mr) - msub);
      sum += p0 + p1;
      if constexpr (DOT) {   // bf16 pairs, rounded to nearest even (p >= 0 or a quiet NaN: no overflow)
        vu b0 = (vu)p0, b1 = (vu)p1;
        b0 = (b0 + 0x7fffu + ((b0 >> 16) & 1u)) >> 16;
        b1 = (b1 + 0x7fffu + ((b1 >> 16) & 1u)) & 0xffff0000u;
        const vu w = b0 | b1;
        __builtin_memcpy(t.Pp + (j / 2) * t.Mr + rv * KV_W, &w, sizeof w);
      } else {
        vstore(s0, p0);
        vstore(s0 + t.Mr, p1);
      }
    }
    l[rv] = l[rv] * alpha[rv] + sum;
    m[rv] = mnew;
  }
  each_block([&](auto rb, int rv) { tile_rows_pv<DOT, decltype(rb)::value>(t, Ot, rv, alpha); });
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

static_assert(kTileKeys % kTileAcc == 0, "a key tile is whole register tiles");

template <int QT, int CT, bool DOT>
static void run_item_rows_t(const AttnParams& P, const WorkItem& it, float* ws) {
  using T = typename Elem<CT>::T;
  using QE = typename Elem<QT>::T;
  constexpr bool fp8 = is_fp8(CT);
  const int D = P.head_size, Dv = P.head_size_v, G = P.num_q_heads / P.num_kv_heads;
  const int Mh = it.num_tokens * G, RV = int((Mh + KV_W - 1) / KV_W), Mr = RV * KV_W;
  const int dvp = int(round_up(Dv, KV_W)), M = it.num_heads * Mh;
  const float ninf = -std::numeric_limits<float>::infinity();
  // Workspace (kvmulti_cpu.h's tile_workspace_floats): Qt, Ot, St, Pp, m, l, widened K, widened V (or V pairs), zero row.
  float* Qt = ws;
  float* Ot = Qt + int64_t(D) * Mr;
  float* St = Ot + int64_t(Dv) * Mr;
  uint32_t* Pp = reinterpret_cast<uint32_t*>(St + int64_t(kTileKeys) * Mr);
  float* mrow = reinterpret_cast<float*>(Pp + int64_t(kTileKeys / 2) * Mr);
  float* lrow = mrow + Mr;
  float* Kw = lrow + Mr;
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
  const int32_t* table = P.block_table + int64_t(it.req) * P.bt_stride;

  for (int hh = 0; hh < it.num_heads; ++hh) {
    const int kvh = it.kv_head + hh;
    const float q_scale = P.scale * (fp8 ? P.k_scale[kvh] * fp8_unit<CT>() : 1.0f);
    vf slope[kTileRowVecs];
    if (P.alibi) {
      float lanes[KV_W];
      for (int rv = 0; rv < RV; ++rv) {
        for (int L = 0; L < KV_W; ++L) lanes[L] = P.alibi[kvh * G + std::min(rv * KV_W + L, Mh - 1) % G];
        slope[rv] = vload(lanes);
      }
    }
    // Qt (fp32 mode: pre-scaled) and the running max / sum; padding lanes are zero rows.
    float* qrow = Kw;   // one widened query row (Kw is free until the first tile)
    for (int rr = 0; rr < Mr; ++rr) {
      bool nan = false;
      if (rr < Mh) {
        const int t = rr / G, h = kvh * G + rr % G;
        convert_row<QT>(query + int64_t(it.q_row0 + t) * P.q_stride_token + int64_t(h) * P.q_stride_head, D, qrow);
        for (int d = 0; d < D; ++d) nan |= qrow[d] != qrow[d];
      } else {
        std::memset(qrow, 0, sizeof(float) * D);
      }
      if constexpr (DOT) {
        uint32_t* q = reinterpret_cast<uint32_t*>(Qt);
        for (int d = 0; d < D; d += 2)
          q[(d / 2) * Mr + rr] = (f32_bits(qrow[d]) >> 16) | (f32_bits(qrow[d + 1]) & 0xffff0000u);
      } else {
        for (int d = 0; d < D; ++d) Qt[int64_t(d) * Mr + rr] = qrow[d] * q_scale;
      }
      mrow[rr] = ninf;
      // A NaN query row gives an all-NaN output row; the running sum carries the mark.
      lrow[rr] = nan ? std::numeric_limits<float>::quiet_NaN() : 0.0f;
    }
    std::memset(Ot, 0, sizeof(float) * int64_t(Dv) * Mr);
    for (int rv = 0; rv < RV; ++rv) {
      m[rv] = vload(mrow + rv * KV_W);
      l[rv] = vload(lrow + rv * KV_W);
    }

    const int64_t head_off = int64_t(kvh) * P.s_head;
    const T* rows[2][kTileKeys];
    const void* kp[kTileKeys];
    const void* vp[kTileKeys];
    int cur = 0;
    key_rows<T>(P, table, head_off, it.k_lo, std::min(kTileKeys, it.k_hi - it.k_lo), rows[0]);
    for (int c0 = it.k_lo; c0 < it.k_hi; c0 += kTileKeys, cur ^= 1) {
      const int n = std::min(kTileKeys, it.k_hi - c0);
      const int cn = c0 + kTileKeys, nn = std::min(kTileKeys, it.k_hi - cn);
      if (nn > 0) {   // the next tile's rows: looked up now, their lines requested while this one runs
        key_rows<T>(P, table, head_off, cn, nn, rows[cur ^ 1]);
#if KV_PREFETCH
        if (P.prefetch) prefetch_rows_any(reinterpret_cast<const void* const*>(rows[cur ^ 1]), 0, nn, row_lines);
#endif
      }
      if (P.causal && c0 > p_hi) continue;                         // after every row
      if (P.window > 0 && p_lo - (c0 + n - 1) >= P.window) continue;  // left every row's window
      if (!P.causal && P.window > 0 && c0 - p_hi >= P.window) continue;  // right of every row's window
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
                P.causal, P.window, P.softcap, DOT ? q_scale : 1.0f, pos, St, Pp, P.alibi ? slope : nullptr};
      tile_step<DOT>(t, Qt, Ot, RV, m, l);
    }

    // Output rows (or the partition's O, m, l), head-major without padding rows.
    for (int rv = 0; rv < RV; ++rv) {
      vstore(mrow + rv * KV_W, m[rv]);
      vstore(lrow + rv * KV_W, l[rv]);
    }
    const float vs = fp8 ? P.v_scale[kvh] * fp8_unit<CT>() : 1.0f;
    float* o = Vw;   // one output row (the tiles are done)
    for (int rr = 0; rr < Mh; ++rr) {
      for (int d = 0; d < Dv; ++d) o[d] = Ot[int64_t(d) * Mr + rr] * vs;
      const int r = hh * Mh + rr;
      const float lr = lrow[rr];
      if (it.partial != nullptr) {
        std::memcpy(it.partial + int64_t(r) * dvp, o, sizeof(float) * Dv);
        std::memset(it.partial + int64_t(r) * dvp + Dv, 0, sizeof(float) * (dvp - Dv));
        it.partial[int64_t(M) * dvp + r] = mrow[rr];
        it.partial[int64_t(M) * dvp + M + r] = lr;
        continue;
      }
      const int t = rr / G, h = kvh * G + rr % G;
      QE* dst = out + int64_t(it.q_row0 + t) * P.o_stride_token + int64_t(h) * P.o_stride_head;
      const float inv = row_inverse(P, h, mrow[rr], lr);
      for (int d = 0; d < Dv; ++d) store_one<QT>(dst + d, o[d] * inv);
    }
  }
}

// The many-row path of one item: bf16 dots where the query is bf16 over a bf16 or fp8 cache.
template <int QT, int CT> static void run_item_rows(const AttnParams& P, const WorkItem& it, float* ws) {
  constexpr bool dot = KV_DIRECT_DOT && QT == kBF16 && (CT == kBF16 || is_fp8(CT));
  if (dot && P.head_size % 2 == 0) run_item_rows_t<QT, CT, dot>(P, it, ws);
  else run_item_rows_t<QT, CT, false>(P, it, ws);
}
