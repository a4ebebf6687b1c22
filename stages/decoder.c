/* A stage's decoder layers in one call, for layers of the plain form: norm, QKV projection
 * (a bias or none, a clamp or none, RMS norms over the whole Q and K or none), attention
 * over the lanes' caches, output projection (or latent attention, DeepSeek2's), optional
 * post-norm, residual; norm, FFN (gate and up, gated activation, down; or a mixture of
 * experts, moe.c), optional post-norm, residual; every matrix on our integer kernel
 * (stages/decoder.py says which layers qualify). A norm is RMS with a weight or LayerNorm
 * without one (OLMo).
 *
 * Each step is the function the layers' Python path calls for it (skr_rms_norm,
 * skr_layer_norm, skq_matmul, skr_attend_rows, skr_linear_f32_heads, skr_gated, skm_moe),
 * with the same arguments, in the same order, and the bias and residual adds and the clamp
 * are single float operations as torch's are: the same bits as that path. What it saves is
 * the path itself: about fifteen Python calls, tensor allocations and ctypes conversions per
 * layer, which on a one-row decode step of SmolLM2 cost as much as the layer's attention,
 * norms and activation together. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

typedef struct {
    int kind;       /* 0: none, 1: RMS times w, 2: LayerNorm without weight or bias */
    const float *w;
} dec_norm;

/* Latent attention (DeepSeek2 / GLM-4.7 Flash; stages/mla.py MlaAttention._rows): the
 * normed row's first product gives the query input and the latent row; per head W_kb q_nope
 * and q_pe, beside the latent row [norm(c), k_pe], go to attention.c (the attn shape's
 * v_row: values inside the latent rows), then W_vb per head; the layer's `out` after. */
typedef struct {
    qmat first, q_b;      /* q_b.n == 0: no query LoRA (first's query columns are q) */
    const float *q_a_norm, *kv_a_norm;
    const float *k_b, *v_b; /* [heads][lora][nope], [heads][v_head][lora] */
    int64_t q_cols;       /* first's query columns */
    int64_t heads, nope, rope, lora, v_head;
} dec_mla;

typedef struct {
    qmat qkv, out, gate_up, down;   /* gate_up: the gate's n / 2 outputs, then the up's */
    const float *qkv_bias;          /* [qkv.n] or NULL */
    dec_norm attn_norm, post_attn_norm, ffn_norm, post_ffn_norm;
    const attn_shape *attn;
    int act;                        /* skr_gated's activation */
    float eps;                      /* the norms' */
    float clamp;                    /* > 0: Q, K and V clamped to [-clamp, clamp] */
    const float *q_norm, *k_norm;   /* RMS over the whole Q and the whole K, or NULL */
    int64_t q_cols, k_cols;
    const moe_block *moe;           /* the FFN's experts (gate_up, down unused), or NULL */
    const dec_mla *mla;             /* latent attention (qkv and the tail unused), or NULL */
} dec_layer;

/* x normed into h (returned), or x itself where there is no norm. */
static const float *normed(const dec_norm *n, const float *x, int64_t rows, int64_t hidden,
                           float eps, float *h)
{
    if (n->kind == 1)
        skr_rms_norm(x, n->w, rows, hidden, 1, eps, h);
    else if (n->kind == 2)
        skr_layer_norm(x, rows, hidden, eps, h);
    return n->kind ? h : x;
}

/* The projection's bias, clamp and whole-Q / whole-K norms on y [rows][qkv.n], in place
 * (h: scratch of a row). */
static void project_tail(const dec_layer *d, float *y, int64_t rows, float *h)
{
    const int64_t n = d->qkv.n;
    if (d->qkv_bias)
        for (int64_t r = 0; r < rows; r++)
            for (int64_t i = 0; i < n; i++)
                y[r * n + i] += d->qkv_bias[i];
    if (d->clamp > 0) {
        const float lo = -d->clamp, hi = d->clamp;
        for (int64_t i = 0; i < rows * n; i++) /* NaN stays NaN, as torch's clamp */
            y[i] = y[i] < lo ? lo : (y[i] > hi ? hi : y[i]);
    }
    if (d->q_norm)
        for (int64_t r = 0; r < rows; r++) {
            float *q = y + r * n, *k = q + d->q_cols;
            skr_rms_norm(q, d->q_norm, 1, d->q_cols, 1, d->eps, h);
            memcpy(q, h, sizeof(float) * d->q_cols);
            skr_rms_norm(k, d->k_norm, 1, d->k_cols, 1, d->eps, h);
            memcpy(k, h, sizeof(float) * d->k_cols);
        }
}

/* MLA's widest row of scratch. */
static int64_t mla_wide(const dec_mla *m)
{
    const int64_t D = m->lora + m->rope, w[] = {m->first.n, m->q_b.n, (m->heads + 1) * D,
                                                 m->heads * m->lora, m->heads * m->v_head};
    int64_t wide = 0;
    for (int i = 0; i < 5; i++)
        wide = w[i] > wide ? w[i] : wide;
    return wide;
}

/* The latent attention of `in` into y (before `out`), as mla.py's _rows for rows in order;
 * scratch h, o, u [rows][wide]. */
static int mla_attend(const dec_layer *d, const float *in, int64_t rows, const int64_t *pos,
                      float *const *cache, float *y, float *h, float *o, float *u, int threads)
{
    const dec_mla *m = d->mla;
    const int64_t H = m->heads, L = m->lora, D = L + m->rope, kh = m->nope + m->rope;
    const int64_t fn = m->first.n, rw = (H + 1) * D;
    int rc = qmat_run(&m->first, in, rows, y, threads);
    if (rc)
        return rc;
    const float *q = y;
    int64_t qs = fn;
    if (m->q_b.n) {
        for (int64_t r = 0; r < rows; r++)
            skr_rms_norm(y + r * fn, m->q_a_norm, 1, m->q_cols, 1, d->eps, h + r * m->q_cols);
        if ((rc = qmat_run(&m->q_b, h, rows, o, threads)))
            return rc;
        q = o;
        qs = m->q_b.n;
    }
    skr_linear_f32_heads(q, qs, kh, m->k_b, L * m->nope, H, rows, m->nope, L, u, rw, D, threads);
    for (int64_t r = 0; r < rows; r++) {
        float *row = u + r * rw;
        for (int64_t i = 0; i < H; i++)
            memcpy(row + i * D + L, q + r * qs + i * kh + m->nope, sizeof(float) * m->rope);
        const float *ckv = y + r * fn + m->q_cols;
        skr_rms_norm(ckv, m->kv_a_norm, 1, L, 1, d->eps, row + H * D);
        memcpy(row + H * D + L, ckv + L, sizeof(float) * m->rope);
    }
    if ((rc = skr_attend_rows(d->attn, u, rows, pos, cache, cache, h, threads)))
        return rc;
    skr_linear_f32_heads(h, H * L, L, m->v_b, m->v_head * L, H, rows, L, m->v_head, o,
                         H * m->v_head, m->v_head, threads);
    return qmat_run(&d->out, o, rows, y, threads);
}

/* x [rows][hidden] in place through layers [0, n_layers). kcache / vcache: per layer,
 * rows pointers (row r's lane cache of that layer), layer-major. real: moe.c's (NULL: every
 * row is real). Returns 0, or -1 when scratch memory could not be had. */
int skd_layers(const dec_layer *L, int n_layers, float *x, int64_t rows, int64_t hidden,
               const int64_t *pos, float *const *kcache, float *const *vcache,
               const uint8_t *real, int threads)
{
    int64_t wide = hidden; /* the widest row any step writes */
    for (int l = 0; l < n_layers; l++) {
        const dec_layer *d = &L[l];
        const int64_t att = (int64_t)d->attn->heads * d->attn->v_head_dim;
        wide = d->qkv.n > wide ? d->qkv.n : wide;
        wide = d->gate_up.n > wide ? d->gate_up.n : wide;
        wide = att > wide ? att : wide;
        if (d->mla)
            wide = mla_wide(d->mla) > wide ? mla_wide(d->mla) : wide;
    }
    float *h = malloc((size_t)(rows * wide) * sizeof(float));
    float *y = malloc((size_t)(rows * wide) * sizeof(float));
    float *o = malloc((size_t)(rows * wide) * sizeof(float));
    float *u = malloc((size_t)(rows * wide) * sizeof(float));
    int rc = (h && y && o && u) ? 0 : -1;
    for (int l = 0; l < n_layers && !rc; l++) {
        const dec_layer *d = &L[l];
        const int64_t att = (int64_t)d->attn->heads * d->attn->v_head_dim;
        const float *in = normed(&d->attn_norm, x, rows, hidden, d->eps, h);
        if (d->mla) {
            if ((rc = mla_attend(d, in, rows, pos, kcache + (int64_t)l * rows, y, h, o, u,
                                 threads)))
                break;
        } else {
            if ((rc = qmat_run(&d->qkv, in, rows, y, threads)))
                break;
            project_tail(d, y, rows, h);
            memset(o, 0, (size_t)(rows * att) * sizeof(float));
            if ((rc = skr_attend_rows(d->attn, y, rows, pos, kcache + (int64_t)l * rows,
                                      vcache + (int64_t)l * rows, o, threads)))
                break;
            if ((rc = qmat_run(&d->out, o, rows, y, threads)))
                break;
        }
        const float *mixed = normed(&d->post_attn_norm, y, rows, hidden, d->eps, h);
        for (int64_t i = 0; i < rows * hidden; i++)
            x[i] += mixed[i];
        in = normed(&d->ffn_norm, x, rows, hidden, d->eps, h);
        if (d->moe) {
            if ((rc = skm_moe(d->moe, in, rows, real, NULL, y, threads)))
                break;
        } else {
            if ((rc = qmat_run(&d->gate_up, in, rows, y, threads)))
                break;
            const int64_t ff = d->gate_up.n / 2;
            skr_gated(d->act, y, y + ff, rows, ff, d->gate_up.n, o, threads);
            if ((rc = qmat_run(&d->down, o, rows, y, threads)))
                break;
        }
        mixed = normed(&d->post_ffn_norm, y, rows, hidden, d->eps, h);
        for (int64_t i = 0; i < rows * hidden; i++)
            x[i] += mixed[i];
    }
    free(h); free(y); free(o); free(u);
    return rc;
}
