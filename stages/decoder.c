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

/* ---- Gemma 4 (stages/gemma4.py; stages/gemma4_run.py describes its layers) --------------
 * Its own layer form: per-head Q and K norms with weights and V's without, rope per layer
 * kind, layers that read another layer's KV, V as K's projection, the dense FFN beside
 * routed experts (26B-A4B), the per-layer embedding block, a scale on the layer's output.
 * The same functions and float operations as gemma4.py's path, in its order: its bits. */

typedef struct {
    const moe_block *moe;
    const float *router;          /* [n_expert][hidden] float32 (moe.c's own) */
    const float *router_scale;    /* ffn_gate_inp.scale [hidden] */
    const float *post_dense, *pre_experts, *post_experts;
    int64_t n_expert;
    float inv_sqrt_hidden;
} g4_experts;

typedef struct {
    qmat proj, gate, up;          /* this layer's rows of per_layer_model_proj; inp_gate; proj */
    const float *norm, *post_norm; /* per_layer_proj_norm; the block's post_norm */
    int64_t at;                   /* this layer's first column of the looked-up table rows */
    float proj_scale, mix_scale;
} g4_per_layer;

typedef struct {
    qmat qkv, out, gate_up, down; /* qkv: q | k | v, q | k (V is K's projection) or q */
    const float *attn_norm, *post_attn_norm, *ffn_norm, *post_ffn_norm;
    const float *q_norm, *k_norm; /* per head [head_dim] */
    const float *unit;            /* ones, at least [max(hidden, head_dim)]: weightless norms */
    const attn_shape *attn;       /* its rope_dim, rope_style, cos and sin are this layer's */
    int kv;                       /* 0: reads another layer's KV, 1: q | k | v, 2: q | k */
    float eps;
    const g4_experts *experts;    /* or NULL: the dense FFN alone */
    const g4_per_layer *per_layer; /* or NULL */
    const float *out_scale;       /* [1] or NULL */
} g4_layer;

/* Row r's q, k and v from y as Gemma4Attention prepares them: q and k normed per head with
 * their weights and rotated at pos[r], v normed without weight (K's projection before K's
 * norm where V has none); k and v into the lane's cache at pos[r], q into q_out [rows][H*D]. */
static void g4_qkv(const g4_layer *d, const float *y, int64_t rows, const int64_t *pos,
                   float *const *kc, float *const *vc, float *q_out)
{
    const attn_shape *A = d->attn;
    const int H = A->heads, G = A->kv_heads, D = A->head_dim, half = A->rope_dim / 2;
    for (int64_t r = 0; r < rows; r++) {
        const float *q = y + r * d->qkv.n, *c = A->cos + pos[r] * half;
        const float *s = A->sin + pos[r] * half;
        float *qo = q_out + r * H * D;
        skr_rms_norm(q, d->q_norm, H, D, 1, d->eps, qo);
        skr_rope(qo, H, D, A->rope_dim, c, s, A->rope_style);
        if (!d->kv)
            continue;
        const float *k = q + (int64_t)H * D, *v = d->kv == 2 ? k : k + (int64_t)G * D;
        float *kd = kc[r] + pos[r] * G * D;
        skr_rms_norm(v, d->unit, G, D, 1, d->eps, vc[r] + pos[r] * G * D);
        skr_rms_norm(k, d->k_norm, G, D, 1, d->eps, kd);
        skr_rope(kd, G, D, A->rope_dim, c, s, A->rope_style);
    }
}

/* The attention block of `in` into y (after `out`); scratch h, o. */
static int g4_attend(const g4_layer *d, const float *in, int64_t rows, const int64_t *pos,
                     float *const *kc, float *const *vc, float *y, float *h, float *o,
                     int threads)
{
    int rc = qmat_run(&d->qkv, in, rows, y, threads);
    if (rc)
        return rc;
    g4_qkv(d, y, rows, pos, kc, vc, o);
    if ((rc = skr_attend_cached(d->attn, o, rows, pos, kc, vc, h, threads)))
        return rc;
    return qmat_run(&d->out, h, rows, y, threads);
}

/* down(gelu_f16(gate(n)) * up(n)) of n = ffn_norm(x) into y; scratch h, o. */
static int g4_dense(const g4_layer *d, const float *x, int64_t rows, int64_t hidden,
                    float *y, float *h, float *o, int threads)
{
    skr_rms_norm(x, d->ffn_norm, rows, hidden, 1, d->eps, h);
    int rc = qmat_run(&d->gate_up, h, rows, y, threads);
    if (rc)
        return rc;
    const int64_t ff = d->gate_up.n / 2;
    skr_gated(2, y, y + ff, rows, ff, d->gate_up.n, o, threads);
    return qmat_run(&d->down, o, rows, y, threads);
}

/* Gemma4MoeFfn: post_dense(dense(x)) + post_experts(experts(pre_experts(x))), the router
 * reading the row normed without weight, times 1/sqrt(hidden), times its scale; into u
 * (scratch y, h, o, w). */
static int g4_experts_ffn(const g4_layer *d, const float *x, int64_t rows, int64_t hidden,
                          const uint8_t *real, float *u, float *y, float *h, float *o,
                          float *w, int threads)
{
    const g4_experts *e = d->experts;
    int rc = g4_dense(d, x, rows, hidden, y, h, o, threads);
    if (rc)
        return rc;
    skr_rms_norm(y, e->post_dense, rows, hidden, 1, d->eps, u);
    skr_rms_norm(x, d->unit, rows, hidden, 1, d->eps, h);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < hidden; i++)
            h[r * hidden + i] = h[r * hidden + i] * e->inv_sqrt_hidden * e->router_scale[i];
    skr_linear_f32(h, hidden, e->router, rows, hidden, e->n_expert, w, e->n_expert, threads);
    skr_rms_norm(x, e->pre_experts, rows, hidden, 1, d->eps, h);
    if ((rc = skm_moe(e->moe, h, rows, real, w, y, threads)))
        return rc;
    skr_rms_norm(y, e->post_experts, rows, hidden, 1, d->eps, h);
    for (int64_t i = 0; i < rows * hidden; i++)
        u[i] += h[i];
    return 0;
}

/* The per-layer embedding block, added to x: post_norm(up(gelu_f16(gate(x)) * p)) with
 * p = (norm(proj(x0) * proj_scale) + table columns) * mix_scale (PerLayerInputs); scratch
 * y, h, o. looked: [rows][width] table rows already scaled. */
static int g4_per_layer_add(const g4_layer *d, float *x, const float *x0, const float *looked,
                            int64_t width, int64_t rows, int64_t hidden, float *y, float *h,
                            float *o, int threads)
{
    const g4_per_layer *p = d->per_layer;
    const int64_t P = p->proj.n;
    int rc = qmat_run(&p->proj, x0, rows, y, threads);
    if (rc)
        return rc;
    for (int64_t i = 0; i < rows * P; i++)
        y[i] = y[i] * p->proj_scale;
    skr_rms_norm(y, p->norm, rows, P, 1, d->eps, h);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < P; i++)
            h[r * P + i] = (h[r * P + i] + looked[r * width + p->at + i]) * p->mix_scale;
    if ((rc = qmat_run(&p->gate, x, rows, y, threads)))
        return rc;
    skr_gated(2, y, h, rows, P, P, o, threads);
    if ((rc = qmat_run(&p->up, o, rows, y, threads)))
        return rc;
    skr_rms_norm(y, p->post_norm, rows, hidden, 1, d->eps, h);
    for (int64_t i = 0; i < rows * hidden; i++)
        x[i] += h[i];
    return 0;
}

/* x += norm(y) (norm's output in h). */
static void add_normed(float *x, const float *y, const float *w, int64_t rows, int64_t hidden,
                       float eps, float *h)
{
    skr_rms_norm(y, w, rows, hidden, 1, eps, h);
    for (int64_t i = 0; i < rows * hidden; i++)
        x[i] += h[i];
}

/* The widest row a Gemma 4 layer's steps write. */
static int64_t g4_wide(const g4_layer *d, int64_t hidden)
{
    const int64_t att = (int64_t)d->attn->heads * d->attn->head_dim;
    const int64_t w[] = {hidden, d->qkv.n, d->gate_up.n, att,
                         d->experts ? d->experts->n_expert : 0,
                         d->per_layer ? d->per_layer->proj.n : 0};
    int64_t wide = 0;
    for (int i = 0; i < 6; i++)
        wide = w[i] > wide ? w[i] : wide;
    return wide;
}

/* One Gemma 4 layer on x in place (Gemma4Layer.forward); scratch b[0..4] [rows][wide]. */
static int g4_layer_run(const g4_layer *d, float *x, int64_t rows, int64_t hidden,
                        const float *x0, const float *looked, int64_t width,
                        const int64_t *pos, float *const *kc, float *const *vc,
                        const uint8_t *real, float *const *b, int threads)
{
    float *h = b[0], *y = b[1], *o = b[2], *u = b[3];
    skr_rms_norm(x, d->attn_norm, rows, hidden, 1, d->eps, h);
    int rc = g4_attend(d, h, rows, pos, kc, vc, y, u, o, threads);
    if (rc)
        return rc;
    add_normed(x, y, d->post_attn_norm, rows, hidden, d->eps, h);
    if (d->experts)
        rc = g4_experts_ffn(d, x, rows, hidden, real, u, y, h, o, b[4], threads);
    else
        rc = g4_dense(d, x, rows, hidden, u, h, o, threads);
    if (rc)
        return rc;
    add_normed(x, u, d->post_ffn_norm, rows, hidden, d->eps, h);
    if (d->per_layer
        && (rc = g4_per_layer_add(d, x, x0, looked, width, rows, hidden, y, h, o, threads)))
        return rc;
    if (d->out_scale)
        for (int64_t i = 0; i < rows * hidden; i++)
            x[i] = x[i] * *d->out_scale;
    return 0;
}

/* skd_layers for Gemma 4's layers; x0 [rows][hidden] (the scaled token embeddings) and
 * looked [rows][width] (the per-layer table's rows, scaled) where the layers have
 * per-layer inputs, else NULL. */
int skd_gemma4_layers(const g4_layer *L, int n_layers, float *x, int64_t rows, int64_t hidden,
                      const float *x0, const float *looked, int64_t width, const int64_t *pos,
                      float *const *kcache, float *const *vcache, const uint8_t *real,
                      int threads)
{
    int64_t wide = 0;
    for (int l = 0; l < n_layers; l++)
        wide = g4_wide(&L[l], hidden) > wide ? g4_wide(&L[l], hidden) : wide;
    float *b[5];
    int rc = 0;
    for (int i = 0; i < 5; i++)
        if (!(b[i] = malloc((size_t)(rows * wide) * sizeof(float))))
            rc = -1;
    for (int l = 0; l < n_layers && !rc; l++)
        rc = g4_layer_run(&L[l], x, rows, hidden, x0, looked, width, pos,
                          kcache + (int64_t)l * rows, vcache + (int64_t)l * rows, real, b,
                          threads);
    for (int i = 0; i < 5; i++)
        free(b[i]);
    return rc;
}
