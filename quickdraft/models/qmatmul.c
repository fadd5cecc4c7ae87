/* y = x @ W.T (+ bias) for weight-only quantized W, on CPU with AVX-VNNI or AVX512-VNNI.
 *
 * W is affine per group of 32 input columns: w[n, k] = scale[n, g] * (q[n, k] - off) + zero[n, g],
 * q unsigned (4 bits: 0..15, off 8; 8 bits: 0..255, off 128), scale/zero bfloat16. x is quantized per
 * row and per group of 32 to int8 (absmax / 127, round to nearest even), so each group's dot product is
 * an exact int32 sum computed with vpdpbusd (u8 x s8):
 *     y[m, n] = sum_g  scale * xs[m, g] * sum_k q x8  +  (zero - off * scale) * xsum[m, g]
 * with xsum[m, g] = xs[m, g] * sum_k x8[m, k].
 *
 * Layout: K is padded to a multiple of 256 (a block of 8 groups). In a block, byte 32 t + 4 j + i of the
 * 8-bit weight (and of the quantized x row) is element 32 j + 4 t + i: after the 8 vpdpbusd of a block,
 * int32 lane j holds the whole dot product of group j, so one fma per block applies 8 group scales.
 * 4-bit weights store blocks of 128 bytes: the low nibbles of bytes 32 s .. 32 s + 31 are the 8-bit
 * layout's bytes 64 s .. 64 s + 31, the high nibbles bytes 64 s + 32 .. 64 s + 63.
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

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define DPBUSD(acc, a, b) _mm256_dpbusd_epi32((acc), (a), (b))
#elif defined(__AVXVNNI__)
#define DPBUSD(acc, a, b) _mm256_dpbusd_avx_epi32((acc), (a), (b))
#else
#error "qmatmul needs AVX-VNNI or AVX512-VNNI"
#endif

#define BLOCK 256
#define GROUP 32
#define ROWS_PER_TASK 8 /* output rows one thread takes at a time */
#define ROW_TILE 4      /* rows of x that share one unpacked weight block */

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

static inline float load_x(const void *x, int bf16, size_t i) {
    if (bf16) {
        uint32_t bits = (uint32_t)((const uint16_t *)x)[i] << 16;
        float f;
        __builtin_memcpy(&f, &bits, 4);
        return f;
    }
    return ((const float *)x)[i];
}

static inline void store_y(void *y, int bf16, size_t i, float v) {
    if (bf16) {
        uint32_t bits;
        __builtin_memcpy(&bits, &v, 4);
        bits += 0x7FFF + ((bits >> 16) & 1); /* round to nearest even */
        ((uint16_t *)y)[i] = (uint16_t)(bits >> 16);
    } else {
        ((float *)y)[i] = v;
    }
}

/* One row of x -> int8 groups in the block layout, per-group scale and scaled sum. */
static void quantize_row(const void *x, int bf16, size_t row_off, int K, int Kpad, int8_t *xq, float *xs,
                         float *xsum) {
    for (int g = 0; g < Kpad / GROUP; g++) {
        float v[GROUP], amax = 0.f;
        for (int e = 0; e < GROUP; e++) {
            int k = g * GROUP + e;
            v[e] = k < K ? load_x(x, bf16, row_off + (size_t)k) : 0.f;
            amax = fmaxf(amax, fabsf(v[e]));
        }
        float inv = amax > 0.f ? 127.f / amax : 0.f;
        int8_t *dst = xq + (g / 8) * BLOCK + 4 * (g % 8);
        int sum = 0;
        for (int e = 0; e < GROUP; e++) {
            int q = (int)nearbyintf(v[e] * inv);
            q = q > 127 ? 127 : q < -127 ? -127 : q;
            dst[32 * (e / 4) + (e % 4)] = (int8_t)q;
            sum += q;
        }
        xs[g] = amax / 127.f;
        xsum[g] = xs[g] * (float)sum;
    }
}

static inline __m256 bf16x8(const uint16_t *p) {
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* rows m0 .. m0 + TILE - 1 of y[:, n]; TILE is a constant after inlining, so acc stays in registers */
static inline __attribute__((always_inline)) void tile(int TILE, int bits, const uint8_t *wrow,
                                                        const uint16_t *szrow, int nblk, const int8_t *xq,
                                                        const float *xs, const float *xsum, int Kpad, int m0,
                                                        float out[ROW_TILE]) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    const __m256 off = _mm256_set1_ps(bits == 4 ? 8.f : 128.f);
    const int ngroups = Kpad / GROUP;
    __m256 acc[ROW_TILE];
    for (int r = 0; r < TILE; r++) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < nblk; b++) {
        __m256i w[8];
        if (bits == 4) {
            const uint8_t *wb = wrow + (size_t)b * (BLOCK / 2);
            for (int s = 0; s < 4; s++) {
                __m256i l = _mm256_loadu_si256((const __m256i *)(wb + 32 * s));
                w[2 * s] = _mm256_and_si256(l, low);
                w[2 * s + 1] = _mm256_and_si256(_mm256_srli_epi16(l, 4), low);
            }
        } else {
            const uint8_t *wb = wrow + (size_t)b * BLOCK;
            for (int t = 0; t < 8; t++) w[t] = _mm256_loadu_si256((const __m256i *)(wb + 32 * t));
        }
        __m256 scale = bf16x8(szrow + 16 * b);
        __m256 shift = _mm256_fnmadd_ps(off, scale, bf16x8(szrow + 16 * b + 8)); /* zero - off * scale */
        for (int r = 0; r < TILE; r++) {
            const int8_t *xb = xq + (size_t)(m0 + r) * Kpad + (size_t)b * BLOCK;
            __m256i dot = _mm256_setzero_si256();
            for (int t = 0; t < 8; t++) dot = DPBUSD(dot, w[t], _mm256_load_si256((const __m256i *)(xb + 32 * t)));
            size_t gi = (size_t)(m0 + r) * ngroups + 8 * b;
            __m256 s = _mm256_mul_ps(scale, _mm256_load_ps(xs + gi));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), s, acc[r]);
            acc[r] = _mm256_fmadd_ps(shift, _mm256_load_ps(xsum + gi), acc[r]);
        }
    }
    for (int r = 0; r < TILE; r++) out[r] = hsum(acc[r]);
}

/* Returns 0 on success, -1 when the workspace cannot be allocated, -2 on bad arguments. */
int qd_linear(const void *x, int x_bf16, int M, int K, const uint8_t *w, const uint16_t *scales_zeros, int bits,
              int N, int Kpad, const float *bias, void *y, int y_bf16) {
    if (M < 0 || N <= 0 || K <= 0 || Kpad % BLOCK || Kpad < K || (bits != 4 && bits != 8)) return -2;
    if (M == 0) return 0;
    const int nblk = Kpad / BLOCK, ngroups = Kpad / GROUP;
    if (!reserve((size_t)M * Kpad, (size_t)M * ngroups)) return -1;
    int8_t *xq = ws.xq;
    float *xs = ws.xs, *xsum = ws.xsum;
#pragma omp parallel for schedule(static) if (M >= 16)
    for (int m = 0; m < M; m++)
        quantize_row(x, x_bf16, (size_t)m * K, K, Kpad, xq + (size_t)m * Kpad, xs + (size_t)m * ngroups,
                     xsum + (size_t)m * ngroups);
    const size_t wbytes = (size_t)Kpad * bits / 8;
    const int ntasks = (N + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
#pragma omp parallel for schedule(static)
    for (int task = 0; task < ntasks; task++) {
        const int n0 = task * ROWS_PER_TASK, n1 = n0 + ROWS_PER_TASK < N ? n0 + ROWS_PER_TASK : N;
        for (int m0 = 0; m0 < M; m0 += ROW_TILE) {
            const int rows = M - m0 < ROW_TILE ? M - m0 : ROW_TILE;
            for (int n = n0; n < n1; n++) {
                const uint8_t *wrow = w + (size_t)n * wbytes;
                const uint16_t *szrow = scales_zeros + (size_t)n * nblk * 16;
                float out[ROW_TILE];
                switch (rows) {
                    case 4: tile(4, bits, wrow, szrow, nblk, xq, xs, xsum, Kpad, m0, out); break;
                    case 3: tile(3, bits, wrow, szrow, nblk, xq, xs, xsum, Kpad, m0, out); break;
                    case 2: tile(2, bits, wrow, szrow, nblk, xq, xs, xsum, Kpad, m0, out); break;
                    default: tile(1, bits, wrow, szrow, nblk, xq, xs, xsum, Kpad, m0, out); break;
                }
                const float b = bias ? bias[n] : 0.f;
                for (int r = 0; r < rows; r++) store_y(y, y_bf16, (size_t)(m0 + r) * N + n, out[r] + b);
            }
        }
    }
    return 0;
}
