/* Per-row operations of a stage, each one call instead of several torch ops: a decode
 * step runs ~35 small ops per layer, and at one row their dispatch costs more than their
 * arithmetic (evals/README.md, torch runtime).
 *
 * Every row is computed alone, by a fixed sequence of float operations: a row's bits do
 * not depend on the rows beside it, the thread count or the instruction set (the plain C
 * loops below are what the compiler vectorizes; sums go through 8 fixed lanes, then
 * ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))). */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 8

static inline float hsum8(const float *l)
{
    return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
}

/* sum a[i] * b[i] over n (n a multiple of 8 or not: the tail joins lane i % 8). */
static inline float dot(const float *a, const float *b, int64_t n)
{
    float l[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int j = 0; j < LANES; j++)
            l[j] += a[i + j] * b[i + j];
    for (int j = 0; i < n; i++, j++)
        l[j] += a[i] * b[i];
    return hsum8(l);
}

/* exp(x) for x <= 0, as a polynomial (vectorizable, unlike libm's expf): x = n ln2 + r,
 * |r| <= ln2 / 2, exp(r) by its degree-6 Taylor polynomial (relative error ~2e-7). */
static inline float exp_neg(float x)
{
    if (x < -87.0f)
        return 0.0f;
    const float t = x * 1.44269504f;
    const float n = (t + 12582912.0f) - 12582912.0f; /* round to nearest */
    const float r = (x - n * 0.693145752f) - n * 1.42860677e-6f;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    union { float f; int32_t i; } s = {.i = ((int32_t)n + 127) << 23};
    return p * s.f;
}

/* out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w[r % w_rows], the mean summed in double
 * in input order, as llama.cpp's rms_norm sums it. */
void skr_rms_norm(const float *x, const float *w, int64_t rows, int64_t k, int64_t w_rows,
                  float eps, float *out)
{
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * k;
        const float *wr = w + (r % w_rows) * k;
        double sum = 0.0;
        for (int64_t i = 0; i < k; i++)
            sum += (double)(xr[i] * xr[i]);
        const float scale = 1.0f / sqrtf((float)(sum / (double)k) + eps);
        for (int64_t i = 0; i < k; i++)
            out[r * k + i] = (xr[i] * scale) * wr[i];
    }
}

/* Rotate the first `dim` values of each of `heads` rows of length `hd` in place by the
 * angle table row (cos, sin: dim / 2 each). style 0: pairs (2i, 2i + 1); 1 (neox):
 * (i, i + dim / 2). */
static void rope(float *x, int heads, int hd, int dim, const float *c, const float *s,
                 int style)
{
    const int half = dim / 2;
    for (int h = 0; h < heads; h++) {
        float *v = x + (int64_t)h * hd;
        for (int i = 0; i < half; i++) {
            const int a = style ? i : 2 * i, b = style ? i + half : 2 * i + 1;
            const float x0 = v[a], x1 = v[b];
            v[a] = x0 * c[i] - x1 * s[i];
            v[b] = x0 * s[i] + x1 * c[i];
        }
    }
}

typedef struct {
    int heads, kv_heads, head_dim, v_head_dim, rope_dim, rope_style, window;
    float eps, scale;
    const float *qk_norm; /* [(heads + kv_heads), head_dim] or NULL */
    const float *cos, *sin; /* angle tables [positions, rope_dim / 2] */
    float softcap; /* > 0: scores become softcap * tanh(score / softcap) (Gemma 2) */
} attn_shape;

/* One head's attention of query q over keys [lo, hi) of a token-major cache. */
static void attend_head(const attn_shape *A, const float *q, const float *kc, const float *vc,
                        int g, int64_t lo, int64_t hi, float *scores, float *out)
{
    const int D = A->head_dim, Dv = A->v_head_dim;
    float m = -INFINITY;
    for (int64_t l = lo; l < hi; l++) {
        float s = dot(q, kc + (l * A->kv_heads + g) * D, D) * A->scale;
        /* libm's tanhf, as ggml's tanh calls it; one scalar call in every build */
        if (A->softcap > 0.0f)
            s = tanhf(s * (1.0f / A->softcap)) * A->softcap;
        scores[l - lo] = s;
        m = s > m ? s : m;
    }
    float sum = 0.0f;
    for (int64_t l = lo; l < hi; l++) {
        const float p = exp_neg(scores[l - lo] - m);
        scores[l - lo] = p;
        sum += p;
    }
    for (int d = 0; d < Dv; d++)
        out[d] = 0.0f;
    for (int64_t l = lo; l < hi; l++) {
        const float p = scores[l - lo];
        const float *v = vc + (l * A->kv_heads + g) * Dv;
        for (int d = 0; d < Dv; d++)
            out[d] += p * v[d];
    }
    const float inv = 1.0f / sum;
    for (int d = 0; d < Dv; d++)
        out[d] *= inv;
}

void skp_run(int threads, int64_t items, void (*fn)(void *, int64_t, int64_t), void *arg);

typedef struct {
    const attn_shape *A;
    float *qkv;
    int64_t width;
    const int64_t *pos;
    float *const *kcache, *const *vcache;
    float *out, *scratch;
    int64_t longest;
} heads_job;

/* (row, head) pairs [b, e): each one thread's. */
static void heads(void *arg, int64_t b, int64_t e)
{
    const heads_job *J = arg;
    const attn_shape *A = J->A;
    const int H = A->heads, G = A->kv_heads, D = A->head_dim, Dv = A->v_head_dim;
    for (int64_t rh = b; rh < e; rh++) {
        const int64_t r = rh / H;
        const int h = (int)(rh % H);
        const int64_t hi = J->pos[r] + 1;
        const int64_t lo = A->window && hi > A->window ? hi - A->window : 0;
        attend_head(A, J->qkv + r * J->width + (int64_t)h * D, J->kcache[r], J->vcache[r],
                    h / (H / G), lo, hi, J->scratch + rh * J->longest, J->out + (r * H + h) * Dv);
    }
}

/* Attention of `rows` query rows (q: [rows, width], row r's heads first), row r the next
 * token of a lane at pos[r] whose k and v are already in that lane's cache (kcache[r],
 * vcache[r]: token-major [cap, kv_heads, D]), over its keys [lo, pos[r]] (lo: the sliding
 * window's start). out: [rows, heads * v_head_dim]. Heads run in parallel; each head is
 * one thread's. */
static int attend_rows(const attn_shape *A, float *q, int64_t width, int64_t rows,
                       const int64_t *pos, float *const *kcache, float *const *vcache,
                       float *out, int threads)
{
    const int H = A->heads, D = A->head_dim;
    int64_t longest = 1;
    for (int64_t r = 0; r < rows; r++)
        longest = pos[r] + 1 > longest ? pos[r] + 1 : longest;
    float *scratch = malloc(sizeof(float) * (size_t)(longest * rows * H));
    if (!scratch)
        return -1;
    heads_job J = {A, q, width, pos, kcache, vcache, out, scratch, longest};
    /* threads pay off on long contexts only */
    skp_run(rows * H * longest * D > 65536 ? threads : 1, rows * H, heads, &J);
    free(scratch);
    return 0;
}

/* Decode attention for `rows` rows, each one lane's next token: row r's qkv output
 * (q heads, k heads, v heads) takes its q/k norms and rope at pos[r], writes its k and v
 * at pos[r] of that lane's cache, and attends as attend_rows says. */
int skr_attend_decode(const attn_shape *A, float *qkv, int64_t rows, const int64_t *pos,
                      float *const *kcache, float *const *vcache, float *out, int threads)
{
    const int H = A->heads, G = A->kv_heads, D = A->head_dim, Dv = A->v_head_dim;
    const int64_t width = (int64_t)(H + G) * D + (int64_t)G * Dv;
    for (int64_t r = 0; r < rows; r++) {
        float *qk = qkv + r * width;
        if (A->qk_norm)
            skr_rms_norm(qk, A->qk_norm, H + G, D, H + G, A->eps, qk);
        rope(qk, H + G, D, A->rope_dim, A->cos + pos[r] * (A->rope_dim / 2),
             A->sin + pos[r] * (A->rope_dim / 2), A->rope_style);
        memcpy(kcache[r] + pos[r] * G * D, qk + (int64_t)H * D, sizeof(float) * G * D);
        memcpy(vcache[r] + pos[r] * G * Dv, qk + (int64_t)(H + G) * D, sizeof(float) * G * Dv);
    }
    return attend_rows(A, qkv, width, rows, pos, kcache, vcache, out, threads);
}

/* Decode attention of q ([rows, heads * head_dim], normed and rotated) for a family that
 * prepares its own rows and writes their k and v itself (Gemma 4: its own norms, and
 * shared-KV layers that read another layer's cache); A's qk_norm and rope are unused. */
int skr_attend_cached(const attn_shape *A, float *q, int64_t rows, const int64_t *pos,
                      float *const *kcache, float *const *vcache, float *out, int threads)
{
    return attend_rows(A, q, (int64_t)A->heads * A->head_dim, rows, pos, kcache, vcache, out,
                       threads);
}

/* out[r][c] = sum over i of (codes[idx[r][c]][i] * scale[idx[r][c]][i / 32]) * x[r][i]:
 * a Q8_0 matrix's float32 values at the rows idx picks, times x (the head's rescoring). */
int skr_rows_dot(const int8_t *codes, const float *scale, int64_t k, const int64_t *idx,
                 int64_t rows, int64_t top, const float *x, float *out)
{
    float *w = malloc(sizeof(float) * (size_t)k);
    if (!w)
        return -1;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < top; c++) {
            const int64_t n = idx[r * top + c];
            for (int64_t i = 0; i < k; i++)
                w[i] = (float)codes[n * k + i] * scale[n * (k / 32) + i / 32];
            out[r * top + c] = dot(w, x + r * k, k);
        }
    free(w);
    return 0;
}
