/* The paged KV cache as quickdraft's attention kernel and decoder layer read and write it. */
#ifndef QUICKDRAFT_KV_H
#define QUICKDRAFT_KV_H
#include <stdint.h>

enum { QD_KV_F32 = 0, QD_KV_BF16 = 1, QD_KV_INT8 = 2 };
#define QGROUP 32 /* int8 values per scale */

/* One layer's cache, as the pool stores it. */
typedef struct {
    void *k, *v;              /* [slots][kv_heads][head_dim] */
    float *k_scale, *v_scale; /* int8 only: [slots][kv_heads][head_dim / QGROUP] */
    int format;
} qd_kv_cache;

/* The query rows of one call. Items group_first[g] .. group_first[g + 1] - 1 belong to one sequence and read one
 * context: item r's query row rows[r] attends to the first lengths[r] positions, whose slots are slots[r][..] (with
 * a window w > 0, to positions max(0, lengths[r] - w) .. lengths[r] - 1 of them). */
typedef struct {
    const int64_t *rows, *slots, *lengths, *group_first;
    int items, width, groups;
} qd_attn_items;

int qd_attend(const void *q, long q_stride, int q_bf16, int H, int KVH, int D, const qd_kv_cache *kv,
              const qd_attn_items *it, float scale, int window, const float *sinks, float softcap, void *out);
int qd_kv_store(const void *x, long x_stride, int x_bf16, int T, int KVH, int D, const int64_t *slot_mapping,
                void *cache, float *scales, int format);
#endif
