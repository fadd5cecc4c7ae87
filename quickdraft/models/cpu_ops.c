/* The small per-token operations of a decoder layer on CPU, for float32 or bfloat16 tensors.
 *
 * Why: in a decode step of a 1.5B model torch spends about as long dispatching these small operations
 * (RMSNorm, rotary embedding, the MLP's gated activation: dozens of aten calls per layer)
 * as the weight-reading matmuls take. Here each is one call.
 *
 * Every result row (a token, or a token and query head) is computed by one thread with a fixed sequence of
 * operations that depends only on that row's own data: results are bit-identical whatever the batch and the
 * thread count, which speculative verification relies on (a token's logits in a verify pass equal its
 * logits when decoded alone).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "floats.h"
#include "tasks.h"

/* 8 floats from float32 or bfloat16 memory */
static inline __m256 ld8(const void *p, int bf16, size_t i) {
    if (bf16) {
        __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps((const float *)p + i);
}

/* 8 floats to float32 or bfloat16 memory (round to nearest even, as st) */
static inline void st8(void *p, int bf16, size_t i, __m256 v) {
    if (bf16) {
        __m256i b = _mm256_castps_si256(v);
        __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
        b = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
        __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
        _mm_storeu_si128((__m128i *)((uint16_t *)p + i), packed);
    } else {
        _mm256_storeu_ps((float *)p + i, v);
    }
}

/* y[row ..] = x[row ..] / sqrt(mean(x^2) + eps) * w over D values (y may alias x) */
static inline void norm_row(const void *x, int x_bf16, const void *w, int w_bf16, size_t row, int D, float eps,
                            void *y) {
    __m256 acc = _mm256_setzero_ps();
    for (int d = 0; d < D; d += 8) {
        __m256 v = ld8(x, x_bf16, row + d);
        acc = _mm256_fmadd_ps(v, v, acc);
    }
    const __m256 inv = _mm256_set1_ps(1.f / sqrtf(hsum(acc) / (float)D + eps));
    for (int d = 0; d < D; d += 8)
        st8(y, x_bf16, row + d, _mm256_mul_ps(_mm256_mul_ps(ld8(x, x_bf16, row + d), inv), ld8(w, w_bf16, d)));
}

/* y = x / sqrt(mean(x^2) + eps) * w per row (y may alias x); D % 8 == 0. */
int qd_rmsnorm(const void *x, int x_bf16, const void *w, int w_bf16, int M, int D, float eps, void *y) {
    if (M < 0 || D <= 0 || D % 8) return -2;
#pragma omp parallel for schedule(static) if (M >= 16)
    for (int m = 0; m < M; m++) norm_row(x, x_bf16, w, w_bf16, (size_t)m * D, D, eps, y);
    return 0;
}

/* qd_rmsnorm of every head of x [T][heads][D] in place, rows row_stride elements apart (the q or k heads of a fused
 * q/k/v projection, as qd_rope takes them): each head gets the bits qd_rmsnorm gives it as a row of its own. */
int qd_head_norm(void *x, int bf16, const void *w, int w_bf16, int T, int heads, int D, long row_stride, float eps) {
    if (T < 0 || heads <= 0 || D <= 0 || D % 8) return -2;
    for (int t = 0; t < T; t++)
        for (int h = 0; h < heads; h++) norm_row(x, bf16, w, w_bf16, (size_t)t * row_stride + (size_t)h * D, D, eps, x);
    return 0;
}

/* Rotate-half rotary embedding in place over the first 2 * half dims of each head (partial rotary; the rest pass as
 * they are; half 0: none): heads [T][heads][D] with row stride row_stride (elements), token t at position
 * positions[t]; cos/sin: float32 [max_positions][half]. */
int qd_rope(void *x, int bf16, int T, int heads, int D, int half, long row_stride, const int64_t *positions,
            const float *cos_table, const float *sin_table) {
    if (T < 0 || heads <= 0 || D <= 0 || half < 0 || 2 * half > D) return -2;
    for (int t = 0; t < T && half; t++) {
        const float *c = cos_table + (size_t)positions[t] * half, *s = sin_table + (size_t)positions[t] * half;
        for (int h = 0; h < heads; h++) {
            const size_t base = (size_t)t * row_stride + (size_t)h * D;
            for (int i = 0; i < half; i++) {
                const float x1 = ld(x, bf16, base + i), x2 = ld(x, bf16, base + half + i);
                st(x, bf16, base + i, x1 * c[i] - x2 * s[i]);
                st(x, bf16, base + half + i, x2 * c[i] + x1 * s[i]);
            }
        }
    }
    return 0;
}

enum { QD_SILU = 0, QD_GELU_TANH = 1, QD_CLAMPED_SWIGLU = 2 };

/* y [M][N] = act(gate) * up from gate_up [M][2N] = [gate | up] per row, in float32, rounded once (the gated MLP
 * activation when gate and up projections ran as one). act QD_SILU: silu, the formula qmatmul applies inside its
 * kernel; QD_GELU_TANH: torch's gelu(approximate="tanh"), 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)));
 * QD_CLAMPED_SWIGLU: gpt-oss's, (up' + 1) * g * sigmoid(alpha * g) with g = min(gate, limit) and up' = up clamped to
 * [-limit, limit] (a NaN stays a NaN, as torch.clamp keeps it); limit and alpha are read for it alone. */
int qd_gated(const void *gate_up, int bf16, int M, int N, int act, float limit, float alpha, void *y) {
    if (M < 0 || N <= 0 || (act != QD_SILU && act != QD_GELU_TANH && act != QD_CLAMPED_SWIGLU)) return -2;
    if (act == QD_CLAMPED_SWIGLU && !(limit > 0.f && alpha == alpha)) return -2;
    const float beta = 0.7978845608028654f, kappa = 0.044715f;
    for (int m = 0; m < M; m++)
        for (int n = 0; n < N; n++) {
            const float g = ld(gate_up, bf16, (size_t)m * 2 * N + n), u = ld(gate_up, bf16, (size_t)m * 2 * N + N + n);
            float a;
            if (act == QD_CLAMPED_SWIGLU) {
                const float gc = g > limit ? limit : g, uc = u < -limit ? -limit : u > limit ? limit : u;
                a = ((uc + 1.f) * gc) * (1.f / (1.f + expf(-(gc * alpha))));
            } else {
                a = (act == QD_SILU ? g / (1.f + expf(-g)) : 0.5f * g * (1.f + tanhf(beta * (g + kappa * (g * g * g)))))
                    * u;
            }
            st(y, bf16, (size_t)m * N + n, a);
        }
    return 0;
}

/* y = x @ W.T (+ bias) with bfloat16 x [M][K] and W [N][K] (row-major, as stored), y bfloat16 [M][N], float32 sums
 * in a fixed order per output element: with AVX512-BF16 of vdpbf16ps pair products, else (AVX2) of exact float32
 * products (bf16 x bf16 fits a float32) accumulated by fma over 8 lanes and summed across lanes once. Weight rows
 * are streamed once per tile of a few rows of x, so a decode step reads the weights at memory speed and a verify
 * pass of a few tokens costs little more. Each output element gets the same operations whatever the tile sizes. */
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define BF16_ROW_TILE 6      /* rows of x per tile ... */
#define BF16_COLS 4          /* ... times weight rows per tile: each loaded x chunk serves 4 columns */
#define BF16_COLS_FOR(rows) BF16_COLS
#else
/* AVX2 has 16 vector registers: one row of x times 4 weight rows (decode), or up to 6 rows times 2 weight rows
 * (12 sums, 2 weight chunks and one x chunk), so a weight chunk is converted once for up to 6 rows */
#define BF16_ROW_TILE 6
#define BF16_COLS 4
#define BF16_COLS_FOR(rows) ((rows) == 1 ? 4 : 2)
#endif
#define BF16_COLS_PER_TASK 16
#define BF16_PREFETCH 4096

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
/* rows m0 .. m0 + TILE - 1 times weight rows wrow, wrow + K, .. (COLS of them); TILE and COLS are constants after
 * inlining. */
typedef uint16_t x_elem; /* x as given */

static inline __attribute__((always_inline)) void bf16_tile(int TILE, int COLS, const x_elem *x, int ldx, int K, int m0,
                                                             const uint16_t *wrow, float out[BF16_COLS][BF16_ROW_TILE]) {
    __m512 acc[BF16_COLS][BF16_ROW_TILE];
    for (int c = 0; c < COLS; c++)
        for (int r = 0; r < TILE; r++) acc[c][r] = _mm512_setzero_ps();
    for (int k = 0; k < K; k += 32) {
        const __mmask32 mask = K - k >= 32 ? 0xFFFFFFFFu : (1u << (K - k)) - 1u;
        __m512bh wv[BF16_COLS];
        for (int c = 0; c < COLS; c++) {
            const uint16_t *wc = wrow + (size_t)c * K + k;
            _mm_prefetch((const char *)wc + BF16_PREFETCH, _MM_HINT_T0);
            wv[c] = (__m512bh)_mm512_maskz_loadu_epi16(mask, wc);
        }
        for (int r = 0; r < TILE; r++) {
            const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + (size_t)(m0 + r) * ldx + k);
            for (int c = 0; c < COLS; c++) acc[c][r] = _mm512_dpbf16_ps(acc[c][r], xv, wv[c]);
        }
    }
    for (int c = 0; c < COLS; c++)
        for (int r = 0; r < TILE; r++) out[c][r] = _mm512_reduce_add_ps(acc[c][r]);
}
#else
/* 8 bfloat16 values at p as floats; only the first n (< 8) are read when n < 8, the rest are 0 */
static inline __m256 bf16x8_tail(const uint16_t *p, int n) {
    uint16_t buf[8] = {0};
    for (int i = 0; i < n; i++) buf[i] = p[i];
    return bf16x8(buf);
}

typedef float x_elem; /* x converted to float32 once per call (exact), rows padded to a multiple of 8 with zeros */

static inline __attribute__((always_inline)) void bf16_tile(int TILE, int COLS, const x_elem *x, int ldx, int K, int m0,
                                                             const uint16_t *wrow, float out[BF16_COLS][BF16_ROW_TILE]) {
    __m256 acc[BF16_COLS][BF16_ROW_TILE];
    for (int c = 0; c < COLS; c++)
        for (int r = 0; r < TILE; r++) acc[c][r] = _mm256_setzero_ps();
    const int body = K / 8 * 8;
    for (int k = 0; k < ldx; k += 8) {
        __m256 wv[BF16_COLS];
        for (int c = 0; c < COLS; c++) {
            const uint16_t *wc = wrow + (size_t)c * K + k;
            if (k % 32 == 0) _mm_prefetch((const char *)wc + BF16_PREFETCH, _MM_HINT_T0);
            wv[c] = k < body ? bf16x8(wc) : bf16x8_tail(wc, K - body);
        }
        for (int r = 0; r < TILE; r++) {
            const __m256 xv = _mm256_load_ps(x + (size_t)(m0 + r) * ldx + k);
            for (int c = 0; c < COLS; c++) acc[c][r] = _mm256_fmadd_ps(xv, wv[c], acc[c][r]);
        }
    }
    for (int c = 0; c < COLS; c++)
        for (int r = 0; r < TILE; r++) out[c][r] = hsum(acc[c][r]);
}
#endif

int qd_linear_bf16(const uint16_t *x_bf16, int M, int K, const uint16_t *w, int N, const float *bias, uint16_t *y) {
    if (M < 0 || K <= 0 || N <= 0) return -2;
    const int ntasks = (N + BF16_COLS_PER_TASK - 1) / BF16_COLS_PER_TASK;
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    const x_elem *x = x_bf16;
    const int ldx = K;
#else
    /* AVX2: converting x once (not once per tile of weight rows) halves the instructions of a multi-row call */
    static __thread scratch x_buf;
    const int ldx = (K + 7) / 8 * 8;
    float *x = reserve_floats(&x_buf, (size_t)(M > 0 ? M : 1) * ldx);
    if (!x) return -1;
#pragma omp parallel for schedule(static) if (M >= 16)
    for (int m = 0; m < M; m++)
        for (int k = 0; k < ldx; k++) x[(size_t)m * ldx + k] = k < K ? ld(x_bf16, 1, (size_t)m * K + k) : 0.f;
#endif
    task_front fronts[MAX_TASK_THREADS];
    const int threads = task_fronts_reset(fronts);
#pragma omp parallel num_threads(threads)
    {
        task_cursor cursor = task_cursor_start(fronts, ntasks);
        int t0, t1;
        while (task_claim(&cursor, &t0, &t1))
        for (int task = t0; task < t1; task++) {
            const int n0 = task * BF16_COLS_PER_TASK;
            const int n1 = n0 + BF16_COLS_PER_TASK < N ? n0 + BF16_COLS_PER_TASK : N;
            for (int m0 = 0; m0 < M; m0 += BF16_ROW_TILE) {
                const int rows = M - m0 < BF16_ROW_TILE ? M - m0 : BF16_ROW_TILE;
                const int step = BF16_COLS_FOR(rows);
                for (int n = n0; n < n1; n += step) {
                    const int cols = n1 - n < step ? n1 - n : step;
                    float out[BF16_COLS][BF16_ROW_TILE] = {{0}};
                    const uint16_t *wrow = w + (size_t)n * K;
#define BF16_CASE(T, C) case T: bf16_tile(T, C, x, ldx, K, m0, wrow, out); break;
#define BF16_ROWS(C) switch (rows) { BF16_CASE(6, C) BF16_CASE(5, C) BF16_CASE(4, C) BF16_CASE(3, C) BF16_CASE(2, C) \
                                     default: BF16_CASE(1, C) }
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
                    switch (cols) {
                        case 4: BF16_ROWS(4) break;
                        case 3: BF16_ROWS(3) break;
                        case 2: BF16_ROWS(2) break;
                        default: BF16_ROWS(1) break;
                    }
#else
                    if (rows == 1) {
                        switch (cols) {
                            case 4: bf16_tile(1, 4, x, ldx, K, m0, wrow, out); break;
                            case 3: bf16_tile(1, 3, x, ldx, K, m0, wrow, out); break;
                            case 2: bf16_tile(1, 2, x, ldx, K, m0, wrow, out); break;
                            default: bf16_tile(1, 1, x, ldx, K, m0, wrow, out); break;
                        }
                    } else if (cols == 2) {
                        BF16_ROWS(2)
                    } else {
                        BF16_ROWS(1)
                    }
#endif
                    for (int c = 0; c < cols; c++) {
                        const float b = bias ? bias[n + c] : 0.f;
                        for (int r = 0; r < rows; r++) st(y, 1, (size_t)(m0 + r) * N + n + c, out[c][r] + b);
                    }
                }
            }
        }
    }
    return 0;
}

/* LoRA: for each listed row, y[row][c] += sum over the parts p covering column c (offset_p <= c < offset_p + n_p) of
 * sum_r bt_p[r][c - offset_p] * scale_p * t_pr, with t_pr = sum_k a_p[r][k] * x[row][k] (a_p [rank_p][K], bt_p
 * [rank_p][n_p]: B transposed; float32). Parts may overlap (several adapters on one module). x and y float32 or
 * bfloat16; an element of y gets its sum added once (one rounding); a column no part covers is not written. Every
 * t_pr and every element runs in one fixed order (K in lanes of 8 summed as hsum does, then the tail; parts, then r,
 * ascending) whichever thread takes it, so a row's bits never depend on the rows beside it. The threads split the
 * rank dot products, then 64-column blocks of the output (each element written by one thread), so one row (a decode
 * step) streams the adapters' weights on every core. */
#define LORA_COLS 64
int qd_lora_add(const void *x, int x_bf16, long ldx, void *y, int y_bf16, long ldy, const int64_t *rows, int nrows,
                int K, int nparts, const int *offsets, const int *ranks, const int *outs, const float *scales,
                const float *const *a, const float *const *bt) {
    if (nparts < 1 || nrows < 0 || K < 1) return nparts == 0 ? 0 : -1;
    int total = 0, width = 0;
    for (int p = 0; p < nparts; p++) {
        if (ranks[p] < 1 || ranks[p] > 512 || outs[p] < 1 || offsets[p] < 0 || total > (1 << 20)) return -1;
        total += ranks[p];
        if (offsets[p] + outs[p] > width) width = offsets[p] + outs[p];
    }
    float *t = malloc(sizeof(float) * (size_t)total * (nrows > 0 ? nrows : 1));
    if (!t) return -2;
    const int blocks = (width + LORA_COLS - 1) / LORA_COLS;
    const long dots = (long)nrows * total, tiles = (long)nrows * blocks;
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (long d = 0; d < dots; d++) {
            const int i = (int)(d / total);
            int p = 0, c = (int)(d % total);
            while (c >= ranks[p]) c -= ranks[p++];
            const float *ar = a[p] + (size_t)c * K;
            const size_t xr = (size_t)(rows ? rows[i] : i) * ldx;
            __m256 acc = _mm256_setzero_ps();
            int k = 0;
            for (; k + 8 <= K; k += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(ar + k), ld8(x, x_bf16, xr + k), acc);
            float s = hsum(acc);
            for (; k < K; k++) s += ar[k] * ld(x, x_bf16, xr + k);
            t[d] = s * scales[p];
        }
#pragma omp for schedule(static)
        for (long b = 0; b < tiles; b++) {
            const int i = (int)(b / blocks), c0 = (int)(b % blocks) * LORA_COLS;
            const int c1 = c0 + LORA_COLS < width ? c0 + LORA_COLS : width;
            float sum[LORA_COLS] = {0};
            unsigned char covered[LORA_COLS] = {0};
            const float *tr = t + (size_t)i * total;
            for (int p = 0; p < nparts; tr += ranks[p], p++) {
                const int lo = offsets[p] > c0 ? offsets[p] : c0;
                const int hi = offsets[p] + outs[p] < c1 ? offsets[p] + outs[p] : c1;
                const int R = ranks[p], N = outs[p];
                int c = lo;
                for (; c + 8 <= hi; c += 8) {
                    __m256 acc = _mm256_setzero_ps();
                    for (int r = 0; r < R; r++)
                        acc = _mm256_fmadd_ps(_mm256_set1_ps(tr[r]),
                                              _mm256_loadu_ps(bt[p] + (size_t)r * N + (c - offsets[p])), acc);
                    _mm256_storeu_ps(sum + (c - c0), _mm256_add_ps(_mm256_loadu_ps(sum + (c - c0)), acc));
                }
                for (; c < hi; c++) {
                    float s = 0.0f;
                    for (int r = 0; r < R; r++) s = fmaf(tr[r], bt[p][(size_t)r * N + (c - offsets[p])], s);
                    sum[c - c0] += s;
                }
                for (c = lo; c < hi; c++) covered[c - c0] = 1;
            }
            const size_t y0 = (size_t)(rows ? rows[i] : i) * ldy;
            for (int c = c0; c < c1; c++)
                if (covered[c - c0]) st(y, y_bf16, y0 + c, ld(y, y_bf16, y0 + c) + sum[c - c0]);
        }
    }
    free(t);
    return 0;
}

/* The largest of 8 floats */
static inline float hmax8(__m256 v) {
    __m128 t4 = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    t4 = _mm_max_ps(t4, _mm_movehl_ps(t4, t4));
    return _mm_cvtss_f32(_mm_max_ss(t4, _mm_movehdup_ps(t4)));
}

/* Index of the first largest value of each row of x [M][N] (float32, rows ld floats apart): what torch.argmax gives,
 * in two vector passes instead of torch's scalar one over a 150k-wide vocabulary. A row holding a NaN gets -1 (torch
 * ranks NaN first; the caller asks torch for that row). */
int qd_argmax(const float *x, int M, int N, long ld, int64_t *out) {
    if (M < 0 || N <= 0 || ld < N) return -2;
    for (int m = 0; m < M; m++) {
        const float *row = x + (size_t)m * (size_t)ld;
        __m256 top = _mm256_set1_ps(-INFINITY), unordered = _mm256_setzero_ps();
        int n = 0;
        for (; n + 8 <= N; n += 8) {
            const __m256 v = _mm256_loadu_ps(row + n);
            unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
            top = _mm256_max_ps(top, v);
        }
        float best = hmax8(top);
        int nan = _mm256_movemask_ps(unordered);
        for (int r = n; r < N; r++) {
            nan |= isnan(row[r]);
            best = row[r] > best ? row[r] : best;
        }
        if (nan) {
            out[m] = -1;
            continue;
        }
        const __m256 target = _mm256_set1_ps(best);
        int64_t found = -1;
        for (n = 0; n + 8 <= N && found < 0; n += 8) {
            const int hits = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + n), target, _CMP_EQ_OQ));
            if (hits) found = n + __builtin_ctz(hits);
        }
        for (; found < 0 && n < N; n++)
            if (row[n] == best) found = n;
        out[m] = found;
    }
    return 0;
}

/* exp(x) for x <= 0, 8 at a time (the Cephes polynomial, ~1 ulp; attention.c's, at this width) */
static inline __m256 exp_neg8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
    const __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

/* Puts value v of id into the k best so far (ids[], vals[], largest first, *n of them): after the equal values
 * already held, so among equal logits the lower id comes first (the row is read in id order). */
static inline void keep_best(int64_t *ids, float *vals, int *n, int k, int64_t id, float v) {
    int at = *n < k ? *n : k - 1;
    if (*n == k && !(v > vals[k - 1])) return;
    while (at > 0 && v > vals[at - 1]) {
        vals[at] = vals[at - 1];
        ids[at] = ids[at - 1];
        at--;
    }
    vals[at] = v;
    ids[at] = id;
    if (*n < k) (*n)++;
}

/* The logprobs of each row of x [M][N] (float32 logits, rows ld floats apart), what sampling/sampler.top_logprobs
 * returns: the chosen token's logprob and rank (1 + how many logits are larger than its own), and the k largest
 * (ids and logprobs, largest first) into top_ids/top_lp [M][k]. Why: torch takes half a dozen passes over a
 * 150k-wide row (log-softmax, a comparison, a sum, top-k), a millisecond a row, as long as the LM head's own row
 * when every prompt row is scored; here it is two, the first finding the max, the rank and the top k together,
 * the second summing the exponentials (in double). Each row is computed by one thread with fixed operations. A
 * row holding a NaN, an infinite largest logit or no finite one gets rank -1: the caller asks torch for it. */
int qd_row_logprobs(const float *x, int M, int N, long ld, const int64_t *chosen, int k, float *chosen_lp,
                    int32_t *rank, int64_t *top_ids, float *top_lp) {
    if (M < 0 || N <= 0 || ld < N || k < 0 || k > N) return -2;
    for (int m = 0; m < M; m++)
        if (chosen[m] < 0 || chosen[m] >= N) return -2;
#pragma omp parallel for schedule(static) if (M >= 4)
    for (int m = 0; m < M; m++) {
        const float *row = x + (size_t)m * (size_t)ld;
        const float mine = row[chosen[m]];
        const __m256 vmine = _mm256_set1_ps(mine);
        int64_t *ids = top_ids + (size_t)m * k;
        float *vals = top_lp + (size_t)m * k;
        int held = 0, above = 0, nan = isnan(mine);
        __m256 top = _mm256_set1_ps(-INFINITY);
        int n = 0;
        for (; n + 8 <= N; n += 8) {
            const __m256 v = _mm256_loadu_ps(row + n);
            nan |= _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
            above += __builtin_popcount(_mm256_movemask_ps(_mm256_cmp_ps(v, vmine, _CMP_GT_OQ)));
            top = _mm256_max_ps(top, v);
            if (k == 0) continue;
            const float floor_ = held < k ? -INFINITY : vals[k - 1];
            int better = _mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_set1_ps(floor_), _CMP_GT_OQ));
            if (held < k) better = 0xFF; /* until k are held, every value is a candidate */
            while (better) {
                const int lane = __builtin_ctz(better);
                better &= better - 1;
                keep_best(ids, vals, &held, k, n + lane, row[n + lane]);
            }
        }
        float best = hmax8(top);
        for (; n < N; n++) {
            nan |= isnan(row[n]);
            above += row[n] > mine;
            best = row[n] > best ? row[n] : best;
            if (k) keep_best(ids, vals, &held, k, n, row[n]);
        }
        if (nan || isinf(best)) {
            rank[m] = -1;
            continue;
        }
        const __m256 vbest = _mm256_set1_ps(best);
        __m256d sum_lo = _mm256_setzero_pd(), sum_hi = _mm256_setzero_pd();
        for (n = 0; n + 8 <= N; n += 8) {
            const __m256 e = exp_neg8(_mm256_sub_ps(_mm256_loadu_ps(row + n), vbest));
            sum_lo = _mm256_add_pd(sum_lo, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
            sum_hi = _mm256_add_pd(sum_hi, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
        }
        double total = 0.0;
        double lanes[4];
        _mm256_storeu_pd(lanes, _mm256_add_pd(sum_lo, sum_hi));
        for (int i = 0; i < 4; i++) total += lanes[i];
        for (; n < N; n++) total += (double)expf(row[n] - best);
        /* (x - max) - log(sum), as torch's log-softmax: max + log(sum) first would round the small log of a
         * confident row away, every logprob there biased toward 0 */
        const float log_total = (float)log(total);
        chosen_lp[m] = (mine - best) - log_total;
        rank[m] = 1 + above;
        for (int i = 0; i < k; i++) vals[i] = (vals[i] - best) - log_total;
    }
    return 0;
}

/* DRY's repeats (sampling/dry.py): for each position j < n - 1 of tokens[n], the length of the longest run of tokens
 * ending at j that equals the run ending at n - 1 (at most limit), into out[j]. The Z-algorithm over the reversed
 * sequence: each token is compared a bounded number of times, so a context of one repeated token costs n steps, not
 * n^2 / 2. */
int qd_dry_repeats(const int64_t *tokens, int n, int limit, int32_t *out) {
    if (n < 0 || limit < 0) return -2;
    const int last = n - 1;
    int left = 0, right = 0; /* the Z-box: reversed positions left .. right match reversed positions 0 .. */
    for (int k = 1; k < n; k++) { /* k: distance from the end of the run ending at j = last - k */
        int length;
        if (k > right) {
            length = 0;
            while (k + length < n && tokens[last - length] == tokens[last - k - length]) length++;
            if (length > 0) left = k, right = k + length - 1;
        } else if (out[last - (k - left)] < right - k + 1) {
            length = out[last - (k - left)]; /* the mirrored position's run ends inside the box */
        } else {
            int i = right + 1;
            while (i < n && tokens[last - i] == tokens[last - (i - k)]) i++;
            length = i - k;
            left = k, right = i - 1;
        }
        out[last - k] = length;
    }
    for (int j = 0; j < last; j++) out[j] = out[j] < limit ? out[j] : limit; /* capped after: the box reads them */
    return 0;
}

/* Lets go of the calling thread's OpenMP worker threads; they are made again by its next parallel region. A model
 * loaded by one thread and run by another (the server's engine thread) otherwise keeps the loader's workers beside
 * its own, and on a machine with as many threads as cores they slowed every step (docs/MEASUREMENTS.md). Weak: an
 * OpenMP runtime older than 5.0 has no such call, and then nothing is let go. Returns 0, or -2 where unsupported. */
extern int omp_pause_resource_all(int kind) __attribute__((weak));
int qd_release_threads(void) {
    return omp_pause_resource_all ? omp_pause_resource_all(1 /* omp_pause_soft */) : -2;
}
