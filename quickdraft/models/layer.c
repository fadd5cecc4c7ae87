/* One whole decoder layer in one call, for a batch in which every new token attends alone: decode steps,
 * verify passes and draft steps, where each token reads its own context from the paged cache.
 *
 * Why: a quantized decode step spends a sizeable share of its time in Python and torch dispatch around the
 * kernels (per layer ~20 small torch ops and 7 kernel calls; figures in docs/MEASUREMENTS.md). This runs the same kernels (qd_rmsnorm,
 * qd_linear or qd_linear_bf16, qd_head_norm, qd_rope, qd_attend, qd_gated) in the same order on the same buffers,
 * rounding to the activation dtype where the module path does, so a token's hidden state is bit-identical whichever
 * path computed it (models/fused.py chooses; the module path still runs prompt chunks and everything off CPU).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "floats.h"
#include "kv.h"

int qd_linear(const void *x, int x_bf16, int M, int K, int Kpad, int nparts, const uint8_t *const *w,
              const uint16_t *const *scales_zeros, const int *formats, const int *N, const float *const *bias,
              int swiglu, void *y, int y_bf16);
int qd_linear_bf16(const uint16_t *x_bf16, int M, int K, const uint16_t *w, int N, const float *bias, uint16_t *y);
int qd_rmsnorm(const void *x, int x_bf16, const void *w, int w_bf16, int M, int D, float eps, void *y);
int qd_head_norm(void *x, int bf16, const void *w, int w_bf16, int T, int heads, int D, long row_stride, float eps);
int qd_rope(void *x, int bf16, int T, int heads, int D, int half, long row_stride, const int64_t *positions,
            const float *cos_table, const float *sin_table);
int qd_gated(const void *gate_up, int bf16, int M, int N, int act, float limit, float alpha, void *y);

enum { QD_QUANTIZED = 1, QD_BF16 = 2 };

/* A linear layer as one of the two kernels takes it. QD_QUANTIZED: the arguments of qd_linear (several parts
 * read the same input; swiglu = 1 gives silu(part 0) * part 1). QD_BF16: qd_linear_bf16's weight and bias. */
typedef struct {
    int kind, in_features, padded_in, nparts, swiglu, out_features;
    const uint8_t *const *weights;
    const uint16_t *const *scales_zeros;
    const int *formats, *part_rows; /* qformats.h */
    const float *const *biases;
    const uint16_t *dense;
    const float *dense_bias;
} qd_linear_desc;

/* A mixture of experts' feed-forward as qd_route and qd_moe take it: the router's weights (float32
 * [num_experts][hidden]) and bias (double, or NULL), each expert's gate/up and down, the activation when gate/up
 * returns [gate | up] (act, limit, alpha: qd_gated's). */
typedef struct {
    int num_experts, k, normalize, act;
    float limit, alpha;
    const float *router;
    const double *router_bias;
    const qd_linear_desc *gate_up, *down;
} qd_moe_desc;

/* A decoder layer: pre-norm attention and a gated MLP, act(gate) * up (act 0: silu, 1: gelu_tanh, qd_gated's), or
 * a mixture of experts (gate_up.kind 0, moe.num_experts > 0: qd_route, then qd_moe), or attention alone (gate_up.kind
 * 0, moe.num_experts 0: a mixture's layer whose feed-forward the caller runs).
 * gate_up either applies SwiGLU itself (gate_up.swiglu, silu only) or returns [gate | up] for qd_gated. Optional
 * parts (NULL: none): q_norm and k_norm, RMSNorm of each q and k head (head_dim weights) before RoPE, or with
 * qk_norm_whole of all of q and all of k at once (heads * head_dim and kv_heads * head_dim weights: OLMoE, OLMo 2);
 * post_attn_norm and post_mlp_norm, RMSNorm of the attention's and the MLP's output before its residual add (Gemma's
 * sandwich, in which post_norm is the norm before the MLP); input_norm and post_norm may be NULL where post_attn_norm
 * and post_mlp_norm are set (OLMo 2: the blocks read the residual stream as it is). Every norm has the weights' dtype
 * norm_bf16 and eps. */
typedef struct {
    const void *input_norm, *post_norm, *q_norm, *k_norm, *post_attn_norm, *post_mlp_norm;
    int norm_bf16, qk_norm_whole;
    float eps, attn_scale; /* attn_scale: the model's attention scale, as the module path passes it */
    float residual_scale;  /* each attention and MLP output times this before its residual add (Granite; else 1) */
    int hidden, heads, kv_heads, head_dim, intermediate, act;
    int window; /* keys a token sees at most, itself included (qd_attend's window); 0: its whole context */
    int rotary_half; /* RoPE rotates the first 2 * rotary_half dims of each head (qd_rope's half; 0: no RoPE) */
    qd_linear_desc qkv, o, gate_up, down;
    const float *cos, *sin; /* this layer's RoPE tables, [positions][rotary_half] (layers of one model may differ) */
    const float *sinks;     /* float32 [heads]: a logit per head every softmax also normalizes over (gpt-oss); NULL */
    float softcap;          /* attention scores soft-capped to softcap * tanh(s / softcap) (Gemma 2); 0: not */
    qd_moe_desc moe;        /* a mixture of experts' feed-forward (gate_up.kind 0); moe.num_experts 0: the caller's */
} qd_layer_desc;

int qd_route(const void *x, int bf16, int T, int hidden, const float *w, const double *bias, int num_experts, int k,
             int normalize, int64_t *experts, float *weights);
int qd_moe(const qd_linear_desc *gate_up, const qd_linear_desc *down, int num_experts, const void *x, int bf16,
           int T, int hidden, int k, const int64_t *experts, const float *weights, int act, float limit, float alpha,
           void *out);

/* One projection site's LoRA parts, as qd_lora_add (cpu_ops.c) takes them; nparts 0: none. */
typedef struct {
    int nparts;
    const int *offsets, *ranks, *outs;
    const float *scales;
    const float *const *a, *const *bt;
} qd_lora_site;

/* A step's LoRA adapters: group g's nrows[g] rows (indices into the step's tokens) run sites[g], 4 sites a layer
 * (QD_LORA_QKV .. QD_LORA_DOWN) from layer 0 on. What the module path adds after the same projections
 * (models/lora.py), with the same kernel. */
typedef struct {
    int ngroups;
    const int64_t *const *rows;
    const int *nrows;
    const qd_lora_site *const *sites;
} qd_lora;
enum { QD_LORA_QKV, QD_LORA_O, QD_LORA_GATE_UP, QD_LORA_DOWN };

int qd_lora_add(const void *x, int x_bf16, long ldx, void *y, int y_bf16, long ldy, const int64_t *rows, int nrows,
                int K, int nparts, const int *offsets, const int *ranks, const int *outs, const float *scales,
                const float *const *a, const float *const *bt);

/* y [T][ldy] += each group's terms at one site of layer `layer`, for x [T][K] (row stride K) */
static int lora_site(const qd_lora *lora, int layer, int site, const void *x, int x_bf16, int K, void *y, int y_bf16,
                     long ldy) {
    for (int g = 0; lora && g < lora->ngroups; g++) {
        const qd_lora_site *s = &lora->sites[g][4 * layer + site];
        if (s->nparts) {
            int rc = qd_lora_add(x, x_bf16, K, y, y_bf16, ldy, lora->rows[g], lora->nrows[g], K, s->nparts, s->offsets,
                                 s->ranks, s->outs, s->scales, s->a, s->bt);
            if (rc) return rc;
        }
    }
    return 0;
}

static int lora_at(const qd_lora *lora, int layer, int site) {
    for (int g = 0; lora && g < lora->ngroups; g++)
        if (lora->sites[g][4 * layer + site].nparts) return 1;
    return 0;
}

static int run_linear(const qd_linear_desc *d, const void *x, int bf16, int M, void *y) {
    if (d->kind == QD_QUANTIZED)
        return qd_linear(x, bf16, M, d->in_features, d->padded_in, d->nparts, d->weights, d->scales_zeros, d->formats,
                         d->part_rows, d->biases, d->swiglu, y, bf16);
    if (d->kind == QD_BF16 && bf16) return qd_linear_bf16(x, M, d->in_features, d->dense, d->out_features, d->dense_bias, y);
    return -2;
}

/* x += y * scale elementwise, y * scale rounded to the dtype first where scale is not 1 (torch's x + y * scale: a
 * sublayer's output times Granite's residual multiplier), then the sum rounded once (what torch's x + y gives) */
static void add_into(void *x, void *y, int bf16, size_t n, float scale) {
    if (scale != 1.f)
        for (size_t i = 0; i < n; i++) st(y, bf16, i, ld(y, bf16, i) * scale);
    for (size_t i = 0; i < n; i++) st(x, bf16, i, ld(x, bf16, i) + ld(y, bf16, i));
}

static __thread struct {
    char *data;
    size_t cap;
} buffers; /* the layer's intermediate activations, grown as needed and reused */

static __thread struct {
    int64_t *experts; /* [T][k] expert ids, then [T][k] float weights */
    size_t cap;
} routes; /* a mixture's routing, in the fused layer */

#define CHECK(call) do { int rc_ = (call); if (rc_) return rc_; } while (0)

/* x [T][hidden] (float32 or bfloat16, updated in place) through one layer, the model's layer `layer`. Token t is at
 * positions[t], its key and value go to cache slot slot_mapping[t], and the items attend as qd_attend says; lora
 * (NULL: none) adds adapters' terms after the projections. Where a LoRA adds to gate/up of a layer whose gate/up
 * applies SwiGLU, every row takes gate and up in float32 and qd_gated, as the module path does (the same bits as
 * the kernel's SwiGLU). Returns 0, -1 (out of memory) or -2 (bad arguments). */
int qd_decoder_layer(const qd_layer_desc *L, void *x, int bf16, int T, const int64_t *positions,
                     const int64_t *slot_mapping, const qd_kv_cache *kv, const qd_attn_items *items,
                     const qd_lora *lora, int layer) {
    if (T < 0 || L->heads % L->kv_heads || (L->gate_up.swiglu && L->act != 0)) return -2; /* the kernel's is silu */
    if (T == 0) return 0;
    const size_t es = bf16 ? 2 : 4, D = (size_t)L->head_dim;
    const size_t q_width = (size_t)L->heads * D, kv_width = (size_t)L->kv_heads * D, qkv_width = q_width + 2 * kv_width;
    const size_t act_width = L->gate_up.swiglu ? (size_t)L->intermediate : 2 * (size_t)L->intermediate;
    const size_t n_h = (size_t)T * L->hidden, n_qkv = (size_t)T * qkv_width, n_att = (size_t)T * q_width;
    const size_t n_gu = (size_t)T * act_width, n_act = (size_t)T * L->intermediate;
    const int lora_gate_up = L->gate_up.swiglu && lora_at(lora, layer, QD_LORA_GATE_UP);
    const size_t n_f32 = lora_gate_up ? (size_t)T * 3 * L->intermediate : 0; /* [gate | up] and act(gate) * up */
    const size_t need = (2 * n_h + n_qkv + n_att + n_gu + n_act) * es + n_f32 * 4 + 7 * 64;
    if (need > buffers.cap) {
        free(buffers.data);
        buffers.data = aligned_alloc(64, (need + 63) / 64 * 64);
        buffers.cap = buffers.data ? need : 0;
        if (!buffers.data) return -1;
    }
    char *next = buffers.data;
#define TAKE(n) (next += ((n) * es + 63) / 64 * 64, next - ((n) * es + 63) / 64 * 64)
    char *h = TAKE(n_h), *tmp = TAKE(n_h), *qkv = TAKE(n_qkv), *att = TAKE(n_att), *gu = TAKE(n_gu), *act = TAKE(n_act);
#undef TAKE
    float *gu32 = (float *)next, *act32 = gu32 + (size_t)T * 2 * L->intermediate;

    /* attention block */
    if ((!L->input_norm || !L->post_norm) && !(L->post_attn_norm && L->post_mlp_norm)) return -2;
    if (L->moe.num_experts && !L->post_norm) return -2; /* (no mixture family leaves out the norm before its experts) */
    const char *in = x; /* what the block reads: the normed stream, or (OLMo 2) the stream itself */
    if (L->input_norm) {
        CHECK(qd_rmsnorm(x, bf16, L->input_norm, L->norm_bf16, T, L->hidden, L->eps, h));
        in = h;
    }
    CHECK(run_linear(&L->qkv, in, bf16, T, qkv));
    CHECK(lora_site(lora, layer, QD_LORA_QKV, in, bf16, L->hidden, qkv, bf16, (long)qkv_width));
    const int q_heads = L->qk_norm_whole ? 1 : L->heads, k_heads = L->qk_norm_whole ? 1 : L->kv_heads;
    if (L->q_norm)
        CHECK(qd_head_norm(qkv, bf16, L->q_norm, L->norm_bf16, T, q_heads, (int)(q_width / q_heads), (long)qkv_width,
                           L->eps));
    if (L->k_norm)
        CHECK(qd_head_norm(qkv + q_width * es, bf16, L->k_norm, L->norm_bf16, T, k_heads, (int)(kv_width / k_heads),
                           (long)qkv_width, L->eps));
    CHECK(qd_rope(qkv, bf16, T, L->heads, L->head_dim, L->rotary_half, (long)qkv_width, positions, L->cos, L->sin));
    CHECK(qd_rope(qkv + q_width * es, bf16, T, L->kv_heads, L->head_dim, L->rotary_half, (long)qkv_width, positions,
                  L->cos, L->sin));
    /* every new key/value is in the cache before any token attends */
    CHECK(qd_kv_store(qkv + q_width * es, (long)qkv_width, bf16, T, L->kv_heads, L->head_dim, slot_mapping, kv->k,
                      kv->k_scale, kv->format));
    CHECK(qd_kv_store(qkv + (q_width + kv_width) * es, (long)qkv_width, bf16, T, L->kv_heads, L->head_dim, slot_mapping,
                      kv->v, kv->v_scale, kv->format));
    CHECK(qd_attend(qkv, (long)qkv_width, bf16, L->heads, L->kv_heads, L->head_dim, kv, items, L->attn_scale,
                    L->window, L->sinks, L->softcap, att));
    CHECK(run_linear(&L->o, att, bf16, T, tmp));
    CHECK(lora_site(lora, layer, QD_LORA_O, att, bf16, (int)q_width, tmp, bf16, L->hidden));
    if (L->post_attn_norm) CHECK(qd_rmsnorm(tmp, bf16, L->post_attn_norm, L->norm_bf16, T, L->hidden, L->eps, tmp));
    add_into(x, tmp, bf16, n_h, L->residual_scale);
    if (!L->gate_up.kind && !L->moe.num_experts) return 0; /* a mixture's layer whose feed-forward the caller runs */
    if (!L->gate_up.kind) { /* a mixture of experts: the module path's SparseMoE, in the same calls */
        const qd_moe_desc *m = &L->moe;
        const size_t pairs = (size_t)T * m->k;
        if (m->k < 1) return -2;
        if (pairs > routes.cap) {
            int64_t *grown = realloc(routes.experts, pairs * (sizeof(int64_t) + sizeof(float)));
            if (!grown) return -1;
            routes.experts = grown;
            routes.cap = pairs;
        }
        float *weights = (float *)(routes.experts + pairs);
        CHECK(qd_rmsnorm(x, bf16, L->post_norm, L->norm_bf16, T, L->hidden, L->eps, h));
        CHECK(qd_route(h, bf16, T, L->hidden, m->router, m->router_bias, m->num_experts, m->k, m->normalize,
                       routes.experts, weights));
        CHECK(qd_moe(m->gate_up, m->down, m->num_experts, h, bf16, T, L->hidden, m->k, routes.experts, weights,
                     m->act, m->limit, m->alpha, tmp));
        add_into(x, tmp, bf16, n_h, L->residual_scale);
        return 0;
    }

    /* MLP block */
    in = x;
    if (L->post_norm) {
        CHECK(qd_rmsnorm(x, bf16, L->post_norm, L->norm_bf16, T, L->hidden, L->eps, h));
        in = h;
    }
    if (lora_gate_up) { /* QuantGroup.unactivated, the terms, then qd_gated in float32 rounded once */
        const qd_linear_desc *g = &L->gate_up;
        CHECK(qd_linear(in, bf16, T, g->in_features, g->padded_in, g->nparts, g->weights, g->scales_zeros, g->formats,
                        g->part_rows, g->biases, 0, gu32, 0));
        CHECK(lora_site(lora, layer, QD_LORA_GATE_UP, in, bf16, L->hidden, gu32, 0, 2 * (long)L->intermediate));
        CHECK(qd_gated(gu32, 0, T, L->intermediate, L->act, 0.f, 0.f, act32));
        for (size_t i = 0; i < n_act; i++) st(act, bf16, i, act32[i]);
    } else if (L->gate_up.swiglu) {
        CHECK(run_linear(&L->gate_up, in, bf16, T, act));
    } else {
        CHECK(run_linear(&L->gate_up, in, bf16, T, gu));
        CHECK(lora_site(lora, layer, QD_LORA_GATE_UP, in, bf16, L->hidden, gu, bf16, 2 * (long)L->intermediate));
        CHECK(qd_gated(gu, bf16, T, L->intermediate, L->act, 0.f, 0.f, act));
    }
    CHECK(run_linear(&L->down, act, bf16, T, tmp));
    CHECK(lora_site(lora, layer, QD_LORA_DOWN, act, bf16, L->intermediate, tmp, bf16, L->hidden));
    if (L->post_mlp_norm) CHECK(qd_rmsnorm(tmp, bf16, L->post_mlp_norm, L->norm_bf16, T, L->hidden, L->eps, tmp));
    add_into(x, tmp, bf16, n_h, L->residual_scale);
    return 0;
}

/* The decoder layers layers[0 .. n) one after the other: a whole decode, verify or draft step's layers in one call.
 * kv is layer 0's cache; layer i's is advanced by i * layer_stride values (the pool's [layers][slots] layout) and its
 * scales by i * scale_layer_stride; the other arguments are qd_decoder_layer's, shared by every layer (each layer's
 * window and RoPE tables are its own desc's). */
int qd_decoder_stack(const qd_layer_desc *const *layers, int n, void *x, int bf16, int T, const int64_t *positions,
                     const int64_t *slot_mapping, const qd_kv_cache *kv, long layer_stride, long scale_layer_stride,
                     const qd_attn_items *items, const qd_lora *lora) {
    if (n < 0 || layer_stride < 0 || scale_layer_stride < 0) return -2;
    const size_t es = kv->format == QD_KV_INT8 ? 1 : kv->format == QD_KV_BF16 ? 2 : 4;
    for (int i = 0; i < n; i++) {
        const size_t offset = (size_t)i * (size_t)layer_stride * es, scales = (size_t)i * (size_t)scale_layer_stride;
        qd_kv_cache layer_kv = {(char *)kv->k + offset, (char *)kv->v + offset,
                                kv->k_scale ? kv->k_scale + scales : NULL, kv->v_scale ? kv->v_scale + scales : NULL,
                                kv->format};
        CHECK(qd_decoder_layer(layers[i], x, bf16, T, positions, slot_mapping, &layer_kv, items, lora, i));
    }
    return 0;
}

/* A mixture of experts' feed-forward for T tokens (x [T][hidden]), each routed to k experts (experts, weights:
 * [T][k]): out[t] = the sum, over t's experts in ascending id order, of weight * down_e(act(gate_up_e(x[t]))), summed
 * in float32 and rounded once to x's dtype. Either every gate_up_e applies SwiGLU itself (its swiglu flag), or each
 * returns [gate | up] and qd_gated applies act (with limit and alpha: gpt-oss's clamped SwiGLU). Each chosen expert
 * runs once, on the rows that chose it (gathered in token order); its output is rounded to the activation dtype before
 * it is weighted: the arithmetic of the module path (SparseMoE in feed_forward.py), so both give the same bits.
 * Experts nobody chose are not read. The chosen experts are spread over the threads (one kernel call each, on its
 * thread: a decode step's 8 small experts would otherwise pay a fork and join per call); each token then sums its
 * experts' outputs in id order. Returns 0, -1 (out of memory) or -2 (bad arguments). */
static __thread struct {
    char *data;
    size_t cap;
} moe_buffers; /* qd_moe's gathered rows and outputs: apart from the fused layer's, which hold its input */

int qd_moe(const qd_linear_desc *gate_up, const qd_linear_desc *down, int num_experts, const void *x, int bf16,
           int T, int hidden, int k, const int64_t *experts, const float *weights, int act, float limit, float alpha,
           void *out) {
    if (T < 0 || k < 1 || hidden < 1 || num_experts < 1) return -2;
    const long pairs = (long)T * k;
    for (long i = 0; i < pairs; i++)
        if (experts[i] < 0 || experts[i] >= num_experts) return -2;
    int inter = 0;
    const int swiglu = gate_up[0].swiglu;
    for (int e = 0; e < num_experts; e++) {
        const int width = down[e].in_features;
        if (gate_up[e].in_features != hidden || down[e].out_features != hidden || gate_up[e].swiglu != swiglu ||
            gate_up[e].out_features != (swiglu ? width : 2 * width))
            return -2;
        if (width > inter) inter = width;
    }
    if (!swiglu && (act < 0 || act > 2 || (act == 2 && !(limit > 0.f && alpha == alpha)))) return -2; /* qd_gated's */
    const size_t gu_width = swiglu ? 0 : 2 * (size_t)inter; /* [gate | up] rows before qd_gated */
    const size_t es = bf16 ? 2 : 4;
    /* row r (0 .. pairs - 1) of the gathered input, hidden and output: experts in id order, each its tokens in order */
    const size_t need = (size_t)pairs * ((size_t)hidden * 2 * es + ((size_t)inter + gu_width) * es + sizeof(int) + 4)
                        + (size_t)(num_experts + 1) * sizeof(int) + (size_t)T * sizeof(int)
                        + (size_t)T * hidden * sizeof(float);
    if (need > moe_buffers.cap) {
        char *grown = realloc(moe_buffers.data, need);
        if (!grown) return -1;
        moe_buffers.data = grown;
        moe_buffers.cap = need;
    }
    char *rows_x = moe_buffers.data;
    char *h = rows_x + (size_t)pairs * hidden * es;
    char *y = h + (size_t)pairs * inter * es;
    int *row_of = (int *)(y + (size_t)pairs * hidden * es); /* [T][k]: the row of token t's j-th expert (id order) */
    float *w = (float *)(row_of + pairs);
    int *first = (int *)(w + pairs); /* expert e's rows: first[e] .. first[e + 1] - 1 */
    int *filled = first + num_experts + 1;
    float *sums = (float *)(filled + T); /* [T][hidden] */
    char *gu = (char *)(sums + (size_t)T * hidden); /* [pairs][2 * inter] where qd_gated applies act */
    memset(filled, 0, (size_t)T * sizeof(int));
    int r = 0;
    for (int e = 0; e < num_experts; e++) {
        first[e] = r;
        for (int t = 0; t < T; t++)
            for (int j = 0; j < k; j++)
                if (experts[(long)t * k + j] == e) {
                    w[r] = weights[(long)t * k + j];
                    row_of[(long)t * k + filled[t]++] = r;
                    memcpy(rows_x + (size_t)r * hidden * es, (const char *)x + (size_t)t * hidden * es, hidden * es);
                    r++;
                }
    }
    first[num_experts] = r;
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) reduction(| : failed)
    for (int e = 0; e < num_experts; e++) {
        const int n = first[e + 1] - first[e];
        if (!n) continue;
        const size_t r0 = (size_t)first[e], width = (size_t)down[e].in_features;
        char *hr = h + r0 * inter * es;
        if (swiglu ? run_linear(&gate_up[e], rows_x + r0 * hidden * es, bf16, n, hr)
                   : run_linear(&gate_up[e], rows_x + r0 * hidden * es, bf16, n, gu + r0 * gu_width * es) ||
                     qd_gated(gu + r0 * gu_width * es, bf16, n, (int)width, act, limit, alpha, hr))
            failed = 1;
        else if (run_linear(&down[e], hr, bf16, n, y + r0 * hidden * es))
            failed = 1;
    }
    if (failed) return -1;
#pragma omp parallel for schedule(static) if (T >= 4)
    for (int t = 0; t < T; t++) {
        float *acc = sums + (size_t)t * hidden;
        memset(acc, 0, (size_t)hidden * sizeof(float));
        for (int j = 0; j < k; j++) {
            const int row = row_of[(long)t * k + j];
            for (int c = 0; c < hidden; c++) {
                float p = w[row] * ld(y, bf16, (size_t)row * hidden + c);
                acc[c] = acc[c] + p;
            }
        }
        for (int c = 0; c < hidden; c++) st(out, bf16, (size_t)t * hidden + c, acc[c]);
    }
    return 0;
}

/* A mixture's router for T tokens (x [T][hidden]; w [num_experts][hidden] in float32, the router's weights; bias: NULL,
 * or [num_experts] in double, gpt-oss's): each token's k experts (largest probability first, a tie to the lower id)
 * and their weights. Each logit is summed in double (every product of two floats is exact there) over 8 lanes of
 * strided indices, the lanes then added in a fixed order, the bias added, and rounded to float32: a token's choice
 * never depends on the other rows of the call, nor on which thread summed which logit (the threads split the
 * logits, so a decode step's one token is routed by both). Softmax in float32 (max subtracted), then the k largest
 * probabilities, divided by their sum where normalize is set. Both paths of a mixture on the CPU route here.
 * Returns 0, -1 (out of memory) or -2 (bad arguments). */
int qd_route(const void *x, int bf16, int T, int hidden, const float *w, const double *bias, int num_experts, int k,
             int normalize, int64_t *experts, float *weights) {
    if (T < 0 || hidden < 1 || num_experts < 1 || k < 1 || k > num_experts) return -2;
    double *rows = malloc((size_t)T * hidden * sizeof(double) + (size_t)T * num_experts * sizeof(float) + 1);
    if (!rows) return -1;
    float *all_probs = (float *)(rows + (size_t)T * hidden);
    for (long i = 0; i < (long)T * hidden; i++) rows[i] = ld(x, bf16, (size_t)i);
    const long logits = (long)T * num_experts;
#pragma omp parallel for schedule(static) if (logits >= 64)
    for (long i = 0; i < logits; i++) {
        const int e = (int)(i % num_experts);
        const double *xr = rows + (size_t)(i / num_experts) * hidden;
        const float *we = w + (size_t)e * hidden;
        double lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        int c = 0;
        for (; c + 8 <= hidden; c += 8)
            for (int l = 0; l < 8; l++) lane[l] += xr[c + l] * (double)we[c + l];
        for (int l = 0; c < hidden; c++, l++) lane[l] += xr[c] * (double)we[c];
        const double sum = ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
        all_probs[i] = (float)(bias ? sum + bias[e] : sum);
    }
#pragma omp parallel for schedule(static) if (T >= 8)
    for (int t = 0; t < T; t++) {
        float *probs = all_probs + (size_t)t * num_experts;
        float top = -INFINITY;
        for (int e = 0; e < num_experts; e++)
            if (probs[e] > top) top = probs[e];
        float total = 0.f;
        for (int e = 0; e < num_experts; e++) {
            probs[e] = expf(probs[e] - top);
            total = total + probs[e];
        }
        for (int e = 0; e < num_experts; e++) probs[e] = probs[e] / total;
        float chosen_sum = 0.f;
        for (int j = 0; j < k; j++) {
            int best = -1;
            for (int e = 0; e < num_experts; e++) {
                int taken = 0;
                for (int i = 0; i < j; i++) taken |= experts[(long)t * k + i] == e;
                if (!taken && (best < 0 || probs[e] > probs[best])) best = e;
            }
            experts[(long)t * k + j] = best;
            weights[(long)t * k + j] = probs[best];
            chosen_sum = chosen_sum + probs[best];
        }
        if (normalize)
            for (int j = 0; j < k; j++) weights[(long)t * k + j] = weights[(long)t * k + j] / chosen_sum;
    }
    free(rows);
    return 0;
}
