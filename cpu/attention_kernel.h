// The paged-attention work-item kernel, written once with GCC/Clang vector extensions and compiled
// once per ISA: kernels_avx512.cpp / kernels_avx2.cpp / kernels_generic.cpp include this file inside
// their own namespace with KV_W (fp32 lanes: 16 / 8 / 4) defined and their target pragma in force.
//
// A work item = some query tokens of one request x all query heads of one KV head (GQA: one pass
// over the KV head serves every query head reading it) x a range of key positions. Rows are
// (token, query head) pairs; a block of up to kRowBlock rows is processed together. Keys are
// walked in chunks of kChunk positions: block-table lookups happen only for positions inside the
// item's range (entries outside a sliding window are never read), K/V rows are addressed through
// the named strides (no repacking) and, for fp16/bf16, widened to fp32 in a small per-thread
// scratch; the next chunk's rows are prefetched. Scores use fp32 FMAs; the 16 (or 8/4) per-key dot
// product accumulators are reduced with a transposing shuffle tree, so one vector holds one score
// per key. Online softmax (running max m, sum l) keeps O unnormalised; a work item either
// normalises and writes `out` or, when the context is partitioned, leaves (O, m, l) for the
// log-sum-exp merge in paged_attention.cpp.
//
// KV_PORTABLE_VECTORS: no intrinsics in the loads (a testing aid: any KV_W on any host).
// Requires before inclusion: <cstdint> <cstring> <cmath> <utility> <limits>, kvmulti_cpu.h,
// <immintrin.h> on x86.

// bf16 probabilities x bf16 V with vdpbf16ps: off -- on this machine it measured no faster than
// widening V to fp32, and rounding P to bf16 made the error ~8x larger (still inside tolerance).
#ifndef KV_BF16_PV
#define KV_BF16_PV 0
#endif
#ifndef KV_PREFETCH_STRIDE
#define KV_PREFETCH_STRIDE 64
#endif
// 3: prefetcht0, 2: prefetcht1, 1: prefetcht2, 0: prefetchnta (all measured alike on the AVX2 host).
#ifndef KV_PREFETCH_LOCALITY
#define KV_PREFETCH_LOCALITY 3
#endif
#ifndef KV_PREFETCH
#define KV_PREFETCH 1
#endif
// Direct path: prefetch the next chunk's rows a key group at a time inside the QK loop (1), or all
// at the start of the chunk (0). Measured on the AVX2 host, bf16 cold decode 32 x 1024: spread
// 1.50 / 1.45 / 1.42 ms at block sizes 16 / 32 / 128, all-at-once 1.73 / 1.65 / 1.47, none 1.75 /
// 1.68 / 1.47 (min of 13, alternated in one process).
#ifndef KV_PREFETCH_SPREAD
#define KV_PREFETCH_SPREAD 1
#endif
#ifndef KV_W
#error "define KV_W (fp32 lanes) before including attention_kernel.h"
#endif

// The hot helpers are forced inline: an out-of-line call spills every live vector register (all are
// caller-saved) and treduce's accumulator array would go through memory.
#ifndef KV_INLINE
#define KV_INLINE inline __attribute__((always_inline))
#endif

typedef float vf __attribute__((vector_size(KV_W * 4)));
typedef int32_t vi __attribute__((vector_size(KV_W * 4)));
typedef uint32_t vu __attribute__((vector_size(KV_W * 4)));
typedef uint16_t vh __attribute__((vector_size(KV_W * 2)));

static inline vf vload(const float* p) { vf v; __builtin_memcpy(&v, p, sizeof v); return v; }
static inline void vstore(float* p, vf v) { __builtin_memcpy(p, &v, sizeof v); }
// A plain broadcast (vf{} + x would add 0.0f first: not an identity for -0.0f, so it is really emitted).
template <int... I> static inline vf splat_impl(float x, std::integer_sequence<int, I...>) { return vf{((void)I, x)...}; }
static inline vf vsplat(float x) { return splat_impl(x, std::make_integer_sequence<int, KV_W>{}); }
static inline vi visplat(int x) { return vi{} + x; }

template <int... I> static inline vi iota_impl(std::integer_sequence<int, I...>) { return vi{I...}; }
static inline vi viota() { return iota_impl(std::make_integer_sequence<int, KV_W>{}); }

// ---- loads with widening to fp32 -----------------------------------------------------------------
template <int DT> struct Elem { using T = uint16_t; };
template <> struct Elem<kF32> { using T = float; };

#if KV_W == 16 && !defined(KV_PORTABLE_VECTORS)
static inline vf load_bf16(const uint16_t* p) {
  return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16);
}
#elif KV_W == 8 && !defined(KV_PORTABLE_VECTORS)
static inline vf load_bf16(const uint16_t* p) {
  return (vf)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16);
}
#else
static inline vf load_bf16(const uint16_t* p) {
  vh h;
  __builtin_memcpy(&h, p, sizeof h);
  vu u = __builtin_convertvector(h, vu) << 16;
  return (vf)u;
}
#endif
#if KV_W == 16 && !defined(KV_PORTABLE_VECTORS)
static inline vf load_f16(const uint16_t* p) { return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
#elif KV_W == 8 && !defined(KV_PORTABLE_VECTORS)
static inline vf load_f16(const uint16_t* p) { return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
#else
static inline vf load_f16(const uint16_t* p) {
  vf v;
  for (int i = 0; i < KV_W; ++i) v[i] = f16_to_f32(p[i]);
  return v;
}
#endif

template <int DT> static inline vf load_vec(const typename Elem<DT>::T* p) {
  if constexpr (DT == kF32) return vload(p);
  else if constexpr (DT == kBF16) return load_bf16(p);
  else return load_f16(p);
}
template <int DT> static inline float load_one(const typename Elem<DT>::T* p) {
  if constexpr (DT == kF32) return *p;
  else if constexpr (DT == kBF16) return bf16_to_f32(*p);
  else return f16_to_f32(*p);
}
template <int DT> static inline void store_one(typename Elem<DT>::T* p, float v) {
  if constexpr (DT == kF32) *p = v;
  else if constexpr (DT == kBF16) *p = f32_to_bf16(v);
  else *p = f32_to_f16(v);
}
// dst[0:n] = fp32(src[0:n]); dst's padding (up to a lane multiple) is left as it is (zeroed once).
template <int DT> static inline void convert_row(const typename Elem<DT>::T* src, int n, float* dst) {
  int d = 0;
  for (; d + KV_W <= n; d += KV_W) vstore(dst + d, load_vec<DT>(src + d));
  for (; d < n; ++d) dst[d] = load_one<DT>(src + d);
}

// ---- math -------------------------------------------------------------------------------------
// exp for x <= 88 (Cephes polynomial, ~1 ulp); x is clamped below at -87.3 (callers zero masked lanes).
static KV_INLINE vf vexp(vf x) {
  const vf lo = vsplat(-87.3365447504f), hi = vsplat(88.0f);
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const vf magic = vsplat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  vf t = x * 1.44269504088896341f + magic;
  vf fx = t - magic;
  vi n = (vi)t - (vi)magic;
  vf r = x - fx * 0.693359375f;
  r = r - fx * -2.12194440e-4f;
  vf y = vsplat(1.9875691500e-4f);
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * (r * r) + r + 1.0f;
  return (vf)((vi)y + (n << 23));
}
static KV_INLINE vf vtanh(vf x) {
  const vf zero = vsplat(0.0f);
  vf ax = x < zero ? -x : x;
  vf e = vexp(ax * 2.0f);
  vf t = 1.0f - 2.0f / (e + 1.0f);
  return x < zero ? -t : t;
}
static inline float hmax(vf v) {
  float m = v[0];
  for (int i = 1; i < KV_W; ++i) m = m > v[i] ? m : v[i];
  return m;
}
static inline float hsum(vf v) {
  float s = 0.0f;
  for (int i = 0; i < KV_W; ++i) s += v[i];
  return s;
}
static inline vf vmax(vf a, vf b) { return a > b ? a : b; }

// ---- transposing reduction: out[j] = sum(acc[j]) for j < KV_W --------------------------------------
// Level H folds each 2H-lane segment of x into its low half and of y into its high half. After
// log2(W) levels lane L holds the sum of input bitrev(L), so inputs are fed bit-reversed.
static constexpr int lane_src(int h, int which, int i) {
  int seg = i / (2 * h), off = i % (2 * h), base = seg * 2 * h;
  return off < h ? base + off + (which ? h : 0) : KV_W + base + off - h + (which ? h : 0);
}
template <int H, int... I> static KV_INLINE vf fold(vf x, vf y, std::integer_sequence<int, I...>) {
  return __builtin_shuffle(x, y, vi{lane_src(H, 0, I)...}) + __builtin_shuffle(x, y, vi{lane_src(H, 1, I)...});
}
template <int H> static KV_INLINE void level(vf* a, int n) {
  for (int i = 0; i < n / 2; ++i) a[i] = fold<H>(a[2 * i], a[2 * i + 1], std::make_integer_sequence<int, KV_W>{});
}
static constexpr int bitrev(int x) {
  int r = 0;
  for (int b = 1; b < KV_W; b <<= 1, x >>= 1) r = (r << 1) | (x & 1);
  return r;
}
static KV_INLINE vf treduce(const vf* acc) {
  vf a[KV_W];
#pragma GCC unroll 16
  for (int k = 0; k < KV_W; ++k) a[k] = acc[bitrev(k)];
#if KV_W == 16
  level<8>(a, 16);
  level<4>(a, 8);
  level<2>(a, 4);
  level<1>(a, 2);
#elif KV_W == 8
  level<4>(a, 8);
  level<2>(a, 4);
  level<1>(a, 2);
#elif KV_W == 4
  level<2>(a, 4);
  level<1>(a, 2);
#else
#error "KV_W must be 4, 8 or 16"
#endif
  return a[0];
}

// ---- one row block over one chunk -----------------------------------------------------------------
struct ChunkCtx {
  const float* const* kp;   // [kChunk] fp32 K rows (padded), zero rows past n (unused on the bf16-dot path)
  const uint16_t* const* kb; // [kChunk] bf16 K rows in the cache (bf16-dot path only)
  const void* const* vp;    // [kChunk] V rows: in the cache (read with widening) or fp32 scratch
  int c0, n, ng;            // first key position, valid keys, lane groups
  int nvd, nvv, dvp;        // vectors per K / V row, padded V row length
  bool need_mask, causal;
  int window;
  float softcap;
  float qk_scale;           // applied to raw scores (1 where Q is pre-scaled)
  int v_dtype;              // element type behind vp
  uint16_t* Pb;             // bf16 probabilities [kRowBlock][kChunk] (bf16 P.V path), else null
  float* S;                 // [kRowBlock][kChunk] scores, then probabilities
};

// Keys per QK group: two rows share every K load; their 2 x KG per-key accumulators reduce into
// one vector (low half: first row, high half: second row).
constexpr int KG = KV_W / 2;

static inline void store_halves(vf s, float* s0, float* s1) {
  float tmp[KV_W];
  vstore(tmp, s);
  for (int j = 0; j < KG; ++j) s0[j] = tmp[j];
  if (s1)
    for (int j = 0; j < KG; ++j) s1[j] = tmp[KG + j];
}

// Raw scores of rows q0, q1 (fp32, padded) against the chunk's keys; s1 may be null.
static inline void qk_pair(const float* q0, const float* q1, const ChunkCtx& c, float* s0, float* s1) {
  const int ngk = (c.n + KG - 1) / KG;
  for (int g = 0; g < ngk; ++g) {
    vf acc[KV_W];
#pragma GCC unroll 16
    for (int j = 0; j < KV_W; ++j) acc[j] = vsplat(0.0f);
    const float* kp[KG];
#pragma GCC unroll 8
    for (int j = 0; j < KG; ++j) kp[j] = c.kp[g * KG + j];
    for (int d = 0; d < c.nvd; ++d) {
      const vf a = vload(q0 + d * KV_W), b = vload(q1 + d * KV_W);
#pragma GCC unroll 8
      for (int j = 0; j < KG; ++j) {
        const vf k = vload(kp[j] + d * KV_W);
        acc[j] += a * k;
        acc[KG + j] += b * k;
      }
    }
    store_halves(treduce(acc), s0 + g * KG, s1 ? s1 + g * KG : nullptr);
  }
}

#if defined(KV_BF16DOT)
// bf16 x bf16 -> fp32 dot products straight from the cache (vdpbf16ps: exact products, fp32 sums).
// q0/q1: bf16 rows (head_size a multiple of 32).
static inline void qk_pair_bf16(const uint16_t* q0, const uint16_t* q1, int head_size, const ChunkCtx& c, float* s0,
                                float* s1) {
  const int ngk = (c.n + KG - 1) / KG;
  for (int g = 0; g < ngk; ++g) {
    __m512 acc[KV_W];
#pragma GCC unroll 16
    for (int j = 0; j < KV_W; ++j) acc[j] = _mm512_setzero_ps();
    const uint16_t* kb[KG];
#pragma GCC unroll 8
    for (int j = 0; j < KG; ++j) kb[j] = c.kb[g * KG + j];
    for (int d = 0; d < head_size; d += 32) {
      const __m512bh a = (__m512bh)_mm512_loadu_si512(q0 + d), b = (__m512bh)_mm512_loadu_si512(q1 + d);
#pragma GCC unroll 8
      for (int j = 0; j < KG; ++j) {
        const __m512bh k = (__m512bh)_mm512_loadu_si512(kb[j] + d);
        acc[j] = _mm512_dpbf16_ps(acc[j], a, k);
        acc[KG + j] = _mm512_dpbf16_ps(acc[KG + j], b, k);
      }
    }
    vf v[KV_W];
#pragma GCC unroll 16
    for (int j = 0; j < KV_W; ++j) v[j] = (vf)acc[j];
    store_halves(treduce(v), s0 + g * KG, s1 ? s1 + g * KG : nullptr);
  }
}

// O += P.V with bf16 probabilities and bf16 V straight from the cache (vdpbf16ps, fp32 sums): two
// keys per instruction, their V rows interleaved with unpacklo/hi. O rows are kept in a permuted
// order inside each 32-wide group (see unpermute_bf16_pv) and restored when the item ends.
template <int R, int NC>
static inline void pv_bf16_block(float* O, int dvp, int d0, const ChunkCtx& c, const float* alpha) {
  __m512 acc[R][2 * NC];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int q = 0; q < 2 * NC; ++q)
      acc[r][q] = _mm512_mul_ps(_mm512_loadu_ps(O + r * dvp + d0 + q * 16), _mm512_set1_ps(alpha[r]));
  for (int j = 0; j < c.n; j += 2) {
    const uint16_t* v0 = static_cast<const uint16_t*>(c.vp[j]) + d0;
    const uint16_t* v1 = static_cast<const uint16_t*>(c.vp[j + 1]) + d0;
    __m512i lo[NC], hi[NC];
#pragma GCC unroll 4
    for (int q = 0; q < NC; ++q) {
      const __m512i a = _mm512_loadu_si512(v0 + q * 32), b = _mm512_loadu_si512(v1 + q * 32);
      lo[q] = _mm512_unpacklo_epi16(a, b);
      hi[q] = _mm512_unpackhi_epi16(a, b);
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, c.Pb + r * kChunk + j, 4);
      const __m512bh p = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 4
      for (int q = 0; q < NC; ++q) {
        acc[r][2 * q] = _mm512_dpbf16_ps(acc[r][2 * q], p, (__m512bh)lo[q]);
        acc[r][2 * q + 1] = _mm512_dpbf16_ps(acc[r][2 * q + 1], p, (__m512bh)hi[q]);
      }
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int q = 0; q < 2 * NC; ++q) _mm512_storeu_ps(O + r * dvp + d0 + q * 16, acc[r][q]);
}

template <int R>
static inline void pv_bf16(float* O, const ChunkCtx& c, const float* alpha) {
  int d0 = 0;
  for (; d0 + 64 <= c.dvp; d0 += 64) pv_bf16_block<R, 2>(O, c.dvp, d0, c, alpha);
  if (d0 < c.dvp) pv_bf16_block<R, 1>(O, c.dvp, d0, c, alpha);
}

// Element i of a permuted 32-group holds dimension perm32(i).
static inline int perm32(int i) { return i < 16 ? (i / 4) * 8 + i % 4 : ((i - 16) / 4) * 8 + 4 + (i - 16) % 4; }
static inline void unpermute_bf16_pv(float* row, int dvp) {
  float tmp[32];
  for (int g = 0; g < dvp; g += 32) {
    for (int i = 0; i < 32; ++i) tmp[perm32(i)] = row[g + i];
    std::memcpy(row + g, tmp, sizeof tmp);
  }
}
#endif

template <int R, int NB, int VT>
static inline void pv_block(float* O, int dvp, int dvb, const ChunkCtx& c, const float* alpha) {
  using TV = typename Elem<VT>::T;
  vf acc[R][NB];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int b = 0; b < NB; ++b) acc[r][b] = vload(O + r * dvp + (dvb + b) * KV_W) * alpha[r];
  for (int j = 0; j < c.n; ++j) {
    const TV* vrow = static_cast<const TV*>(c.vp[j]) + dvb * KV_W;
    vf v[NB];
#pragma GCC unroll 4
    for (int b = 0; b < NB; ++b) v[b] = load_vec<VT>(vrow + b * KV_W);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      vf p = vsplat(c.S[r * kChunk + j]);
#pragma GCC unroll 4
      for (int b = 0; b < NB; ++b) acc[r][b] += p * v[b];
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int b = 0; b < NB; ++b) vstore(O + r * dvp + (dvb + b) * KV_W, acc[r][b]);
}

template <int R, int VT>
static inline void pv_all(float* O, const ChunkCtx& c, const float* alpha) {
  int dvb = 0;
  for (; dvb + 4 <= c.nvv; dvb += 4) pv_block<R, 4, VT>(O, c.dvp, dvb, c, alpha);
  switch (c.nvv - dvb) {
    case 3: pv_block<R, 3, VT>(O, c.dvp, dvb, c, alpha); break;
    case 2: pv_block<R, 2, VT>(O, c.dvp, dvb, c, alpha); break;
    case 1: pv_block<R, 1, VT>(O, c.dvp, dvb, c, alpha); break;
    default: break;
  }
}

// Q: R rows (stride dp, pre-scaled); O: R rows (stride dvp); m/l: running max / sum; pos: row positions.
template <int R>
static inline void row_block(const float* Q, const uint16_t* Qb, int dp, float* O, float* m, float* l, const int* pos,
                      const ChunkCtx& c) {
  const float ninf = -std::numeric_limits<float>::infinity();
  const vi lane = viota();
  for (int r = 0; r < R; r += 2) {
    const bool pair = r + 1 < R;
    float* s0 = c.S + r * kChunk;
    float* s1 = pair ? s0 + kChunk : nullptr;
#if defined(KV_BF16DOT)
    if (Qb) {
      qk_pair_bf16(Qb + r * dp, Qb + (pair ? r + 1 : r) * dp, dp, c, s0, s1);
      continue;
    }
#endif
    qk_pair(Q + r * dp, Q + (pair ? r + 1 : r) * dp, c, s0, s1);
  }
  for (int r = 0; r < R; ++r) {
    float* srow = c.S + r * kChunk;
    for (int g = 0; g < c.ng; ++g) {
      vf s = vload(srow + g * KV_W);
      if (c.qk_scale != 1.0f) s *= c.qk_scale;
      if (c.softcap > 0.0f) s = c.softcap * vtanh(s * (1.0f / c.softcap));
      if (c.need_mask) {
        vi idx = lane + g * KV_W;
        vi kpos = idx + c.c0;
        vi valid = idx < c.n;
        if (c.causal) valid &= kpos <= pos[r];
        if (c.window > 0) valid &= (pos[r] - kpos) < c.window;
        s = valid ? s : vsplat(ninf);
      }
      vstore(srow + g * KV_W, s);
    }
  }
  float alpha[R];
  for (int r = 0; r < R; ++r) {
    float* s = c.S + r * kChunk;
    vf mx = vsplat(ninf);
    for (int g = 0; g < c.ng; ++g) mx = vmax(mx, vload(s + g * KV_W));
    float mc = hmax(mx);
    float m_new = m[r] > mc ? m[r] : mc;
    if (m_new == ninf) {  // nothing visible yet for this row
      alpha[r] = 1.0f;
      for (int g = 0; g < c.ng; ++g) vstore(s + g * KV_W, vsplat(0.0f));
#if defined(KV_BF16DOT)
      if (c.Pb) std::memset(c.Pb + r * kChunk, 0, sizeof(uint16_t) * c.ng * KV_W);
#endif
      continue;
    }
    alpha[r] = m[r] == ninf ? 0.0f : std::exp(m[r] - m_new);
    vf sum = vsplat(0.0f);
    for (int g = 0; g < c.ng; ++g) {
      vf x = vload(s + g * KV_W);
      vf p = vexp(x - m_new);
      p = x == vsplat(ninf) ? vsplat(0.0f) : p;
      vstore(s + g * KV_W, p);
#if defined(KV_BF16DOT)
      if (c.Pb) _mm256_storeu_si256((__m256i*)(c.Pb + r * kChunk + g * KV_W), (__m256i)_mm512_cvtneps_pbh((__m512)p));
#endif
      sum += p;
    }
    l[r] = l[r] * alpha[r] + hsum(sum);
    m[r] = m_new;
  }
#if defined(KV_BF16DOT)
  if (c.Pb) {
    pv_bf16<R>(O, c, alpha);
    return;
  }
#endif
  switch (c.v_dtype) {
    case kBF16: pv_all<R, kBF16>(O, c, alpha); break;
    case kF16: pv_all<R, kF16>(O, c, alpha); break;
    default: pv_all<R, kF32>(O, c, alpha); break;
  }
}

// ---- the direct path: K and V read straight from the cache, 2W elements per step ----------------
// Used when head_size and head_size_v are multiples of 2W (kPair) and a row block holds one or a few
// query tokens (decode, short verification). A row block of RR rows (1, 2 or 4; 3 rows run as 4 with
// a zero padding row) is processed against KG = W / RR keys at a time: every K row is loaded and
// widened once for all RR rows, and the W (row, key) accumulators reduce with one transposing tree
// into one vector that is stored KEY-MAJOR (St[key * RR + row]) -- contiguous, no scatter. The
// softmax runs on those vectors with per-lane row constants (row = lane % RR) and xor-shuffle folds
// for the per-row max / sum; P.V reads each V row once for all RR rows.
// bf16 is widened two vectors per load: a 32-bit lane holds elements 2i (low half) and 2i + 1
// (high half), so (u << 16) and (u & 0xffff0000) are the even and odd elements in fp32. Q and O
// rows are kept "pair-permuted" to match ([evens | odds] per 2W group) and O is restored at the end.
// fp32 / fp16 rows stay in natural order. With avx512bf16 (KV_BF16DOT), QK of bf16 uses vdpbf16ps
// on the raw bf16 query (unscaled; the scale is applied to the scores).
constexpr int kPair = 2 * KV_W;
constexpr int kDirectMaxRows = 2 * kRowBlock;
#if (defined(KV_BF16DOT) || defined(KV_BF16DOT_EMULATE)) && KV_W == 16
#define KV_DIRECT_DOT 1
#else
#define KV_DIRECT_DOT 0
#endif

template <int DT> static inline void load_pair(const typename Elem<DT>::T* p, vf& lo, vf& hi) {
  if constexpr (DT == kBF16) {
    vu u;
    __builtin_memcpy(&u, p, sizeof u);
    lo = (vf)(u << 16);
    hi = (vf)(u & 0xffff0000u);
  } else {
    lo = load_vec<DT>(p);
    hi = load_vec<DT>(p + KV_W);
  }
}
static inline void permute_pairs(float* row, int n) {   // natural -> [evens | odds] per kPair group
  float tmp[kPair];
  for (int g = 0; g + kPair <= n; g += kPair) {
    for (int i = 0; i < KV_W; ++i) {
      tmp[i] = row[g + 2 * i];
      tmp[KV_W + i] = row[g + 2 * i + 1];
    }
    std::memcpy(row + g, tmp, sizeof tmp);
  }
}
static inline void unpermute_pairs(float* row, int n) {
  float tmp[kPair];
  for (int g = 0; g + kPair <= n; g += kPair) {
    for (int i = 0; i < KV_W; ++i) {
      tmp[2 * i] = row[g + i];
      tmp[2 * i + 1] = row[g + KV_W + i];
    }
    std::memcpy(row + g, tmp, sizeof tmp);
  }
}
#if KV_DIRECT_DOT
// acc[i] += a[2i] * b[2i] + a[2i+1] * b[2i+1] for bf16 pairs a, b (exact products, fp32 sums).
static inline vf dot2_bf16(vf acc, vu a, vu b) {
#if defined(KV_BF16DOT)
  return (vf)_mm512_dpbf16_ps((__m512)acc, (__m512bh)(__m512i)a, (__m512bh)(__m512i)b);
#else  // emulation, to test the lane logic on hosts without avx512bf16
  acc += (vf)(a << 16) * (vf)(b << 16);
  return acc + (vf)(a & 0xffff0000u) * (vf)(b & 0xffff0000u);
#endif
}
#endif

template <int H, int... I> static inline vf xor_shuffle(vf x, std::integer_sequence<int, I...>) {
  return __builtin_shuffle(x, vi{(I ^ H)...});
}
// Every lane ends up with the max (sum) over the lanes of its row (lanes equal mod RR).
template <int H, int RR> static inline vf fold_rows_max(vf x) {
  if constexpr (H < RR) return x;
  else return fold_rows_max<H / 2, RR>(vmax(x, xor_shuffle<H>(x, std::make_integer_sequence<int, KV_W>{})));
}
template <int H, int RR> static inline vf fold_rows_sum(vf x) {
  if constexpr (H < RR) return x;
  else return fold_rows_sum<H / 2, RR>(x + xor_shuffle<H>(x, std::make_integer_sequence<int, KV_W>{}));
}

struct DirectCtx {
  const void* const* kr;    // [kChunk] K/V rows in the cache (rows past n: a zero row)
  int voff;                 // V's offset in a row (elements)
  int c0, n;
  bool need_mask, causal;
  int window;
  float softcap;
  float qk_scale;           // applied to raw scores (1 where Q is pre-scaled)
  float* St;                // [kChunk][RR] key-major scores, then probabilities
  const void* const* pf;    // the next chunk's rows, prefetched while this one's scores are computed
  int pf_n, pf_lines;       // rows to prefetch (0: none), 64-byte lines per row
};

static KV_INLINE void prefetch_line(const char* p) {
#if defined(__x86_64__) && !defined(KV_PORTABLE_VECTORS)
  // GCC dropped __builtin_prefetch from the direct path's loops at -O2 and above; the asm keeps
  // every prefetch of the kernel (all of them go through here).
#if KV_PREFETCH_LOCALITY == 3
  asm volatile("prefetcht0 %0" : : "m"(*p));
#elif KV_PREFETCH_LOCALITY == 2
  asm volatile("prefetcht1 %0" : : "m"(*p));
#elif KV_PREFETCH_LOCALITY == 1
  asm volatile("prefetcht2 %0" : : "m"(*p));
#else
  asm volatile("prefetchnta %0" : : "m"(*p));
#endif
#else
  __builtin_prefetch(p, 0, KV_PREFETCH_LOCALITY);
#endif
}
// Prefetch lines [0, L) of rows [j0, j0 + n) (L fully unrolled for the common row sizes).
template <int L> static inline void prefetch_rows(const void* const* rows, int j0, int n) {
  for (int j = j0; j < j0 + n; ++j) {
    const char* p = static_cast<const char*>(rows[j]);
#pragma GCC unroll 16
    for (int b = 0; b < L; ++b) prefetch_line(p + b * 64);
  }
}
static inline void prefetch_rows_any(const void* const* rows, int j0, int n, int lines) {
  switch (lines) {
    case 2: prefetch_rows<2>(rows, j0, n); break;
    case 4: prefetch_rows<4>(rows, j0, n); break;
    case 8: prefetch_rows<8>(rows, j0, n); break;
    default:
      for (int j = j0; j < j0 + n; ++j)
        for (int b = 0; b < lines; ++b) prefetch_line(static_cast<const char*>(rows[j]) + b * 64);
  }
}

template <int RR, int NC, int DT>
static inline void pv_direct(float* O, int Dv, int d0, const DirectCtx& c, const float* alpha) {
  using T = typename Elem<DT>::T;
  const int voff = c.voff + d0;
  vf acc[RR][2 * NC];
#pragma GCC unroll 4
  for (int r = 0; r < RR; ++r)
#pragma GCC unroll 8
    for (int q = 0; q < 2 * NC; ++q) acc[r][q] = vload(O + r * Dv + d0 + q * KV_W) * alpha[r];
#pragma GCC unroll 2
  for (int j = 0; j < c.n; ++j) {
    const T* v = static_cast<const T*>(c.kr[j]) + voff;
    vf vv[2 * NC];
#pragma GCC unroll 4
    for (int q = 0; q < NC; ++q) load_pair<DT>(v + q * kPair, vv[2 * q], vv[2 * q + 1]);
    const float* p = c.St + j * RR;
#pragma GCC unroll 4
    for (int r = 0; r < RR; ++r) {
      const vf pr = vsplat(p[r]);
#pragma GCC unroll 8
      for (int q = 0; q < 2 * NC; ++q) acc[r][q] += pr * vv[q];
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < RR; ++r)
#pragma GCC unroll 8
    for (int q = 0; q < 2 * NC; ++q) vstore(O + r * Dv + d0 + q * KV_W, acc[r][q]);
}

// Q: RR fp32 rows (stride D, pre-scaled, pair-permuted for bf16); Qb: raw bf16 rows (stride D) for
// the dot path or null; O: RR rows (stride Dv); m / l: running max / sum; pos: row positions.
// ND / NV: head_size / head_size_v in kPair steps when known at compile time (full unrolling), else 0.
template <int RR, int DT, int ND, int NV>
static inline void row_block_direct(const float* Q, const uint16_t* Qb, int D, int Dv, float* O, float* m, float* l,
                                    const int* pos, const DirectCtx& c) {
  using T = typename Elem<DT>::T;
  if constexpr (ND > 0) D = ND * kPair;
  if constexpr (NV > 0) Dv = NV * kPair;
  constexpr int KG = KV_W / RR;
  const float ninf = -std::numeric_limits<float>::infinity();
  const int nv = (c.n + KG - 1) / KG;
  (void)Qb;
  for (int g = 0; g < nv; ++g) {
#if KV_PREFETCH && KV_PREFETCH_SPREAD
    if (g * KG < c.pf_n) prefetch_rows_any(c.pf, g * KG, std::min(KG, c.pf_n - g * KG), c.pf_lines);
#endif
    vf acc[KV_W];
#pragma GCC unroll 16
    for (int j = 0; j < KV_W; ++j) acc[j] = vsplat(0.0f);
    const T* kp[KG];
#pragma GCC unroll 16
    for (int j = 0; j < KG; ++j) kp[j] = static_cast<const T*>(c.kr[g * KG + j]);
#if KV_DIRECT_DOT
    if (DT == kBF16 && Qb) {
#pragma GCC unroll 8
      for (int d = 0; d < D; d += kPair) {
#pragma GCC unroll 16
        for (int j = 0; j < KG; ++j) {
          vu k;
          __builtin_memcpy(&k, kp[j] + d, sizeof k);
#pragma GCC unroll 4
          for (int r = 0; r < RR; ++r) {
            vu q;
            __builtin_memcpy(&q, Qb + r * D + d, sizeof q);
            acc[j * RR + r] = dot2_bf16(acc[j * RR + r], q, k);
          }
        }
      }
      vstore(c.St + g * KV_W, treduce(acc));
      continue;
    }
#endif
#pragma GCC unroll 8
    for (int d = 0; d < D; d += kPair) {
#pragma GCC unroll 16
      for (int j = 0; j < KG; ++j) {
        vf klo, khi;
        load_pair<DT>(kp[j] + d, klo, khi);
#pragma GCC unroll 4
        for (int r = 0; r < RR; ++r) {
          const float* q = Q + r * D + d;
          acc[j * RR + r] += vload(q) * klo;
          acc[j * RR + r] += vload(q + KV_W) * khi;
        }
      }
    }
    vstore(c.St + g * KV_W, treduce(acc));
  }

  // Per-lane row constants: lane L is row L % RR, key L / RR of its group.
  float mt[KV_W];
  int pt[KV_W], kt[KV_W];
  for (int L = 0; L < KV_W; ++L) {
    mt[L] = m[L % RR];
    pt[L] = pos[L % RR];
    kt[L] = L / RR;
  }
  vi posv, lkey;
  __builtin_memcpy(&posv, pt, sizeof posv);
  __builtin_memcpy(&lkey, kt, sizeof lkey);
  vf mx = vsplat(ninf);
  for (int g = 0; g < nv; ++g) {
    vf s = vload(c.St + g * KV_W);
    if (c.qk_scale != 1.0f) s *= c.qk_scale;
    if (c.softcap > 0.0f) s = c.softcap * vtanh(s * (1.0f / c.softcap));
    if (c.need_mask) {
      vi idx = lkey + g * KG;
      vi kpos = idx + c.c0;
      vi valid = idx < c.n;
      if (c.causal) valid &= kpos <= posv;
      if (c.window > 0) valid &= (posv - kpos) < c.window;
      s = valid ? s : vsplat(ninf);
    }
    vstore(c.St + g * KV_W, s);
    mx = vmax(mx, s);
  }
  const vf mnew = vmax(vload(mt), fold_rows_max<KV_W / 2, RR>(mx));
  vf sum = vsplat(0.0f);
  for (int g = 0; g < nv; ++g) {
    const vf x = vload(c.St + g * KV_W);
    vf p = vexp(x - mnew);
    p = x == vsplat(ninf) ? vsplat(0.0f) : p;
    vstore(c.St + g * KV_W, p);
    sum += p;
  }
  float mn[KV_W], sm[KV_W];
  vstore(mn, mnew);
  vstore(sm, fold_rows_sum<KV_W / 2, RR>(sum));
  float alpha[RR];
  for (int r = 0; r < RR; ++r) {
    if (mn[r] == ninf) {  // nothing visible yet for this row (its probabilities are all 0)
      alpha[r] = 1.0f;
      continue;
    }
    alpha[r] = m[r] == ninf ? 0.0f : std::exp(m[r] - mn[r]);
    l[r] = l[r] * alpha[r] + sm[r];
    m[r] = mn[r];
  }
  // P.V: NC pairs of V vectors per pass (as many accumulators as the registers hold).
  constexpr int NC = (KV_W == 16 ? 2 : 1) * (RR == 4 ? 1 : 2);
  int d0 = 0;
#pragma GCC unroll 8
  for (; d0 + NC * kPair <= Dv; d0 += NC * kPair) pv_direct<RR, NC, DT>(O, Dv, d0, c, alpha);
  if constexpr (NC > 1)
    for (; d0 < Dv; d0 += kPair) pv_direct<RR, 1, DT>(O, Dv, d0, c, alpha);
}

template <int DT, int ND>
static void direct_rows(int RR, const float* Q, const uint16_t* Qb, int D, int Dv, float* O, float* m, float* l,
                        const int* pos, const DirectCtx& c) {
  switch (RR) {
    case 4: row_block_direct<4, DT, ND, ND>(Q, Qb, D, Dv, O, m, l, pos, c); break;
    case 2: row_block_direct<2, DT, ND, ND>(Q, Qb, D, Dv, O, m, l, pos, c); break;
    default: row_block_direct<1, DT, ND, ND>(Q, Qb, D, Dv, O, m, l, pos, c); break;
  }
}

// ---- the work item ------------------------------------------------------------------------------
template <int DT>
static void run_item_t(const AttnParams& P, const WorkItem& it, float* ws) {
  using T = typename Elem<DT>::T;
  const int D = P.head_size, Dv = P.head_size_v, G = P.num_q_heads / P.num_kv_heads, bs = P.block_size;
  const int dp = int(round_up(D, KV_W)), dvp = int(round_up(Dv, KV_W));
  const int M = it.num_tokens * G;
  const int Mp = int(round_up(M, kRowBlock));   // rows padded to whole row blocks (the direct path runs 3 as 4)
  const float ninf = -std::numeric_limits<float>::infinity();
  // The direct path (see row_block_direct): bf16, few rows, head sizes in whole 2W pairs. fp32 and fp16
  // keep the path below: for fp32 the direct path measured slower at block sizes 16 / 32 (cold decode,
  // AVX2 host); fp16 is not measured (the direct path supports it: KV_DIRECT_ALL_DTYPES=1).
#ifndef KV_DIRECT_ALL_DTYPES
#define KV_DIRECT_ALL_DTYPES 0
#endif
  const bool direct = (DT == kBF16 || KV_DIRECT_ALL_DTYPES) && D > 0 && Dv > 0 && D % kPair == 0 &&
                      Dv % kPair == 0 && M <= kDirectMaxRows;
  const bool permuted = direct && DT == kBF16;

  float* Qs = ws;
  float* Os = Qs + int64_t(Mp) * dp;
  float* mrow = Os + int64_t(Mp) * dvp;
  float* lrow = mrow + Mp;
  float* Kc = lrow + Mp;
  float* Vc = Kc + kChunk * dp;
  float* zero = Vc + kChunk * dvp;
  float* S = zero + (dp > dvp ? dp : dvp);
  uint16_t* Qb = nullptr;   // bf16 queries (unscaled) for the bf16-dot path
  uint16_t* Pb = nullptr;   // bf16 probabilities for the bf16 P.V path
#if defined(KV_BF16DOT) || defined(KV_BF16DOT_EMULATE)
#if defined(KV_BF16DOT)
  if (DT == kBF16 && D % 32 == 0) Qb = reinterpret_cast<uint16_t*>(S + 2 * kRowBlock * kChunk);
#else
  if (DT == kBF16 && direct) Qb = reinterpret_cast<uint16_t*>(S + 2 * kRowBlock * kChunk);
#endif
#if KV_BF16_PV
  if (DT == kBF16 && Dv % 32 == 0) Pb = reinterpret_cast<uint16_t*>(S + kRowBlock * kChunk);
#endif
#endif

  const bool direct_k = (DT == kF32 && D == dp) || Qb != nullptr || direct, direct_v = Dv == dvp;
  std::memset(zero, 0, sizeof(float) * (dp > dvp ? dp : dvp));
  if (!direct_k && D != dp) std::memset(Kc, 0, sizeof(float) * kChunk * dp);
  if (!direct_v && Dv != dvp) std::memset(Vc, 0, sizeof(float) * kChunk * dvp);

  // Queries, widened, pre-scaled, padded with zeros.
  const T* query = static_cast<const T*>(P.query);
  for (int r = 0; r < Mp; ++r) {
    float* q = Qs + int64_t(r) * dp;
    std::memset(q, 0, sizeof(float) * dp);
    mrow[r] = ninf;
    lrow[r] = 0.0f;
    if (r >= M) {  // padding row: zero query (bf16 too)
      if (Qb) std::memset(Qb + int64_t(r) * dp, 0, sizeof(uint16_t) * dp);
      continue;
    }
    int t = r / G, h = it.kv_head * G + r % G;
    const T* src = query + int64_t(it.q_row0 + t) * P.q_stride_token + int64_t(h) * P.q_stride_head;
    convert_row<DT>(src, D, q);
    if (Qb) std::memcpy(Qb + int64_t(r) * dp, src, sizeof(uint16_t) * D);
    for (int d = 0; d < dp; d += KV_W) vstore(q + d, vload(q + d) * P.scale);
    if (permuted) permute_pairs(q, D);
  }
  std::memset(Os, 0, sizeof(float) * int64_t(Mp) * dvp);

  const T* cache = static_cast<const T*>(P.cache);
  const int64_t head_off = int64_t(it.kv_head) * P.s_head;
  const int32_t* table = P.block_table + int64_t(it.req) * P.bt_stride;
  const int row_bytes = int((D + Dv) * sizeof(T));

  // Row pointers of keys [c0, c0 + n): the block table is read only for these positions.
  auto rows_of = [&](int c0, int n, const T** dst) {
    int bi = c0 / bs, off = c0 - bi * bs, j = 0;
    const int64_t st = P.s_token;
    while (j < n) {
      const T* p = cache + int64_t(table[bi]) * P.s_block + head_off + int64_t(off) * st;
      const int e = std::min(n, j + bs - off);
      for (; j < e; ++j, p += st) dst[j] = p;
      off = 0;
      ++bi;
    }
  };

  const T* raw_a[kChunk];
  const T* raw_b[kChunk];
  const T** raw = raw_a;
  const T** next = raw_b;
  const float* kp[kChunk];
  const void* vp[kChunk];
  const uint16_t* kb[kChunk];
  int pos[kRowBlock];

  int c0 = it.k_lo;
  if (c0 < it.k_hi) rows_of(c0, std::min(kChunk, it.k_hi - c0), raw);
  for (; c0 < it.k_hi; c0 += kChunk) {
    const int n = std::min(kChunk, it.k_hi - c0);
    const int c1 = c0 + kChunk;
    int nn = 0;
    if (c1 < it.k_hi) {  // the next chunk's K/V rows, prefetched while this chunk is widened
      nn = std::min(kChunk, it.k_hi - c1);
      rows_of(c1, nn, next);
    }
    if (direct) {
      for (int j = n; j < kChunk && j < n + KV_W; ++j) raw[j] = reinterpret_cast<const T*>(zero);  // padding keys
#if KV_PREFETCH && !KV_PREFETCH_SPREAD
      prefetch_rows_any(reinterpret_cast<const void* const*>(next), 0, nn, (row_bytes + 63) / 64);
#endif
    }
    for (int j = 0; j < (direct ? 0 : n); ++j) {
#if KV_PREFETCH
      if (j < nn)
        for (int b = 0; b < row_bytes; b += KV_PREFETCH_STRIDE) prefetch_line(reinterpret_cast<const char*>(next[j]) + b);
#endif
      if (Qb) kb[j] = reinterpret_cast<const uint16_t*>(raw[j]);
      else if (direct_k) kp[j] = reinterpret_cast<const float*>(raw[j]);
      else { convert_row<DT>(raw[j], D, Kc + j * dp); kp[j] = Kc + j * dp; }
      if (direct_v) vp[j] = raw[j] + D;
      else { convert_row<DT>(raw[j] + D, Dv, Vc + j * dvp); vp[j] = Vc + j * dvp; }
    }
    const int ng = (n + KV_W - 1) / KV_W;
    for (int j = n; j < ng * KV_W; ++j) {
      kp[j] = zero;
      vp[j] = zero;
      kb[j] = reinterpret_cast<const uint16_t*>(zero);
    }

    ChunkCtx c{kp, kb, vp, c0, n, ng, dp / KV_W, dvp / KV_W, dvp, false, P.causal, P.window, P.softcap,
               Qb ? P.scale : 1.0f, direct_v ? DT : int(kF32), Pb, S};
    DirectCtx dc{reinterpret_cast<const void* const*>(raw), D, c0, n, false, P.causal, P.window, P.softcap,
                 (KV_DIRECT_DOT && Qb) ? P.scale : 1.0f, S, reinterpret_cast<const void* const*>(next),
                 KV_PREFETCH_SPREAD ? nn : 0, (row_bytes + 63) / 64};
    for (int m0 = 0; m0 < M; m0 += kRowBlock) {
      const int R = std::min(kRowBlock, M - m0);
      const int p_lo = it.pos0 + m0 / G, p_hi = it.pos0 + (m0 + R - 1) / G;
      if (P.causal && c0 > p_hi) continue;                                // chunk after every row
      if (P.window > 0 && p_lo - (c0 + n - 1) >= P.window) continue;      // chunk left every window
      c.need_mask = n % KV_W != 0 || (P.causal && c0 + n - 1 > p_lo) || (P.window > 0 && p_hi - c0 >= P.window);
      for (int r = 0; r < R; ++r) pos[r] = it.pos0 + (m0 + r) / G;
      for (int r = R; r < kRowBlock; ++r) pos[r] = pos[R - 1];
      const float* Q = Qs + int64_t(m0) * dp;
      float* O = Os + int64_t(m0) * dvp;
      if (direct) {
        dc.need_mask = c.need_mask;
        const uint16_t* Qbm = Qb ? Qb + int64_t(m0) * dp : nullptr;
        const int RR = R > 2 ? 4 : R;
        if (D == Dv && D == 64) direct_rows<DT, 64 / kPair>(RR, Q, Qbm, D, Dv, O, mrow + m0, lrow + m0, pos, dc);
        else if (D == Dv && D == 128) direct_rows<DT, 128 / kPair>(RR, Q, Qbm, D, Dv, O, mrow + m0, lrow + m0, pos, dc);
        else direct_rows<DT, 0>(RR, Q, Qbm, D, Dv, O, mrow + m0, lrow + m0, pos, dc);
        dc.pf_n = 0;   // prefetched by the first row block
        continue;
      }
      switch (R) {
        case 4: row_block<4>(Q, Qb ? Qb + int64_t(m0) * dp : nullptr, dp, O, mrow + m0, lrow + m0, pos, c); break;
        case 3: row_block<3>(Q, Qb ? Qb + int64_t(m0) * dp : nullptr, dp, O, mrow + m0, lrow + m0, pos, c); break;
        case 2: row_block<2>(Q, Qb ? Qb + int64_t(m0) * dp : nullptr, dp, O, mrow + m0, lrow + m0, pos, c); break;
        default: row_block<1>(Q, Qb ? Qb + int64_t(m0) * dp : nullptr, dp, O, mrow + m0, lrow + m0, pos, c); break;
      }
    }
    std::swap(raw, next);
  }

#if defined(KV_BF16DOT)
  if (Pb)
    for (int r = 0; r < M; ++r) unpermute_bf16_pv(Os + int64_t(r) * dvp, dvp);
#endif
  if (permuted)
    for (int r = 0; r < M; ++r) unpermute_pairs(Os + int64_t(r) * dvp, Dv);
  if (it.partial == nullptr) {
    T* out = static_cast<T*>(P.out);
    for (int r = 0; r < M; ++r) {
      int t = r / G, h = it.kv_head * G + r % G;
      T* dst = out + int64_t(it.q_row0 + t) * P.o_stride_token + int64_t(h) * P.o_stride_head;
      const float* o = Os + int64_t(r) * dvp;
      const float inv = lrow[r] > 0.0f ? 1.0f / lrow[r] : 0.0f;
      for (int d = 0; d < Dv; ++d) store_one<DT>(dst + d, o[d] * inv);
    }
  } else {
    std::memcpy(it.partial, Os, sizeof(float) * int64_t(M) * dvp);
    std::memcpy(it.partial + int64_t(M) * dvp, mrow, sizeof(float) * M);
    std::memcpy(it.partial + int64_t(M) * dvp + M, lrow, sizeof(float) * M);
  }
}

static void run_item(const AttnParams& P, const WorkItem& it, float* ws) {
  switch (P.dtype) {
    case kF32: run_item_t<kF32>(P, it, ws); break;
    case kF16: run_item_t<kF16>(P, it, ws); break;
    default: run_item_t<kBF16>(P, it, ws); break;
  }
}
