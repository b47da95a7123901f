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
// scratch; rows two chunks ahead are prefetched (into L2). Scores use fp32 FMAs; the 16 (or 8/4) per-key dot
// product accumulators are reduced with a transposing shuffle tree, so one vector holds one score
// per key. Online softmax (running max m, sum l) keeps O unnormalised; a work item either
// normalises and writes `out` or, when the context is partitioned, leaves (O, m, l) for the
// log-sum-exp merge in paged_attention.cpp. Items with more rows per KV head than the direct path
// takes (prefill, longer verification) run with the rows in the lanes instead: prefill_tiles.h.
//
// KV_PORTABLE_VECTORS: no intrinsics in the loads (a testing aid: any KV_W on any host).
// Requires before inclusion: <cstdint> <cstring> <cmath> <utility> <limits>, kvmulti_cpu.h,
// <immintrin.h> on x86.

// Software prefetch of the K/V rows KV_PREFETCH_DIST chunks ahead (KV_PREFETCH=0: none), with
// KV_PREFETCH_LEVEL 0 / 1 / 2 / 3 = prefetcht0 / t1 / t2 / nta. Into L2, two chunks ahead: into L1
// the lines were evicted before use (measurements: CHANGELOG.md).
#ifndef KV_PREFETCH
#define KV_PREFETCH 1
#endif
#ifndef KV_PREFETCH_DIST
#define KV_PREFETCH_DIST 2
#endif
// Chunks of the item a thread runs next that are prefetched during this item's last ones
// (WorkItem::next; 0: none), so the prefetch distance holds across items.
#ifndef KV_PREFETCH_NEXT_ITEM
#define KV_PREFETCH_NEXT_ITEM KV_PREFETCH_DIST
#endif
// The prefetch of a chunk's rows is spread over the chunk before it: KV_PREFETCH_SPLIT quarters of each
// row's lines while that chunk's scores are computed, the rest during its P.V (the direct path's
// bf16-dot P.V; the other paths request all lines during the scores), so reads overlap both halves
// of the arithmetic.
#ifndef KV_PREFETCH_SPLIT
#define KV_PREFETCH_SPLIT 2
#endif
#ifndef KV_PREFETCH_LEVEL
#define KV_PREFETCH_LEVEL 1
#endif
// A chunk's rows are requested again one chunk ahead, all their lines, spread over the key groups of
// the chunk before it (KV_PREFETCH_DIST > 1): Zen 4 drops some prefetcht1 requests, and such a line
// is then read from RAM when it is used; spread out, the second request costs little hot.
#ifndef KV_PREFETCH_AGAIN
#define KV_PREFETCH_AGAIN 1
#endif
#if KV_PREFETCH_LEVEL == 0
#define KV_PREFETCH_INSN "prefetcht0"
#elif KV_PREFETCH_LEVEL == 1
#define KV_PREFETCH_INSN "prefetcht1"
#elif KV_PREFETCH_LEVEL == 2
#define KV_PREFETCH_INSN "prefetcht2"
#else
#define KV_PREFETCH_INSN "prefetchnta"
#endif
#ifndef KV_W
#error "define KV_W (fp32 lanes) before including attention_kernel.h"
#endif

// The hot helpers are forced inline: an out-of-line call spills every live vector register (all are
// caller-saved) and treduce's accumulator array would go through memory.
#ifndef KV_INLINE
#define KV_INLINE inline __attribute__((always_inline))
#endif
// The opposite, for a loop nest that needs the vector registers to itself.
#ifndef KV_NOINLINE
#define KV_NOINLINE __attribute__((noinline))
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


// fp8 caches, widened in registers. A load yields fp8_unit<DT>()^-1 x the stored value: e5m2 bytes
// are the top byte of an fp16 (unit 1); e4m3fn bytes map to fp16 bits with a shift (kvmulti_cpu.h),
// which is the value x 2^-8 (unit 2^8, folded into the per-head scales: no multiply per element).
template <> struct Elem<kE4M3> { using T = uint8_t; };
template <> struct Elem<kE5M2> { using T = uint8_t; };
template <int DT> constexpr float fp8_unit() { return DT == kE4M3 ? 256.0f : 1.0f; }
// e4m3fn -> fp16 bits of the value x 2^-8: sign-extended byte << 7, masked (bit 14 is the sign's copy).
static inline float load_e4m3_one(const uint8_t* p) {
  if ((*p & 0x7fu) == 0x7fu) return std::numeric_limits<float>::quiet_NaN();
  return f16_to_f32(uint16_t((uint16_t(int16_t(int8_t(*p))) << 7) & 0xbf80u));
}
static inline float load_e5m2_one(const uint8_t* p) { return e5m2_to_f32(*p); }
#if KV_W == 16 && !defined(KV_PORTABLE_VECTORS)
static inline vf load_e5m2(const uint8_t* p) {
  const __m256i h = _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)p)), 8);
  return (vf)_mm512_cvtph_ps(h);
}
static inline vf load_e4m3(const uint8_t* p) {
  const __m128i b = _mm_loadu_si128((const __m128i*)p);
  const __mmask16 nan = _mm_cmpeq_epi8_mask(_mm_and_si128(b, _mm_set1_epi8(0x7f)), _mm_set1_epi8(0x7f));
  const __m256i h = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(b), 7), _mm256_set1_epi16(int16_t(0xbf80)));
  return (vf)_mm512_mask_blend_ps(nan, _mm512_cvtph_ps(h), _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN()));
}
#elif KV_W == 8 && !defined(KV_PORTABLE_VECTORS)
static inline vf load_e5m2(const uint8_t* p) {
  return (vf)_mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i*)p)), 8));
}
static inline vf load_e4m3(const uint8_t* p) {
  const __m128i b = _mm_loadl_epi64((const __m128i*)p);
  const __m128i nan = _mm_cmpeq_epi8(_mm_and_si128(b, _mm_set1_epi8(0x7f)), _mm_set1_epi8(0x7f));
  const __m128i h = _mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(b), 7), _mm_set1_epi16(int16_t(0xbf80)));
  return (vf)_mm256_blendv_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(std::numeric_limits<float>::quiet_NaN()),
                              _mm256_castsi256_ps(_mm256_cvtepi8_epi32(nan)));
}
#else
static inline vf load_e5m2(const uint8_t* p) {
  vf v;
  for (int i = 0; i < KV_W; ++i) v[i] = load_e5m2_one(p + i);
  return v;
}
static inline vf load_e4m3(const uint8_t* p) {
  vf v;
  for (int i = 0; i < KV_W; ++i) v[i] = load_e4m3_one(p + i);
  return v;
}
#endif

template <int DT> static inline vf load_vec(const typename Elem<DT>::T* p) {
  if constexpr (DT == kF32) return vload(p);
  else if constexpr (DT == kBF16) return load_bf16(p);
  else if constexpr (DT == kE4M3) return load_e4m3(p);
  else if constexpr (DT == kE5M2) return load_e5m2(p);
  else return load_f16(p);
}
template <int DT> static inline float load_one(const typename Elem<DT>::T* p) {
  if constexpr (DT == kF32) return *p;
  else if constexpr (DT == kBF16) return bf16_to_f32(*p);
  else if constexpr (DT == kE4M3) return load_e4m3_one(p);
  else if constexpr (DT == kE5M2) return load_e5m2_one(p);
  else return f16_to_f32(*p);
}
template <int DT> static inline void store_one(typename Elem<DT>::T* p, float v) {
  if constexpr (DT == kF32) *p = v;
  else if constexpr (DT == kBF16) *p = f32_to_bf16(v);
  else *p = f32_to_f16(v);
}
static inline bool row_has_nan(const float* x, int n) {   // n: a multiple of KV_W
  vi nan = vsplat(0.0f) != vsplat(0.0f);
  for (int d = 0; d < n; d += KV_W) {
    const vf v = vload(x + d);
    nan |= v != v;
  }
  for (int i = 0; i < KV_W; ++i)
    if (nan[i]) return true;
  return false;
}
// dst[0:n] = fp32(src[0:n]); dst's padding (up to a lane multiple) is left as it is (zeroed once).
template <int DT> static inline void convert_row(const typename Elem<DT>::T* src, int n, float* dst) {
  int d = 0;
  for (; d + KV_W <= n; d += KV_W) vstore(dst + d, load_vec<DT>(src + d));
  for (; d < n; ++d) dst[d] = load_one<DT>(src + d);
}

// ---- math -------------------------------------------------------------------------------------
// exp for -87.3 <= x <= 88 without clamps (Cephes polynomial, ~1 ulp).
static KV_INLINE vf vexp_unclamped(vf x) {
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

// exp for x <= 88; x is clamped below at -87.3 (callers zero masked lanes).
static KV_INLINE vf vexp(vf x) {
  const vf lo = vsplat(-87.3365447504f), hi = vsplat(88.0f);
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  return vexp_unclamped(x);
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
  float* S;                 // [kRowBlock][kChunk] scores, then probabilities
  const float* slope;       // [kRowBlock] each row's ALiBi slope, or nullptr
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
      if (c.slope) s += c.slope[r] * __builtin_convertvector(lane + (g * KV_W + c.c0 - pos[r]), vf);
      if (c.need_mask) {
        vi idx = lane + g * KV_W;
        vi kpos = idx + c.c0;
        vi valid = idx < c.n;
        if (c.causal) valid &= kpos <= pos[r];
        if (c.window > 0) valid &= (pos[r] - kpos) < c.window;
        if (c.window > 0 && !c.causal) valid &= (kpos - pos[r]) < c.window;   // both sides
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
      continue;
    }
    alpha[r] = m[r] == ninf ? 0.0f : std::exp(m[r] - m_new);
    vf sum = vsplat(0.0f);
    for (int g = 0; g < c.ng; ++g) {
      vf x = vload(s + g * KV_W);
      vf p = vexp(x - m_new);
      p = x == vsplat(ninf) ? vsplat(0.0f) : p;
      vstore(s + g * KV_W, p);
      sum += p;
    }
    l[r] = l[r] * alpha[r] + hsum(sum);
    m[r] = m_new;
  }
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
// on the raw bf16 query (unscaled; the scale is applied to the scores), and so does P.V of a bf16
// query (pv_direct_dot: bf16 probabilities, two keys per instruction; O rows then in pvdot order).
constexpr int kPair = 2 * KV_W;
constexpr int kDirectMaxRows = 2 * kRowBlock;
#if (defined(KV_BF16DOT) || defined(KV_BF16DOT_EMULATE)) && KV_W == 16
#define KV_DIRECT_DOT 1
#else
#define KV_DIRECT_DOT 0
#endif
// P.V of bf16 caches on bf16 dots too (pv_direct_dot; the probabilities rounded to bf16, as flash
// attention kernels do on GPUs); KV_PV_DOT=0: fp32 FMAs on widened V.
#ifndef KV_PV_DOT
#define KV_PV_DOT KV_DIRECT_DOT
#elif KV_PV_DOT && !KV_DIRECT_DOT
#undef KV_PV_DOT
#define KV_PV_DOT 0
#endif
// The one rule for it, used where P.V runs (row_block_direct) and where O's order is undone
// (run_item_t): bf16 query rows over a bf16 cache, or over fp8 read through the byte tables.
static constexpr bool pv_on_dots(int cache_dt, bool lut, bool bf16_query_rows) {
  return KV_PV_DOT && (cache_dt == kBF16 || lut) && bf16_query_rows;
}

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
// Rows kept in a load's element order: per group of GROUP elements, position p holds element src(p).
template <int GROUP, typename E> static inline void permute_rows(E* row, int n, int (*src)(int)) {
  E tmp[GROUP];
  for (int g = 0; g + GROUP <= n; g += GROUP) {
    for (int p = 0; p < GROUP; ++p) tmp[p] = row[g + src(p)];
    std::memcpy(row + g, tmp, sizeof tmp);
  }
}
template <int GROUP> static inline void unpermute_rows(float* row, int n, int (*src)(int)) {
  float tmp[GROUP];
  for (int g = 0; g + GROUP <= n; g += GROUP) {
    for (int p = 0; p < GROUP; ++p) tmp[src(p)] = row[g + p];
    std::memcpy(row + g, tmp, sizeof tmp);
  }
}
// load_pair's bf16 order: [evens | odds] per kPair group.
constexpr int pair_src(int p) { return p < KV_W ? 2 * p : 2 * (p - KV_W) + 1; }
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

#if KV_DIRECT_DOT
// QK of bf16 on half vectors (KV_QK_HALVES): one vector holds key j's next KV_W elements in its low
// half and key j + KG / 2's in its high half, against the query's KV_W elements in both halves. The
// per-key sums then start from 8 vectors of two 8-lane segments instead of 16 of one 16-lane
// segment: treduce's first level (16 cross-half shuffles and 8 adds per key group) is not needed.
#ifndef KV_QK_HALVES
#define KV_QK_HALVES 1
#endif
// A vector of the KV_W bf16 at lo (low half) and the KV_W at hi (high half).
static KV_INLINE vu load_halves(const uint16_t* lo, const uint16_t* hi) {
#if defined(KV_BF16DOT) && !defined(KV_PORTABLE_VECTORS)
  const __m512i v = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo)));
  return (vu)_mm512_inserti64x4(v, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(hi)), 1);
#else
  vu v;
  __builtin_memcpy(&v, lo, sizeof v / 2);
  __builtin_memcpy(reinterpret_cast<char*>(&v) + sizeof v / 2, hi, sizeof v / 2);
  return v;
#endif
}
static KV_INLINE vu load_dup(const uint16_t* p) {
#if defined(KV_BF16DOT) && !defined(KV_PORTABLE_VECTORS)
  return (vu)_mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#else
  return load_halves(p, p);
#endif
}
// treduce of acc[0:KV_W] given as the 8 vectors A[m] = [acc[m] half-summed | acc[m + 8] half-summed].
static KV_INLINE vf treduce_halves(const vf* A) {
  vf a[KV_W / 2];
#pragma GCC unroll 8
  for (int i = 0; i < KV_W / 2; ++i) a[i] = A[bitrev(2 * i)];
  level<4>(a, 8);
  level<2>(a, 4);
  level<1>(a, 2);
  return a[0];
}
#endif

// ---- fp8 through byte tables (KV_FP8_LUT) ---------------------------------------------------------
// On the direct path, 64 fp8 codes at a time become 64 bf16 (exact: fp8 has at most 4 significant bits)
// with two 128-entry byte lookups (vpermt2b: the low and the high byte of the bf16 of the code's 7
// magnitude bits), the sign OR-ed into the high byte, and two byte interleaves. The words come out
// in "lut order" (lut_bf16_src); their fp32 halves as the bf16 pair trick gives them (load_pair)
// in lut_f32_src order. Q and O rows are kept permuted to match, as for bf16. About half the
// instructions of widening through fp16 (vcvtph2ps), and the QK of a bf16 query uses the bf16 dot.
#if KV_W == 16 && ((defined(KV_BF16DOT) && defined(KV_FP8_VBMI)) || defined(KV_BF16DOT_EMULATE))
#define KV_FP8_LUT 1
#else
#define KV_FP8_LUT 0
#endif
constexpr int kLutGroup = 64;
// bf16 bits of fp8 magnitude code c (0..127) x fp8_unit<DT>()^-1; NaN (and e5m2's inf) as bf16.
constexpr uint16_t fp8_mag_bf16(int dt, int c) {
  const bool e4 = dt == kE4M3;
  const int mb = e4 ? 3 : 2, bias = e4 ? 7 : 15, e = c >> mb, m = c & ((1 << mb) - 1);
  if (e4 ? c == 0x7f : e == 31) return (!e4 && m == 0) ? 0x7f80 : 0x7fc0;
  if (c == 0) return 0;
  const int M = e ? (1 << mb) + m : m;                           // value = M x 2^E
  const int E = (e ? e : 1) - bias - mb - (e4 ? 8 : 0);
  int t = 0;
  while ((2 << t) <= M) ++t;                                       // M in [2^t, 2^(t+1))
  return uint16_t(((E + t + 127) << 7) | ((M - (1 << t)) << (7 - t)));
}
struct alignas(64) Fp8Lut { uint8_t lo[128], hi[128]; };
template <int DT> constexpr Fp8Lut make_fp8_lut() {
  Fp8Lut t{};
  for (int c = 0; c < 128; ++c) {
    t.lo[c] = uint8_t(fp8_mag_bf16(DT, c) & 0xff);
    t.hi[c] = uint8_t(fp8_mag_bf16(DT, c) >> 8);
  }
  return t;
}
template <int DT> inline constexpr Fp8Lut kFp8Lut = make_fp8_lut<DT>();
// Element (within a group of 64) at bf16 position p of the pair (a, b), and at fp32 position p of
// (a << 16, a & hi16, b << 16, b & hi16). a holds elements 0-7, 16-23, 32-39, 48-55; b the others.
constexpr int lut_bf16_src(int p) { return 16 * ((p % 32) / 8) + (p >= 32 ? 8 : 0) + p % 8; }
constexpr int lut_f32_src(int p) { return lut_bf16_src((p / 32) * 32 + 2 * (p % 16) + (p / 16) % 2); }

#if KV_FP8_LUT
template <int DT> static KV_INLINE void fp8_lut64(const uint8_t* p, vu& a, vu& b) {
#if defined(KV_BF16DOT) && !defined(KV_PORTABLE_VECTORS)
  const __m512i lo0 = _mm512_load_si512(kFp8Lut<DT>.lo), lo1 = _mm512_load_si512(kFp8Lut<DT>.lo + 64);
  const __m512i hi0 = _mm512_load_si512(kFp8Lut<DT>.hi), hi1 = _mm512_load_si512(kFp8Lut<DT>.hi + 64);
  const __m512i c = _mm512_loadu_si512(p);
  const __m512i lo = _mm512_permutex2var_epi8(lo0, c, lo1);      // index: the low 7 bits
  const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(hi0, c, hi1), c,
                                               _mm512_set1_epi8(char(0x80)), 0xf8);   // hi | (c & 0x80)
  a = (vu)_mm512_unpacklo_epi8(lo, hi);
  b = (vu)_mm512_unpackhi_epi8(lo, hi);
#else
  uint16_t w[2 * 32];
  for (int q = 0; q < kLutGroup; ++q) {
    const int c = p[lut_bf16_src(q)], m = c & 0x7f;
    w[q] = uint16_t(((kFp8Lut<DT>.hi[m] | (c & 0x80)) << 8) | kFp8Lut<DT>.lo[m]);
  }
  __builtin_memcpy(&a, w, sizeof a);
  __builtin_memcpy(&b, w + 32, sizeof b);
#endif
}
// The same 64 codes as four fp32 vectors, in lut_f32_src order.
template <int DT> static KV_INLINE void fp8_lut64_f32(const uint8_t* p, vf* v) {
  vu a, b;
  fp8_lut64<DT>(p, a, b);
  v[0] = (vf)(a << 16);
  v[1] = (vf)(a & 0xffff0000u);
  v[2] = (vf)(b << 16);
  v[3] = (vf)(b & 0xffff0000u);
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
  const void* const* pf;    // rows KV_PREFETCH_DIST chunks ahead, prefetched while this one's scores are computed
  int pf_n, pf_lines;       // rows to prefetch (0: none), 64-byte lines per row
  const void* const* ag;    // rows one chunk ahead, prefetched again (KV_PREFETCH_AGAIN), all pf_lines
  int ag_n;                 // rows to prefetch again (0: none)
  const float* slope = nullptr;   // [RR] each row's ALiBi slope, or nullptr
};

static KV_INLINE void prefetch_line(const char* p) {
#if defined(__x86_64__) && !defined(KV_PORTABLE_VECTORS)
  // GCC drops __builtin_prefetch from the direct path's loops at -O2 and above; the asm keeps every
  // prefetch of the kernel (all of them go through here).
  asm volatile(KV_PREFETCH_INSN " %0" : : "m"(*p));
#else
  __builtin_prefetch(p, 0, 3);
#endif
}
// Prefetch lines [from, from + L) of rows [j0, j0 + n) (L fully unrolled for the common counts).
template <int L> static inline void prefetch_rows(const void* const* rows, int j0, int n, int from) {
  for (int j = j0; j < j0 + n; ++j) {
    const char* p = static_cast<const char*>(rows[j]) + from * 64;
#pragma GCC unroll 16
    for (int b = 0; b < L; ++b) prefetch_line(p + b * 64);
  }
}
static inline void prefetch_rows_any(const void* const* rows, int j0, int n, int lines, int from = 0) {
  switch (lines) {
    case 2: prefetch_rows<2>(rows, j0, n, from); break;
    case 4: prefetch_rows<4>(rows, j0, n, from); break;
    case 8: prefetch_rows<8>(rows, j0, n, from); break;
    default:
      for (int j = j0; j < j0 + n; ++j)
        for (int b = from; b < from + lines; ++b) prefetch_line(static_cast<const char*>(rows[j]) + b * 64);
  }
}

// The N O vectors from element d0 of RR rows (stride Dv), rescaled by each row's alpha, and back.
template <int RR, int N> static KV_INLINE void load_o_rows(vf (&acc)[RR][N], const float* O, int Dv, int d0,
                                                          const float* alpha) {
#pragma GCC unroll 4
  for (int r = 0; r < RR; ++r)
#pragma GCC unroll 8
    for (int q = 0; q < N; ++q) acc[r][q] = vload(O + r * Dv + d0 + q * KV_W) * alpha[r];
}
template <int RR, int N> static KV_INLINE void store_o_rows(const vf (&acc)[RR][N], float* O, int Dv, int d0) {
#pragma GCC unroll 4
  for (int r = 0; r < RR; ++r)
#pragma GCC unroll 8
    for (int q = 0; q < N; ++q) vstore(O + r * Dv + d0 + q * KV_W, acc[r][q]);
}

// The lines of a prefetched row requested during QK; P.V requests the rest (prefetch_pv_lines).
static constexpr int qk_prefetch_lines(int lines) { return KV_PREFETCH ? lines * KV_PREFETCH_SPLIT / 4 : 0; }
// P.V's share of the prefetch: rows [j, j + n) ahead, lines from qk_prefetch_lines on, requested every
// kPvPrefetchKeys keys of the bf16-dot P.V (pv_direct_dot). The FMA P.V (fp32 / fp16 queries or caches)
// requests none: there the QK loop requests all lines, since the split costs small hot calls there.
constexpr int kPvPrefetchKeys = 4;
static KV_INLINE void prefetch_pv_lines(const DirectCtx& c, int j, int n) {
  if (KV_PREFETCH_SPLIT >= 4 || j >= c.pf_n) return;
  const int first = qk_prefetch_lines(c.pf_lines);
  prefetch_rows_any(c.pf, j, std::min(j + n, c.pf_n) - j, c.pf_lines - first, first);
}

template <int RR, int NC, int DT, bool LUT = false>
static inline void pv_direct(float* O, int Dv, int d0, const DirectCtx& c, const float* alpha) {
  using T = typename Elem<DT>::T;
  const int voff = c.voff + d0;
  vf acc[RR][2 * NC];
  load_o_rows<RR, 2 * NC>(acc, O, Dv, d0, alpha);
#pragma GCC unroll 2
  for (int j = 0; j < c.n; ++j) {
    const T* v = static_cast<const T*>(c.kr[j]) + voff;
    vf vv[2 * NC];
    if constexpr (LUT) {
#if KV_FP8_LUT
      static_assert(NC % 2 == 0, "a lut group is two pairs");
#pragma GCC unroll 4
      for (int q = 0; q < NC / 2; ++q) fp8_lut64_f32<DT>(v + q * kLutGroup, vv + 4 * q);
#endif
    } else {
#pragma GCC unroll 4
      for (int q = 0; q < NC; ++q) load_pair<DT>(v + q * kPair, vv[2 * q], vv[2 * q + 1]);
    }
    const float* p = c.St + j * RR;
#pragma GCC unroll 4
    for (int r = 0; r < RR; ++r) {
      const vf pr = vsplat(p[r]);
#pragma GCC unroll 8
      for (int q = 0; q < 2 * NC; ++q) acc[r][q] += pr * vv[q];
    }
  }
  store_o_rows<RR, 2 * NC>(acc, O, Dv, d0);
}

// Element (within a kPair group) at O position p when P.V runs on bf16 dots.
constexpr int pvdot_src(int p) { return 8 * ((p % KV_W) / 4) + (p >= KV_W ? 4 : 0) + p % 4; }
// The same for fp8 through the byte tables (a group of kLutGroup): the word pvdot_src gives, of
// fp8_lut64's a (first kPair positions) or b, in lut_bf16_src order.
constexpr int pvdot_lut_src(int p) { return lut_bf16_src((p / kPair) * kPair + pvdot_src(p % kPair)); }

#if KV_PV_DOT
// P.V of a bf16 cache with bf16 dots: one vdpbf16ps takes two keys. The V rows of keys j and j + 1
// are interleaved word by word (within 128-bit lanes, as vpunpck{l,h}wd do), and Pw holds each
// row's probabilities of the key pair as one bf16 pair (pv_pairs). O's lanes: pvdot_src order.
static KV_INLINE void interleave_words(vu a, vu b, vu& lo, vu& hi) {
#if defined(KV_BF16DOT) && !defined(KV_PORTABLE_VECTORS)
  lo = (vu)_mm512_unpacklo_epi16((__m512i)a, (__m512i)b);
  hi = (vu)_mm512_unpackhi_epi16((__m512i)a, (__m512i)b);
#else
  // 32-bit lane i of lo: words 8 (i / 4) + i % 4 of a (low half) and b (high half); hi: + 4.
  vu wa_lo, wb_lo, wa_hi, wb_hi;
  for (int i = 0; i < KV_W; ++i) {
    const int w = 8 * (i / 4) + i % 4;
    wa_lo[i] = (a[w / 2] >> (16 * (w % 2))) & 0xffffu;
    wb_lo[i] = (b[w / 2] >> (16 * (w % 2))) & 0xffffu;
    wa_hi[i] = (a[(w + 4) / 2] >> (16 * (w % 2))) & 0xffffu;
    wb_hi[i] = (b[(w + 4) / 2] >> (16 * (w % 2))) & 0xffffu;
  }
  lo = wa_lo | (wb_lo << 16);
  hi = wa_hi | (wb_hi << 16);
#endif
}
// Probabilities of one key group (lane L: row L % RR, key L / RR) as bf16 pairs, rounded to
// nearest even: word q x RR + r = (p[key 2q][r], p[key 2q + 1][r]); KV_W / 2 words.
template <int RR, int... I> static KV_INLINE void pv_pairs(vf p, uint32_t* dst, std::integer_sequence<int, I...>) {
  vu b = (vu)p;
  b = (b + 0x7fffu + ((b >> 16) & 1u)) >> 16;     // p >= 0 or a quiet NaN: no overflow into inf
  const vu lo = __builtin_shuffle(b, vu{uint32_t((2 * ((I % (KV_W / 2)) / RR)) * RR + I % RR)...});
  const vu hi = __builtin_shuffle(b, vu{uint32_t((2 * ((I % (KV_W / 2)) / RR) + 1) * RR + I % RR)...});
  const vu w = lo | (hi << 16);
  __builtin_memcpy(dst, &w, sizeof(uint32_t) * (KV_W / 2));
}

// DT: kBF16, or an fp8 format read through the byte tables (LUT; NC even: whole lut groups).
template <int RR, int NC, int DT, bool LUT>
static inline void pv_direct_dot(float* O, int Dv, int d0, const DirectCtx& c, const uint32_t* Pw, const float* alpha) {
  using T = typename Elem<DT>::T;
  const int voff = c.voff + d0;
  vf acc[RR][2 * NC];
  load_o_rows<RR, 2 * NC>(acc, O, Dv, d0, alpha);
  // Keys past n are zero rows with probability 0 (a key group is an even number of keys).
  for (int j = 0; j < c.n; j += 2) {
    if (d0 == 0 && j % kPvPrefetchKeys == 0) prefetch_pv_lines(c, j, kPvPrefetchKeys);
    const T* v0 = static_cast<const T*>(c.kr[j]) + voff;
    const T* v1 = static_cast<const T*>(c.kr[j + 1]) + voff;
    vu lo[NC], hi[NC];
    if constexpr (LUT) {
#if KV_FP8_LUT
      static_assert(NC % 2 == 0, "a lut group is two pairs");
#pragma GCC unroll 4
      for (int q = 0; q < NC / 2; ++q) {   // words of the two keys: a (then b) of fp8_lut64
        vu a0, b0, a1, b1;
        fp8_lut64<DT>(v0 + q * kLutGroup, a0, b0);
        fp8_lut64<DT>(v1 + q * kLutGroup, a1, b1);
        interleave_words(a0, a1, lo[2 * q], hi[2 * q]);
        interleave_words(b0, b1, lo[2 * q + 1], hi[2 * q + 1]);
      }
#endif
    } else {
#pragma GCC unroll 4
      for (int q = 0; q < NC; ++q) {
        vu a, b;
        __builtin_memcpy(&a, v0 + q * kPair, sizeof a);
        __builtin_memcpy(&b, v1 + q * kPair, sizeof b);
        interleave_words(a, b, lo[q], hi[q]);
      }
    }
    const uint32_t* pw = Pw + (j / 2) * RR;
#pragma GCC unroll 4
    for (int r = 0; r < RR; ++r) {
      const vu pr = vu{} + pw[r];
#pragma GCC unroll 4
      for (int q = 0; q < NC; ++q) {
        acc[r][2 * q] = dot2_bf16(acc[r][2 * q], pr, lo[q]);
        acc[r][2 * q + 1] = dot2_bf16(acc[r][2 * q + 1], pr, hi[q]);
      }
    }
  }
  store_o_rows<RR, 2 * NC>(acc, O, Dv, d0);
}
#endif

// Q: RR fp32 rows (stride D, pre-scaled, pair-permuted for bf16); Qb: raw bf16 rows (stride D) for
// the dot path or null; O: RR rows (stride Dv); m / l: running max / sum; pos: row positions.
// ND / NV: head_size / head_size_v in kPair steps when known at compile time (full unrolling), else 0.
// Scores of one key group (lane L: row L % RR, key g x KG + L / RR) after the scale / softcap / mask
// steps that are on for this chunk; `plain` (none of them) is the common decode case.
struct LaneRows { vi pos, key; vf slope; };
static KV_INLINE vf finish_scores(vf s, int g, int KG, const LaneRows& lr, const DirectCtx& c) {
  if (c.qk_scale != 1.0f) s *= c.qk_scale;
  if (c.softcap > 0.0f) s = c.softcap * vtanh(s * (1.0f / c.softcap));
  if (c.slope) s += lr.slope * __builtin_convertvector(lr.key + (g * KG + c.c0) - lr.pos, vf);
  if (c.need_mask) {
    const vi idx = lr.key + g * KG;
    const vi kpos = idx + c.c0;
    vi valid = idx < c.n;
    if (c.causal) valid &= kpos <= lr.pos;
    if (c.window > 0) valid &= (lr.pos - kpos) < c.window;
    if (c.window > 0 && !c.causal) valid &= (kpos - lr.pos) < c.window;   // both sides
    s = valid ? s : vsplat(-std::numeric_limits<float>::infinity());
  }
  return s;
}

// exp(x) for x <= 0, and exactly 0 for x < -87.3 (so -inf, a masked score, gives 0): vexp without
// the upper clamp, and one mask instead of the lower clamp plus the -inf select.
static KV_INLINE vf vexp_nonpos(vf x) {
  const vi keep = x >= vsplat(-87.3365447504f);
  return (vf)((vi)vexp_unclamped(x) & keep);
}

// Q: RR fp32 rows (stride D, pre-scaled, pair-permuted for bf16); Qb: raw bf16 rows (stride D) for
// the dot path or null; O: RR rows (stride Dv); m / l: running max / sum; pos: row positions.
// ND / NV: head_size / head_size_v in kPair steps when known at compile time (full unrolling), else 0.
// Per key group: scores (the first K step multiplies, so no accumulator is zeroed), then scale / mask
// and the running max while the scores are still in a register; per chunk: one exp pass and one
// rescale of O (alpha), then P.V.
template <int RR, int DT, int ND, int NV, bool LUT = false>
static inline void row_block_direct(const float* Q, const uint16_t* Qb, int D, int Dv, float* O, float* m, float* l,
                                    const int* pos, const DirectCtx& c) {
  using T = typename Elem<DT>::T;
  if constexpr (ND > 0) D = ND * kPair;
  if constexpr (NV > 0) Dv = NV * kPair;
  constexpr int KG = KV_W / RR;
  const float ninf = -std::numeric_limits<float>::infinity();
  const int nv = (c.n + KG - 1) / KG;
  (void)Qb;
  // Per-lane row constants: lane L is row L % RR, key L / RR of its group.
  float mt[KV_W];
  float st[KV_W];
  int pt[KV_W], kt[KV_W];
  for (int L = 0; L < KV_W; ++L) {
    mt[L] = m[L % RR];
    pt[L] = pos[L % RR];
    kt[L] = L / RR;
    st[L] = c.slope ? c.slope[L % RR] : 0.0f;
  }
  LaneRows lr;
  __builtin_memcpy(&lr.pos, pt, sizeof lr.pos);
  __builtin_memcpy(&lr.key, kt, sizeof lr.key);
  __builtin_memcpy(&lr.slope, st, sizeof lr.slope);
  const bool plain = c.qk_scale == 1.0f && !(c.softcap > 0.0f) && !c.need_mask && !c.slope;
  const bool pvdot = pv_on_dots(DT, LUT, Qb != nullptr);
  const int qk_lines = pvdot ? qk_prefetch_lines(c.pf_lines) : c.pf_lines;   // the rest: pv_direct_dot
  vf mx = vsplat(ninf);
  for (int g = 0; g < nv; ++g) {
#if KV_PREFETCH
    if (g * KG < c.pf_n) prefetch_rows_any(c.pf, g * KG, std::min(KG, c.pf_n - g * KG), qk_lines);
    if (g * KG < c.ag_n) prefetch_rows_any(c.ag, g * KG, std::min(KG, c.ag_n - g * KG), c.pf_lines);
#endif
    vf acc[KV_W];
    const T* kp[KG];
#pragma GCC unroll 16
    for (int j = 0; j < KG; ++j) kp[j] = static_cast<const T*>(c.kr[g * KG + j]);
    vf s;
#if KV_DIRECT_DOT
    if (DT == kBF16 && Qb && KV_QK_HALVES) {
      // acc[j * RR + r]: key j (low half) and key j + KG / 2 (high half) of row r, j < KG / 2.
#pragma GCC unroll 8
      for (int i = 0; i < KV_W / 2; ++i) acc[i] = vsplat(0.0f);
#pragma GCC unroll 8
      for (int d = 0; d < D; d += KV_W) {
#pragma GCC unroll 8
        for (int j = 0; j < KG / 2; ++j) {
          const vu k = load_halves(reinterpret_cast<const uint16_t*>(kp[j]) + d,
                                   reinterpret_cast<const uint16_t*>(kp[j + KG / 2]) + d);
#pragma GCC unroll 4
          for (int r = 0; r < RR; ++r) acc[j * RR + r] = dot2_bf16(acc[j * RR + r], load_dup(Qb + r * D + d), k);
        }
      }
      s = treduce_halves(acc);
    } else if (DT == kBF16 && Qb) {
#pragma GCC unroll 16
      for (int j = 0; j < KV_W; ++j) acc[j] = vsplat(0.0f);
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
      s = treduce(acc);
    } else
#endif
    if constexpr (LUT) {
#if KV_FP8_LUT
#pragma GCC unroll 16
      for (int j = 0; j < KV_W; ++j) acc[j] = vsplat(0.0f);
#pragma GCC unroll 4
      for (int d = 0; d < D; d += kLutGroup) {
#pragma GCC unroll 16
        for (int j = 0; j < KG; ++j) {
          if (Qb) {   // bf16 query in lut order: bf16 dots
            vu a, b;
            fp8_lut64<DT>(kp[j] + d, a, b);
#pragma GCC unroll 4
            for (int r = 0; r < RR; ++r) {
              vu qa, qb;
              __builtin_memcpy(&qa, Qb + r * D + d, sizeof qa);
              __builtin_memcpy(&qb, Qb + r * D + d + kPair, sizeof qb);
              acc[j * RR + r] = dot2_bf16(dot2_bf16(acc[j * RR + r], qa, a), qb, b);
            }
          } else {    // fp32 query in lut order
            vf k[4];
            fp8_lut64_f32<DT>(kp[j] + d, k);
#pragma GCC unroll 4
            for (int r = 0; r < RR; ++r) {
              const float* q = Q + r * D + d;
              acc[j * RR + r] += vload(q) * k[0] + vload(q + KV_W) * k[1] + vload(q + 2 * KV_W) * k[2] +
                                 vload(q + 3 * KV_W) * k[3];
            }
          }
        }
      }
      s = treduce(acc);
#endif
    } else {
#pragma GCC unroll 16
      for (int j = 0; j < KG; ++j) {   // first step: multiply
        vf klo, khi;
        load_pair<DT>(kp[j], klo, khi);
#pragma GCC unroll 4
        for (int r = 0; r < RR; ++r) acc[j * RR + r] = vload(Q + r * D) * klo + vload(Q + r * D + KV_W) * khi;
      }
#pragma GCC unroll 8
      for (int d = kPair; d < D; d += kPair) {
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
      s = treduce(acc);
    }
    if (!plain) s = finish_scores(s, g, KG, lr, c);
    vstore(c.St + g * KV_W, s);
    mx = vmax(mx, s);
  }

  vf mnew = vmax(vload(mt), fold_rows_max<KV_W / 2, RR>(mx));
  // A row with nothing visible yet (max -inf) subtracts 0: its scores are all -inf, so its p are 0.
  const vf msub = mnew == vsplat(ninf) ? vsplat(0.0f) : mnew;
  vf sum = vsplat(0.0f);
#if KV_PV_DOT
  uint32_t Pw[kChunk / 2 * (KV_W / 2) + KV_W];   // bf16 pairs: word (key pair) x RR + row
#endif
  for (int g = 0; g < nv; ++g) {
    const vf p = vexp_nonpos(vload(c.St + g * KV_W) - msub);
#if KV_PV_DOT
    if (pvdot) pv_pairs<RR>(p, Pw + g * (KV_W / 2), std::make_integer_sequence<int, KV_W>{});
    else
#endif
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
  // P.V: NC pairs of V vectors per pass (as many accumulators as the registers hold, and no more
  // than a head_size_v known at compile time has: one pass then, not NV passes of the tail's one pair).
  constexpr int NC_REGS = (KV_W == 16 ? 2 : 1) * (RR == 4 ? 1 : 2);
  constexpr int NC = NV > 0 && NV < NC_REGS ? NV : NC_REGS;
  constexpr int NC_TAIL = LUT ? 2 : 1;   // a lut group is two pairs
#if KV_PREFETCH
  // Rows ahead that this chunk's key loops do not reach (a short chunk before a full one).
  if (c.pf_n > nv * KG) prefetch_rows_any(c.pf, nv * KG, c.pf_n - nv * KG, c.pf_lines);
  if (c.ag_n > nv * KG) prefetch_rows_any(c.ag, nv * KG, c.ag_n - nv * KG, c.pf_lines);
  if (pvdot) {   // pv_direct_dot requests rows up to c.n rounded up to kPvPrefetchKeys
    const int covered = (c.n + kPvPrefetchKeys - 1) / kPvPrefetchKeys * kPvPrefetchKeys;
    prefetch_pv_lines(c, covered, nv * KG - covered);
  }
#endif
  int d0 = 0;
#if KV_PV_DOT
  if (pvdot) {
#pragma GCC unroll 8
    for (; d0 + NC * kPair <= Dv; d0 += NC * kPair) pv_direct_dot<RR, NC, DT, LUT>(O, Dv, d0, c, Pw, alpha);
    if constexpr (NC > NC_TAIL)
      for (; d0 < Dv; d0 += NC_TAIL * kPair) pv_direct_dot<RR, NC_TAIL, DT, LUT>(O, Dv, d0, c, Pw, alpha);
    return;
  }
#endif
#pragma GCC unroll 8
  for (; d0 + NC * kPair <= Dv; d0 += NC * kPair) pv_direct<RR, NC, DT, LUT>(O, Dv, d0, c, alpha);
  if constexpr (NC > NC_TAIL)
    for (; d0 < Dv; d0 += NC_TAIL * kPair) pv_direct<RR, NC_TAIL, DT, LUT>(O, Dv, d0, c, alpha);
}

template <int DT, int ND, bool LUT>
static void direct_rows(int RR, const float* Q, const uint16_t* Qb, int D, int Dv, float* O, float* m, float* l,
                        const int* pos, const DirectCtx& c) {
  switch (RR) {
    case 4: row_block_direct<4, DT, ND, ND, LUT>(Q, Qb, D, Dv, O, m, l, pos, c); break;
    case 2: row_block_direct<2, DT, ND, ND, LUT>(Q, Qb, D, Dv, O, m, l, pos, c); break;
    default: row_block_direct<1, DT, ND, ND, LUT>(Q, Qb, D, Dv, O, m, l, pos, c); break;
  }
}
// direct_rows with the head sizes as constants where they are the common ones.
template <int DT, bool LUT>
static void direct_rows_any(int RR, const float* Q, const uint16_t* Qb, int D, int Dv, float* O, float* m, float* l,
                            const int* pos, const DirectCtx& c) {
  if (D == Dv && D == 64) direct_rows<DT, 64 / kPair, LUT>(RR, Q, Qb, D, Dv, O, m, l, pos, c);
  else if (D == Dv && D == 128) direct_rows<DT, 128 / kPair, LUT>(RR, Q, Qb, D, Dv, O, m, l, pos, c);
  else direct_rows<DT, 0, LUT>(RR, Q, Qb, D, Dv, O, m, l, pos, c);
}

// Row pointers of keys [c0, c0 + n) of one request (its block-table row `table`) and KV head (cache
// offset head_off): the block table is read only for these positions; a block id outside
// [0, num_blocks) reads block 0 instead (wrong numbers, no stray access).
template <typename T>
static inline void key_rows(const AttnParams& P, const int32_t* table, int64_t head_off, int c0, int n, const T** dst) {
  const T* cache = static_cast<const T*>(P.cache);
  const int bs = P.block_size;
  int bi = c0 / bs, off = c0 - bi * bs, j = 0;
  const int64_t st = P.s_token;
  while (j < n) {
    int32_t blk = table[bi];
    if (blk < 0 || blk >= P.num_blocks) blk = 0;
    const T* p = cache + int64_t(blk) * P.s_block + head_off + int64_t(off) * st;
    const int e = std::min(n, j + bs - off);
    for (; j < e; ++j, p += st) dst[j] = p;
    off = 0;
    ++bi;
  }
}

#include "prefill_tiles.h"

// ---- the work item ------------------------------------------------------------------------------
// Rows of an item are head-major: head hh (KV head it.kv_head + hh) owns rows [hh * Mhp, hh * Mhp + Mh)
// of the workspace (Mh = tokens x G, Mhp = Mh padded to whole row blocks), so a row block never
// straddles two KV heads. An item over several heads (NHD caches: the heads of a token are adjacent)
// walks each chunk's token rows once for all of them.
// QT: query / out dtype; CT: cache dtype (QT, or fp8: K/V widened in registers, the per-head scales
// folded into Q (k_scale) and into the output rows (v_scale)).
template <int QT, int CT>
static void run_item_t(const AttnParams& P, const WorkItem& it, float* ws) {
  using T = typename Elem<CT>::T;     // cache elements
  using QE = typename Elem<QT>::T;    // query / out elements
  constexpr bool fp8 = is_fp8(CT);
  const int D = P.head_size, Dv = P.head_size_v, G = P.num_q_heads / P.num_kv_heads, bs = P.block_size;
  const int dp = int(round_up(D, KV_W)), dvp = int(round_up(Dv, KV_W));
  const int NH = it.num_heads;
  const int Mh = it.num_tokens * G;                 // rows per KV head
  const int Mhp = int(round_up(Mh, kRowBlock));     // padded to whole row blocks (the direct path runs 3 as 4)
  const int Mp = NH * Mhp;
  const float ninf = -std::numeric_limits<float>::infinity();
  // Items with more rows per KV head than the direct path takes: rows in the lanes (prefill_tiles.h);
  // KV_ROW_TILES=0 keeps them on the row-block path below.
#ifndef KV_ROW_TILES
#define KV_ROW_TILES 1
#endif
  if (KV_ROW_TILES && Mh > kDirectMaxRows && Mh <= kTileMaxRows) return run_item_rows<QT, CT>(P, it, ws);
  // The direct path (see row_block_direct): few rows, head sizes in whole 2W pairs; bf16 and fp8, and
  // fp32 / fp16 unless KV_DIRECT_ALL_DTYPES=0 (the direct path is also the faster one for those).
#ifndef KV_DIRECT_ALL_DTYPES
#define KV_DIRECT_ALL_DTYPES 1
#endif
  const bool direct = (CT == kBF16 || fp8 || KV_DIRECT_ALL_DTYPES) && D > 0 && Dv > 0 && D % kPair == 0 &&
                      Dv % kPair == 0 && Mh <= kDirectMaxRows;
  const bool permuted = direct && CT == kBF16;
  // fp8 through the byte tables (fp8_lut64): head sizes in whole lut groups; Q / O rows in lut order.
  const bool lut = KV_FP8_LUT && fp8 && direct && D % kLutGroup == 0 && Dv % kLutGroup == 0;

  float* Qs = ws;
  float* Os = Qs + int64_t(Mp) * dp;
  float* mrow = Os + int64_t(Mp) * dvp;
  float* lrow = mrow + Mp;
  float* Kc = lrow + Mp;
  float* Vc = Kc + kChunk * dp;
  float* zero = Vc + kChunk * dvp;
  float* S = zero + (dp > dvp ? dp : dvp);
  uint16_t* Qb = nullptr;   // bf16 queries (unscaled) for the bf16-dot paths
#if defined(KV_BF16DOT)
  if (QT == kBF16 && CT == kBF16 && D % 32 == 0) Qb = reinterpret_cast<uint16_t*>(S + 2 * kRowBlock * kChunk);
#elif defined(KV_BF16DOT_EMULATE)
  if (QT == kBF16 && CT == kBF16 && direct) Qb = reinterpret_cast<uint16_t*>(S + 2 * kRowBlock * kChunk);
#endif
  if (QT == kBF16 && lut) Qb = reinterpret_cast<uint16_t*>(S + 2 * kRowBlock * kChunk);   // fp8: bf16 dots

  const bool direct_k = (CT == kF32 && D == dp) || Qb != nullptr || direct, direct_v = Dv == dvp && !fp8;
  // P.V on bf16 dots (pv_direct_dot, on the direct path): O rows in its order.
  const bool pvdot = direct && pv_on_dots(CT, lut, Qb != nullptr);
  std::memset(zero, 0, sizeof(float) * (dp > dvp ? dp : dvp));
  if (!direct_k && D != dp) std::memset(Kc, 0, sizeof(float) * kChunk * dp);
  if (!direct_v && Dv != dvp) std::memset(Vc, 0, sizeof(float) * kChunk * dvp);

  // Queries, widened, pre-scaled (fp8: by the KV head's k_scale and the load unit too), padded with zeros.
  const QE* query = static_cast<const QE*>(P.query);
  auto q_scale = [&](int hh) { return fp8 ? P.scale * (P.k_scale[it.kv_head + hh] * fp8_unit<CT>()) : P.scale; };
  for (int r = 0; r < Mp; ++r) {
    float* q = Qs + int64_t(r) * dp;
    std::memset(q, 0, sizeof(float) * dp);
    mrow[r] = ninf;
    lrow[r] = 0.0f;
    const int hh = r / Mhp, rr = r % Mhp;
    if (rr >= Mh) {  // padding row: zero query (bf16 too)
      if (Qb) std::memset(Qb + int64_t(r) * dp, 0, sizeof(uint16_t) * dp);
      continue;
    }
    const int t = rr / G, h = (it.kv_head + hh) * G + rr % G;
    const QE* src = query + int64_t(it.q_row0 + t) * P.q_stride_token + int64_t(h) * P.q_stride_head;
    convert_row<QT>(src, D, q);
    // A NaN query row gives an all-NaN output row (what the math gives); the running sum carries the
    // mark, since max/exp arithmetic on NaN scores is order-dependent and can lose it.
    if (row_has_nan(q, dp)) lrow[r] = std::numeric_limits<float>::quiet_NaN();
    if (Qb) std::memcpy(Qb + int64_t(r) * dp, src, sizeof(uint16_t) * D);
    const float qs = q_scale(hh);
    for (int d = 0; d < dp; d += KV_W) vstore(q + d, vload(q + d) * qs);
    if (permuted) permute_rows<kPair>(q, D, pair_src);
    if (lut) {
      permute_rows<kLutGroup>(q, D, lut_f32_src);
      if (Qb) permute_rows<kLutGroup>(Qb + int64_t(r) * dp, D, lut_bf16_src);
    }
  }
  std::memset(Os, 0, sizeof(float) * int64_t(Mp) * dvp);

  const T* cache = static_cast<const T*>(P.cache);
  const int row_lines = int(((D + Dv) * sizeof(T) + 63) / 64);
  // The heads of a token are adjacent (NHD): one prefetch sweep covers all NH of them.
  const int pf_lines = (NH > 1 && P.s_head == D + Dv) ? int((int64_t(NH) * (D + Dv) * sizeof(T) + 63) / 64) : row_lines;

  auto rows_of = [&](const int32_t* table, int64_t head_off, int c0, int n, const T** dst) {
    key_rows<T>(P, table, head_off, c0, n, dst);
  };

  // Row pointers of the chunks from this one to kAhead ahead, chunk k in slot k % kRing: each chunk's
  // rows are looked up once, when it is prefetched, and used kAhead iterations later.
  constexpr int kAhead = KV_PREFETCH ? KV_PREFETCH_DIST : 1;
  constexpr int kRing = kAhead + 1;
  const T* ring[kRing][kChunk];
  int ring_n[kRing] = {};         // keys in each slot (0: none)
  const T* hrow[kChunk + KV_W];   // this head's rows (direct path), padding keys -> the zero row
  const float* kp[kChunk];
  const void* vp[kChunk];
  const uint16_t* kb[kChunk];
  int pos[kRowBlock];
  float slope[kRowBlock];

  // When a KV head's token rows are further apart than a row (NHD: num_kv_heads x (D + Dv) elements),
  // its lines use only a fraction of the L1 sets: with 64 rows KV_HALF_CHUNK_STRIDE bytes apart or
  // more, a chunk's K and V lines (plus the next chunk's, prefetched) crowd them, and the direct path
  // walks 32-key chunks instead (shorter strides, e.g. fp8's 256 bytes, keep 64; so does HND).
#ifndef KV_HALF_CHUNK_STRIDE
#define KV_HALF_CHUNK_STRIDE 512
#endif
  const int chunk = direct && P.s_token > D + Dv && P.s_token * int64_t(sizeof(T)) >= KV_HALF_CHUNK_STRIDE
                        ? kChunk / 2 : kChunk;
  // Chunk k's row pointers into its slot; its key count. Past the item's end, the chunks of the item
  // this thread runs next (prefetched, never computed here), so the prefetch distance holds across
  // items; 0 past those too, and for all of them in a call without prefetch.
  const int chunks = (it.k_hi - it.k_lo + chunk - 1) / chunk;
  auto fill = [&](int k) -> int {
    if (k >= chunks && (!P.prefetch || k - chunks >= KV_PREFETCH_NEXT_ITEM || it.next == nullptr)) return 0;
    const WorkItem& src = k < chunks ? it : *it.next;
    const int c = src.k_lo + (k < chunks ? k : k - chunks) * chunk;
    if (c >= src.k_hi) return 0;
    const int n = std::min(chunk, src.k_hi - c);
    rows_of(P.block_table + int64_t(src.req) * P.bt_stride, int64_t(src.kv_head) * P.s_head, c, n, ring[k % kRing]);
    return n;
  };
  for (int k = 0; k < kAhead; ++k) {
    [[maybe_unused]] const int n = ring_n[k % kRing] = fill(k);
#if KV_PREFETCH
    // The loop prefetches kAhead chunks ahead; chunks 1 .. kAhead - 1 are requested here, all at
    // once. Chunk 0 is read at once: a prefetch of it would only cost instructions. The item before this
    // one on this thread may have requested them already (WorkItem::prefetched).
    if (!P.prefetch || k == 0 || (it.prefetched && k < std::min(chunks, KV_PREFETCH_NEXT_ITEM))) continue;
    const T* head_rows[kChunk];
    for (int hh = 0; hh < (pf_lines == row_lines ? NH : 1); ++hh) {
      for (int j = 0; j < n; ++j) head_rows[j] = ring[k % kRing][j] + int64_t(hh) * P.s_head;
      prefetch_rows_any(reinterpret_cast<const void* const*>(head_rows), 0, n, pf_lines);
    }
#endif
  }
  int c0 = it.k_lo;
  for (int k = 0; c0 < it.k_hi; ++k, c0 += chunk) {
    const int n = std::min(chunk, it.k_hi - c0);
    const T* const* raw = ring[k % kRing];
    // The rows kAhead chunks ahead: looked up now, prefetched while this chunk is computed.
    const int nn = ring_n[(k + kAhead) % kRing] = fill(k + kAhead);
    const T* const* ahead = ring[(k + kAhead) % kRing];
    // The rows one chunk ahead, requested again while this chunk is computed (KV_PREFETCH_AGAIN).
    const T* const* again = ring[(k + 1) % kRing];
    const int again_n = kAhead > 1 && KV_PREFETCH_AGAIN ? ring_n[(k + 1) % kRing] : 0;
    for (int hh = 0; hh < NH; ++hh) {
      const int64_t hoff = int64_t(hh) * P.s_head;
      // Prefetch ahead with the first head (all heads' lines when they are adjacent), or per head.
      const bool pf_now = P.prefetch && (hh == 0 || pf_lines == row_lines);
      const int hpf_lines = pf_now ? pf_lines : 0;
      const T* const* pf_rows = ahead;
      const T* pf_h[kChunk];
      const T* const* ag_rows = again;
      const T* ag_h[kChunk];
      if (pf_now && hh > 0) {
        for (int j = 0; j < nn; ++j) pf_h[j] = ahead[j] + hoff;
        pf_rows = pf_h;
        for (int j = 0; j < again_n; ++j) ag_h[j] = again[j] + hoff;
        ag_rows = ag_h;
      }
      if (direct) {
        for (int j = 0; j < n; ++j) hrow[j] = raw[j] + hoff;
        for (int j = n; j < kChunk + KV_W && j < n + KV_W; ++j) hrow[j] = reinterpret_cast<const T*>(zero);
      }
      for (int j = 0; j < (direct ? 0 : n); ++j) {
#if KV_PREFETCH
        if (j < nn && pf_now)
          for (int b = 0; b < hpf_lines; ++b) prefetch_line(reinterpret_cast<const char*>(pf_rows[j]) + b * 64);
        if (j < again_n && pf_now)
          for (int b = 0; b < hpf_lines; ++b) prefetch_line(reinterpret_cast<const char*>(ag_rows[j]) + b * 64);
#endif
        const T* row = raw[j] + hoff;
        if (Qb) kb[j] = reinterpret_cast<const uint16_t*>(row);
        else if (direct_k) kp[j] = reinterpret_cast<const float*>(row);
        else { convert_row<CT>(row, D, Kc + j * dp); kp[j] = Kc + j * dp; }
        if (direct_v) vp[j] = row + D;
        else { convert_row<CT>(row + D, Dv, Vc + j * dvp); vp[j] = Vc + j * dvp; }
      }
      const int ng = (n + KV_W - 1) / KV_W;
      for (int j = n; j < ng * KV_W; ++j) {
        kp[j] = zero;
        vp[j] = zero;
        kb[j] = reinterpret_cast<const uint16_t*>(zero);
      }

      ChunkCtx c{kp, kb, vp, c0, n, ng, dp / KV_W, dvp / KV_W, dvp, false, P.causal, P.window, P.softcap,
                 Qb ? P.scale : 1.0f, direct_v ? CT : int(kF32), S, nullptr};
      DirectCtx dc{reinterpret_cast<const void* const*>(hrow), D, c0, n, false, P.causal, P.window, P.softcap,
                   (KV_DIRECT_DOT && Qb) ? q_scale(hh) : 1.0f, S, reinterpret_cast<const void* const*>(pf_rows),
                   KV_PREFETCH && pf_now ? nn : 0, hpf_lines, reinterpret_cast<const void* const*>(ag_rows),
                   KV_PREFETCH && pf_now ? again_n : 0};
      for (int m0 = 0; m0 < Mh; m0 += kRowBlock) {
        const int R = std::min(kRowBlock, Mh - m0);
        const int p_lo = it.pos0 + m0 / G, p_hi = it.pos0 + (m0 + R - 1) / G;
        if (P.causal && c0 > p_hi) continue;                                // chunk after every row
        if (P.window > 0 && p_lo - (c0 + n - 1) >= P.window) continue;      // chunk left every window
        if (!P.causal && P.window > 0 && c0 - p_hi >= P.window) continue;   // chunk right of every window
        c.need_mask = n % KV_W != 0 || (P.causal && c0 + n - 1 > p_lo) || (P.window > 0 && p_hi - c0 >= P.window) ||
                      (!P.causal && P.window > 0 && c0 + n - 1 - p_lo >= P.window);
        for (int r = 0; r < R; ++r) pos[r] = it.pos0 + (m0 + r) / G;
        for (int r = R; r < kRowBlock; ++r) pos[r] = pos[R - 1];
        if (P.alibi) {
          for (int r = 0; r < R; ++r) slope[r] = P.alibi[(it.kv_head + hh) * G + (m0 + r) % G];
          for (int r = R; r < kRowBlock; ++r) slope[r] = slope[R - 1];
        }
        c.slope = dc.slope = P.alibi ? slope : nullptr;
        const int64_t row0 = int64_t(hh) * Mhp + m0;
        const float* Q = Qs + row0 * dp;
        float* O = Os + row0 * dvp;
        if (direct) {
          dc.need_mask = c.need_mask;
          const uint16_t* Qbm = Qb ? Qb + row0 * dp : nullptr;
          const int RR = R > 2 ? 4 : R;
          if constexpr (fp8 && KV_FP8_LUT) {
            if (lut) direct_rows_any<CT, true>(RR, Q, Qbm, D, Dv, O, mrow + row0, lrow + row0, pos, dc);
            else direct_rows_any<CT, false>(RR, Q, Qbm, D, Dv, O, mrow + row0, lrow + row0, pos, dc);
          } else {
            direct_rows_any<CT, false>(RR, Q, Qbm, D, Dv, O, mrow + row0, lrow + row0, pos, dc);
          }
          dc.pf_n = dc.ag_n = 0;   // prefetched by the first row block
          continue;
        }
        const uint16_t* Qbm = Qb ? Qb + row0 * dp : nullptr;
        switch (R) {
          case 4: row_block<4>(Q, Qbm, dp, O, mrow + row0, lrow + row0, pos, c); break;
          case 3: row_block<3>(Q, Qbm, dp, O, mrow + row0, lrow + row0, pos, c); break;
          case 2: row_block<2>(Q, Qbm, dp, O, mrow + row0, lrow + row0, pos, c); break;
          default: row_block<1>(Q, Qbm, dp, O, mrow + row0, lrow + row0, pos, c); break;
        }
      }
    }
  }

  // Output (or the partition's O, m, l): rows in head-major order without the padding rows.
  const int M = NH * Mh;
  QE* out = static_cast<QE*>(P.out);
  auto v_scale = [&](int hh) { return fp8 ? P.v_scale[it.kv_head + hh] * fp8_unit<CT>() : 1.0f; };
  for (int r = 0; r < M; ++r) {
    const int hh = r / Mh, rr = r % Mh;
    float* o = Os + (int64_t(hh) * Mhp + rr) * dvp;
    if (pvdot && lut) unpermute_rows<kLutGroup>(o, Dv, pvdot_lut_src);
    else if (pvdot) unpermute_rows<kPair>(o, Dv, pvdot_src);
    else if (permuted) unpermute_rows<kPair>(o, Dv, pair_src);
    else if (lut) unpermute_rows<kLutGroup>(o, Dv, lut_f32_src);
    const float m = mrow[hh * Mhp + rr], l = lrow[hh * Mhp + rr];
    if (fp8) {
      const float vs = v_scale(hh);
      for (int d = 0; d < Dv; ++d) o[d] *= vs;
    }
    if (it.partial != nullptr) {
      std::memcpy(it.partial + int64_t(r) * dvp, o, sizeof(float) * dvp);
      it.partial[int64_t(M) * dvp + r] = m;
      it.partial[int64_t(M) * dvp + M + r] = l;
      continue;
    }
    const int t = rr / G, h = (it.kv_head + hh) * G + rr % G;
    QE* dst = out + int64_t(it.q_row0 + t) * P.o_stride_token + int64_t(h) * P.o_stride_head;
    const float inv = row_inverse(P, h, m, l);
    for (int d = 0; d < Dv; ++d) store_one<QT>(dst + d, o[d] * inv);
  }
}

// The loads above, exposed for tests (fp8_to_f32 in paged_attention.cpp): the unit multiplied back.
// With lut, whole groups of 64 go through fp8_lut64 (as the direct path reads them) and the rest as
// without; returns false (nothing written) where this variant has no byte tables.
template <int DT> static void widen_fp8_lut(const uint8_t* src, int n, float* dst) {
  int i = 0;
#if KV_FP8_LUT
  for (; i + kLutGroup <= n; i += kLutGroup) {
    vf v[4];
    fp8_lut64_f32<DT>(src + i, v);
    for (int q = 0; q < 4; ++q) vstore(dst + i + q * KV_W, v[q]);
    unpermute_rows<kLutGroup>(dst + i, kLutGroup, lut_f32_src);
  }
#endif
  convert_row<DT>(src + i, n - i, dst + i);
}
static bool widen_fp8(int dtype, const uint8_t* src, int n, float* dst, bool lut) {
  if (lut && !KV_FP8_LUT) return false;
  if (dtype == kE4M3) {
    if (lut) widen_fp8_lut<kE4M3>(src, n, dst);
    else convert_row<kE4M3>(src, n, dst);
    for (int i = 0; i < n; ++i) dst[i] *= fp8_unit<kE4M3>();
  } else {
    if (lut) widen_fp8_lut<kE5M2>(src, n, dst);
    else convert_row<kE5M2>(src, n, dst);
  }
  return true;
}

template <int CT> static void run_item_fp8(const AttnParams& P, const WorkItem& it, float* ws) {
  switch (P.dtype) {
    case kF32: run_item_t<kF32, CT>(P, it, ws); break;
    case kF16: run_item_t<kF16, CT>(P, it, ws); break;
    default: run_item_t<kBF16, CT>(P, it, ws); break;
  }
}

static void run_item(const AttnParams& P, const WorkItem& it, float* ws) {
  if (P.cache_dtype == kE4M3) return run_item_fp8<kE4M3>(P, it, ws);
  if (P.cache_dtype == kE5M2) return run_item_fp8<kE5M2>(P, it, ws);
  switch (P.dtype) {
    case kF32: run_item_t<kF32, kF32>(P, it, ws); break;
    case kF16: run_item_t<kF16, kF16>(P, it, ws); break;
    default: run_item_t<kBF16, kBF16>(P, it, ws); break;
  }
}
