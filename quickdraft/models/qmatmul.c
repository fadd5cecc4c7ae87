/* y = x @ W.T (+ bias) for weight-only quantized W, on x86-64 CPUs with AVX2 and FMA (VNNI used where present).
 *
 * W is one of the formats of qformats.h: quickdraft's own int4/int8 (affine per group of 32 input columns, bfloat16
 * scales and zeros), or a GGML block format read at the file's own size (Q4_0 .. Q8_0, the K-quants, IQ4_NL /
 * IQ4_XS, the lattice i-quants, TQ1_0 / TQ2_0, Q1_0 / Q2_0, MXFP4), each repacked so that a group's dot product is
 * one int32 lane. Every format is w = scale * v + shift per group with v an unsigned byte. x is quantized per row
 * and per group of 32 to int8 (absmax / 127, round to nearest even), so each group's dot product is an exact int32
 * sum computed with vpdpbusd (u8 x s8), or on AVX2 without VNNI with vpmaddubsw + vpmaddwd, exact too (the sums
 * never saturate, see dot8), so every ISA gives the same integer sums:
 *     y[m, n] = sum_g  scale * xs[m, g] * sum_k v x8  +  shift * xsum[m, g]
 * with xsum[m, g] = xs[m, g] * sum_k x8[m, k].
 *
 * Layout: K is cut into blocks of 256 (8 groups). In a block, chunk t holds elements 32 j + 4 t + i (group j,
 * i = 0..3) at byte 4 j + i, so after the dot products of a block int32 lane j holds the whole dot product of group
 * j and one fma per block applies 8 group scales. Chunks are stored in the order t = 0, 2, 1, 3, 4, 6, 5, 7 (in the
 * quantized x rows and the weights), so that one 64-byte load takes chunks (0, 2), (1, 3), (4, 6) or (5, 7). How
 * each format packs its values and scales into a block: qformats.h. int4/int8 pad K to a multiple of 256 (scales:
 * [N][K / 256][16] bfloat16 bits, 8 scales then 8 zeros per block); the GGML formats keep the columns past the last
 * whole block as tail records in element order, read against a copy of x's last groups in element order.
 *
 * Every output element is computed by one thread with the same sequence of operations whatever M, the
 * row tile it falls in and the thread count are: a row's result is bit-identical whether it is alone in
 * the call or one of many (speculative verification relies on this).
 *
 * The file is compiled in parts, side by side (native_build.py; a format's kernels take seconds to compile): with
 * -DQD_PART=n, 1 <= n <= QD_PARTS, the kernels of the formats of FORMATS_n alone; with -DQD_PART=0, the rest (x's
 * quantization, the dispatch over formats, qd_linear).
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <math.h>

#include "floats.h"
#include "qformats.h"
#include "tasks.h"

#define QD_PARTS 8
#if !defined(QD_PART) || QD_PART < 0 || QD_PART > QD_PARTS
#error "qmatmul.c is compiled in parts: -DQD_PART=0 .. QD_PARTS"
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define WIDE 1 /* 512-bit dot products: half the instructions per block */
#elif !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "quickdraft's CPU kernels need AVX2, FMA and F16C"
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define DPBUSD256(acc, a, b) _mm256_dpbusd_epi32(acc, a, b)
#elif defined(__AVXVNNI__)
#define DPBUSD256(acc, a, b) _mm256_dpbusd_avx_epi32(acc, a, b)
#endif

#define BLOCK 256
#define GROUP 32
#define ROWS_PER_TASK 8 /* output rows one thread takes at a time */
/* How far ahead the AVX512 tiles ask for their weights, in calls of every row count: the best of the distances
 * measured, on Zen 4 with the block formats of every size (docs/MEASUREMENTS.md). */
#define PREFETCH_BYTES 2048
/* A tile of rows streams each weight row whole, with prefetch, when it has at most STREAM_ROWS rows or its quantized
 * x rows take at most STREAM_X_BYTES (they stay in L1 while every output column reads them); others go through K
 * chunks of x (see qd_linear). The limits were chosen by timing the calls of a quantized decode step at several row
 * counts (docs/MEASUREMENTS.md). */
#ifdef WIDE
#define STREAM_ROWS 4
#define STREAM_X_BYTES 32768
#else
#define STREAM_ROWS 2 /* as tuned on AVX2 (docs/MEASUREMENTS.md) */
#define STREAM_X_BYTES 0
#endif
#define K_CHUNK 8 /* blocks (of 256 columns) per pass over a task's output columns, when x has several rows */
#define ROW_TILE 8      /* rows of x that share one unpacked weight block (a verify pass of up to 8 tokens) */

#if QD_PART == 0

/* The quantized x rows: xq row m at m * xrow (the block layout over Kpad columns, then, when K % 256 != 0, the last
 * groups again in element order for the tail records); per group g: xs (scale), xsum, and xhalf (per block: the 8
 * groups' sums over their first 16 columns, then over their last 16, times xs: the scales of Q6_K, Q2_K and Q3_K are
 * per 16). */
typedef struct {
    int8_t *xq;
    float *xs, *xsum, *xhalf;
    size_t cap_q, cap_f;
} workspace;

static __thread workspace ws;

static int reserve(size_t nq, size_t nf) {
    if (nq > ws.cap_q) {
        free(ws.xq);
        ws.xq = aligned_alloc(64, (nq + 63) / 64 * 64);
        ws.cap_q = ws.xq ? nq : 0;
    }
    if (nf > ws.cap_f) {
        free(ws.xs);
        free(ws.xsum);
        free(ws.xhalf);
        ws.xs = aligned_alloc(64, (nf * 4 + 63) / 64 * 64);
        ws.xsum = aligned_alloc(64, (nf * 4 + 63) / 64 * 64);
        ws.xhalf = aligned_alloc(64, (nf * 8 + 63) / 64 * 64);
        ws.cap_f = ws.xs && ws.xsum && ws.xhalf ? nf : 0;
    }
    return ws.xq && ws.xs && ws.xsum && ws.xhalf;
}

/* One group of x whose values are all inside the row, vectorized: the same operations as the scalar loop of
 * quantize_row (one float multiply, round to nearest even, clamp), so both give the same bytes. nat: where the
 * group's bytes also go in element order (a tail group), or NULL. */
static inline void quantize_group8x4(const void *x, int bf16, size_t at, int8_t *dst, int8_t *nat, float *xs,
                                     float *xsum, float *half_lo, float *half_hi) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 v[4], mx = _mm256_setzero_ps();
    for (int j = 0; j < 4; j++) {
        v[j] = bf16 ? bf16x8((const uint16_t *)x + at + 8 * j) : _mm256_loadu_ps((const float *)x + at + 8 * j);
        mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[j]));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    const __m256 scale = _mm256_set1_ps(inv);
    const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
    /* the low byte of each int32, packed to the first 4 bytes of each 128-bit lane */
    const __m256i low_bytes = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                               0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
    __m256i sum[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()}; /* elements 0..15, 16..31 */
    for (int j = 0; j < 4; j++) { /* elements 8 j .. 8 j + 7: chunks 2 j and 2 j + 1 */
        __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], scale));
        q = _mm256_min_epi32(_mm256_max_epi32(q, lo), hi);
        sum[j / 2] = _mm256_add_epi32(sum[j / 2], q);
        const __m256i bytes = _mm256_shuffle_epi8(q, low_bytes);
        const int32_t first = _mm256_extract_epi32(bytes, 0), second = _mm256_extract_epi32(bytes, 4);
        __builtin_memcpy(dst + 32 * QF_CHUNK_AT[2 * j], &first, 4);
        __builtin_memcpy(dst + 32 * QF_CHUNK_AT[2 * j + 1], &second, 4);
        if (nat) {
            __builtin_memcpy(nat + 8 * j, &first, 4);
            __builtin_memcpy(nat + 8 * j + 4, &second, 4);
        }
    }
    int total[2];
    for (int h = 0; h < 2; h++) {
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum[h]), _mm256_extracti128_si256(sum[h], 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
        total[h] = _mm_cvtsi128_si32(s4);
    }
    *xs = amax / 127.f;
    *xsum = *xs * (float)(total[0] + total[1]);
    *half_lo = *xs * (float)total[0];
    *half_hi = *xs * (float)total[1];
}

/* One row of x -> int8 groups in the block layout (and its tail groups in element order at Kpad), per-group scale,
 * scaled sum and scaled half sums. */
static void quantize_row(const void *x, int bf16, size_t row_off, int K, int Kpad, int8_t *xq, float *xs,
                         float *xsum, float *xhalf) {
    const int first_tail = K / BLOCK * (BLOCK / GROUP); /* groups from here on are also kept in element order */
    for (int g = 0; g < Kpad / GROUP; g++) {
        int8_t *dst = xq + (g / 8) * BLOCK + 4 * (g % 8);
        int8_t *nat = g >= first_tail && g * GROUP < K ? xq + Kpad + (size_t)(g - first_tail) * GROUP : NULL;
        float *lo_half = xhalf + (g / 8) * 16 + g % 8, *hi_half = lo_half + 8;
        if ((g + 1) * GROUP <= K) {
            quantize_group8x4(x, bf16, row_off + (size_t)g * GROUP, dst, nat, xs + g, xsum + g, lo_half, hi_half);
            continue;
        }
        float v[GROUP], amax = 0.f;
        for (int e = 0; e < GROUP; e++) {
            int k = g * GROUP + e;
            v[e] = k < K ? ld(x, bf16, row_off + (size_t)k) : 0.f;
            amax = fmaxf(amax, fabsf(v[e]));
        }
        float inv = amax > 0.f ? 127.f / amax : 0.f;
        int sum[2] = {0, 0};
        for (int e = 0; e < GROUP; e++) {
            int q = (int)nearbyintf(v[e] * inv);
            q = q > 127 ? 127 : q < -127 ? -127 : q;
            dst[32 * QF_CHUNK_AT[e / 4] + (e % 4)] = (int8_t)q;
            if (nat) nat[e] = (int8_t)q;
            sum[e / 16] += q;
        }
        xs[g] = amax / 127.f;
        xsum[g] = xs[g] * (float)(sum[0] + sum[1]);
        *lo_half = xs[g] * (float)sum[0];
        *hi_half = xs[g] * (float)sum[1];
    }
}
#endif

/* The int32 dot products of one tail group: 32 values w (u8) with 32 x (s8), in 8 lanes of partial sums. */
static inline __attribute__((always_inline)) __m256i dot32(int F, __m256i w, __m256i x) {
#ifdef DPBUSD256
    (void)F;
    return DPBUSD256(_mm256_setzero_si256(), w, x);
#else
    const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(0x0F);
    if (qf_max_value(F) <= 63) return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones); /* pairs <= 2 * 63 * 127 */
    const __m256i lo = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_and_si256(w, low), x), ones);
    const __m256i hi = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(w, 4), low), x), ones);
    return _mm256_add_epi32(lo, _mm256_slli_epi32(hi, 4));
#endif
}

#ifndef WIDE
/* Lane j = the int32 dot product of group j of one block: w[0..7] (by stored position, u8) with the quantized x
 * chunks at xb (s8, 32 bytes each); for the formats with scales per 16 (Q6_K, Q2_K, Q3_K), *hi gets the groups'
 * last 16 columns and the result their first 16
 * (stored positions 0..3 hold elements 0..15 of each group, 4..7 elements 16..31). */
static inline __attribute__((always_inline)) __m256i dot8(int F, const __m256i w[8], const int8_t *xb, __m256i *hi) {
    __m256i x[8];
    for (int c = 0; c < 8; c++) x[c] = _mm256_load_si256((const __m256i *)(xb + 32 * c));
#ifdef DPBUSD256
    if (qf_per16(F)) {
        __m256i a = _mm256_setzero_si256(), b = _mm256_setzero_si256();
        for (int c = 0; c < 4; c++) a = DPBUSD256(a, w[c], x[c]), b = DPBUSD256(b, w[c + 4], x[c + 4]);
        *hi = b;
        return a;
    }
    __m256i d0 = _mm256_setzero_si256(), d1 = _mm256_setzero_si256(); /* two chains: dpbusd latency */
    for (int c = 0; c < 8; c += 2) d0 = DPBUSD256(d0, w[c], x[c]), d1 = DPBUSD256(d1, w[c + 1], x[c + 1]);
    return _mm256_add_epi32(d0, d1);
#else
    /* vpmaddubsw sums two u8 x s8 products in 16 bits with saturation, which must never happen: 16-bit lane i of
     * chunk c holds 2 products of at most max_value * 127, so values <= 15 add 8 chunks (30480 < 32767), <= 31 four
     * chunks, <= 63 two chunks, <= 127 one chunk (32258) before vpmaddwd adds the lane pairs into int32 lane j = group j; 8-bit values are
     * split into nibbles (v = 16 hi + lo). */
    const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(0x0F);
    const int vmax = qf_max_value(F);
    if (vmax == 255) {
        __m256i lo = _mm256_setzero_si256(), hi8 = _mm256_setzero_si256();
        const __m256i lo_table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)qf_low_nibbles(F)));
        const __m256i hi_table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)qf_high_nibbles(F)));
        for (int c = 0; c < 8; c++) { /* lookup formats hold indices here: their values' nibbles by table */
            const __m256i l = qf_lookup(F) ? _mm256_shuffle_epi8(lo_table, w[c]) : _mm256_and_si256(w[c], low);
            const __m256i h = qf_lookup(F) ? _mm256_shuffle_epi8(hi_table, w[c])
                                           : _mm256_and_si256(_mm256_srli_epi16(w[c], 4), low);
            lo = _mm256_add_epi16(lo, _mm256_maddubs_epi16(l, x[c]));
            hi8 = _mm256_add_epi16(hi8, _mm256_maddubs_epi16(h, x[c]));
        }
        return _mm256_add_epi32(_mm256_madd_epi16(lo, ones), _mm256_slli_epi32(_mm256_madd_epi16(hi8, ones), 4));
    }
    /* runs of chunks summed in 16 bits; formats with scales per 16 keep chunks 0..3 and 4..7 apart */
    const int run = vmax == 15 && !qf_per16(F) ? 8 : vmax <= 31 ? 4 : vmax <= 63 ? 2 : 1, nruns = 8 / run;
    __m256i part[8];
    for (int c0 = 0; c0 < 8; c0 += run) {
        __m256i s16 = _mm256_maddubs_epi16(w[c0], x[c0]);
        for (int c = c0 + 1; c < c0 + run; c++) s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(w[c], x[c]));
        part[c0 / run] = _mm256_madd_epi16(s16, ones);
    }
    const int first_half = qf_per16(F) ? nruns / 2 : nruns;
    __m256i sum32 = part[0];
    for (int i = 1; i < first_half; i++) sum32 = _mm256_add_epi32(sum32, part[i]);
    if (qf_per16(F)) {
        __m256i sum_hi = part[first_half];
        for (int i = first_half + 1; i < nruns; i++) sum_hi = _mm256_add_epi32(sum_hi, part[i]);
        *hi = sum_hi;
    }
    return sum32;
#endif
}
#endif

#ifdef WIDE
/* Lanes j + 8 k of v summed into lane j (a block's 16 lanes hold two parts of each of its 8 groups). */
static inline __m256i fold8(__m512i v) {
    return _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
}
#endif

/* Running sums of rows m0 .. m0 + TILE - 1 of one output column, kept between chunks of blocks. */
typedef struct {
    __m256 dot[ROW_TILE];
    __m256 part[ROW_TILE]; /* WIDE: the shift terms; both: the tail groups' dot products */
    float tail_shift[ROW_TILE];
} tile_sums;

static inline float tile_total(const tile_sums *t, int r) {
    return hsum(t->dot[r]) + hsum(t->part[r]) + t->tail_shift[r];
}

/* What every tile of a call reads of x (written by quantize_row first). */
typedef struct {
    int8_t *xq;
    float *xs, *xsum, *xhalf;
    size_t xrow;
    int Kpad, ngroups;
} x_rows;

/* Blocks b0 .. b1 - 1 of rows m0 .. m0 + TILE - 1 of y[:, n], added to st (which they start when b0 = 0), then when
 * b1 = nblk the ntail tail groups; TILE and F are constants after inlining, so the sums stay in registers within
 * the call. */
static inline __attribute__((always_inline)) void tile(int TILE, int F, const uint8_t *wrow, const uint16_t *szrow,
                                                        int b0, int b1, int nblk, int ntail, const x_rows *X, int m0,
                                                        tile_sums *st) {
    const int BB = qf_block_bytes(F);
    __m256 acc[ROW_TILE];
    for (int r = 0; r < TILE; r++) acc[r] = b0 ? st->dot[r] : _mm256_setzero_ps();
    __m256 part[ROW_TILE];
    for (int r = 0; r < TILE; r++) part[r] = b0 ? st->part[r] : _mm256_setzero_ps();
    for (int b = b0; b < b1; b++) {
        const uint8_t *blk = wrow + (size_t)b * BB;
#ifdef WIDE
        const uint8_t *ahead = blk + PREFETCH_BYTES; /* weight rows are contiguous */
        for (int c = 0; c < BB; c += 64) _mm_prefetch((const char *)ahead + c, _MM_HINT_T0);
        if (qf_padded(F)) _mm_prefetch((const char *)(szrow + 16 * b) + PREFETCH_BYTES / 4, _MM_HINT_T0);
        __m512i w[4];
        qf_decode4(F, blk, w);
#else
        __m256i w[8];
        qf_decode8(F, blk, w);
#endif
        const block_scales s = qf_scales(F, blk, qf_padded(F) ? szrow + 16 * b : NULL);
        for (int r = 0; r < TILE; r++) {
            const int8_t *xb = X->xq + (size_t)(m0 + r) * X->xrow + (size_t)b * BLOCK;
            const size_t gi = (size_t)(m0 + r) * X->ngroups + 8 * b;
#ifdef WIDE
            const __m512i x0 = _mm512_load_si512((const void *)xb), x1 = _mm512_load_si512((const void *)(xb + 64)),
                          x2 = _mm512_load_si512((const void *)(xb + 128)), x3 = _mm512_load_si512((const void *)(xb + 192));
            const __m256 xs8 = _mm256_load_ps(X->xs + gi);
            if (qf_per16(F)) { /* w[0], w[1]: each group's first 16 columns; w[2], w[3]: its last 16 */
                const __m512i lo = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), w[0], x0), w[1], x1);
                const __m512i hi = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), w[2], x2), w[3], x3);
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(fold8(lo)), _mm256_mul_ps(s.scale, xs8), acc[r]);
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(fold8(hi)), _mm256_mul_ps(s.scale_hi, xs8), acc[r]);
                const float *half = X->xhalf + 2 * gi;
                part[r] = _mm256_fmadd_ps(s.shift, _mm256_load_ps(half), part[r]);
                part[r] = _mm256_fmadd_ps(s.shift_hi, _mm256_load_ps(half + 8), part[r]);
                continue;
            }
            __m512i d0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[0], x0);
            __m512i d1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[1], x1);
            d0 = _mm512_dpbusd_epi32(d0, w[2], x2);
            d1 = _mm512_dpbusd_epi32(d1, w[3], x3);
            /* lane j and lane 8 + j both hold parts of group j's dot product: folded to 8 lanes, one per group */
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(fold8(_mm512_add_epi32(d0, d1))), _mm256_mul_ps(s.scale, xs8),
                                     acc[r]);
            part[r] = _mm256_fmadd_ps(s.shift, _mm256_load_ps(X->xsum + gi), part[r]);
#else
            const __m256 xs8 = _mm256_load_ps(X->xs + gi);
            __m256i hi;
            const __m256i dot = dot8(F, w, xb, &hi);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(s.scale, xs8), acc[r]);
            if (qf_per16(F)) {
                const float *half = X->xhalf + 2 * gi;
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), _mm256_mul_ps(s.scale_hi, xs8), acc[r]);
                acc[r] = _mm256_fmadd_ps(s.shift, _mm256_load_ps(half), acc[r]);
                acc[r] = _mm256_fmadd_ps(s.shift_hi, _mm256_load_ps(half + 8), acc[r]);
            } else {
                acc[r] = _mm256_fmadd_ps(s.shift, _mm256_load_ps(X->xsum + gi), acc[r]);
            }
#endif
        }
    }
    float tail_shift[ROW_TILE];
    for (int r = 0; r < TILE; r++) tail_shift[r] = b0 ? st->tail_shift[r] : 0.f;
    if (qf_tail_cols(F) && b1 == nblk && ntail) {
        const uint8_t *tail = wrow + (size_t)nblk * BB;
        const int per_record = qf_tail_cols(F) / GROUP;
        int g = 0;
#ifdef WIDE
        /* two groups per 512-bit dot product: their x bytes are adjacent, and lanes 0-7 / 8-15 keep them apart */
        for (; g + 1 < ntail; g += 2) {
            const uint8_t *r0 = tail + (size_t)(g / per_record) * qf_tail_bytes(F);
            const uint8_t *r1 = tail + (size_t)((g + 1) / per_record) * qf_tail_bytes(F);
            const __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(qf_tail_values(F, r0, g % per_record)),
                                                 qf_tail_values(F, r1, (g + 1) % per_record), 1);
            float scale0, shift0, scale1, shift1;
            qf_tail_scale(F, r0, &scale0, &shift0);
            qf_tail_scale(F, r1, &scale1, &shift1);
            for (int r = 0; r < TILE; r++) {
                const __m512i x = _mm512_loadu_si512((const void *)(X->xq + (size_t)(m0 + r) * X->xrow + X->Kpad +
                                                                    (size_t)g * GROUP));
                const size_t gi = (size_t)(m0 + r) * X->ngroups + 8 * nblk + g;
                const __m512 sc = _mm512_insertf32x8(_mm512_set1_ps(scale0 * X->xs[gi]),
                                                     _mm256_set1_ps(scale1 * X->xs[gi + 1]), 1);
                const __m512 d = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), w, x)), sc);
                part[r] = _mm256_add_ps(part[r], _mm256_add_ps(_mm512_castps512_ps256(d), _mm512_extractf32x8_ps(d, 1)));
                tail_shift[r] += shift0 * X->xsum[gi] + shift1 * X->xsum[gi + 1];
            }
        }
#endif
        for (; g < ntail; g++) {
            const uint8_t *rec = tail + (size_t)(g / per_record) * qf_tail_bytes(F);
            const __m256i w = qf_tail_values(F, rec, g % per_record);
            float scale, shift;
            qf_tail_scale(F, rec, &scale, &shift);
            for (int r = 0; r < TILE; r++) {
                const __m256i x = _mm256_load_si256((const __m256i *)(X->xq + (size_t)(m0 + r) * X->xrow + X->Kpad +
                                                                      (size_t)g * GROUP));
                const size_t gi = (size_t)(m0 + r) * X->ngroups + 8 * nblk + g;
                part[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot32(F, w, x)), _mm256_set1_ps(scale * X->xs[gi]), part[r]);
                tail_shift[r] += shift * X->xsum[gi];
            }
        }
    }
    for (int r = 0; r < TILE; r++) st->dot[r] = acc[r], st->part[r] = part[r], st->tail_shift[r] = tail_shift[r];
}

/* Every format, with the name its functions take, in the parts compiled apart (three or four formats each). */
#define FORMATS_1(X) X(QF_INT4, int4) X(QF_INT8, int8) X(QF_Q4_0, q4_0)
#define FORMATS_2(X) X(QF_Q4_1, q4_1) X(QF_Q5_0, q5_0) X(QF_Q5_1, q5_1)
#define FORMATS_3(X) X(QF_Q8_0, q8_0) X(QF_Q4_K, q4_k) X(QF_Q5_K, q5_k)
#define FORMATS_4(X) X(QF_Q6_K, q6_k) X(QF_IQ4_NL, iq4_nl) X(QF_IQ4_XS, iq4_xs)
#define FORMATS_5(X) X(QF_Q1_0, q1_0) X(QF_Q2_0, q2_0) X(QF_MXFP4, mxfp4) X(QF_TQ1_0, tq1_0)
#define FORMATS_6(X) X(QF_Q2_K, q2_k) X(QF_Q3_K, q3_k) X(QF_IQ3_S, iq3_s)
#define FORMATS_7(X) X(QF_IQ2_XXS, iq2_xxs) X(QF_IQ2_XS, iq2_xs) X(QF_IQ2_S, iq2_s)
#define FORMATS_8(X) X(QF_IQ3_XXS, iq3_xxs) X(QF_IQ1_S, iq1_s) X(QF_IQ1_M, iq1_m) X(QF_TQ2_0, tq2_0)
#define FORMATS(X) FORMATS_1(X) FORMATS_2(X) FORMATS_3(X) FORMATS_4(X) FORMATS_5(X) FORMATS_6(X) FORMATS_7(X) FORMATS_8(X)

/* A format's kernels are called from part 0 through the dispatch below: visible across the library's objects, not
 * outside it. */
#define KERNEL __attribute__((visibility("hidden")))
#define KERNEL_SIGNATURES(name)                                                                                     \
    KERNEL void tiles_##name(int rows, const uint8_t *wrow, const uint16_t *szrow, int b0, int b1, int nblk,        \
                             int ntail, const x_rows *X, int m0, tile_sums *st);                                     \
    KERNEL void columns_##name(const uint8_t *w, const uint16_t *sz, size_t row_bytes, int full, int nblk,         \
                               int ntail, const x_rows *X, int n0, int n1, float *total);
#define DECLARE_KERNELS(F, name) KERNEL_SIGNATURES(name)
FORMATS(DECLARE_KERNELS)

/* For format F, in functions of its own (a switch over formats of inlined tiles would be one very large function):
 * tiles_NAME, one tile of every row count; columns_NAME, the totals of columns n0 .. n1 - 1 of a single row of x (a
 * decode step's matrix-vector product), each a one-row tile taken whole with its sums kept in registers: the same
 * operations, so the same bits, as the tile path. */
#define KERNELS_OF(F, name)                                                                                         \
    KERNEL void tiles_##name(int rows, const uint8_t *wrow, const uint16_t *szrow, int b0, int b1, int nblk,        \
                             int ntail, const x_rows *X, int m0, tile_sums *st) {                                    \
        switch (rows) {                                                                                             \
        case 8: tile(8, F, wrow, szrow, b0, b1, nblk, ntail, X, m0, st); break;                                     \
        case 7: tile(7, F, wrow, szrow, b0, b1, nblk, ntail, X, m0, st); break;                                     \
        case 6: tile(6, F, wrow, szrow, b0, b1, nblk, ntail, X, m0, st); break;                                     \
        case 5: tile(5, F, wrow, szrow, b0, b1, nblk, ntail, X, m0, st); break;                                     \
        case 4: tile(4, F, wrow, szrow, b0, b1, nblk, ntail, X, m0, st); break;                                     \
        case 3: tile(3, F, wrow, szrow, b0, b1, nblk, ntail, X, m0, st); break;                                     \
        case 2: tile(2, F, wrow, szrow, b0, b1, nblk, ntail, X, m0, st); break;                                     \
        default: tile(1, F, wrow, szrow, b0, b1, nblk, ntail, X, m0, st); break;                                    \
        }                                                                                                           \
    }                                                                                                               \
    KERNEL void columns_##name(const uint8_t *w, const uint16_t *sz, size_t row_bytes, int full, int nblk,         \
                               int ntail, const x_rows *X, int n0, int n1, float *total) {                           \
        for (int n = n0; n < n1; n++) {                                                                             \
            tile_sums s;                                                                                            \
            tile(1, F, w + (size_t)n * row_bytes, sz ? sz + (size_t)n * full * 16 : NULL, 0, nblk, nblk, ntail, X, \
                 0, &s);                                                                                            \
            total[n - n0] = tile_total(&s, 0);                                                                      \
        }                                                                                                           \
    }
#define DEFINE_KERNELS(F, name) KERNELS_OF(F, name)
#define PART_FORMATS(n) FORMATS_##n
#define FORMATS_OF_PART(n) PART_FORMATS(n) /* (QD_PART expanded first) */
#if QD_PART > 0
FORMATS_OF_PART(QD_PART)(DEFINE_KERNELS)
#else

typedef void (*tiles_fn)(int, const uint8_t *, const uint16_t *, int, int, int, int, const x_rows *, int, tile_sums *);
typedef void (*columns_fn)(const uint8_t *, const uint16_t *, size_t, int, int, int, const x_rows *, int, int, float *);

static tiles_fn tiles_for(int f) {
    switch (f) {
#define TILES_CASE(F, name) case F: return tiles_##name;
        FORMATS(TILES_CASE)
#undef TILES_CASE
    default: return NULL;
    }
}

static columns_fn columns_for(int f) {
    switch (f) {
#define COLUMNS_CASE(F, name) case F: return columns_##name;
        FORMATS(COLUMNS_CASE)
#undef COLUMNS_CASE
    default: return NULL;
    }
}

#define MAX_PARTS 8

/* Bytes of one row of a part in format f (qformats.h), or 0 when f cannot take K columns; -1 for an unknown f. */
long qd_row_bytes(int f, int K) {
    if (!qf_known(f) || K <= 0) return -1;
    return (long)qf_row_bytes(f, K, (K + BLOCK - 1) / BLOCK * BLOCK);
}

/* Several weights that read the same x (q/k/v, gate/up), computed in one call: x is quantized once and one
 * parallel loop covers every part. Part p (w[p], its format fmt[p] (qformats.h), N[p] rows, bias[p] or NULL;
 * scales_zeros[p] for INT4/INT8, unused by the others) fills columns offset .. offset + N[p] of y,
 * offset = N[0] + .. + N[p-1]. swiglu = 1 (two parts of equal N): y has N[0] columns, silu(part 0) * part 1,
 * computed in float32 and rounded once.
 * Returns 0 on success, -1 when the workspace cannot be allocated, -2 on bad arguments. */
int qd_linear(const void *x, int x_bf16, int M, int K, int Kpad, int nparts, const uint8_t *const *w,
              const uint16_t *const *scales_zeros, const int *fmt, const int *N, const float *const *bias,
              int swiglu, void *y, int y_bf16) {
    if (M < 0 || K <= 0 || Kpad % BLOCK || Kpad < K || Kpad >= K + BLOCK || nparts < 1 || nparts > MAX_PARTS)
        return -2;
    if (swiglu && (nparts != 2 || N[0] != N[1])) return -2;
    int first_task[MAX_PARTS + 1], offset[MAX_PARTS + 1];
    first_task[0] = offset[0] = 0;
    for (int p = 0; p < nparts; p++) {
        if (N[p] <= 0 || !qf_known(fmt[p]) || !qf_row_bytes(fmt[p], K, Kpad)) return -2;
        const int tasks = swiglu && p == 1 ? 0 : (N[p] + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
        first_task[p + 1] = first_task[p] + tasks;
        offset[p + 1] = offset[p] + N[p];
    }
    if (M == 0) return 0;
    const int ldy = swiglu ? N[0] : offset[nparts];
    const int ngroups = Kpad / GROUP;
    const size_t xrow = (size_t)Kpad + (K % BLOCK ? BLOCK : 0);
    if (!reserve((size_t)M * xrow, (size_t)M * ngroups)) return -1;
    /* ws is per thread: the parallel loops below use this thread's buffers through X */
    const x_rows X = {ws.xq, ws.xs, ws.xsum, ws.xhalf, xrow, Kpad, ngroups};
#pragma omp parallel for schedule(static) if (M >= 16)
    for (int m = 0; m < M; m++)
        quantize_row(x, x_bf16, (size_t)m * K, K, Kpad, X.xq + (size_t)m * xrow, X.xs + (size_t)m * ngroups,
                     X.xsum + (size_t)m * ngroups, X.xhalf + (size_t)m * ngroups * 2);
    task_front fronts[MAX_TASK_THREADS];
    const int threads = task_fronts_reset(fronts);
#pragma omp parallel num_threads(threads)
    {
        task_cursor cursor = task_cursor_start(fronts, first_task[nparts]);
        int t0, t1;
        while (task_claim(&cursor, &t0, &t1))
        for (int task = t0; task < t1; task++) {
            int p = 0;
            while (task >= first_task[p + 1]) p++;
            const int n0 = (task - first_task[p]) * ROWS_PER_TASK;
            const int n1 = n0 + ROWS_PER_TASK < N[p] ? n0 + ROWS_PER_TASK : N[p];
            if (M == 1) { /* a decode step: each column's total straight from its tile's registers */
                const int full = Kpad / BLOCK;
                float total[2][ROWS_PER_TASK];
                for (int part = p; part < p + 1 + swiglu; part++) {
                    const int f = fmt[part];
                    columns_for(f)(w[part], qf_padded(f) ? scales_zeros[part] : NULL, qf_row_bytes(f, K, Kpad), full,
                                   qf_padded(f) ? full : K / BLOCK, qf_padded(f) ? 0 : (K % BLOCK) / GROUP, &X, n0, n1,
                                   total[part - p]);
                }
                for (int n = n0; n < n1; n++) {
                    float v = total[0][n - n0] + (bias[p] ? bias[p][n] : 0.f);
                    if (swiglu) {
                        const float up = total[1][n - n0] + (bias[1] ? bias[1][n] : 0.f);
                        v = v / (1.f + expf(-v)) * up;
                    }
                    st(y, y_bf16, (size_t)offset[p] + n, v);
                }
                continue;
            }
            for (int m0 = 0; m0 < M; m0 += ROW_TILE) {
                const int rows = M - m0 < ROW_TILE ? M - m0 : ROW_TILE;
                tile_sums sums[2][ROWS_PER_TASK]; /* set by the first chunk (b0 = 0) */
                /* a tile whose x rows are large: blocks in chunks, so the chunk of x rows stays in L1 while every output
                 * column of the task reads it; otherwise each weight row streamed whole (what the prefetcher likes). The
                 * sums are carried exactly between chunks: the chunking never changes a result. */
                const int full = Kpad / BLOCK;
                const int chunk = rows <= STREAM_ROWS || (size_t)rows * Kpad <= STREAM_X_BYTES ? full : K_CHUNK;
                for (int b0 = 0; b0 < full; b0 += chunk) {
                    for (int n = n0; n < n1; n++) {
                        for (int part = p; part < p + 1 + swiglu; part++) {
                            const int f = fmt[part];
                            const int nblk = qf_padded(f) ? full : K / BLOCK; /* the tail records follow block nblk */
                            const int b1 = b0 + chunk < nblk ? b0 + chunk : nblk;
                            if (!(b0 < b1 || (b0 == 0 && nblk == 0))) continue; /* a row of tail records alone: once */
                            const uint8_t *wrow = w[part] + (size_t)n * qf_row_bytes(f, K, Kpad);
                            const uint16_t *szrow = qf_padded(f) ? scales_zeros[part] + (size_t)n * full * 16 : NULL;
                            tiles_for(f)(rows, wrow, szrow, b0, b1, nblk, qf_padded(f) ? 0 : (K % BLOCK) / GROUP, &X, m0,
                                         &sums[part - p][n - n0]);
                        }
                    }
                }
                for (int n = n0; n < n1; n++) {
                    for (int r = 0; r < rows; r++) {
                        float v = tile_total(&sums[0][n - n0], r) + (bias[p] ? bias[p][n] : 0.f);
                        if (swiglu) {
                            const float up = tile_total(&sums[1][n - n0], r) + (bias[1] ? bias[1][n] : 0.f);
                            v = v / (1.f + expf(-v)) * up;
                        }
                        st(y, y_bf16, (size_t)(m0 + r) * ldy + offset[p] + n, v);
                    }
                }
            }
        }
    }
    return 0;
}
#endif
