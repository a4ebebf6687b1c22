/* A mixture-of-experts FFN block in one call, for blocks of the common form (stages/moe.py
 * says which qualify): the router's float32 product, its gate, the choice of n_used experts
 * and their weights, each chosen expert over the rows that chose it, the weighted sum in
 * selection order, then the shared experts.
 *
 * Each step is the function moe.py's torch path calls for it (skr_linear_f32, skr_gate,
 * skq_matmul, skr_gated), or the single float operation torch does elementwise, in the same
 * order: the same bits as that path (tests/test_moe.py). What it saves is the path itself:
 * at one row, the Python of the routing and of each chosen expert cost more than the
 * experts' products. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#define MIN_WEIGHT_SUM 6.103515625e-5f /* llama.cpp clamps the weights' sum: the least normal f16 */

struct moe_block {
    int64_t hidden;
    int n_expert, n_used;
    int gating;          /* skr_gate's kind; -1: softmax over the chosen (softmax_weight) */
    int norm;            /* divide the chosen weights by their sum */
    float scale;         /* multiply the chosen weights; 0: not */
    int groups, groups_used; /* groups > 1: only the best groups_used groups of experts
                              * compete (a group's score: its two best summed) */
    const float *router; /* [n_expert][hidden] */
    const float *bias;   /* [n_expert]: shifts the choice, not the weights; or NULL */
    const qmat *gate_up, *down; /* [n_expert] each; gate_up: the gate's n / 2, then the up's */
    const float *gate_scale, *up_scale, *down_scale; /* [n_expert]: each expert's products
                                                      * scaled (llama.cpp's .scale), or NULL */
    int act;             /* skr_gated's activation */
    const qmat *shared_gate_up, *shared_down; /* NULL: no shared experts */
    const float *shared_gate; /* [hidden]: the shared output times sigmoid(h . it); or NULL */
};

/* The n_used best of n scores, best first; of equal scores the first. */
static void choose(const float *score, int n, int n_used, int32_t *out)
{
    for (int j = 0; j < n_used; j++) {
        int best = -1;
        for (int e = 0; e < n; e++) {
            int taken = 0;
            for (int i = 0; i < j && !taken; i++)
                taken = out[i] == e;
            if (!taken && (best < 0 || score[e] > score[best]))
                best = e;
        }
        out[j] = best;
    }
}

/* Scores of experts outside the best groups_used groups set to -inf, in place. */
static void best_groups(const moe_block *B, float *score)
{
    const int G = B->groups, size = B->n_expert / G;
    float group[G];
    int32_t keep[G];
    for (int g = 0; g < G; g++) {
        int32_t two[2];
        choose(score + g * size, size, 2, two);
        group[g] = score[g * size + two[0]] + score[g * size + two[1]];
    }
    choose(group, G, B->groups_used, keep);
    for (int g = 0; g < G; g++) {
        int kept = 0;
        for (int i = 0; i < B->groups_used; i++)
            kept |= keep[i] == g;
        if (!kept)
            for (int e = 0; e < size; e++)
                score[g * size + e] = -INFINITY;
    }
}

/* Each real row's experts and weights, as moe.py's Routing computes them. */
static void route(const moe_block *B, const float *x, int64_t rows, const uint8_t *real,
                  const float *given, float *logits, float *scores, int32_t *experts,
                  float *weights, int threads)
{
    const int E = B->n_expert, k = B->n_used;
    if (given)
        memcpy(logits, given, sizeof(float) * rows * E);
    else
        skr_linear_f32(x, B->hidden, B->router, rows, B->hidden, E, logits, E, threads);
    float *probs = logits;
    if (B->gating >= 0) {
        probs = scores;
        skr_gate(B->gating, logits, rows, E, probs);
    }
    for (int64_t r = 0; r < rows; r++) {
        if (real && !real[r])
            continue;
        const float *p = probs + r * E;
        float s[E];
        for (int e = 0; e < E; e++)
            s[e] = B->bias ? p[e] + B->bias[e] : p[e];
        if (B->groups > 1)
            best_groups(B, s);
        int32_t *ex = experts + r * k;
        float *w = weights + r * k;
        choose(s, E, k, ex);
        for (int j = 0; j < k; j++)
            w[j] = p[ex[j]];
        if (B->gating < 0) {
            float soft[k];
            skr_gate(0, w, 1, k, soft);
            memcpy(w, soft, sizeof soft);
        }
        if (B->norm) {
            float total = w[0];
            for (int j = 1; j < k; j++)
                total = total + w[j];
            total = total < MIN_WEIGHT_SUM ? MIN_WEIGHT_SUM : total;
            for (int j = 0; j < k; j++)
                w[j] = w[j] / total;
        }
        if (B->scale != 0.0f)
            for (int j = 0; j < k; j++)
                w[j] = w[j] * B->scale;
    }
}

/* v[r][0 .. n) *= by for `rows` rows `stride` apart (NULL: not scaled). */
static void scaled(float *v, int64_t rows, int64_t n, int64_t stride, const float *by)
{
    if (by)
        for (int64_t r = 0; r < rows; r++)
            for (int64_t i = 0; i < n; i++)
                v[r * stride + i] = v[r * stride + i] * *by;
}

/* down(act(gate * sg) * (up * su)) * sd of `rows` rows x into y (a scale NULL: none);
 * scratch gu [rows][gate_up n], a [rows][n / 2]. */
static int expert(const qmat *gate_up, const qmat *down, int act, const float *sg,
                  const float *su, const float *sd, const float *x, int64_t rows, float *gu,
                  float *a, float *y, int threads)
{
    int rc = qmat_run(gate_up, x, rows, gu, threads);
    if (rc)
        return rc;
    const int64_t ff = gate_up->n / 2;
    scaled(gu, rows, ff, gate_up->n, sg);
    scaled(gu + ff, rows, ff, gate_up->n, su);
    skr_gated(act, gu, gu + ff, rows, ff, gate_up->n, a, threads);
    rc = qmat_run(down, a, rows, y, threads);
    scaled(y, rows, down->n, down->n, sd);
    return rc;
}

static const float *at(const float *scales, int e)
{
    return scales ? scales + e : NULL;
}

/* out [rows][hidden] = the block over x [rows][hidden]; rows with real[r] == 0 (padding) get
 * no routed output (real NULL: every row is real); given: the router's logits [rows][n_expert]
 * where the family computes its own (Gemma 4), else NULL. Returns 0, or -1 without scratch
 * memory. */
int skm_moe(const moe_block *B, const float *x, int64_t rows, const uint8_t *real,
            const float *given, float *out, int threads)
{
    const int64_t H = B->hidden;
    const int E = B->n_expert, k = B->n_used;
    int64_t wide = 0; /* the widest gate_up product */
    for (int e = 0; e < E; e++)
        wide = B->gate_up[e].n > wide ? B->gate_up[e].n : wide;
    if (B->shared_gate_up && B->shared_gate_up->n > wide)
        wide = B->shared_gate_up->n;
    float *logits = malloc(sizeof(float) * rows * E), *scores = malloc(sizeof(float) * rows * E);
    int32_t *experts = malloc(sizeof(int32_t) * rows * k), *picks = malloc(sizeof(int32_t) * rows * k);
    float *weights = malloc(sizeof(float) * rows * k), *ys = malloc(sizeof(float) * rows * k * H);
    float *xin = malloc(sizeof(float) * rows * H), *yo = malloc(sizeof(float) * rows * H);
    float *gu = malloc(sizeof(float) * rows * wide), *a = malloc(sizeof(float) * rows * wide);
    int rc = logits && scores && experts && picks && weights && ys && xin && yo && gu && a ? 0 : -1;
    if (!rc)
        route(B, x, rows, real, given, logits, scores, experts, weights, threads);
    /* each chosen expert once, over its rows in row order (moe.py: an expert runs the
     * rows that chose it together; our kernel computes each row alone) */
    for (int e = 0; e < E && !rc; e++) {
        int64_t m = 0;
        for (int64_t r = 0; r < rows; r++) {
            if (real && !real[r])
                continue;
            for (int j = 0; j < k; j++)
                if (experts[r * k + j] == e) {
                    picks[m] = (int32_t)(r * k + j);
                    memcpy(xin + m * H, x + r * H, sizeof(float) * H);
                    m++;
                }
        }
        if (!m)
            continue;
        if ((rc = expert(&B->gate_up[e], &B->down[e], B->act, at(B->gate_scale, e),
                         at(B->up_scale, e), at(B->down_scale, e), xin, m, gu, a, yo,
                         threads)))
            break;
        for (int64_t i = 0; i < m; i++)
            memcpy(ys + (int64_t)picks[i] * H, yo + i * H, sizeof(float) * H);
    }
    for (int64_t r = 0; r < rows && !rc; r++) {
        float *o = out + r * H;
        if (real && !real[r]) {
            memset(o, 0, sizeof(float) * H);
            continue;
        }
        const float *y0 = ys + r * k * H, w0 = weights[r * k];
        for (int64_t i = 0; i < H; i++)
            o[i] = y0[i] * w0;
        for (int j = 1; j < k; j++) {
            const float *yj = ys + (r * k + j) * H, wj = weights[r * k + j];
            for (int64_t i = 0; i < H; i++)
                o[i] = o[i] + yj[i] * wj;
        }
    }
    if (!rc && B->shared_gate_up) {
        rc = expert(B->shared_gate_up, B->shared_down, B->act, NULL, NULL, NULL, x, rows, gu,
                    a, yo, threads);
        if (!rc && B->shared_gate) {
            skr_linear_f32(x, H, B->shared_gate, rows, H, 1, logits, 1, threads);
            skr_gate(1, logits, rows, 1, scores);
            for (int64_t r = 0; r < rows; r++)
                for (int64_t i = 0; i < H; i++)
                    yo[r * H + i] = yo[r * H + i] * scores[r];
        }
        for (int64_t i = 0; !rc && i < rows * H; i++)
            out[i] = out[i] + yo[i];
    }
    free(logits); free(scores); free(experts); free(picks); free(weights); free(ys);
    free(xin); free(yo); free(gu); free(a);
    return rc;
}
