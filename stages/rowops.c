/* Per-row operations of a stage, each one call instead of several torch ops: a decode
 * step runs ~35 small ops per layer, and at one row their dispatch costs more than their
 * arithmetic (evals/README.md, torch runtime).
 *
 * Every row is computed alone, by a fixed sequence of float operations: a row's bits do
 * not depend on the rows beside it, the thread count or the instruction set (the plain C
 * loops below are what the compiler vectorizes; sums go through 8 fixed lanes, then
 * ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))). */

#include <math.h>
#include <stdatomic.h>
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

/* Attention reads keys in blocks of KB from position 0 (0, KB, 2 KB, ...: fixed by the
 * position alone) with an online softmax, so a query row's float operations are one
 * sequence fixed by its position and window: a decode row, a row of a 2,000-row prefill
 * and a row beside other lanes are computed alike (DESIGN.md §5.3, row-invariant). Up to
 * TR consecutive rows of one lane share each block's keys (read once, transposed), which
 * is where prefill's speed comes from; each row's sums stay its own. */
#define KB 32
#define TR 4

typedef struct {
    const attn_shape *A;
    const float *q;
    int64_t width;
    const int64_t *pos, *tile0; /* tile t: rows [tile0[t], tile0[t + 1]) of one lane */
    float *const *kcache, *const *vcache;
    float *out;
} attn_job;

/* One row's step over the block at b0, its scores in s (raw dot products): scale, cap,
 * mask to the row's keys [lo, hi), then fold the block into the running max m, sum l and
 * accumulator acc[Dv]. */
static void fold_block(const attn_shape *A, float *s, int64_t b0, int64_t lo, int64_t hi,
                       const float *vc, int g, float *m, float *l, float *acc)
{
    const int64_t a = (lo > b0 ? lo : b0) - b0, e = (hi < b0 + KB ? hi : b0 + KB) - b0;
    if (a >= e)
        return; /* none of this row's keys: the block is not one of its blocks */
    const int G = A->kv_heads, Dv = A->v_head_dim;
    float bm = -INFINITY;
    for (int j = 0; j < KB; j++) {
        float x = s[j] * A->scale;
        /* libm's tanhf, as ggml's tanh calls it; one scalar call in every build */
        if (A->softcap > 0.0f)
            x = tanhf(x * (1.0f / A->softcap)) * A->softcap;
        x = j >= a && j < e ? x : -INFINITY;
        s[j] = x;
        bm = x > bm ? x : bm;
    }
    const float mn = *m > bm ? *m : bm;
    const float alpha = exp_neg(*m - mn); /* 0 before the first block, 1 if m stays */
    float lanes[LANES] = {0};
    for (int j = 0; j < KB; j++) {
        s[j] = exp_neg(s[j] - mn); /* 0 where masked */
        lanes[j % LANES] += s[j];
    }
    *l = *l * alpha + hsum8(lanes);
    *m = mn;
    for (int d = 0; d < Dv; d++)
        acc[d] *= alpha;
    for (int64_t j = a; j < e; j++) {
        const float p = s[j];
        const float *v = vc + ((b0 + j) * G + g) * Dv;
        for (int d = 0; d < Dv; d++)
            acc[d] = fmaf(p, v[d], acc[d]);
    }
}

/* Scores of tr rows' head-h queries against the block's keys kt ([D][KB]): each a sum
 * over d in order, d = 0 first. */
static void block_scores(const attn_job *J, int64_t r0, int tr, int h, const float *kt,
                         float s[TR][KB])
{
    const int D = J->A->head_dim;
    for (int i = 0; i < tr; i++) {
        const float *q = J->q + (r0 + i) * J->width + (int64_t)h * D;
        for (int j = 0; j < KB; j++)
            s[i][j] = 0.0f;
        for (int d = 0; d < D; d++) {
            const float qd = q[d];
            for (int j = 0; j < KB; j++)
                s[i][j] = fmaf(qd, kt[d * KB + j], s[i][j]);
        }
    }
}

/* Tile t's rows for kv head g: every query head of the group, block by block. */
static int attend_tile(const attn_job *J, int64_t t, int g)
{
    const attn_shape *A = J->A;
    const int H = A->heads, G = A->kv_heads, D = A->head_dim, Dv = A->v_head_dim;
    const int hg = H / G;
    const int64_t r0 = J->tile0[t];
    const int tr = (int)(J->tile0[t + 1] - r0);
    const float *kc = J->kcache[r0], *vc = J->vcache[r0];
    int64_t lo[TR], hi[TR], first = INT64_MAX, last = 0;
    for (int i = 0; i < tr; i++) {
        hi[i] = J->pos[r0 + i] + 1;
        lo[i] = A->window && hi[i] > A->window ? hi[i] - A->window : 0;
        first = lo[i] < first ? lo[i] : first;
        last = hi[i] > last ? hi[i] : last;
    }
    /* per (head, row): max, sum, accumulator */
    float *kt = malloc(sizeof(float) * ((size_t)D * KB + (size_t)hg * TR * (Dv + 2)));
    if (!kt)
        return -1;
    float *m = kt + (size_t)D * KB, *l = m + hg * TR, *acc = l + hg * TR;
    for (int i = 0; i < hg * TR; i++)
        m[i] = -INFINITY, l[i] = 0.0f;
    memset(acc, 0, sizeof(float) * (size_t)hg * TR * Dv);
    float s[TR][KB];
    for (int64_t b0 = first / KB * KB; b0 < last; b0 += KB) {
        const int64_t n = last - b0 < KB ? last - b0 : KB; /* keys past `last`: zeros */
        for (int d = 0; d < D; d++)
            for (int j = 0; j < KB; j++)
                kt[d * KB + j] = j < n ? kc[((b0 + j) * G + g) * D + d] : 0.0f;
        for (int hh = 0; hh < hg; hh++) {
            block_scores(J, r0, tr, g * hg + hh, kt, s);
            for (int i = 0; i < tr; i++) {
                const int at = hh * TR + i;
                fold_block(A, s[i], b0, lo[i], hi[i], vc, g, m + at, l + at,
                           acc + (size_t)at * Dv);
            }
        }
    }
    for (int hh = 0; hh < hg; hh++)
        for (int i = 0; i < tr; i++) {
            const int at = hh * TR + i;
            const float inv = 1.0f / l[at];
            float *o = J->out + ((r0 + i) * H + g * hg + hh) * Dv;
            for (int d = 0; d < Dv; d++)
                o[d] = acc[(size_t)at * Dv + d] * inv;
        }
    free(kt);
    return 0;
}

void skp_run(int threads, int64_t items, void (*fn)(void *, int64_t, int64_t), void *arg);

typedef struct {
    const attn_job *J;
    atomic_int failed;
} tiles_run;

/* (tile, kv head) items [b, e): each one thread's. */
static void attend_items(void *arg, int64_t b, int64_t e)
{
    tiles_run *R = arg;
    const int G = R->J->A->kv_heads;
    for (int64_t it = b; it < e; it++)
        if (attend_tile(R->J, it / G, (int)(it % G)))
            atomic_store(&R->failed, 1);
}

/* Above this many rows (prefill) the threads are torch's OpenMP team, as in qmatmul.c. */
#define OMP_ROWS 16

/* Attention of `rows` query rows (q: [rows, width], row r's heads first), row r the token
 * of a lane at pos[r] whose k and v are already in that lane's cache (kcache[r],
 * vcache[r]: token-major [cap, kv_heads, D]), over its keys [lo, pos[r]] (lo: the sliding
 * window's start). out: [rows, heads * v_head_dim]. Consecutive rows of one lane at
 * consecutive positions form tiles; tiles and kv heads run in parallel. */
static int attend_rows(const attn_shape *A, float *q, int64_t width, int64_t rows,
                       const int64_t *pos, float *const *kcache, float *const *vcache,
                       float *out, int threads)
{
    int64_t *tile0 = malloc(sizeof(int64_t) * (size_t)(rows + 1));
    if (!tile0)
        return -1;
    int64_t tiles = 0, work = 0;
    for (int64_t r = 0; r < rows; r++) {
        if (!(r && r - tile0[tiles - 1] < TR && kcache[r] == kcache[r - 1]
              && pos[r] == pos[r - 1] + 1))
            tile0[tiles++] = r;
        work += pos[r] + 1;
    }
    tile0[tiles] = rows;
    attn_job J = {A, q, width, pos, tile0, kcache, vcache, out};
    tiles_run R = {&J, 0};
    const int64_t items = tiles * A->kv_heads;
    /* threads pay off on long contexts only */
    const int n = work * A->heads * A->head_dim > 65536 ? threads : 1;
    if (rows > OMP_ROWS) {
#pragma omp parallel for schedule(static) num_threads(n)
        for (int64_t it = 0; it < items; it++)
            attend_items(&R, it, it + 1);
    } else {
        skp_run(n, items, attend_items, &R);
    }
    free(tile0);
    return atomic_load(&R.failed) ? -1 : 0;
}

/* Attention for `rows` rows, decode or prefill: row r's qkv output (q heads, k heads,
 * v heads) takes its q/k norms and rope at pos[r] and writes its k and v at pos[r] of its
 * lane's cache; then every row attends as attend_rows says (a prefill row sees the keys
 * of the rows before it in the same call). */
int skr_attend_rows(const attn_shape *A, float *qkv, int64_t rows, const int64_t *pos,
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

/* Attention of q ([rows, heads * head_dim], normed and rotated) for a family that
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
