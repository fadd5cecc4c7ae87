/* Loads and stores of float32 or bfloat16 values shared by quickdraft's CPU kernels. */
#ifndef QUICKDRAFT_FLOATS_H
#define QUICKDRAFT_FLOATS_H
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

static inline float ld(const void *p, int bf16, size_t i) {
    if (bf16) {
        uint32_t bits = (uint32_t)((const uint16_t *)p)[i] << 16;
        float f;
        __builtin_memcpy(&f, &bits, 4);
        return f;
    }
    return ((const float *)p)[i];
}

static inline void st(void *p, int bf16, size_t i, float v) {
    if (bf16) {
        uint32_t bits;
        __builtin_memcpy(&bits, &v, 4);
        bits += 0x7FFF + ((bits >> 16) & 1); /* round to nearest even */
        ((uint16_t *)p)[i] = (uint16_t)(bits >> 16);
    } else {
        ((float *)p)[i] = v;
    }
}

/* 8 bfloat16 values as floats */
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
/* A per-thread float buffer that only grows: kernels called for every token reuse it instead of allocating. */
typedef struct {
    float *data;
    size_t cap;
} scratch;

/* At least n floats, 64-byte aligned; NULL when out of memory. */
static inline float *reserve_floats(scratch *s, size_t n) {
    if (n > s->cap) {
        free(s->data);
        s->data = aligned_alloc(64, (n * 4 + 63) / 64 * 64);
        s->cap = s->data ? n : 0;
    }
    return s->data;
}
#endif
