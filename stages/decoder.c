/* A stage's decoder layers in one call, for layers of the plain form: norm, QKV projection
 * (a bias or none), attention over the lanes' caches, output projection, optional post-norm,
 * residual; norm, gate and up projection, gated activation, down projection, optional
 * post-norm, residual; every matrix on our integer kernel (stages/decoder.py says which
 * layers qualify).
 *
 * Each step is the function the layers' Python path calls for it (skr_rms_norm,
 * skq_matmul, skr_attend_rows, skr_gated), with the same arguments, in the same order, and
 * the bias and residual adds are single float additions as torch's are: the same bits as
 * that path. What it saves is the path itself: about fifteen Python calls, tensor
 * allocations and ctypes conversions per layer, which on a one-row decode step of SmolLM2
 * cost as much as the layer's attention, norms and activation together. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

typedef struct {
    qmat qkv, out, gate_up, down;   /* gate_up: the gate's n / 2 outputs, then the up's */
    const float *qkv_bias;          /* [qkv.n] or NULL */
    const float *attn_norm, *post_attn_norm, *ffn_norm, *post_ffn_norm; /* NULL: none */
    const attn_shape *attn;
    int act;                        /* skr_gated's activation */
    float eps;                      /* the norms' */
} dec_layer;

/* x [rows][hidden] in place through layers [0, n_layers). kcache / vcache: per layer,
 * rows pointers (row r's lane cache of that layer), layer-major. Returns 0, or -1 when
 * scratch memory could not be had. */
int skd_layers(const dec_layer *L, int n_layers, float *x, int64_t rows, int64_t hidden,
               const int64_t *pos, float *const *kcache, float *const *vcache, int threads)
{
    int64_t wide = hidden; /* the widest row any step writes */
    for (int l = 0; l < n_layers; l++) {
        const dec_layer *d = &L[l];
        const int64_t att = (int64_t)d->attn->heads * d->attn->v_head_dim;
        wide = d->qkv.n > wide ? d->qkv.n : wide;
        wide = d->gate_up.n > wide ? d->gate_up.n : wide;
        wide = att > wide ? att : wide;
    }
    float *h = malloc((size_t)(rows * wide) * sizeof(float));
    float *y = malloc((size_t)(rows * wide) * sizeof(float));
    float *o = malloc((size_t)(rows * wide) * sizeof(float));
    int rc = (h && y && o) ? 0 : -1;
    for (int l = 0; l < n_layers && !rc; l++) {
        const dec_layer *d = &L[l];
        const int64_t att = (int64_t)d->attn->heads * d->attn->v_head_dim;
        const float *in = x;
        if (d->attn_norm) {
            skr_rms_norm(x, d->attn_norm, rows, hidden, 1, d->eps, h);
            in = h;
        }
        if ((rc = qmat_run(&d->qkv, in, rows, y, threads)))
            break;
        if (d->qkv_bias)
            for (int64_t r = 0; r < rows; r++)
                for (int64_t i = 0; i < d->qkv.n; i++)
                    y[r * d->qkv.n + i] += d->qkv_bias[i];
        memset(o, 0, (size_t)(rows * att) * sizeof(float));
        if ((rc = skr_attend_rows(d->attn, y, rows, pos, kcache + (int64_t)l * rows,
                                  vcache + (int64_t)l * rows, o, threads)))
            break;
        if ((rc = qmat_run(&d->out, o, rows, y, threads)))
            break;
        const float *mixed = y;
        if (d->post_attn_norm) {
            skr_rms_norm(y, d->post_attn_norm, rows, hidden, 1, d->eps, h);
            mixed = h;
        }
        for (int64_t i = 0; i < rows * hidden; i++)
            x[i] += mixed[i];
        in = x;
        if (d->ffn_norm) {
            skr_rms_norm(x, d->ffn_norm, rows, hidden, 1, d->eps, h);
            in = h;
        }
        if ((rc = qmat_run(&d->gate_up, in, rows, y, threads)))
            break;
        const int64_t ff = d->gate_up.n / 2;
        skr_gated(d->act, y, y + ff, rows, ff, d->gate_up.n, o, threads);
        if ((rc = qmat_run(&d->down, o, rows, y, threads)))
            break;
        mixed = y;
        if (d->post_ffn_norm) {
            skr_rms_norm(y, d->post_ffn_norm, rows, hidden, 1, d->eps, h);
            mixed = h;
        }
        for (int64_t i = 0; i < rows * hidden; i++)
            x[i] += mixed[i];
    }
    free(h); free(y); free(o);
    return rc;
}
