/* The weight formats qmatmul.c reads: how one block of 256 input columns (8 groups of 32) of one output row is
 * stored, and how it becomes unsigned byte values and per-group float scales for the int8 dot products.
 *
 * Every format is written as w[n, k] = scale[g] * v[n, k] + shift[g] per group g of 32 columns (Q6_K: per 16), v
 * an unsigned byte; x is quantized per group to int8 with scale xs[g], so a group adds
 *     scale * xs * sum_k v x8  +  shift * xsum        (xsum = xs * sum_k x8).
 * scale and shift are exact products of the file's numbers (an fp16 times a small integer), so the only rounding
 * besides float sums is the activations' int8 quantization, as for the int4/int8 formats.
 *
 * Element order inside a block (the same as the quantized x rows, see qmatmul.c): element 32 j + 4 t + i (group j,
 * chunk t, i = 0..3) is "stored byte" s = 32 CHUNK_AT[t] + 4 j + i. Building blocks of a block's layout:
 *   nib    128 bytes, 4-bit values: the low nibbles of bytes 32 s .. 32 s + 31 are chunk 2 s, the high ones chunk
 *          2 s + 1 (a 64-byte load holds stored bytes 64 u .. 64 u + 63 for u = 2 h and 2 h + 1 in its low and high
 *          nibbles);
 *   bits1  32 bytes, one bit per stored byte s = 32 p + k: bit p of byte k (stored position p is one shift of the
 *          plane away on AVX2; AVX-512 tests the plane against bit p in each half of a 64-byte register);
 *   bits2  64 bytes, two bits per stored byte s = 64 u + k: bits 2 u, 2 u + 1 of byte k;
 *   byte   256 bytes in stored order.
 * Formats (q: the file's value; d, m, dmin: fp16; sc, mn: small integers):
 *   INT4   nib; bfloat16 scales/zeros in their own array (quickdraft's int4, K padded to 256)   v = q, shift = zero - 8 scale
 *   INT8   byte (q + 128); bfloat16 scales/zeros in their own array (quickdraft's int8)
 *   Q4_0   nib, d[8]                                   d (q - 8)          144 bytes (GGML: 144)
 *   Q4_1   nib, d[8], m[8]                             d q + m            160 (160)
 *   Q5_0   nib, bits1 (value 16), d[8]                 d (q - 16)         176 (176)
 *   Q5_1   nib, bits1, d[8], m[8]                      d q + m            192 (192)
 *   Q8_0   byte (q + 128), d[8]                        d q                272 (272)
 *   Q4_K   nib, d, dmin, sc[8] u8, mn[8] u8            d sc q - dmin mn   148 (144: the 6-bit sc/mn as bytes)
 *   Q5_K   nib, bits1, d, dmin, sc[8], mn[8]                              180 (176)
 *   Q6_K   nib, bits2 (values 16, 32), sc[16] s8 (8 first halves, then 8 second halves), d   d sc (q - 32), per 16
 *                                                                         210 (210)
 *   IQ4_NL nib (index into KVALUES), d[8]              d KVALUES[q]       144 (144)
 *   IQ4_XS nib, d, sc[8] s8 (the file's 6-bit scale - 32)   d sc KVALUES[q]   138 (136)
 *   Q1_0   bits1 (value 1), d[2] (one per 128)        q ? d : -d         36 (36)
 *   Q2_0   bits2 (values 0..3), d[4] (one per 64)     d (q - 1)          72 (72)
 *   MXFP4  nib (index into MXFP4_VALUES), e[8] u8     2^(e-128) MXFP4_VALUES[q]   136 (136; gpt-oss's experts:
 *          e2m1 values doubled, the e8m0 exponent as ggml's e8m0_to_fp32_half reads it)
 *   Q2_K   bits2 (values 0..3), per 16: sc | mn << 4 [16] (8 first halves, then 8 second halves), d, dmin
 *                                                      d sc q - dmin mn, per 16   84 (84)
 *   Q3_K   bits2 (low 2 bits), bits1 (value 4), per 16 6-bit scales as low nibbles [8] (first half i low, second
 *          half i high) and a 32-bit word of top bits (2 i: first half i, 16 + 2 i: second half i), d
 *                                                      d (sc - 32) (q - 4), per 16   110 (110)
 * The lattice formats (IQ2_*, IQ3_*): each entry of 8 weights (IQ3: 4) is a grid entry (iq_grids.py) named by an
 * index, with a sign bit per weight; v = OFF + sign * grid value (OFF: the grid's largest value), shift -OFF scale.
 * Entry k of a block: for 8-weight entries k = 8 e + j (entry e of group j), for 4-weight ones k = 8 p + j (the
 * chunk at stored position p of group j); sign bytes, one per 8 weights, always in the first order (bits 0..3 sign
 * chunk 2 e, bits 4..7 chunk 2 e + 1).
 *   IQ2_XXS idx[32], sgn[32] (7 sign bits, the eighth makes their count even; bit 7 of entry e's byte: bit e of its
 *          group's 4-bit scale sc), d                   d (sc + 1/2) / 4 sign grid              66 (66)
 *   IQ2_XS  16 bits an entry: 9-bit idx | 7 sign bits << 9 [32], per 16 sc [8] (low nibble: first 16), d
 *                                                      d (sc + 1/2) / 4 sign grid, per 16      74 (74)
 *   IQ2_S   idx low bytes [32], sgn[32] (8 bits), a 64-bit word of the idx's 2 high bits (2 k: entry k), sc [8]
 *          per 16 as IQ2_XS, d                         d (sc + 1/2) / 4 sign grid, per 16      82 (82)
 *   IQ3_XXS idx[64] (4-weight entries), sgn[32] as IQ2_XXS's, d   d (sc + 1/2) / 2 sign grid    98 (98)
 *   IQ3_S   idx low bytes [64], a 64-bit word of their 9th bits (bit k: entry k), sgn[32] (8 bits), sc [4] (group j
 *          in nibble j % 2 of byte j / 2), d                d (2 sc + 1) sign grid            110 (110)
 *   IQ1_S   idx low bytes [32], per group 16 bits: entry e's 3 high idx bits at 3 e, a 3-bit sc at 12, the shift's
 *          sign at 15; d                               d (2 sc + 1) (grid -+ 1/8)           50 (50)
 *   IQ1_M   idx low bytes [32], a nibble an entry (3 high idx bits, the shift's sign; entry 16 v + i in byte 8 v + i
 *          % 8, the low nibble for i < 8), 4 16-bit words of 3-bit sc per 16 (sc 4 i + m at bits 3 m of word i) whose
 *          top nibbles are d's (word i: bits 4 i ..)      d (2 sc + 1) (grid -+ 1/8), per 16   56 (56)
 * IQ1's v = 8 grid + 9 -+ 1 (0 .. 18) with scale d (2 sc + 1) / 8: the same products, exactly.
 *   TQ2_0   bits2 (values 0..3), d (one per 256)        d (q - 1)          66 (66)
 *   TQ1_0   base-3 bytes of 5 values 0..2 (ggml's encoding: byte = ceil(256 sum_n q_n 3^(4 - n) / 243), digit n
 *          = ((3^n byte mod 256) 3) >> 8), d                d (q - 1)          54 (54)
 *          The 52 bytes are 4 lanes of 13 (bytes 13 L ..), lane L of a 512-bit register u (stored bytes 64 u + 16 L
 *          + i): for i < 13 digit u of byte 13 L + i, for i = 13, 14, 15 digit 4 of byte 13 L + 3 u + i - 13 (byte
 *          13 L + 12 holds 4 values; each lane is a 128-bit lane of the registers, so no value crosses one).
 * A row of K columns is K / 256 blocks, then the columns past the last whole block (K % 256) as tail records in
 * element order, each as the file stores it but for the value order below: Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 /
 * IQ4_NL one group (nibbles: element i in the low nibble of byte i, element i + 16 in its high one; Q5 high bits:
 * bit i of 4 bytes; Q8_0: q + 128; MXFP4: nibbles as IQ4_NL's, then e), Q1_0 four groups (bit i of 16 bytes), Q2_0 two groups (group h: 8 bytes,
 * element 8 q + k in bits 2 q of byte k), followed by d (and m). So every row has the file's bytes, or within 3 %.
 * The K-quants and IQ4_XS need K % 256 == 0 (as in GGML); INT4 and INT8 pad K to a multiple of 256.
 */
#ifndef QUICKDRAFT_QFORMATS_H
#define QUICKDRAFT_QFORMATS_H
#include <immintrin.h>
#include <stdint.h>
#include <stddef.h>

#include "floats.h"
#include "iq_grids.h" /* written into the build directory by native_build.py (iq_grids.py: c_header) */

enum {
    QF_INT4 = 4, QF_INT8 = 8,
    QF_Q4_0 = 20, QF_Q4_1, QF_Q5_0, QF_Q5_1, QF_Q8_0, QF_Q4_K, QF_Q5_K, QF_Q6_K, QF_IQ4_NL, QF_IQ4_XS, QF_Q1_0,
    QF_Q2_0, QF_MXFP4, QF_Q2_K, QF_Q3_K, QF_IQ2_XXS, QF_IQ2_XS, QF_IQ2_S, QF_IQ3_XXS, QF_IQ3_S, QF_IQ1_S,
    QF_IQ1_M, QF_TQ2_0, QF_TQ1_0,
};

#define QF_BLOCK 256

/* IQ4_NL / IQ4_XS values, plus 128 (so they are unsigned bytes; the shift subtracts 128 scale), and their low and
 * high nibbles (what the AVX2 dot products without VNNI multiply) */
static const uint8_t IQ4_VALUES_U8[16] = {1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241};
static const uint8_t IQ4_LOW_NIBBLES[16] = {1, 8, 13, 15, 15, 13, 10, 6, 1, 13, 9, 6, 5, 5, 9, 1};
static const uint8_t IQ4_HIGH_NIBBLES[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 8, 9, 10, 11, 12, 13, 15};
/* MXFP4's e2m1 values, doubled (0, 1, 2, 3, 4, 6, 8, 12, then their negatives), plus 128, and their nibbles */
static const uint8_t MXFP4_VALUES_U8[16] = {128, 129, 130, 131, 132, 134, 136, 140, 128, 127, 126, 125, 124, 122, 120,
                                            116};
static const uint8_t MXFP4_LOW_NIBBLES[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, 15, 14, 13, 12, 10, 8, 4};
static const uint8_t MXFP4_HIGH_NIBBLES[16] = {8, 8, 8, 8, 8, 8, 8, 8, 8, 7, 7, 7, 7, 7, 7, 7};

/* the value table of a lookup format (IQ4_NL, IQ4_XS, MXFP4), and its values' low and high nibbles */
static inline const uint8_t *qf_values(int F) { return F == QF_MXFP4 ? MXFP4_VALUES_U8 : IQ4_VALUES_U8; }
static inline const uint8_t *qf_low_nibbles(int F) { return F == QF_MXFP4 ? MXFP4_LOW_NIBBLES : IQ4_LOW_NIBBLES; }
static inline const uint8_t *qf_high_nibbles(int F) { return F == QF_MXFP4 ? MXFP4_HIGH_NIBBLES : IQ4_HIGH_NIBBLES; }

static inline int qf_known(int f) { return f == QF_INT4 || f == QF_INT8 || (f >= QF_Q4_0 && f <= QF_TQ1_0); }
static inline int qf_padded(int f) { return f == QF_INT4 || f == QF_INT8; }
static inline int qf_grid(int F) { return F >= QF_IQ2_XXS && F <= QF_IQ1_M; }
/* IQ1: grid values -1, 0, 1 (the table holds 8 (v + 1)) and a shift of 1/8 either way an entry, no sign bits */
static inline int qf_iq1(int F) { return F == QF_IQ1_S || F == QF_IQ1_M; }
/* a lattice format's grid entries hold 4 weights (IQ3) or 8 (IQ2) */
static inline int qf_grid4(int F) { return F == QF_IQ3_XXS || F == QF_IQ3_S; }
/* the largest grid value: v = OFF + sign * value is 0 .. 2 OFF */
static inline int qf_grid_offset(int F) {
    return F == QF_IQ3_S ? 15 : F == QF_IQ3_XXS ? 62 : qf_iq1(F) ? 9 : 43; /* IQ1: v = 8 value + 9 -+ 1 */
}
/* the 7 sign bits of the XXS formats' entries, the eighth derived, and their scales in the sign bytes' bit 7 */
static inline int qf_seven_signs(int F) { return F == QF_IQ2_XXS || F == QF_IQ3_XXS || F == QF_IQ2_XS; }
static inline const uint32_t *qf_grid_table(int F) {
    switch (F) {
    case QF_IQ2_XXS: return QF_GRID_IQ2_XXS;
    case QF_IQ2_XS: return QF_GRID_IQ2_XS;
    case QF_IQ2_S: return QF_GRID_IQ2_S;
    case QF_IQ3_XXS: return QF_GRID_IQ3_XXS;
    case QF_IQ3_S: return QF_GRID_IQ3_S;
    default: return QF_GRID_IQ1_S; /* IQ1_S and IQ1_M */
    }
}
static inline int qf_lookup(int F) { return F == QF_IQ4_NL || F == QF_IQ4_XS || F == QF_MXFP4; }
static inline int qf_bytes(int F) { return F == QF_INT8 || F == QF_Q8_0; }

static inline int qf_block_bytes(int f) {
    switch (f) {
    case QF_INT4: return 128;
    case QF_INT8: return 256;
    case QF_Q4_0: case QF_IQ4_NL: return 144;
    case QF_MXFP4: return 136;
    case QF_Q4_1: return 160;
    case QF_Q5_0: return 176;
    case QF_Q5_1: return 192;
    case QF_Q8_0: return 272;
    case QF_Q4_K: return 148;
    case QF_Q5_K: return 180;
    case QF_Q6_K: return 210;
    case QF_IQ4_XS: return 138;
    case QF_Q1_0: return 36;
    case QF_Q2_0: return 72;
    case QF_Q2_K: return 84;
    case QF_Q3_K: case QF_IQ3_S: return 110;
    case QF_IQ2_XXS: case QF_TQ2_0: return 66;
    case QF_IQ2_XS: return 74;
    case QF_IQ2_S: return 82;
    case QF_IQ3_XXS: return 98;
    case QF_IQ1_S: return 50;
    case QF_IQ1_M: return 56;
    case QF_TQ1_0: return 54;
    default: return 0;
    }
}

/* Columns of one tail record (0: the format takes no tail) and its bytes. */
static inline int qf_tail_cols(int f) {
    switch (f) {
    case QF_Q4_0: case QF_Q4_1: case QF_Q5_0: case QF_Q5_1: case QF_Q8_0: case QF_IQ4_NL: case QF_MXFP4: return 32;
    case QF_Q1_0: return 128;
    case QF_Q2_0: return 64;
    default: return 0;
    }
}

static inline int qf_tail_bytes(int f) {
    switch (f) {
    case QF_Q4_0: case QF_IQ4_NL: case QF_Q1_0: case QF_Q2_0: return 18;
    case QF_MXFP4: return 17;
    case QF_Q4_1: return 20;
    case QF_Q5_0: return 22;
    case QF_Q5_1: return 24;
    case QF_Q8_0: return 34;
    default: return 0;
    }
}

/* Bytes of one row of K columns (Kpad: K rounded up to 256), or 0 when the format cannot take K. */
static inline size_t qf_row_bytes(int f, int K, int Kpad) {
    if (f == QF_INT4) return (size_t)Kpad / 2;
    if (f == QF_INT8) return (size_t)Kpad;
    const int rest = K % QF_BLOCK, unit = qf_tail_cols(f);
    if (rest && (!unit || rest % unit)) return 0;
    return (size_t)(K / QF_BLOCK) * qf_block_bytes(f) + (rest ? (size_t)(rest / unit) * qf_tail_bytes(f) : 0);
}

/* ---- per-group scales and shifts of a block ---------------------------------------------------------------- */

static inline uint32_t ld32(const uint8_t *p) {
    uint32_t v;
    __builtin_memcpy(&v, p, 4);
    return v;
}

typedef struct {
    __m256 scale, shift;       /* per group; Q6_K: of each group's first 16 columns */
    __m256 scale_hi, shift_hi; /* Q6_K: of each group's last 16 columns */
} block_scales;

static inline __m256 f16x8(const uint8_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
static inline __m256 f16_bcast(const uint8_t *p) {
    uint16_t h;
    __builtin_memcpy(&h, p, 2);
    return _mm256_cvtph_ps(_mm_set1_epi16((short)h));
}
static inline __m256 u8x8(const uint8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
static inline __m256 s8x8(const uint8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* sz: INT4/INT8's own bfloat16 scales (8) and zeros (8) of this block; unused by the others */
static inline __attribute__((always_inline)) block_scales qf_scales(int F, const uint8_t *blk, const uint16_t *sz) {
    block_scales s;
    const __m256 neg8 = _mm256_set1_ps(-8.f), neg16 = _mm256_set1_ps(-16.f), neg32 = _mm256_set1_ps(-32.f),
                 neg128 = _mm256_set1_ps(-128.f);
    s.scale_hi = s.shift_hi = _mm256_setzero_ps();
    switch (F) {
    case QF_INT4: case QF_INT8:
        s.scale = bf16x8(sz);
        s.shift = _mm256_fnmadd_ps(_mm256_set1_ps(F == QF_INT4 ? 8.f : 128.f), s.scale, bf16x8(sz + 8));
        break;
    case QF_MXFP4: { /* 2^(e - 128) from the exponent bytes, as ggml's e8m0_to_fp32_half (a subnormal for e < 2) */
        const __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(blk + 128)));
        const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
        const __m256i tiny = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
        s.scale = _mm256_castsi256_ps(_mm256_blendv_epi8(normal, tiny, _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e)));
        s.shift = _mm256_mul_ps(neg128, s.scale);
        break;
    }
    case QF_Q4_0: case QF_IQ4_NL:
        s.scale = f16x8(blk + 128);
        s.shift = _mm256_mul_ps(F == QF_Q4_0 ? neg8 : neg128, s.scale);
        break;
    case QF_Q4_1: s.scale = f16x8(blk + 128), s.shift = f16x8(blk + 144); break;
    case QF_Q5_0: s.scale = f16x8(blk + 160), s.shift = _mm256_mul_ps(neg16, s.scale); break;
    case QF_Q5_1: s.scale = f16x8(blk + 160), s.shift = f16x8(blk + 176); break;
    case QF_Q8_0: s.scale = f16x8(blk + 256), s.shift = _mm256_mul_ps(neg128, s.scale); break;
    case QF_Q4_K: case QF_Q5_K: { /* d and dmin in one load; the mins' term is subtracted: shift = -dmin mn */
        const uint8_t *p = blk + (F == QF_Q4_K ? 128 : 160);
        int32_t both;
        __builtin_memcpy(&both, p, 4);
        const __m128 d_dmin = _mm_cvtph_ps(_mm_cvtsi32_si128(both));
        const __m128 neg = _mm_xor_ps(d_dmin, _mm_set_ps(0.f, 0.f, -0.f, 0.f));
        s.scale = _mm256_mul_ps(_mm256_broadcastss_ps(neg), u8x8(p + 4));
        s.shift = _mm256_mul_ps(_mm256_permutevar8x32_ps(_mm256_castps128_ps256(neg), _mm256_set1_epi32(1)), u8x8(p + 12));
        break;
    }
    case QF_Q6_K: {
        const __m256 d = f16_bcast(blk + 208);
        s.scale = _mm256_mul_ps(d, s8x8(blk + 192));
        s.scale_hi = _mm256_mul_ps(d, s8x8(blk + 200));
        s.shift = _mm256_mul_ps(neg32, s.scale);
        s.shift_hi = _mm256_mul_ps(neg32, s.scale_hi);
        break;
    }
    case QF_Q2_K: { /* the scale in each byte's low nibble, the min in its high one */
        int32_t both;
        __builtin_memcpy(&both, blk + 80, 4);
        const __m128 d_dmin = _mm_cvtph_ps(_mm_cvtsi32_si128(both));
        const __m256 d = _mm256_broadcastss_ps(d_dmin), neg_dmin = _mm256_broadcastss_ps(_mm_sub_ss(_mm_setzero_ps(),
                                                                                        _mm_movehdup_ps(d_dmin)));
        const __m256i low4 = _mm256_set1_epi32(0x0F);
        for (int h = 0; h < 2; h++) {
            const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(blk + 64 + 8 * h)));
            const __m256 scale = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(b, low4)));
            const __m256 shift = _mm256_mul_ps(neg_dmin, _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4)));
            if (h) s.scale_hi = scale, s.shift_hi = shift;
            else s.scale = scale, s.shift = shift;
        }
        break;
    }
    case QF_Q3_K: { /* sc = low nibble | top 2 bits << 4, weight scale d (sc - 32), shift -4 scale */
        const __m256 d = f16_bcast(blk + 108), neg4 = _mm256_set1_ps(-4.f);
        const __m256i nib = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(blk + 96)));
        int32_t top_bits;
        __builtin_memcpy(&top_bits, blk + 104, 4);
        const __m256i top = _mm256_set1_epi32(top_bits), three = _mm256_set1_epi32(3),
                      low4 = _mm256_set1_epi32(0x0F), at = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14);
        const __m256i lo = _mm256_or_si256(_mm256_and_si256(nib, low4),
                                           _mm256_slli_epi32(_mm256_and_si256(_mm256_srlv_epi32(top, at), three), 4));
        const __m256i hi = _mm256_or_si256(_mm256_srli_epi32(nib, 4),
                                           _mm256_slli_epi32(_mm256_and_si256(_mm256_srlv_epi32(
                                               top, _mm256_add_epi32(at, _mm256_set1_epi32(16))), three), 4));
        s.scale = _mm256_mul_ps(d, _mm256_add_ps(_mm256_cvtepi32_ps(lo), neg32));
        s.scale_hi = _mm256_mul_ps(d, _mm256_add_ps(_mm256_cvtepi32_ps(hi), neg32));
        s.shift = _mm256_mul_ps(neg4, s.scale);
        s.shift_hi = _mm256_mul_ps(neg4, s.scale_hi);
        break;
    }
    case QF_IQ2_XXS: case QF_IQ3_XXS: { /* sc: bit 7 of the sign bytes of the group's 4 entries (8 e + j) */
        const uint8_t *sgn = blk + (F == QF_IQ2_XXS ? 32 : 64);
        const uint32_t top = (uint32_t)_mm256_movemask_epi8(_mm256_loadu_si256((const __m256i *)sgn));
        const __m256i bits = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)top),
                                                                _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)),
                                              _mm256_set1_epi32(0x01010101));
        /* bytes b0..b3 -> b0 + 2 b1 + 4 b2 + 8 b3 in the top byte */
        const __m256i sc = _mm256_srli_epi32(_mm256_mullo_epi32(bits, _mm256_set1_epi32(0x01020408)), 24);
        const __m256 d = _mm256_mul_ps(f16_bcast(sgn + 32), _mm256_set1_ps(F == QF_IQ2_XXS ? 0.25f : 0.5f));
        s.scale = _mm256_mul_ps(d, _mm256_add_ps(_mm256_cvtepi32_ps(sc), _mm256_set1_ps(0.5f)));
        s.shift = _mm256_mul_ps(_mm256_set1_ps((float)-qf_grid_offset(F)), s.scale);
        break;
    }
    case QF_IQ2_XS: case QF_IQ2_S: { /* per 16: the low nibble of byte j for group j's first 16, the high one */
        const uint8_t *sc = blk + (F == QF_IQ2_XS ? 64 : 72);
        const __m256 d = _mm256_mul_ps(f16_bcast(sc + 8), _mm256_set1_ps(0.25f)), half = _mm256_set1_ps(0.5f),
                     neg = _mm256_set1_ps((float)-qf_grid_offset(F));
        const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)sc));
        s.scale = _mm256_mul_ps(d, _mm256_add_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(0x0F))), half));
        s.scale_hi = _mm256_mul_ps(d, _mm256_add_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4)), half));
        s.shift = _mm256_mul_ps(neg, s.scale);
        s.shift_hi = _mm256_mul_ps(neg, s.scale_hi);
        break;
    }
    case QF_IQ1_S: { /* sc at bits 12..14 of group j's word; d (2 sc + 1) / 8 */
        const __m256i words = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(blk + 32)));
        const __m256i sc = _mm256_and_si256(_mm256_srli_epi32(words, 12), _mm256_set1_epi32(7));
        const __m256i odd = _mm256_add_epi32(_mm256_add_epi32(sc, sc), _mm256_set1_epi32(1));
        s.scale = _mm256_mul_ps(_mm256_mul_ps(f16_bcast(blk + 48), _mm256_set1_ps(0.125f)), _mm256_cvtepi32_ps(odd));
        s.shift = _mm256_mul_ps(_mm256_set1_ps(-9.f), s.scale);
        break;
    }
    case QF_IQ1_M: { /* group j's scales per 16: sc 2 j and 2 j + 1, in word j / 2; d from the words' top nibbles */
        uint16_t wd[4];
        __builtin_memcpy(wd, blk + 48, 8);
        const uint16_t d_bits = (uint16_t)((wd[0] >> 12) | ((wd[1] >> 12) << 4) | ((wd[2] >> 12) << 8) |
                                           ((wd[3] >> 12) << 12));
        const __m256 d = _mm256_set1_ps(_cvtsh_ss(d_bits) * 0.125f), neg = _mm256_set1_ps(-9.f);
        const __m256i words = _mm256_permutevar8x32_epi32(
            _mm256_castsi128_si256(_mm_cvtepu16_epi32(_mm_loadl_epi64((const __m128i *)(blk + 48)))),
            _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3));
        const __m256i at = _mm256_setr_epi32(0, 6, 0, 6, 0, 6, 0, 6), seven = _mm256_set1_epi32(7),
                      one = _mm256_set1_epi32(1);
        const __m256i lo = _mm256_and_si256(_mm256_srlv_epi32(words, at), seven);
        const __m256i hi = _mm256_and_si256(_mm256_srlv_epi32(words, _mm256_add_epi32(at, _mm256_set1_epi32(3))), seven);
        s.scale = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_add_epi32(lo, lo), one)));
        s.scale_hi = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_add_epi32(hi, hi), one)));
        s.shift = _mm256_mul_ps(neg, s.scale);
        s.shift_hi = _mm256_mul_ps(neg, s.scale_hi);
        break;
    }
    case QF_IQ3_S: { /* group j's sc in nibble j % 2 of byte j / 2; d (2 sc + 1) */
        const __m256i sc = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)ld32(blk + 104)),
                                                              _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)),
                                            _mm256_set1_epi32(0x0F));
        const __m256i odd = _mm256_add_epi32(_mm256_add_epi32(sc, sc), _mm256_set1_epi32(1));
        s.scale = _mm256_mul_ps(f16_bcast(blk + 108), _mm256_cvtepi32_ps(odd));
        s.shift = _mm256_mul_ps(_mm256_set1_ps(-15.f), s.scale);
        break;
    }
    case QF_TQ2_0: case QF_TQ1_0:
        s.scale = f16_bcast(blk + (F == QF_TQ2_0 ? 64 : 52)), s.shift = _mm256_sub_ps(_mm256_setzero_ps(), s.scale);
        break;
    case QF_IQ4_XS:
        s.scale = _mm256_mul_ps(f16_bcast(blk + 128), s8x8(blk + 130));
        s.shift = _mm256_mul_ps(neg128, s.scale);
        break;
    case QF_Q1_0: { /* d0 for groups 0..3, d1 for 4..7: bits b give 2 d b - d */
        int32_t two;
        __builtin_memcpy(&two, blk + 32, 4);
        __m128i h = _mm_cvtsi32_si128(two);
        h = _mm_unpacklo_epi16(h, h);
        const __m256 d = _mm256_cvtph_ps(_mm_unpacklo_epi32(h, h));
        s.scale = _mm256_add_ps(d, d);
        s.shift = _mm256_sub_ps(_mm256_setzero_ps(), d);
        break;
    }
    default: { /* QF_Q2_0: one d per two groups, d (q - 1) */
        const __m128i h = _mm_loadl_epi64((const __m128i *)(blk + 64));
        s.scale = _mm256_cvtph_ps(_mm_unpacklo_epi16(h, h));
        s.shift = _mm256_sub_ps(_mm256_setzero_ps(), s.scale);
        break;
    }
    }
    return s;
}

static inline int qf_has_nibbles(int F) {
    return F == QF_INT4 || F == QF_Q4_0 || F == QF_Q4_1 || F == QF_Q5_0 || F == QF_Q5_1 || F == QF_Q4_K ||
           F == QF_Q5_K || F == QF_Q6_K || F == QF_IQ4_NL || F == QF_IQ4_XS || F == QF_MXFP4;
}
static inline int qf_fifth_bit(int F) { return F == QF_Q5_0 || F == QF_Q5_1 || F == QF_Q5_K; }
/* a bits2 plane at the block's start holds the value (Q3_K: its low two bits) */
static inline int qf_two_bits(int F) { return F == QF_Q2_0 || F == QF_Q2_K || F == QF_Q3_K || F == QF_TQ2_0; }
/* scales per 16 columns: a group's first 16 (stored positions 0..3) and last 16 (4..7) apart */
/* a bits1 plane whose set bits add a value to the one decoded before: Q5's fifth bit (16, after the nibbles, the
 * plane at byte 128) and Q3_K's third (4, after the bits2 plane, at byte 64); 0 for the other formats */
static inline int qf_extra_bit(int F) { return qf_fifth_bit(F) ? 16 : F == QF_Q3_K ? 4 : 0; }
static inline int qf_extra_bit_at(int F) { return F == QF_Q3_K ? 64 : 128; }
static inline int qf_per16(int F) {
    return F == QF_Q6_K || F == QF_Q2_K || F == QF_Q3_K || F == QF_IQ2_XS || F == QF_IQ2_S || F == QF_IQ1_M;
}
/* the largest value v takes: 15, 31, 63, 127 or 255 (what the AVX2 dot products must not saturate on) */
static inline int qf_max_value(int F) {
    if (qf_bytes(F) || qf_lookup(F)) return 255;
    if (qf_grid(F)) return 2 * qf_grid_offset(F) <= 31 ? 31 : 127;
    if (F == QF_Q6_K) return 63;
    if (qf_fifth_bit(F)) return 31;
    return 15;
}

/* byte b of the result: 0xFF where bit b of the 32-bit word is set */
static inline __m256i bits_to_bytes(uint32_t word) {
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                            2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    const __m256i b = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)word), spread), bit);
    return _mm256_cmpeq_epi8(b, bit);
}

static const int QF_CHUNK_AT[8] = {0, 2, 1, 3, 4, 6, 5, 7}; /* stored position of chunk t (its own inverse) */

/* ---- the lattice formats' entries: grid indices, sign bytes --------------------------------------------------- */

static inline uint64_t ld64(const uint8_t *p) {
    uint64_t v;
    __builtin_memcpy(&v, p, 8);
    return v;
}
/* where a lattice format's sign bytes start (IQ2_XS keeps its sign bits in its 16-bit entries) */
static inline int qf_signs_at(int F) { return F == QF_IQ3_XXS ? 64 : F == QF_IQ3_S ? 72 : 32; }

/* A block's 32 sign bytes, entry k = 8 e + j at byte k, each with its eighth bit: the XXS formats store seven, the
 * eighth set where they hold an odd count (ggml's ksigns), found by a lookup of each nibble's parity. */
static inline __m256i grid_sign_bytes(int F, const uint8_t *blk) {
    __m256i s;
    if (F == QF_IQ2_XS) { /* the top 7 bits of its 16-bit entries */
        const __m256i a = _mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)blk), 9);
        const __m256i b = _mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)(blk + 32)), 9);
        s = _mm256_permute4x64_epi64(_mm256_packus_epi16(a, b), 0xD8);
    } else {
        s = _mm256_loadu_si256((const __m256i *)(blk + qf_signs_at(F)));
    }
    if (qf_seven_signs(F)) {
        const __m256i odd = _mm256_broadcastsi128_si256(_mm_setr_epi8(0, -128, -128, 0, -128, 0, 0, -128, -128, 0, 0,
                                                                      -128, 0, -128, -128, 0));
        const __m256i low = _mm256_set1_epi8(0x0F);
        s = _mm256_and_si256(s, _mm256_set1_epi8(0x7F));
        const __m256i parity = _mm256_xor_si256(_mm256_shuffle_epi8(odd, _mm256_and_si256(s, low)),
                                                _mm256_shuffle_epi8(odd, _mm256_and_si256(_mm256_srli_epi16(s, 4), low)));
        s = _mm256_or_si256(s, parity);
    }
    return s;
}

/* IQ1's nibble of entries 8 e .. 8 e + 7, one a 32-bit lane: 3 high index bits, the shift's sign at bit 3. */
static inline __m256i iq1_nibbles8(int F, const uint8_t *blk, int e) {
    if (F == QF_IQ1_S) { /* in group j's word: bits 3 e .., the sign at 15 */
        const __m256i words = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(blk + 32)));
        const __m256i high = _mm256_and_si256(_mm256_srlv_epi32(words, _mm256_set1_epi32(3 * e)), _mm256_set1_epi32(7));
        return _mm256_or_si256(high, _mm256_slli_epi32(_mm256_srli_epi32(words, 15), 3));
    }
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(blk + 32 + 8 * (e >> 1))));
    return _mm256_and_si256(_mm256_srlv_epi32(b, _mm256_set1_epi32(4 * (e & 1))), _mm256_set1_epi32(0x0F));
}

/* The grid indices of entries k .. k + 7, one a 32-bit lane. */
static inline __m256i grid_index8(int F, const uint8_t *blk, int k) {
    if (F == QF_IQ2_XS)
        return _mm256_and_si256(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(blk + 2 * k))),
                                _mm256_set1_epi32(511));
    const __m256i low = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(blk + k)));
    if (F == QF_IQ2_S || F == QF_IQ3_S) { /* 2 high bits an entry (at 2 k), or 1 (at k), in a 64-bit word */
        const int bits = F == QF_IQ2_S ? 2 : 1;
        const __m256i at = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(bits));
        const __m256i word = _mm256_set1_epi32((int)(uint32_t)(ld64(blk + 64) >> (bits * k)));
        const __m256i high = _mm256_and_si256(_mm256_srlv_epi32(word, at), _mm256_set1_epi32(bits == 2 ? 3 : 1));
        return _mm256_or_si256(low, _mm256_slli_epi32(high, 8));
    }
    if (qf_iq1(F))
        return _mm256_or_si256(low, _mm256_slli_epi32(_mm256_and_si256(iq1_nibbles8(F, blk, k >> 3), _mm256_set1_epi32(7)), 8));
    return low;
}

/* The grid values of a block's 8 stored positions (before signs). An entry of 8 values comes whole from one 64-bit
 * gather (half the loads of two 32-bit ones): its halves are chunks 2 e and 2 e + 1, the even and odd 32-bit words. */
static inline __attribute__((always_inline)) void grid_values8(int F, const uint8_t *blk, __m256i g[8]) {
    const uint32_t *table = qf_grid_table(F);
    if (qf_grid4(F)) {
        for (int p = 0; p < 8; p++) g[p] = _mm256_i32gather_epi32((const int *)table, grid_index8(F, blk, 8 * p), 4);
        return;
    }
    for (int e = 0; e < 4; e++) {
        const __m256i idx = grid_index8(F, blk, 8 * e);
        const __m256 a = _mm256_castsi256_ps(_mm256_i32gather_epi64((const long long *)table, _mm256_castsi256_si128(idx), 8));
        const __m256 b = _mm256_castsi256_ps(_mm256_i32gather_epi64((const long long *)table,
                                                                     _mm256_extracti128_si256(idx, 1), 8));
        /* [lo0 hi0 lo1 hi1 | lo2 hi2 lo3 hi3] and the same of 4..7 -> lo0 .. lo7 and hi0 .. hi7 */
        g[QF_CHUNK_AT[2 * e]] = _mm256_permute4x64_epi64(_mm256_castps_si256(_mm256_shuffle_ps(a, b, 0x88)), 0xD8);
        g[QF_CHUNK_AT[2 * e + 1]] = _mm256_permute4x64_epi64(_mm256_castps_si256(_mm256_shuffle_ps(a, b, 0xDD)), 0xD8);
    }
}

/* The sign bytes of entries 8 e .. 8 e + 7 (of a block's, grid_sign_bytes), each repeated in the 4 bytes of its
 * 32-bit lane. */
static inline __m256i grid_signs8(__m256i signs, int e) {
    __m128i half = e < 2 ? _mm256_castsi256_si128(signs) : _mm256_extracti128_si256(signs, 1);
    if (e & 1) half = _mm_srli_si128(half, 8);
    const __m256i repeat = _mm256_setr_epi8(0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12,
                                            0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12);
    return _mm256_shuffle_epi8(_mm256_cvtepu8_epi32(half), repeat);
}

/* the bit that byte i of a 32-bit lane tests in its repeated sign byte: bit i (chunk 2 e) or bit 4 + i (2 e + 1) */
static inline int32_t sign_bits_of_half(int h) { return h ? (int32_t)0x80402010 : 0x08040201; }

/* ---- TQ1_0's base-3 bytes ----------------------------------------------------------------------------------- */

/* Lanes 2 h and 2 h + 1 of a TQ1_0 block: bytes 13 L .. 13 L + 12 at the start of 128-bit lane L (the last lane is
 * read from one byte early and shifted, so no load passes the block's 54 bytes). */
static inline __m256i tq1_lanes(const uint8_t *blk, int h) {
    const __m128i first = _mm_loadu_si128((const __m128i *)(blk + 26 * h));
    const __m128i second = h ? _mm_srli_si128(_mm_loadu_si128((const __m128i *)(blk + 38)), 1)
                             : _mm_loadu_si128((const __m128i *)(blk + 13));
    return _mm256_set_m128i(second, first);
}
/* the shuffle that puts digit 4 of lane bytes 3 u .. 3 u + 2 at lane bytes 13 .. 15 (bytes 0 .. 12 are kept) */
static inline __m128i tq1_spill_index(int u) {
    return _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, (char)(3 * u), (char)(3 * u + 1), (char)(3 * u + 2));
}
/* a byte's digit n from its n-th multiple by 3 (mod 256, byte additions), q: floor(3 q / 256) = (q > 85) + (q > 170),
 * compared as signed bytes after flipping the top bit */
static inline __m256i times3_bytes(__m256i q) { return _mm256_add_epi8(q, _mm256_add_epi8(q, q)); }
static inline __m256i base3_digit(__m256i q) {
    const __m256i s = _mm256_xor_si256(q, _mm256_set1_epi8((char)0x80));
    const __m256i above1 = _mm256_cmpgt_epi8(s, _mm256_set1_epi8((char)(85 ^ 0x80)));
    const __m256i above2 = _mm256_cmpgt_epi8(s, _mm256_set1_epi8((char)(170 ^ 0x80)));
    return _mm256_sub_epi8(_mm256_setzero_si256(), _mm256_add_epi8(above1, above2));
}

/* ---- a block's values, 256-bit: w[p] = stored bytes 32 p .. 32 p + 31 ------------------------------------ */


static inline __attribute__((always_inline)) void qf_decode8(int F, const uint8_t *blk, __m256i w[8]) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    if (qf_has_nibbles(F)) {
        for (int s = 0; s < 4; s++) {
            const __m256i l = _mm256_loadu_si256((const __m256i *)(blk + 32 * s));
            w[QF_CHUNK_AT[2 * s]] = _mm256_and_si256(l, low);
            w[QF_CHUNK_AT[2 * s + 1]] = _mm256_and_si256(_mm256_srli_epi16(l, 4), low);
        }
    }
    if (F == QF_Q6_K) { /* bits 2 u of bits2 -> bits 4, 5 of the value (16-bit shifts keep each byte's bits) */
        const __m256i top = _mm256_set1_epi8(0x30);
        for (int p = 0; p < 8; p++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * (p & 1)));
            const int u = p >> 1;
            const __m256i hi = u == 0 ? _mm256_slli_epi16(v, 4) : u == 1 ? _mm256_slli_epi16(v, 2)
                             : u == 2 ? v : _mm256_srli_epi16(v, 2);
            w[p] = _mm256_or_si256(w[p], _mm256_and_si256(hi, top));
        }
    }
#if defined(__AVX512VNNI__) && defined(__AVX512VL__) || defined(__AVXVNNI__)
    if (qf_lookup(F)) { /* without VNNI the indices stay: dot8 looks up the values' two nibbles itself */
        const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)qf_values(F)));
        for (int p = 0; p < 8; p++) w[p] = _mm256_shuffle_epi8(table, w[p]);
    }
#endif
    if (qf_bytes(F))
        for (int p = 0; p < 8; p++) w[p] = _mm256_loadu_si256((const __m256i *)(blk + 32 * p));
    if (F == QF_Q1_0) {
        const __m256i one = _mm256_set1_epi8(1), plane = _mm256_loadu_si256((const __m256i *)blk);
        for (int p = 0; p < 8; p++) w[p] = _mm256_and_si256(_mm256_srli_epi16(plane, p), one);
    }
    if (qf_two_bits(F)) {
        const __m256i three = _mm256_set1_epi8(3);
        for (int p = 0; p < 8; p++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + 32 * (p & 1)));
            w[p] = _mm256_and_si256(_mm256_srli_epi16(v, 2 * (p >> 1)), three);
        }
    }
    if (F == QF_TQ1_0) { /* w[2 u + h]: lanes 2 h, 2 h + 1 of register u (see the layout above) */
        const __m256i spill = _mm256_broadcastsi128_si256(_mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, -1, -1,
                                                                         -1));
        for (int h = 0; h < 2; h++) {
            __m256i times[5];
            times[0] = tq1_lanes(blk, h);
            for (int n = 1; n < 5; n++) times[n] = times3_bytes(times[n - 1]);
            for (int u = 0; u < 4; u++) {
                const __m256i fifth = _mm256_shuffle_epi8(times[4], _mm256_broadcastsi128_si256(tq1_spill_index(u)));
                w[2 * u + h] = base3_digit(_mm256_blendv_epi8(times[u], fifth, spill));
            }
        }
    }
    if (qf_grid(F)) { /* stored position p: chunk t = 2 e + h, half h of the sign bytes of entries 8 e .. */
        const __m256i off = _mm256_set1_epi8((char)qf_grid_offset(F));
        __m256i values[8];
        grid_values8(F, blk, values);
        const __m256i signs = qf_iq1(F) ? _mm256_setzero_si256() : grid_sign_bytes(F, blk);
        for (int p = 0; p < 8; p++) {
            const int t = QF_CHUNK_AT[p], e = t >> 1, h = t & 1;
            const __m256i g = values[p];
            if (qf_iq1(F)) { /* + 2 where the entry's shift is +1/8 (its sign bit clear) */
                const __m256i minus = _mm256_srli_epi32(iq1_nibbles8(F, blk, e), 3);
                w[p] = _mm256_add_epi8(g, _mm256_and_si256(_mm256_sub_epi32(minus, _mm256_set1_epi32(1)),
                                                           _mm256_set1_epi32(0x02020202)));
                continue;
            }
            const __m256i bits = _mm256_set1_epi32(sign_bits_of_half(h));
            const __m256i neg = _mm256_cmpeq_epi8(_mm256_and_si256(grid_signs8(signs, e), bits), bits);
            w[p] = _mm256_add_epi8(off, _mm256_sub_epi8(_mm256_xor_si256(g, neg), neg));
        }
    }
    if (qf_extra_bit(F)) { /* bit p of each plane byte -> the value's bit b (16-bit shifts keep each byte's bits) */
        const int b = qf_extra_bit(F) == 16 ? 4 : 2;
        const __m256i value = _mm256_set1_epi8((char)qf_extra_bit(F)),
                      plane = _mm256_loadu_si256((const __m256i *)(blk + qf_extra_bit_at(F)));
        for (int p = 0; p < 8; p++) {
            const __m256i hi = p < b ? _mm256_slli_epi16(plane, b - p) : _mm256_srli_epi16(plane, p - b);
            w[p] = _mm256_or_si256(w[p], _mm256_and_si256(hi, value));
        }
    }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
/* ---- a block's values, 512-bit: w[u] = stored bytes 64 u .. 64 u + 63 ------------------------------------ */

/* A bits1 plane in both 256-bit halves of a register. */
static inline __m512i bits1_plane(const uint8_t *p) {
    return _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)p));
}

/* Set for stored bytes 64 u .. 64 u + 63: bit 2 u of the plane's bytes for the first 32, bit 2 u + 1 for the rest. */
static inline __mmask64 bits1_mask(__m512i plane, int u) {
    const __m512i bit = _mm512_inserti64x4(_mm512_set1_epi8((char)(1 << (2 * u))),
                                           _mm256_set1_epi8((char)(1 << (2 * u + 1))), 1);
    return _mm512_test_epi8_mask(plane, bit);
}
/* IQ1's nibble of entries 16 v .. 16 v + 15, one a 32-bit lane (see iq1_nibbles8). */
static inline __m512i iq1_nibbles16(int F, const uint8_t *blk, int v) {
    if (F == QF_IQ1_S) {
        const __m256i w8 = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(blk + 32)));
        const __m512i words = _mm512_inserti64x4(_mm512_castsi256_si512(w8), w8, 1);
        const __m512i at = _mm512_inserti64x4(_mm512_set1_epi32(6 * v), _mm256_set1_epi32(6 * v + 3), 1);
        const __m512i high = _mm512_and_si512(_mm512_srlv_epi32(words, at), _mm512_set1_epi32(7));
        return _mm512_or_si512(high, _mm512_slli_epi32(_mm512_srli_epi32(words, 15), 3));
    }
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(blk + 32 + 8 * v)));
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(b, _mm256_set1_epi32(0x0F))),
                              _mm256_srli_epi32(b, 4), 1);
}

/* The grid indices of entries k .. k + 15, one a 32-bit lane. */
static inline __m512i grid_index16(int F, const uint8_t *blk, int k) {
    if (F == QF_IQ2_XS)
        return _mm512_and_si512(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(blk + 2 * k))),
                                _mm512_set1_epi32(511));
    const __m512i low = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + k)));
    if (F == QF_IQ2_S || F == QF_IQ3_S) {
        const int bits = F == QF_IQ2_S ? 2 : 1;
        const __m512i at = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                              _mm512_set1_epi32(bits));
        const __m512i word = _mm512_set1_epi32((int)(uint32_t)(ld64(blk + 64) >> (bits * k)));
        const __m512i high = _mm512_and_si512(_mm512_srlv_epi32(word, at), _mm512_set1_epi32(bits == 2 ? 3 : 1));
        return _mm512_or_si512(low, _mm512_slli_epi32(high, 8));
    }
    if (qf_iq1(F))
        return _mm512_or_si512(low, _mm512_slli_epi32(_mm512_and_si512(iq1_nibbles16(F, blk, k >> 4), _mm512_set1_epi32(7)), 8));
    return low;
}

/* The grid values of a block's 4 registers (before signs), 8-value entries by 64-bit gathers as grid_values8. */
static inline __attribute__((always_inline)) void grid_values4(int F, const uint8_t *blk, __m512i g[4]) {
    const uint32_t *table = qf_grid_table(F);
    if (qf_grid4(F)) {
        for (int u = 0; u < 4; u++) g[u] = _mm512_i32gather_epi32(grid_index16(F, blk, 16 * u), (const void *)table, 4);
        return;
    }
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    for (int v = 0; v < 2; v++) {
        const __m512i idx = grid_index16(F, blk, 16 * v);
        const __m512i a = _mm512_i32gather_epi64(_mm512_castsi512_si256(idx), (const void *)table, 8);
        const __m512i b = _mm512_i32gather_epi64(_mm512_extracti64x4_epi64(idx, 1), (const void *)table, 8);
        g[2 * v] = _mm512_permutex2var_epi32(a, even, b);
        g[2 * v + 1] = _mm512_permutex2var_epi32(a, _mm512_add_epi32(even, _mm512_set1_epi32(1)), b);
    }
}

/* The sign bytes of entries k .. k + 15, each repeated in the 4 bytes of its 32-bit lane. */
static inline __m512i grid_signs16(int F, const uint8_t *blk, int k) {
#ifdef __AVX512VBMI__
    /* one byte permutation repeats each entry's sign byte 4 times; 7 sign bits become 8 through ggml's ksigns table
     * (its 128 bytes in two registers, one more permutation). IQ2_XS's are the top 7 bits of its 16-bit entries. */
    static const uint8_t entry_of_byte[64] = {0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4, 5, 5, 5, 5,
                                              6, 6, 6, 6, 7, 7, 7, 7, 8, 8, 8, 8, 9, 9, 9, 9, 10, 10, 10, 10, 11, 11,
                                              11, 11, 12, 12, 12, 12, 13, 13, 13, 13, 14, 14, 14, 14, 15, 15, 15, 15};
    const __m512i entry = _mm512_loadu_si512((const void *)entry_of_byte);
    __m512i s;
    if (F == QF_IQ2_XS) /* byte 2 k + 1 of the entries, shifted right once: its 7 sign bits (bit 7 is not an index's) */
        s = _mm512_permutexvar_epi8(_mm512_add_epi8(_mm512_add_epi8(entry, entry), _mm512_set1_epi8((char)(2 * k + 1))),
                                    _mm512_srli_epi16(_mm512_loadu_si512((const void *)blk), 1));
    else
        s = _mm512_permutexvar_epi8(_mm512_add_epi8(entry, _mm512_set1_epi8((char)k)),
                                    _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(blk + qf_signs_at(F)))));
    if (qf_seven_signs(F))
        s = _mm512_permutex2var_epi8(_mm512_loadu_si512((const void *)QF_KSIGNS), s,
                                     _mm512_loadu_si512((const void *)(QF_KSIGNS + 64)));
    return s;
#else
    const __m128i bytes = k ? _mm256_extracti128_si256(grid_sign_bytes(F, blk), 1)
                            : _mm256_castsi256_si128(grid_sign_bytes(F, blk));
    return _mm512_shuffle_epi8(_mm512_cvtepu8_epi32(bytes),
                               _mm512_broadcast_i32x4(_mm_setr_epi8(0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12)));
#endif
}

static inline __attribute__((always_inline)) void qf_decode4(int F, const uint8_t *blk, __m512i w[4]) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    if (qf_has_nibbles(F)) {
        for (int h = 0; h < 2; h++) {
            const __m512i l = _mm512_loadu_si512((const void *)(blk + 64 * h));
            w[2 * h] = _mm512_and_si512(l, low);
            w[2 * h + 1] = _mm512_and_si512(_mm512_srli_epi16(l, 4), low);
        }
    }
    if (F == QF_Q6_K) {
        const __m512i top = _mm512_set1_epi8(0x30), v = _mm512_loadu_si512((const void *)(blk + 128));
        w[0] = _mm512_or_si512(w[0], _mm512_and_si512(_mm512_slli_epi16(v, 4), top));
        w[1] = _mm512_or_si512(w[1], _mm512_and_si512(_mm512_slli_epi16(v, 2), top));
        w[2] = _mm512_or_si512(w[2], _mm512_and_si512(v, top));
        w[3] = _mm512_or_si512(w[3], _mm512_and_si512(_mm512_srli_epi16(v, 2), top));
    }
    if (qf_lookup(F)) {
        const __m512i table = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)qf_values(F)));
        for (int u = 0; u < 4; u++) w[u] = _mm512_shuffle_epi8(table, w[u]);
    }
    if (qf_bytes(F))
        for (int u = 0; u < 4; u++) w[u] = _mm512_loadu_si512((const void *)(blk + 64 * u));
    if (F == QF_Q1_0) {
        const __m512i one = _mm512_set1_epi8(1), plane = bits1_plane(blk);
        for (int u = 0; u < 4; u++) w[u] = _mm512_maskz_mov_epi8(bits1_mask(plane, u), one);
    }
    if (qf_two_bits(F)) {
        const __m512i three = _mm512_set1_epi8(3), v = _mm512_loadu_si512((const void *)blk);
        for (int u = 0; u < 4; u++) w[u] = _mm512_and_si512(_mm512_srli_epi16(v, 2 * u), three);
    }
    if (F == QF_TQ1_0) { /* register u: digit u of lane bytes 0 .. 12, digit 4 of 3 u .. 3 u + 2 at 13 .. 15 */
        const __m512i one = _mm512_set1_epi8(1), two = _mm512_set1_epi8(2);
        const __m512i a85 = _mm512_set1_epi8((char)85), a170 = _mm512_set1_epi8((char)170);
        __m512i times[5];
        times[0] = _mm512_inserti64x4(_mm512_castsi256_si512(tq1_lanes(blk, 0)), tq1_lanes(blk, 1), 1);
        for (int n = 1; n < 5; n++)
            times[n] = _mm512_add_epi8(times[n - 1], _mm512_add_epi8(times[n - 1], times[n - 1]));
        for (int u = 0; u < 4; u++) {
            const __m512i q = _mm512_mask_shuffle_epi8(times[u], (__mmask64)0xE000E000E000E000ULL, times[4],
                                                       _mm512_broadcast_i32x4(tq1_spill_index(u)));
            w[u] = _mm512_mask_blend_epi8(_mm512_cmpgt_epu8_mask(q, a170),
                                          _mm512_maskz_mov_epi8(_mm512_cmpgt_epu8_mask(q, a85), one), two);
        }
    }
    if (qf_grid(F)) { /* register u: stored positions 2 u, 2 u + 1, the sign bytes of entries 16 (u / 2) .., half u % 2 */
        const __m512i off = _mm512_set1_epi8((char)qf_grid_offset(F));
        __m512i values[4];
        grid_values4(F, blk, values);
        for (int u = 0; u < 4; u++) {
            const int v = u >> 1, h = u & 1;
            const __m512i g = values[u];
            if (qf_iq1(F)) {
                const __m512i minus = _mm512_srli_epi32(iq1_nibbles16(F, blk, v), 3);
                w[u] = _mm512_add_epi8(g, _mm512_and_si512(_mm512_sub_epi32(minus, _mm512_set1_epi32(1)),
                                                           _mm512_set1_epi32(0x02020202)));
                continue;
            }
            const __mmask64 neg = _mm512_test_epi8_mask(grid_signs16(F, blk, 16 * v),
                                                        _mm512_set1_epi32(sign_bits_of_half(h)));
            w[u] = _mm512_mask_sub_epi8(_mm512_add_epi8(g, off), neg, off, g);
        }
    }
    if (qf_extra_bit(F)) {
        const __m512i value = _mm512_set1_epi8((char)qf_extra_bit(F)), plane = bits1_plane(blk + qf_extra_bit_at(F));
        for (int u = 0; u < 4; u++) w[u] = _mm512_mask_add_epi8(w[u], bits1_mask(plane, u), w[u], value);
    }
}
#endif

/* ---- tail records: one group's 32 values in element order, its scale and shift ---------------------------- */

static inline __attribute__((always_inline)) __m256i qf_tail_values(int F, const uint8_t *rec, int h) {
    const __m128i low = _mm_set1_epi8(0x0F);
    __m256i w;
    if (F == QF_Q8_0) return _mm256_loadu_si256((const __m256i *)rec);
    if (F == QF_Q1_0) return _mm256_and_si256(bits_to_bytes(ld32(rec + 4 * h)), _mm256_set1_epi8(1));
    if (F == QF_Q2_0) {
        uint64_t v;
        __builtin_memcpy(&v, rec + 8 * h, 8);
        return _mm256_and_si256(_mm256_srlv_epi64(_mm256_set1_epi64x((long long)v), _mm256_setr_epi64x(0, 2, 4, 6)),
                                _mm256_set1_epi8(3));
    }
    const __m128i b = _mm_loadu_si128((const __m128i *)rec);
    w = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), low), _mm_and_si128(b, low));
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    /* bit i of the word is element i's fifth bit: a mask register adds 16 where it is set (nibbles lack it) */
    if (qf_fifth_bit(F)) w = _mm256_mask_add_epi8(w, (__mmask32)ld32(rec + 16), w, _mm256_set1_epi8(16));
#else
    if (qf_fifth_bit(F)) w = _mm256_or_si256(w, _mm256_and_si256(bits_to_bytes(ld32(rec + 16)), _mm256_set1_epi8(16)));
#endif
    if (F == QF_IQ4_NL || F == QF_MXFP4)
        w = _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)qf_values(F))), w);
    return w;
}

static inline float f16_at(const uint8_t *p) {
    uint16_t h;
    __builtin_memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

static inline float e8m0_half(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    __builtin_memcpy(&f, &bits, 4);
    return f;
}

static inline __attribute__((always_inline)) void qf_tail_scale(int F, const uint8_t *rec, float *scale, float *shift) {
    switch (F) {
    case QF_Q4_0: *scale = f16_at(rec + 16), *shift = -8.f * *scale; break;
    case QF_IQ4_NL: *scale = f16_at(rec + 16), *shift = -128.f * *scale; break;
    case QF_MXFP4: *scale = e8m0_half(rec[16]), *shift = -128.f * *scale; break;
    case QF_Q4_1: *scale = f16_at(rec + 16), *shift = f16_at(rec + 18); break;
    case QF_Q5_0: *scale = f16_at(rec + 20), *shift = -16.f * *scale; break;
    case QF_Q5_1: *scale = f16_at(rec + 20), *shift = f16_at(rec + 22); break;
    case QF_Q8_0: *scale = f16_at(rec + 32), *shift = -128.f * *scale; break;
    case QF_Q1_0: *shift = -f16_at(rec + 16), *scale = -2.f * *shift; break;
    default: *scale = f16_at(rec + 16), *shift = -*scale; break; /* QF_Q2_0 */
    }
}
#endif
