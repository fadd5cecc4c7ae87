/* Attention of new tokens over the paged KV cache: decode steps, draft steps and the k+1 queries of a verify pass.
 *
 * Why this shape (flash-decoding over a paged cache):
 * - The query heads that share a key/value head (GQA) are served by one pass over that head's keys and values,
 *   and so are all the queries of one sequence in a verify pass (a causal mask inside the block): the cache is
 *   read once per sequence and key/value head, not once per query row.
 * - A context is cut into partitions of PART positions at fixed absolute boundaries; partitions are independent
 *   tasks spread over the threads and merged afterwards (log-sum-exp), so one long sequence keeps every core busy.
 * - Keys and values are read in their stored format (float32, bfloat16, or int8 with a float scale per QGROUP
 *   values) and widened to float32 a tile at a time. Products run on LANES-wide vectors, but every sum (a dot
 *   product's 8 lanes, a softmax denominator) is added in one fixed order, that of an 8-lane single dot product, so
 *   the width never shows in the bits, and a context of one partition gets exactly what the kernel this replaced
 *   computed.
 * - Gemma 2 soft-caps each score (after the scale) to cap * tanh(s / cap) before its softmax (softcap > 0).
 * - A sliding-window layer (window > 0) sees only the last window positions of each context: partitions wholly
 *   before every row's window are neither computed nor read, nor are tiles before it, so such a layer reads only
 *   its window of the paged cache, however long the context.
 * Batch invariance: a query row's result depends only on its own query and context. Its partitions, the keys of
 * each, every sum's order and the merge are fixed by its length and the window alone; rows that share a pass only
 * share loads. Keys a row does not see (past its own length, or before its window) get probability exactly 0, and
 * 0 * v adds nothing, as leading zeros add nothing to a sum, so a draft verified among k others gets the bits it
 * gets when decoded alone, and a window that covers the whole context changes no bit.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "floats.h"
#include "kv.h"

#define PART 1024  /* positions per partition (a multiple of TILE) */
#define TILE 32    /* keys or values widened to float32 at a time */
#define MAX_DIM 256

/* Vectors of LANES floats: 512-bit where the CPU has AVX-512 (half the instructions), else AVX2. */
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define LANES 16
typedef __m512 vf;
typedef __m512i vi;
#define vzero _mm512_setzero_ps
#define vloadu _mm512_loadu_ps
#define vstoreu _mm512_storeu_ps
#define vfma _mm512_fmadd_ps
#define vfnma _mm512_fnmadd_ps
#define vset1 _mm512_set1_ps
#define vadd _mm512_add_ps
#define vsub _mm512_sub_ps
#define vmul _mm512_mul_ps
#define vmax _mm512_max_ps
#define vfloor(x) _mm512_roundscale_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC)
#define vcvtt _mm512_cvttps_epi32
#define viadd _mm512_add_epi32
#define viset1 _mm512_set1_epi32
#define vislli _mm512_slli_epi32
#define vasf _mm512_castsi512_ps
static inline vf vbf16(const uint16_t *p) {
    return vasf(vislli(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
static inline vf vint8(const int8_t *p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p))); }
static inline __mmask16 lanes_in(int lo, int hi) { /* lanes lo <= i < hi */
    const unsigned below = hi >= 16 ? 0xFFFFu : hi > 0 ? (1u << hi) - 1u : 0u;
    const unsigned from = lo <= 0 ? 0xFFFFu : lo >= 16 ? 0u : 0xFFFFu << lo;
    return (__mmask16)(below & from);
}
static inline vf vkeep_in(vf x, int lo, int hi) { return _mm512_maskz_mov_ps(lanes_in(lo, hi), x); } /* others 0 */
static inline float vhmax(vf x) { return _mm512_reduce_max_ps(x); }
static inline vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
static inline vf vkeep_nan(vf x, vf y) { return _mm512_mask_mov_ps(y, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), x); }
static inline vf vcopysign(vf x, vf sign) { /* |x| with sign's sign bit (x >= 0) */
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(x), _mm512_and_si512(_mm512_castps_si512(sign),
                                                                                        _mm512_set1_epi32(INT32_MIN))));
}
static inline vf vmax_in(vf m, vf x, int lo, int hi) { /* max(m, x) in lanes lo <= i < hi, m elsewhere */
    return _mm512_mask_max_ps(m, lanes_in(lo, hi), m, x);
}
#define PV_ROWS 6
#else
#define LANES 8
typedef __m256 vf;
typedef __m256i vi;
#define vzero _mm256_setzero_ps
#define vloadu _mm256_loadu_ps
#define vstoreu _mm256_storeu_ps
#define vfma _mm256_fmadd_ps
#define vfnma _mm256_fnmadd_ps
#define vset1 _mm256_set1_ps
#define vadd _mm256_add_ps
#define vsub _mm256_sub_ps
#define vmul _mm256_mul_ps
#define vmax _mm256_max_ps
#define vfloor _mm256_floor_ps
#define vcvtt _mm256_cvttps_epi32
#define viadd _mm256_add_epi32
#define viset1 _mm256_set1_epi32
#define vislli _mm256_slli_epi32
#define vasf _mm256_castsi256_ps
static inline vf vbf16(const uint16_t *p) { return bf16x8(p); }
static inline vf vint8(const int8_t *p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p))); }
static inline __m256 lanes_in(int lo, int hi) { /* all ones in lanes lo <= i < hi */
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_castsi256_ps(_mm256_and_si256(_mm256_cmpgt_epi32(_mm256_set1_epi32(hi), lane),
                                                _mm256_cmpgt_epi32(lane, _mm256_set1_epi32(lo - 1))));
}
static inline vf vkeep_in(vf x, int lo, int hi) { return _mm256_and_ps(x, lanes_in(lo, hi)); }
static inline vf vdiv(vf a, vf b) { return _mm256_div_ps(a, b); }
static inline vf vkeep_nan(vf x, vf y) { return _mm256_blendv_ps(y, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q)); }
static inline vf vcopysign(vf x, vf sign) { return _mm256_or_ps(x, _mm256_and_ps(sign, _mm256_set1_ps(-0.f))); }
static inline float vhmax(vf x) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
static inline vf vmax_in(vf m, vf x, int lo, int hi) {
    return _mm256_blendv_ps(m, _mm256_max_ps(m, x), lanes_in(lo, hi));
}
#define PV_ROWS 3
#endif

static inline vf exp_neg(vf x) { /* exp for x <= 0 (Cephes polynomial, ~1 ulp) */
    x = vmax(x, vset1(-87.f));
    vf fx = vfloor(vfma(x, vset1(1.44269504088896341f), vset1(0.5f)));
    x = vfnma(fx, vset1(0.693359375f), x);
    x = vfnma(fx, vset1(-2.12194440e-4f), x);
    vf y = vset1(1.9875691500e-4f);
    y = vfma(y, x, vset1(1.3981999507e-3f));
    y = vfma(y, x, vset1(8.3334519073e-3f));
    y = vfma(y, x, vset1(4.1665795894e-2f));
    y = vfma(y, x, vset1(1.6666665459e-1f));
    y = vfma(y, x, vset1(5.0000001201e-1f));
    y = vfma(y, vmul(x, x), vadd(x, vset1(1.f)));
    return vmul(y, vasf(vislli(viadd(vcvtt(fx), viset1(127)), 23)));
}

/* cap * tanh(x / cap) (Gemma 2's soft-capped scores): tanh|y| = (1 - e) / (1 + e) with e = exp(-2|y|) <= 1, which
 * never overflows, then y's sign; a NaN stays NaN (as torch's path keeps it). Within about 1e-7 * cap of the true
 * value absolutely, which is what a softmax sees (a score's relative precision near 0 is lost, its effect is not). */
static inline vf soft_cap(vf x, float cap) {
    const vf y = vmul(x, vset1(1.f / cap));
    const vf e = exp_neg(vmul(vset1(-2.f), vmax(y, vsub(vzero(), y))));
    return vkeep_nan(x, vmul(vcopysign(vdiv(vsub(vset1(1.f), e), vadd(vset1(1.f), e)), y), vset1(cap)));
}

/* Asks for the cache rows of the next tile (slots sl[0..n)) while this one is computed: the rows lie wherever the
 * block table put them, so the hardware's stride prefetcher cannot follow them from one block to the next. */
static inline void prefetch_rows(const void *cache, int format, const int64_t *sl, int n, int KVH, int h, int D) {
    const size_t bytes = (size_t)D * (format == QD_KV_INT8 ? 1 : format == QD_KV_BF16 ? 2 : 4);
    for (int j = 0; j < n; j++) {
        const char *row = (const char *)cache + ((size_t)sl[j] * KVH + h) * bytes;
        for (size_t b = 0; b < bytes; b += 64) _mm_prefetch(row + b, _MM_HINT_T0);
    }
}

/* n cache rows (slots sl[0..n)) of key/value head h as float32 into dst [TILE][Dp]; padding columns and rows
 * n .. TILE are zeroed. */
static void widen(const void *cache, const float *scales, int format, const int64_t *sl, int n, int KVH, int h,
                  int D, int Dp, float *dst) {
    const int wide = D % LANES == 0;
    for (int j = 0; j < n; j++) {
        const size_t base = ((size_t)sl[j] * KVH + h) * D;
        float *o = dst + (size_t)j * Dp;
        if (format == QD_KV_INT8) {
            const int8_t *p = (const int8_t *)cache + base;
            const float *s = scales + ((size_t)sl[j] * KVH + h) * (D / QGROUP);
            for (int d = 0; d < D; d += LANES) vstoreu(o + d, vmul(vint8(p + d), vset1(s[d / QGROUP])));
        } else if (format == QD_KV_BF16 && wide) {
            for (int d = 0; d < D; d += LANES) vstoreu(o + d, vbf16((const uint16_t *)cache + base + d));
        } else if (format == QD_KV_BF16) {
            for (int d = 0; d < D; d += 8) _mm256_storeu_ps(o + d, bf16x8((const uint16_t *)cache + base + d));
        } else {
            memcpy(o, (const float *)cache + base, (size_t)D * 4);
        }
        for (int d = D; d < Dp; d++) o[d] = 0.f;
    }
    memset(dst + (size_t)n * Dp, 0, (size_t)(TILE - n) * Dp * 4);
}


/* s[i] = the sum of a[i]'s 8 lanes, added as floats.h's hsum adds them ((0+4) + (2+6)) + ((1+5) + (3+7)), for 8
 * vectors at once */
static inline void hsum8(const __m256 a[8], float *s) {
    __m128 f[8];
    for (int i = 0; i < 8; i++) f[i] = _mm_add_ps(_mm256_castps256_ps128(a[i]), _mm256_extractf128_ps(a[i], 1));
    _MM_TRANSPOSE4_PS(f[0], f[1], f[2], f[3]);
    _MM_TRANSPOSE4_PS(f[4], f[5], f[6], f[7]);
    _mm_storeu_ps(s, _mm_add_ps(_mm_add_ps(f[0], f[2]), _mm_add_ps(f[1], f[3])));
    _mm_storeu_ps(s + 4, _mm_add_ps(_mm_add_ps(f[4], f[6]), _mm_add_ps(f[5], f[7])));
}

/* s[0..8) = q . k[i] for 8 consecutive rows of kt (Dp floats apart; q pre-scaled): each one 8 lanes accumulated
 * over D in order, then hsum'd, the order of operations of a single dot product (whatever the vector width) */
static inline void dot8(const float *q, const float *kt, int D, int Dp, float *s) {
    __m256 a[8];
    for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_ps();
    for (int d = 0; d < D; d += 8) {
        const __m256 qv = _mm256_loadu_ps(q + d);
        for (int i = 0; i < 8; i++) a[i] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kt + (size_t)i * Dp + d), a[i]);
    }
    hsum8(a, s);
}

#if LANES == 16
/* Keys for dot8_pairs: the tile's keys in pairs, key 2i's 8-value chunks interleaved with key 2i+1's, so one 512-bit
 * load feeds two keys' dot products (each lane still sums what an 8-lane dot product sums). Rows n .. TILE are 0. */
static void widen_pairs(const void *cache, const float *scales, int format, const int64_t *sl, int n, int KVH, int h,
                        int D, int Dp, float *dst) {
    if (n < TILE) memset(dst, 0, (size_t)TILE * Dp * 4);
    for (int j = 0; j < n; j++) {
        const size_t base = ((size_t)sl[j] * KVH + h) * D;
        float *o = dst + (size_t)(j / 2) * 2 * Dp + (j % 2) * 8;
        for (int d = 0; d < D; d += 8) {
            __m256 x;
            if (format == QD_KV_INT8)
                x = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((const int8_t *)cache + base + d)))),
                                  _mm256_set1_ps(scales[((size_t)sl[j] * KVH + h) * (D / QGROUP) + d / QGROUP]));
            else if (format == QD_KV_BF16)
                x = bf16x8((const uint16_t *)cache + base + d);
            else
                x = _mm256_loadu_ps((const float *)cache + base + d);
            _mm256_storeu_ps(o + 2 * d, x);
        }
    }
}

/* dot8 over keys laid out by widen_pairs, two keys per 512-bit vector: the same sums, half the instructions */
static inline void dot8_pairs(const float *q, const float *kt, int D, int Dp, float *s) {
    __m512 a[4];
    for (int i = 0; i < 4; i++) a[i] = _mm512_setzero_ps();
    for (int d = 0; d < D; d += 8) {
        const __m512 qv = _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(q + d))));
        for (int i = 0; i < 4; i++) a[i] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(kt + (size_t)i * 2 * Dp + 2 * d), a[i]);
    }
    __m256 h[8];
    for (int i = 0; i < 4; i++) {
        h[2 * i] = _mm512_castps512_ps256(a[i]);
        h[2 * i + 1] = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a[i]), 1));
    }
    hsum8(h, s);
}
#endif

/* acc[r][d0 .. d0 + LANES * NV) += sum_j p[r][j] * vt[j][..] for NR rows and n keys, j in order */
static inline __attribute__((always_inline)) void pv_tile(int NR, int NV, float *const *p, const float *vt, int Dp,
                                                           int d0, int n, float *const *acc) {
    vf a[PV_ROWS][4];
    for (int r = 0; r < NR; r++)
        for (int v = 0; v < NV; v++) a[r][v] = vloadu(acc[r] + d0 + LANES * v);
    for (int j = 0; j < n; j++) {
        vf vv[4];
        for (int v = 0; v < NV; v++) vv[v] = vloadu(vt + (size_t)j * Dp + d0 + LANES * v);
        for (int r = 0; r < NR; r++) {
            const vf pj = vset1(p[r][j]);
            for (int v = 0; v < NV; v++) a[r][v] = vfma(pj, vv[v], a[r][v]);
        }
    }
    for (int r = 0; r < NR; r++)
        for (int v = 0; v < NV; v++) vstoreu(acc[r] + d0 + LANES * v, a[r][v]);
}

#define PV_NV(R) switch (nv) { case 4: pv_tile(R, 4, p + r, vt, Dp, d0, n, acc + r); break; \
                               case 3: pv_tile(R, 3, p + r, vt, Dp, d0, n, acc + r); break; \
                               case 2: pv_tile(R, 2, p + r, vt, Dp, d0, n, acc + r); break; \
                               default: pv_tile(R, 1, p + r, vt, Dp, d0, n, acc + r); }

static void pv_rows(int nr, float *const *p, const float *vt, int Dp, int n, float *const *acc) {
    for (int d0 = 0; d0 < Dp; d0 += 4 * LANES) {
        const int nv = Dp - d0 >= 4 * LANES ? 4 : (Dp - d0) / LANES;
        for (int r = 0; r < nr; r += PV_ROWS) {
            switch (nr - r < PV_ROWS ? nr - r : PV_ROWS) {
#if PV_ROWS == 6
                case 6: PV_NV(6) break;
                case 5: PV_NV(5) break;
                case 4: PV_NV(4) break;
#endif
                case 3: PV_NV(3) break;
                case 2: PV_NV(2) break;
                default: PV_NV(1) break;
            }
        }
    }
}


/* The first position a row with `length` keys sees: its window's first, or 0 without a window (window 0). */
static long first_visible(long length, int window) { return window > 0 && length > window ? length - window : 0; }

static int clamp_to(long x, int n) { return x < 0 ? 0 : x < n ? (int)x : n; }

/* Softmax numerators of nr rows over one partition's n scores: row r's scores from[r] .. keys[r] - 1 become
 * exp(s - max) (s soft-capped first where softcap > 0), every other score up to the tile padding becomes exactly 0
 * (from tile t_lo on, what the outputs read). Writes each row's max and sum of exponentials. */
static void softmax_rows(int nr, float *const *srow, const int *from, const int *keys, int t_lo, int n, float softcap,
                         float *m, float *l) {
    const int n_padded = (n + TILE - 1) / TILE * TILE;
    for (int r = 0; r < nr; r++) {
        const int a = from[r], kr = keys[r], j0 = a / LANES * LANES, padded = (kr + LANES - 1) / LANES * LANES;
        if (softcap > 0.f) /* (the lanes outside a .. kr - 1 are dropped below, whatever they hold) */
            for (int j = j0; j < padded; j += LANES) vstoreu(srow[r] + j, soft_cap(vloadu(srow[r] + j), softcap));
        vf vmx = vset1(-INFINITY);
        for (int j = j0; j < padded; j += LANES) vmx = vmax_in(vmx, vloadu(srow[r] + j), a - j, kr - j);
        const float mx = vhmax(vmx);
        /* 8 lanes, 8 keys at a time in order from the partition's start: a single row's sum (the leading keys
         * outside the window would only add zeros) */
        __m256 sum = _mm256_setzero_ps();
        for (int j = j0; j < padded; j += LANES) {
            const vf p = vkeep_in(exp_neg(vsub(vloadu(srow[r] + j), vset1(mx))), a - j, kr - j);
            vstoreu(srow[r] + j, p);
            for (int h8 = 0; h8 < LANES; h8 += 8) sum = _mm256_add_ps(sum, _mm256_loadu_ps(srow[r] + j + h8));
        }
        memset(srow[r] + t_lo, 0, (size_t)(j0 - t_lo) * 4);
        memset(srow[r] + padded, 0, (size_t)(n_padded - padded) * 4);
        m[r] = mx;
        l[r] = hsum(sum);
    }
}

/* One task: the rows of group g (its items times the G query heads of key/value head h) over partition part.
 * Writes each row's partial result: running max, sum of exponentials and unnormalized output (D floats). */
static int attend_partition(const void *q, long q_stride, int q_bf16, int H, int KVH, int D, const qd_kv_cache *kv,
                            const qd_attn_items *it, int g, int h, int part, float scale, int window, float softcap,
                            float *res) {
    static __thread scratch qbuf, sbuf, tbuf, abuf;
    const int G = H / KVH, first = (int)it->group_first[g], nq = (int)it->group_first[g + 1] - first, nr = nq * G;
    const int Dp = (D + LANES - 1) / LANES * LANES; /* row stride of the float32 buffers, zero-padded */
    int last = first;
    for (int i = first; i < first + nq; i++)
        if (it->lengths[i] > it->lengths[last]) last = i;
    const int64_t *sl = it->slots + (size_t)last * it->width;
    const int k0 = part * PART, n = (int)(it->lengths[last] - k0 < PART ? it->lengths[last] - k0 : PART);
    float *qf = reserve_floats(&qbuf, (size_t)nr * Dp), *s = reserve_floats(&sbuf, (size_t)nr * PART), *kt = reserve_floats(&tbuf, (size_t)TILE * Dp);
    float *acc = reserve_floats(&abuf, (size_t)nr * Dp);
    if (!qf || !s || !kt || !acc) return -1;
    float *srow[nr], *arow[nr];
    int from[nr], keys[nr]; /* row r attends to positions k0 + from[r] .. k0 + keys[r] - 1 of this partition */
    int t_lo = n;           /* the first tile any row sees: the tiles before it are not read */
    for (int i = 0; i < nq; i++)
        for (int gg = 0; gg < G; gg++) {
            const int r = i * G + gg;
            const size_t qb = (size_t)it->rows[first + i] * q_stride + (size_t)(h * G + gg) * D;
            for (int d = 0; d < Dp; d++) qf[(size_t)r * Dp + d] = d < D ? ld(q, q_bf16, qb + d) * scale : 0.f;
            keys[r] = clamp_to(it->lengths[first + i] - k0, n);
            from[r] = clamp_to(first_visible(it->lengths[first + i], window) - k0, n);
            t_lo = from[r] < t_lo ? from[r] : t_lo;
            srow[r] = s + (size_t)r * PART;
            arow[r] = acc + (size_t)r * Dp;
            memset(arow[r], 0, (size_t)Dp * 4);
        }
    t_lo = t_lo / TILE * TILE;
    for (int t0 = t_lo; t0 < n; t0 += TILE) { /* scores */
        const int tn = n - t0 < TILE ? n - t0 : TILE;
        prefetch_rows(kv->k, kv->format, sl + k0 + t0 + tn, n - t0 - tn < TILE ? n - t0 - tn : TILE, KVH, h, D);
        if (t0 == t_lo) prefetch_rows(kv->v, kv->format, sl + k0 + t0, tn, KVH, h, D);
#if LANES == 16
        widen_pairs(kv->k, kv->k_scale, kv->format, sl + k0 + t0, tn, KVH, h, D, Dp, kt);
#define DOT dot8_pairs
#else
        widen(kv->k, kv->k_scale, kv->format, sl + k0 + t0, tn, KVH, h, D, Dp, kt);
#define DOT dot8
#endif
        for (int r = 0; r < nr; r++)
            for (int c = from[r] > t0 ? (from[r] - t0) / 8 * 8 : 0; c < keys[r] - t0 && c < tn; c += 8)
                DOT(qf + (size_t)r * Dp, kt + (size_t)c * Dp, D, Dp, srow[r] + t0 + c);
#undef DOT
    }
    float *out = res + 2 * nr;
    softmax_rows(nr, srow, from, keys, t_lo, n, softcap, res, res + nr);
    for (int t0 = t_lo; t0 < n; t0 += TILE) { /* outputs */
        const int tn = n - t0 < TILE ? n - t0 : TILE;
        prefetch_rows(kv->v, kv->format, sl + k0 + t0 + tn, n - t0 - tn < TILE ? n - t0 - tn : TILE, KVH, h, D);
        widen(kv->v, kv->v_scale, kv->format, sl + k0 + t0, tn, KVH, h, D, Dp, kt);
        float *prow[nr];
        for (int r = 0; r < nr; r++) prow[r] = srow[r] + t0;
        pv_rows(nr, prow, kt, Dp, tn, arow);
    }
    for (int r = 0; r < nr; r++) memcpy(out + (size_t)r * D, arow[r], (size_t)D * 4);
    return 0;
}

static int parts_of(long length) { return (int)((length + PART - 1) / PART); }

/* Row r's result from its partitions first .. end - 1 (partial results nr * (D + 2) floats apart, from base),
 * merged in order, to o [D]; `sink` (gpt-oss's attention sinks; -INFINITY: none) is one more logit of the softmax
 * whose value is zero: it adds exp(sink) to the sum of weights and nothing to o (with none, exactly nothing) */
static void merge_row(const float *base, int nr, int D, int r, int first, int end, float sink, float *o) {
    float mx = sink, total = 0.f;
    for (int p = first; p < end; p++) mx = fmaxf(mx, base[(size_t)p * nr * (D + 2) + r]);
    if (sink != -INFINITY) total = expf(sink - mx); /* (a NaN sink gives NaN, as torch's path does) */
    for (int d = 0; d < D; d++) o[d] = 0.f;
    for (int p = first; p < end; p++) {
        const float *pr = base + (size_t)p * nr * (D + 2);
        const float w = expf(pr[r] - mx);
        total += w * pr[nr + r];
        for (int d = 0; d < D; d++) o[d] += w * pr[2 * nr + (size_t)r * D + d];
    }
    const float inv = 1.f / total;
    for (int d = 0; d < D; d++) o[d] *= inv;
}

/* out [T][H][D] (q's dtype), rows rows[r] written: each item's query row attends to its context, or with window > 0
 * to the last window positions of it; sinks: NULL, or a logit per query head [H] in every row's softmax; softcap > 0:
 * each score soft-capped to cap * tanh(s / cap) (0: not capped). */
int qd_attend(const void *q, long q_stride, int q_bf16, int H, int KVH, int D, const qd_kv_cache *kv,
              const qd_attn_items *it, float scale, int window, const float *sinks, float softcap, void *out) {
    if (KVH <= 0 || H % KVH || D % 8 || D > MAX_DIM || (kv->format == QD_KV_INT8 && D % QGROUP) || it->groups < 0
        || window < 0 || !(softcap >= 0.f && softcap < INFINITY))
        return -2;
    const int G = H / KVH;
    if (it->groups && (it->group_first[0] < 0 || it->group_first[it->groups] > it->items)) return -2;
    for (int g = 0; g < it->groups; g++) {
        if (it->group_first[g + 1] <= it->group_first[g]) return -2;
        for (long r = it->group_first[g]; r < it->group_first[g + 1]; r++)
            if (it->lengths[r] <= 0 || it->lengths[r] > it->width) return -2;
    }
    /* tasks (group, head, partition) from the group's first visible partition on, and where each one's partial
     * results go */
    static __thread scratch resbuf;
    int64_t *task_of_group = malloc(sizeof(int64_t) * (size_t)(it->groups + 1));
    size_t *res_of_group = malloc(sizeof(size_t) * (size_t)(it->groups + 1));
    int *part0 = malloc(sizeof(int) * (size_t)(it->groups + 1));
    if (!task_of_group || !res_of_group || !part0) { free(task_of_group); free(res_of_group); free(part0); return -1; }
    task_of_group[0] = 0;
    res_of_group[0] = 0;
    for (int g = 0; g < it->groups; g++) {
        long longest = 0, seen = it->width;
        for (long r = it->group_first[g]; r < it->group_first[g + 1]; r++) {
            const long from = first_visible(it->lengths[r], window);
            longest = it->lengths[r] > longest ? it->lengths[r] : longest;
            seen = from < seen ? from : seen;
        }
        part0[g] = (int)(seen / PART);
        const size_t nr = (size_t)(it->group_first[g + 1] - it->group_first[g]) * G;
        const size_t parts = (size_t)(parts_of(longest) - part0[g]);
        task_of_group[g + 1] = task_of_group[g] + (int64_t)(KVH * parts);
        res_of_group[g + 1] = res_of_group[g] + (size_t)KVH * parts * nr * (D + 2);
    }
    float *res = reserve_floats(&resbuf, res_of_group[it->groups] ? res_of_group[it->groups] : 1);
    int failed = res ? 0 : 1;
    const int64_t tasks = task_of_group[it->groups];
#pragma omp parallel for schedule(dynamic, 1) reduction(| : failed) if (!failed)
    for (int64_t task = 0; task < tasks; task++) {
        int g = 0;
        while (task_of_group[g + 1] <= task) g++;
        const int local = (int)(task - task_of_group[g]), nparts = (int)((task_of_group[g + 1] - task_of_group[g]) / KVH);
        const int h = local / nparts, part = part0[g] + local % nparts;
        const size_t nr = (size_t)(it->group_first[g + 1] - it->group_first[g]) * G;
        failed |= -attend_partition(q, q_stride, q_bf16, H, KVH, D, kv, it, g, h, part, scale, window, softcap,
                                    res + res_of_group[g] + (size_t)local * nr * (D + 2));
    }
    if (!failed) { /* merge each row's own partitions in order */
#pragma omp parallel for schedule(static)
        for (int g = 0; g < it->groups; g++) {
            const int first = (int)it->group_first[g], nq = (int)it->group_first[g + 1] - first, nr = nq * G;
            const int nparts = (int)((task_of_group[g + 1] - task_of_group[g]) / KVH);
            for (int h = 0; h < KVH; h++)
                for (int i = 0; i < nq; i++) {
                    const long length = it->lengths[first + i];
                    const int own_first = (int)(first_visible(length, window) / PART) - part0[g];
                    const int own_end = parts_of(length) - part0[g];
                    for (int gg = 0; gg < G; gg++) {
                        float o[MAX_DIM];
                        merge_row(res + res_of_group[g] + (size_t)h * nparts * nr * (D + 2), nr, D, i * G + gg,
                                  own_first, own_end, sinks ? sinks[h * G + gg] : -INFINITY, o);
                        const size_t ob = (size_t)it->rows[first + i] * H * D + (size_t)(h * G + gg) * D;
                        for (int d = 0; d < D; d++) st(out, q_bf16, ob + d, o[d]);
                    }
                }
        }
    }
    free(task_of_group);
    free(res_of_group);
    free(part0);
    return failed ? -1 : 0;
}

/* Writes T rows of KVH x D values (row t of x, rows x_stride elements apart) to cache slots slot_mapping[t]: copied
 * in the cache's float format (x's own), or as int8 with one scale per QGROUP values (max |x| / 127, each value
 * x / scale rounded to nearest even; kv/blocks.py's torch version gives the same bytes). */
int qd_kv_store(const void *x, long x_stride, int x_bf16, int T, int KVH, int D, const int64_t *slot_mapping,
                void *cache, float *scales, int format) {
    if (T < 0 || KVH <= 0 || D <= 0 || (format == QD_KV_INT8 && D % QGROUP) || (format != QD_KV_INT8 && format != x_bf16))
        return -2;
    const size_t width = (size_t)KVH * D, es = x_bf16 ? 2 : 4;
    for (int t = 0; t < T; t++) {
        const size_t src = (size_t)t * x_stride;
        if (format != QD_KV_INT8) {
            memcpy((char *)cache + (size_t)slot_mapping[t] * width * es, (const char *)x + src * es, width * es);
            continue;
        }
        int8_t *dst = (int8_t *)cache + (size_t)slot_mapping[t] * width;
        float *sc = scales + (size_t)slot_mapping[t] * (width / QGROUP);
        for (size_t g0 = 0; g0 < width; g0 += QGROUP) {
            float amax = 0.f;
            for (int i = 0; i < QGROUP; i++) amax = fmaxf(amax, fabsf(ld(x, x_bf16, src + g0 + i)));
            const float s = amax / 127.f;
            sc[g0 / QGROUP] = s;
            for (int i = 0; i < QGROUP; i++)
                dst[g0 + i] = s > 0.f ? (int8_t)nearbyintf(ld(x, x_bf16, src + g0 + i) / s) : 0;
        }
    }
    return 0;
}
