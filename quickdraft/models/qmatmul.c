/* y = x @ W.T (+ bias) for weight-only quantized W, on x86-64 CPUs with AVX2 and FMA (VNNI used where present).
 *
 * W is affine per group of 32 input columns: w[n, k] = scale[n, g] * (q[n, k] - off) + zero[n, g],
 * q unsigned (4 bits: 0..15, off 8; 8 bits: 0..255, off 128), scale/zero bfloat16. x is quantized per
 * row and per group of 32 to int8 (absmax / 127, round to nearest even), so each group's dot product is
 * an exact int32 sum computed with vpdpbusd (u8 x s8), or on AVX2 without VNNI with vpmaddubsw + vpmaddwd on
 * 4-bit values, exact too (see dot_block), so every ISA gives the same integer sums:
 *     y[m, n] = sum_g  scale * xs[m, g] * sum_k q x8  +  (zero - off * scale) * xsum[m, g]
 * with xsum[m, g] = xs[m, g] * sum_k x8[m, k].
 *
 * Layout: K is padded to a multiple of 256 (a block of 8 groups). A block is 8 chunks of 32 bytes; chunk t
 * holds elements 32 j + 4 t + i (group j, i = 0..3) at byte 4 j + i, so after the dot products of a block
 * int32 lane j holds the whole dot product of group j and one fma per block applies 8 group scales.
 * Chunks are stored in the order t = 0, 2, 1, 3, 4, 6, 5, 7 (in the quantized x rows and the 8-bit
 * weights), so that one 64-byte load takes chunks (0, 2), (1, 3), (4, 6) or (5, 7).
 * 4-bit weights store blocks of 128 bytes: the low nibbles of bytes 32 s .. 32 s + 31 are chunk 2 s, the
 * high nibbles chunk 2 s + 1; so the low and high nibbles of a 64-byte load are chunks (0, 2) and (1, 3),
 * or (4, 6) and (5, 7).
 * scales_zeros: [N][K / 256][16] bfloat16 bits, 8 scales then 8 zeros per block.
 *
 * Every output element is computed by one thread with the same sequence of operations whatever M, the
 * row tile it falls in and the thread count are: a row's result is bit-identical whether it is alone in
 * the call or one of many (speculative verification relies on this).
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <math.h>

#include "floats.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define WIDE 1 /* 512-bit dot products: half the instructions per block */
#elif !defined(__AVX2__) || !defined(__FMA__)
#error "quickdraft's CPU kernels need AVX2 and FMA"
#endif

static const int CHUNK_AT[8] = {0, 2, 1, 3, 4, 6, 5, 7}; /* stored position of chunk t (its own inverse) */

#define BLOCK 256
#define GROUP 32
#define ROWS_PER_TASK 8 /* output rows one thread takes at a time */
/* How far ahead the AVX512 tiles ask for their weights, in calls of every row count: the best of the distances
 * measured (docs/MEASUREMENTS.md). */
#define PREFETCH_BYTES 4096
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

typedef struct {
    int8_t *xq;
    float *xs, *xsum;
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
        ws.xs = aligned_alloc(64, (nf * 4 + 63) / 64 * 64);
        ws.xsum = aligned_alloc(64, (nf * 4 + 63) / 64 * 64);
        ws.cap_f = ws.xs && ws.xsum ? nf : 0;
    }
    return ws.xq && ws.xs && ws.xsum;
}

/* One group of x whose values are all inside the row, vectorized: the same operations as the scalar loop of
 * quantize_row (one float multiply, round to nearest even, clamp), so both give the same bytes. */
static inline void quantize_group8x4(const void *x, int bf16, size_t at, int8_t *dst, float *xs, float *xsum) {
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
    __m256i sum = _mm256_setzero_si256();
    for (int j = 0; j < 4; j++) { /* elements 8 j .. 8 j + 7: chunks 2 j and 2 j + 1 */
        __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], scale));
        q = _mm256_min_epi32(_mm256_max_epi32(q, lo), hi);
        sum = _mm256_add_epi32(sum, q);
        const __m256i bytes = _mm256_shuffle_epi8(q, low_bytes);
        const int32_t first = _mm256_extract_epi32(bytes, 0), second = _mm256_extract_epi32(bytes, 4);
        __builtin_memcpy(dst + 32 * CHUNK_AT[2 * j], &first, 4);
        __builtin_memcpy(dst + 32 * CHUNK_AT[2 * j + 1], &second, 4);
    }
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
    *xs = amax / 127.f;
    *xsum = *xs * (float)_mm_cvtsi128_si32(s4);
}

/* One row of x -> int8 groups in the block layout, per-group scale and scaled sum. */
static void quantize_row(const void *x, int bf16, size_t row_off, int K, int Kpad, int8_t *xq, float *xs,
                         float *xsum) {
    for (int g = 0; g < Kpad / GROUP; g++) {
        int8_t *dst = xq + (g / 8) * BLOCK + 4 * (g % 8);
        if ((g + 1) * GROUP <= K) {
            quantize_group8x4(x, bf16, row_off + (size_t)g * GROUP, dst, xs + g, xsum + g);
            continue;
        }
        float v[GROUP], amax = 0.f;
        for (int e = 0; e < GROUP; e++) {
            int k = g * GROUP + e;
            v[e] = k < K ? ld(x, bf16, row_off + (size_t)k) : 0.f;
            amax = fmaxf(amax, fabsf(v[e]));
        }
        float inv = amax > 0.f ? 127.f / amax : 0.f;
        int sum = 0;
        for (int e = 0; e < GROUP; e++) {
            int q = (int)nearbyintf(v[e] * inv);
            q = q > 127 ? 127 : q < -127 ? -127 : q;
            dst[32 * CHUNK_AT[e / 4] + (e % 4)] = (int8_t)q;
            sum += q;
        }
        xs[g] = amax / 127.f;
        xsum[g] = xs[g] * (float)sum;
    }
}

#ifndef WIDE
/* Lane j = the int32 dot product of group j of one block: weight chunks w[0..7] (by stored position, u8) with the
 * quantized x chunks at xb (s8, 32 bytes each). */
static inline __m256i dot_block(const __m256i w[8], int bits, const int8_t *xb) {
#ifdef __AVXVNNI__
    (void)bits;
    __m256i d0 = _mm256_setzero_si256(), d1 = _mm256_setzero_si256(); /* two chains: dpbusd latency */
    for (int c = 0; c < 8; c += 2) {
        d0 = _mm256_dpbusd_avx_epi32(d0, w[c], _mm256_load_si256((const __m256i *)(xb + 32 * c)));
        d1 = _mm256_dpbusd_avx_epi32(d1, w[c + 1], _mm256_load_si256((const __m256i *)(xb + 32 * c + 32)));
    }
    return _mm256_add_epi32(d0, d1);
#else
    /* AVX2: vpmaddubsw sums two u8 x s8 products in 16 bits with saturation, which never happens for 4-bit
     * values: 16-bit lane i of chunk c holds 2 products of at most 15 * 127, and summing the 8 chunks keeps
     * 16 such products per lane (at most 30480 < 32767); vpmaddwd then adds the lane pairs into int32 lane j
     * = group j. 8-bit weights are split into nibbles: q = 16 * hi + lo. */
    const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(0x0F);
    __m256i lo = _mm256_setzero_si256(), hi = _mm256_setzero_si256();
    for (int c = 0; c < 8; c++) {
        const __m256i x = _mm256_load_si256((const __m256i *)(xb + 32 * c));
        if (bits == 4) {
            lo = _mm256_add_epi16(lo, _mm256_maddubs_epi16(w[c], x));
        } else {
            lo = _mm256_add_epi16(lo, _mm256_maddubs_epi16(_mm256_and_si256(w[c], low), x));
            hi = _mm256_add_epi16(hi, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(w[c], 4), low), x));
        }
    }
    __m256i dot = _mm256_madd_epi16(lo, ones);
    if (bits == 8) dot = _mm256_add_epi32(dot, _mm256_slli_epi32(_mm256_madd_epi16(hi, ones), 4));
    return dot;
#endif
}
#endif

/* Running sums of rows m0 .. m0 + TILE - 1 of one output column, kept between chunks of blocks. */
typedef struct {
#ifdef WIDE
    __m512 dot[ROW_TILE];
    __m256 shift[ROW_TILE];
#else
    __m256 dot[ROW_TILE];
#endif
} tile_sums;

static inline float tile_total(const tile_sums *t, int r) {
#ifdef WIDE
    return _mm512_reduce_add_ps(t->dot[r]) + hsum(t->shift[r]);
#else
    return hsum(t->dot[r]);
#endif
}

/* Blocks b0 .. b1 - 1 of rows m0 .. m0 + TILE - 1 of y[:, n], added to st (which they start when b0 = 0); TILE is a constant after inlining,
 * so the sums stay in registers within the call. */
static inline __attribute__((always_inline)) void tile(int TILE, int bits, const uint8_t *wrow,
                                                        const uint16_t *szrow, int b0, int b1, const int8_t *xq,
                                                        const float *xs, const float *xsum, int Kpad, int m0,
                                                        tile_sums *st) {
    const __m256 off = _mm256_set1_ps(bits == 4 ? 8.f : 128.f);
    const int ngroups = Kpad / GROUP;
#ifdef WIDE
    const __m512i low = _mm512_set1_epi8(0x0F);
    __m512 acc[ROW_TILE];
    __m256 acc_shift[ROW_TILE];
    for (int r = 0; r < TILE; r++) {
        acc[r] = b0 ? st->dot[r] : _mm512_setzero_ps();
        acc_shift[r] = b0 ? st->shift[r] : _mm256_setzero_ps();
    }
    for (int b = b0; b < b1; b++) {
        __m512i w[4]; /* chunk pairs (0, 2), (1, 3), (4, 6), (5, 7) */
        const uint8_t *ahead = wrow + (size_t)b * BLOCK * bits / 8 + PREFETCH_BYTES; /* weight rows are contiguous */
        for (int c = 0; c < BLOCK * bits / 8; c += 64) _mm_prefetch((const char *)ahead + c, _MM_HINT_T0);
        _mm_prefetch((const char *)(szrow + 16 * b) + PREFETCH_BYTES / 4, _MM_HINT_T0);
        if (bits == 4) {
            const uint8_t *wb = wrow + (size_t)b * (BLOCK / 2);
            for (int h = 0; h < 2; h++) {
                __m512i l = _mm512_loadu_si512((const void *)(wb + 64 * h));
                w[2 * h] = _mm512_and_si512(l, low);
                w[2 * h + 1] = _mm512_and_si512(_mm512_srli_epi16(l, 4), low);
            }
        } else {
            const uint8_t *wb = wrow + (size_t)b * BLOCK;
            for (int u = 0; u < 4; u++) w[u] = _mm512_loadu_si512((const void *)(wb + 64 * u));
        }
        const __m256 scale = bf16x8(szrow + 16 * b);
        const __m256 shift = _mm256_fnmadd_ps(off, scale, bf16x8(szrow + 16 * b + 8)); /* zero - off * scale */
        const __m512 scale2 = _mm512_insertf32x8(_mm512_castps256_ps512(scale), scale, 1);
        for (int r = 0; r < TILE; r++) {
            const int8_t *xb = xq + (size_t)(m0 + r) * Kpad + (size_t)b * BLOCK;
            __m512i d0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[0], _mm512_load_si512((const void *)xb));
            __m512i d1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[1], _mm512_load_si512((const void *)(xb + 64)));
            d0 = _mm512_dpbusd_epi32(d0, w[2], _mm512_load_si512((const void *)(xb + 128)));
            d1 = _mm512_dpbusd_epi32(d1, w[3], _mm512_load_si512((const void *)(xb + 192)));
            /* lane j and lane 8 + j both hold parts of group j's dot product: both get its scale */
            const size_t gi = (size_t)(m0 + r) * ngroups + 8 * b;
            const __m512 s = _mm512_mul_ps(scale2, _mm512_broadcast_f32x8(_mm256_load_ps(xs + gi)));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(d0, d1)), s, acc[r]);
            acc_shift[r] = _mm256_fmadd_ps(shift, _mm256_load_ps(xsum + gi), acc_shift[r]);
        }
    }
    for (int r = 0; r < TILE; r++) st->dot[r] = acc[r], st->shift[r] = acc_shift[r];
#else
    const __m256i low = _mm256_set1_epi8(0x0F);
    __m256 acc[ROW_TILE];
    for (int r = 0; r < TILE; r++) acc[r] = b0 ? st->dot[r] : _mm256_setzero_ps();
    for (int b = b0; b < b1; b++) {
        __m256i w[8]; /* by stored position */
        if (bits == 4) {
            const uint8_t *wb = wrow + (size_t)b * (BLOCK / 2);
            for (int s = 0; s < 4; s++) {
                __m256i l = _mm256_loadu_si256((const __m256i *)(wb + 32 * s));
                w[CHUNK_AT[2 * s]] = _mm256_and_si256(l, low);
                w[CHUNK_AT[2 * s + 1]] = _mm256_and_si256(_mm256_srli_epi16(l, 4), low);
            }
        } else {
            const uint8_t *wb = wrow + (size_t)b * BLOCK;
            for (int c = 0; c < 8; c++) w[c] = _mm256_loadu_si256((const __m256i *)(wb + 32 * c));
        }
        __m256 scale = bf16x8(szrow + 16 * b);
        __m256 shift = _mm256_fnmadd_ps(off, scale, bf16x8(szrow + 16 * b + 8)); /* zero - off * scale */
        for (int r = 0; r < TILE; r++) {
            const __m256i dot = dot_block(w, bits, xq + (size_t)(m0 + r) * Kpad + (size_t)b * BLOCK);
            size_t gi = (size_t)(m0 + r) * ngroups + 8 * b;
            __m256 s = _mm256_mul_ps(scale, _mm256_load_ps(xs + gi));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), s, acc[r]);
            acc[r] = _mm256_fmadd_ps(shift, _mm256_load_ps(xsum + gi), acc[r]);
        }
    }
    for (int r = 0; r < TILE; r++) st->dot[r] = acc[r];
#endif
}

#define MAX_PARTS 8

/* Several weights that read the same x (q/k/v, gate/up), computed in one call: x is quantized once and one
 * parallel loop covers every part. Part p (w[p], scales_zeros[p], bits[p], N[p] rows, bias[p] or NULL) fills
 * columns offset .. offset + N[p] of y, offset = N[0] + .. + N[p-1]. swiglu = 1 (two parts of equal N):
 * y has N[0] columns, silu(part 0) * part 1, computed in float32 and rounded once.
 * Returns 0 on success, -1 when the workspace cannot be allocated, -2 on bad arguments. */
int qd_linear(const void *x, int x_bf16, int M, int K, int Kpad, int nparts, const uint8_t *const *w,
              const uint16_t *const *scales_zeros, const int *bits, const int *N, const float *const *bias,
              int swiglu, void *y, int y_bf16) {
    if (M < 0 || K <= 0 || Kpad % BLOCK || Kpad < K || nparts < 1 || nparts > MAX_PARTS) return -2;
    if (swiglu && (nparts != 2 || N[0] != N[1])) return -2;
    int first_task[MAX_PARTS + 1], offset[MAX_PARTS + 1];
    first_task[0] = offset[0] = 0;
    for (int p = 0; p < nparts; p++) {
        if (N[p] <= 0 || (bits[p] != 4 && bits[p] != 8)) return -2;
        const int tasks = swiglu && p == 1 ? 0 : (N[p] + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
        first_task[p + 1] = first_task[p] + tasks;
        offset[p + 1] = offset[p] + N[p];
    }
    if (M == 0) return 0;
    const int ldy = swiglu ? N[0] : offset[nparts];
    const int nblk = Kpad / BLOCK, ngroups = Kpad / GROUP;
    if (!reserve((size_t)M * Kpad, (size_t)M * ngroups)) return -1;
    int8_t *xq = ws.xq;
    float *xs = ws.xs, *xsum = ws.xsum;
#pragma omp parallel for schedule(static) if (M >= 16)
    for (int m = 0; m < M; m++)
        quantize_row(x, x_bf16, (size_t)m * K, K, Kpad, xq + (size_t)m * Kpad, xs + (size_t)m * ngroups,
                     xsum + (size_t)m * ngroups);
#pragma omp parallel for schedule(static)
    for (int task = 0; task < first_task[nparts]; task++) {
        int p = 0;
        while (task >= first_task[p + 1]) p++;
        const int n0 = (task - first_task[p]) * ROWS_PER_TASK;
        const int n1 = n0 + ROWS_PER_TASK < N[p] ? n0 + ROWS_PER_TASK : N[p];
        for (int m0 = 0; m0 < M; m0 += ROW_TILE) {
            const int rows = M - m0 < ROW_TILE ? M - m0 : ROW_TILE;
            tile_sums sums[2][ROWS_PER_TASK]; /* set by the first chunk (b0 = 0) */
            /* a tile whose x rows are large: blocks in chunks, so the chunk of x rows stays in L1 while every output
             * column of the task reads it; otherwise each weight row streamed whole (what the prefetcher likes). The
             * sums are carried exactly between chunks: the chunking never changes a result. */
            const int chunk = rows <= STREAM_ROWS || (size_t)rows * Kpad <= STREAM_X_BYTES ? nblk : K_CHUNK;
            for (int b0 = 0; b0 < nblk; b0 += chunk) {
                const int b1 = b0 + chunk < nblk ? b0 + chunk : nblk;
                for (int n = n0; n < n1; n++) {
                    for (int part = p; part < p + 1 + swiglu; part++) {
                        const size_t wbytes = (size_t)Kpad * bits[part] / 8;
                        const uint8_t *wrow = w[part] + (size_t)n * wbytes;
                        const uint16_t *szrow = scales_zeros[part] + (size_t)n * nblk * 16;
                        tile_sums *st = &sums[part - p][n - n0];
/* bits as a constant: with it known, each tile keeps its weight chunks and sums in registers (a run-time bits
 * spilled them to the stack and read markedly slower) */
#define TILE_CASE(T) case T: if (bits[part] == 4) tile(T, 4, wrow, szrow, b0, b1, xq, xs, xsum, Kpad, m0, st); \
                                    else tile(T, 8, wrow, szrow, b0, b1, xq, xs, xsum, Kpad, m0, st); break;
                        switch (rows) {
                            TILE_CASE(8) TILE_CASE(7) TILE_CASE(6) TILE_CASE(5) TILE_CASE(4) TILE_CASE(3) TILE_CASE(2)
                            default: TILE_CASE(1)
                        }
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
    return 0;
}
