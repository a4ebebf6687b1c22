/* The recurrent mixers' per-token arithmetic (stages/shortconv.py, mamba2.py, deltanet.py):
 * the depthwise causal convolution and the Mamba2 and gated DeltaNet scans, token by token.
 *
 * Every token is computed by one fixed sequence of float operations, so a row's bits and
 * the state after it depend only on the tokens so far: never on how many rows share the
 * call, where it starts, the thread count (threads split channels or heads, never a sum)
 * or the instruction set (the plain C loops below are what the compiler vectorizes, with
 * no contraction into FMAs; transcendental functions are our own polynomials, as
 * rowops.c's exp_poly, not libm's or torch's, whose vector body and scalar tail round
 * differently; sums go through 8 fixed lanes, as rowops.c's dot). */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fmath.h"

/* log1p(u) for 0 <= u < 2^64 (an exp_poly result), branch-free: w = 1 + u = m 2^k with
 * m in [sqrt(1/2), sqrt(2)), log m = 2 atanh(s), s = (m - 1) / (m + 1), by its odd series
 * to s^13 (|s| <= 0.172: relative error ~1e-9 before rounding); then scaled by
 * u / (w - 1), which puts back what rounding 1 + u lost (u itself where w rounds to 1). */
static inline float log1p_poly(float u)
{
    const float w = 1.0f + u;
    union { float f; int32_t i; } b = {.f = w};
    int32_t k = ((b.i >> 23) & 0xff) - 127;
    b.i = (b.i & 0x7fffff) | 0x3f800000; /* m in [1, 2) */
    const int big = b.f > 1.41421356f;
    const float m = big ? b.f * 0.5f : b.f;
    k = big ? k + 1 : k;
    const float s = (m - 1.0f) / (m + 1.0f);
    const float s2 = s * s;
    float p = 1.0f / 13.0f;
    p = p * s2 + 1.0f / 11.0f;
    p = p * s2 + 1.0f / 9.0f;
    p = p * s2 + 1.0f / 7.0f;
    p = p * s2 + 1.0f / 5.0f;
    p = p * s2 + 1.0f / 3.0f;
    const float lm = (2.0f * s) + (2.0f * s) * (s2 * p);
    const float kf = (float)k;
    const float lw = kf * 0.693145752f + (lm + kf * 1.42860677e-6f);
    const float d = w - 1.0f;
    return d == 0.0f ? u : lw * (u / d);
}

/* softplus as torch's and ggml's: x above 20, else log1p(exp(x)). */
static inline float softplus(float x)
{
    const float y = log1p_poly(exp_poly(x));
    return x > 20.0f ? x : y;
}

static inline float sigmoid(float x)
{
    return 1.0f / (1.0f + exp_poly(-x));
}

static inline float silu(float x)
{
    return x / (1.0f + exp_poly(-x)); /* rowops.c skr_gated's silu */
}

/* A depthwise causal convolution of `width` taps over ch channels: out[t][c] for the n
 * rows of x (rows x_stride floats apart) after the width - 1 rows of state ([width - 1,
 * ch]), the taps ([width, ch], tap 0 on the oldest row) summed oldest first from the
 * first product (as ggml_ssm_conv and layers.causal_conv sum them), then + bias[c]
 * (bias may be NULL) and, act 1, SiLU. Rows above 16 split over torch's OpenMP team. */
void skr_scan_conv(const float *state, const float *x, int64_t x_stride, int64_t n,
                   int64_t ch, const float *taps, int width, const float *bias, int act,
                   float *out, int threads)
{
#pragma omp parallel for schedule(static) num_threads(threads) if (n > 16)
    for (int64_t t = 0; t < n; t++) {
        float *o = out + t * ch;
        for (int j = 0; j < width; j++) {
            const int64_t row = t + j - (width - 1); /* < 0: a state row */
            const float *in = row < 0 ? state + (width - 1 + row) * ch : x + row * x_stride;
            const float *w = taps + (int64_t)j * ch;
            if (j == 0)
                for (int64_t c = 0; c < ch; c++)
                    o[c] = in[c] * w[c];
            else
                for (int64_t c = 0; c < ch; c++)
                    o[c] = o[c] + in[c] * w[c];
        }
        if (bias)
            for (int64_t c = 0; c < ch; c++)
                o[c] = o[c] + bias[c];
        if (act == 1)
            for (int64_t c = 0; c < ch; c++)
                o[c] = silu(o[c]);
    }
}

/* The Mamba2 selective scan over n tokens (stages/mamba2.py says the formula). xbc: the
 * conv output rows [n, d_inner + 2 * groups * d_state] (x, B, C); dt: the raw time steps
 * (rows dt_stride floats apart, n_head each); state_in / state_out [n_head, head_dim,
 * d_state]: state_out is the state after token n_real - 1 (later tokens pad a chunk: their
 * outputs are computed, the state skips them). y [n, n_head * head_dim]. Heads split over
 * the OpenMP team; a head's tokens run in order. Returns -1 without scratch memory. */
int skr_scan_mamba2(const float *xbc, int64_t n, int64_t n_real, const float *dt,
                    int64_t dt_stride, const float *dt_bias, const float *A, const float *D,
                    int n_head, int head_dim, int d_state, int groups,
                    const float *state_in, float *state_out, float *y, int threads)
{
    const int64_t d_inner = (int64_t)n_head * head_dim, hs = (int64_t)head_dim * d_state;
    const int64_t width = d_inner + 2 * (int64_t)groups * d_state;
    const int rep = n_head / groups;
    int failed = 0;
#pragma omp parallel for schedule(static) num_threads(threads) if (n * hs * n_head > 1 << 16)
    for (int h = 0; h < n_head; h++) {
        float *s = state_out + h * hs, *pad = NULL;
        memcpy(s, state_in + h * hs, sizeof(float) * (size_t)hs);
        const int64_t g = h / rep;
        for (int64_t t = 0; t < n; t++) {
            if (t == n_real) { /* padding rows: on a copy, the state stays at n_real */
                pad = malloc(sizeof(float) * (size_t)hs);
                if (!pad) {
#pragma omp atomic write
                    failed = 1;
                    break;
                }
                memcpy(pad, s, sizeof(float) * (size_t)hs);
                s = pad;
            }
            const float *row = xbc + t * width;
            const float *x = row + (int64_t)h * head_dim;
            const float *B = row + d_inner + g * d_state;
            const float *C = row + d_inner + (groups + g) * d_state;
            const float dts = softplus(dt[t * dt_stride + h] + dt_bias[h]);
            const float dA = exp_poly(dts * A[h]);
            float *yt = y + t * d_inner + (int64_t)h * head_dim;
            for (int p = 0; p < head_dim; p++) {
                float *sp = s + (int64_t)p * d_state;
                const float xdt = x[p] * dts;
                for (int i = 0; i < d_state; i++)
                    sp[i] = sp[i] * dA + B[i] * xdt;
                yt[p] = dot(sp, C, d_state) + x[p] * D[h];
            }
        }
        free(pad);
    }
    return failed ? -1 : 0;
}

/* The gated delta rule over n tokens (stages/deltanet.py says the formula). q, k: the
 * L2-normed rows [n, n_k, d] (rows qk_stride floats apart); v [n, n_v, d] (v_stride);
 * ba: the raw betas and alphas (rows ba_stride floats apart; per key head its rep value
 * heads' betas, then their alphas); dt_bias, A [n_v]; state_in / state_out [n_v, d (j),
 * d (i)] (state[j][i] = S[i][j]), state_out after token n_real - 1 as in skr_scan_mamba2;
 * out [n, n_v, d], scaled by `scale`. Value head h reads key head h / (n_v / n_k). */
int skr_scan_deltanet(const float *q, const float *k, int64_t qk_stride, const float *v,
                      int64_t v_stride, const float *ba, int64_t ba_stride, int64_t n,
                      int64_t n_real, const float *dt_bias, const float *A, int n_k, int n_v,
                      int d, float scale, const float *state_in, float *state_out, float *out,
                      int threads)
{
    const int64_t hs = (int64_t)d * d;
    const int rep = n_v / n_k;
    int failed = 0;
#pragma omp parallel for schedule(static) num_threads(threads) if (n * hs * n_v > 1 << 16)
    for (int h = 0; h < n_v; h++) {
        float *s = state_out + h * hs, *pad = NULL;
        memcpy(s, state_in + h * hs, sizeof(float) * (size_t)hs);
        const int kh = h / rep, r = h % rep;
        for (int64_t t = 0; t < n; t++) {
            if (t == n_real) {
                pad = malloc(sizeof(float) * (size_t)hs);
                if (!pad) {
#pragma omp atomic write
                    failed = 1;
                    break;
                }
                memcpy(pad, s, sizeof(float) * (size_t)hs);
                s = pad;
            }
            const float *qt = q + t * qk_stride + (int64_t)kh * d;
            const float *kt = k + t * qk_stride + (int64_t)kh * d;
            const float *vt = v + t * v_stride + (int64_t)h * d;
            const float *bt = ba + t * ba_stride + (int64_t)kh * 2 * rep;
            const float beta = sigmoid(bt[r]);
            const float decay = exp_poly(softplus(bt[rep + r] + dt_bias[h]) * A[h]);
            float *o = out + (t * n_v + h) * d;
            for (int j = 0; j < d; j++) {
                float *sj = s + (int64_t)j * d;
                for (int i = 0; i < d; i++)
                    sj[i] = sj[i] * decay;
                const float delta = (vt[j] - dot(sj, kt, d)) * beta;
                for (int i = 0; i < d; i++)
                    sj[i] = sj[i] + delta * kt[i];
                o[j] = dot(sj, qt, d) * scale;
            }
        }
        free(pad);
    }
    return failed ? -1 : 0;
}
