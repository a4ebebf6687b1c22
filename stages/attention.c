/* Attention of query rows over their lanes' KV caches, the same for every row: a decode
 * step, a row of a 2,000-row prefill and a row beside other lanes (DESIGN.md §5.3,
 * row-invariant).
 *
 * Keys are read in blocks of KB from position 0 (blocks start at 0, KB, 2 KB, ...: fixed
 * by position alone), with an online softmax, so a row's float operations are one
 * sequence fixed by its position and window:
 *   score s_j = fma chain over d = 0, 1, ... of q[d] * k_j[d], times the scale (capped);
 *   per block: m' = max(m, block max), alpha = exp(m - m'), p_j = exp(s_j - m'),
 *   l = l * alpha + sum16(p), acc = acc * alpha, then acc = fma(p_j, v_j, acc) for the
 *   row's keys of the block in order; out = acc * (1 / l).
 * sum16 adds the block's 64 values as t[i] = ((p[i] + p[16 + i]) + p[32 + i]) + p[48 + i],
 * then t in the fixed tree (i, i + 8), (i, i + 4), (i, i + 2), (0, 1). The vector paths
 * compute those same floats (fma is exact-rounded; the compiler is told not to contract),
 * so every build gives the same bits (tests/test_attention_kernel.py).
 *
 * Speed: up to TR consecutive rows of one lane form a tile whose rows, with the query heads
 * of a kv head (all of them, or a group when there are fewer tiles than threads), share
 * each block's keys, transposed once ([D][KB]) so that a vector holds 16 keys' scores;
 * each (row, head) pair's sums stay its own, so neither tiles nor groups change a bit.
 *
 * Multi-head latent attention (stages/mla.py) is the case kv_heads = 1 whose values are
 * the first v_head_dim floats of each key row (v_row: no value cache of their own). */

#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h" /* attn_shape, and what this file calls of the others */
#include "fmath.h" /* exp_poly: the plain C definition's exp, which the vector paths reproduce */
#if defined(SKQ_AVX512) || defined(SKQ_AVX2)
#include <immintrin.h>
#endif

#define KB 64 /* keys per block */
#define TR 16 /* rows per tile */
#define QR 4  /* (row, head) pairs whose scores are computed together */
#define PAIRS 256 /* at most this many (row, head) pairs per tile while TR rows exceed it */

static inline float tree16(const float *t)
{
    float u[8], w[4];
    for (int i = 0; i < 8; i++)
        u[i] = t[i] + t[i + 8];
    for (int i = 0; i < 4; i++)
        w[i] = u[i] + u[i + 4];
    return (w[0] + w[2]) + (w[1] + w[3]);
}

/* ---- plain C: the definition the vector paths reproduce ------------------------------ */

/* s[r][j] for nq query vectors q[r] against the block kt ([D][KB]). */
static void scores_c(const float *kt, const float *const *q, int nq, int D, float s[QR][KB])
{
    for (int r = 0; r < nq; r++) {
        for (int j = 0; j < KB; j++)
            s[r][j] = 0.0f;
        for (int d = 0; d < D; d++)
            for (int j = 0; j < KB; j++)
                s[r][j] = fmaf(q[r][d], kt[d * KB + j], s[r][j]);
    }
}

/* p_j = exp(s_j - mn) in place (s_j = -inf: 0); returns sum16(p). */
static float exps_c(float *s, float mn)
{
    float t[16];
    for (int j = 0; j < KB; j++)
        s[j] = exp_poly(s[j] - mn);
    for (int i = 0; i < 16; i++)
        t[i] = ((s[i] + s[16 + i]) + s[32 + i]) + s[48 + i];
    return tree16(t);
}

/* s_j * scale for j in [a, e), -inf elsewhere, in place; returns the largest. */
static float scaled_c(float *s, float scale, int a, int e)
{
    float bm = -INFINITY;
    for (int j = 0; j < KB; j++) {
        s[j] = j >= a && j < e ? s[j] * scale : -INFINITY;
        bm = s[j] > bm ? s[j] : bm;
    }
    return bm;
}

/* scaled_c with the scores capped: cap * tanh(s_j * scale / cap) (libm's tanhf, as
 * ggml's tanh calls it; one scalar call in every build). */
static float capped_c(float *s, float scale, float cap, int a, int e)
{
    float bm = -INFINITY;
    for (int j = 0; j < KB; j++) {
        s[j] = j >= a && j < e ? tanhf(s[j] * scale * (1.0f / cap)) * cap : -INFINITY;
        bm = s[j] > bm ? s[j] : bm;
    }
    return bm;
}

/* kt[d][j] = key b0 + j's value d (kv head g of a token-major cache), 0 for j >= n. */
static void keys_c(const float *kc, int64_t b0, int64_t n, int G, int g, int D, float *kt)
{
    for (int j = 0; j < KB; j++)
        for (int d = 0; d < D; d++)
            kt[d * KB + j] = j < n ? kc[((b0 + j) * G + g) * D + d] : 0.0f;
}

/* acc = acc * alpha, then acc = fma(p_j, v_j, acc) for j in [a, e) (v_j at v + j * stride). */
static void values_c(float *acc, int Dv, float alpha, const float *p, int a, int e,
                     const float *v, int64_t stride)
{
    for (int d = 0; d < Dv; d++)
        acc[d] *= alpha;
    for (int j = a; j < e; j++)
        for (int d = 0; d < Dv; d++)
            acc[d] = fmaf(p[j], v[j * stride + d], acc[d]);
}

#if defined(SKQ_AVX512)
/* ---- AVX-512 ------------------------------------------------------------------------- */
static inline __attribute__((always_inline)) void
scores_v(const float *kt, const float *const *q, const int NQ, int D, float s[QR][KB])
{
    __m512 acc[QR][4];
    for (int r = 0; r < NQ; r++)
        for (int c = 0; c < 4; c++)
            acc[r][c] = _mm512_setzero_ps();
    for (int d = 0; d < D; d++) {
        __m512 k[4];
        for (int c = 0; c < 4; c++)
            k[c] = _mm512_loadu_ps(kt + d * KB + 16 * c);
        for (int r = 0; r < NQ; r++) {
            const __m512 qd = _mm512_set1_ps(q[r][d]);
            for (int c = 0; c < 4; c++)
                acc[r][c] = _mm512_fmadd_ps(qd, k[c], acc[r][c]);
        }
    }
    for (int r = 0; r < NQ; r++)
        for (int c = 0; c < 4; c++)
            _mm512_storeu_ps(s[r] + 16 * c, acc[r][c]);
}

static void scores(const float *kt, const float *const *q, int nq, int D, float s[QR][KB])
{
    switch (nq) {
    case 4: scores_v(kt, q, 4, D, s); break;
    case 3: scores_v(kt, q, 3, D, s); break;
    case 2: scores_v(kt, q, 2, D, s); break;
    default: scores_v(kt, q, 1, D, s);
    }
}

static inline __m512 exp_neg_v(__m512 x)
{
    const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_NLT_UQ);
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504f));
    const __m512 big = _mm512_set1_ps(12582912.0f);
    const __m512 n = _mm512_sub_ps(_mm512_add_ps(t, big), big);
    const __m512 r = _mm512_sub_ps(_mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(0.693145752f))),
                                   _mm512_mul_ps(n, _mm512_set1_ps(1.42860677e-6f)));
    static const float c[6] = {1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f, 0.5f, 1.0f, 1.0f};
    __m512 p = _mm512_set1_ps(1.0f / 720.0f);
    for (int i = 0; i < 6; i++)
        p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(c[i]));
    const __m512i e = _mm512_slli_epi32(
        _mm512_add_epi32(_mm512_cvttps_epi32(_mm512_maskz_mov_ps(live, n)), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mul_ps(live, p, _mm512_castsi512_ps(e));
}

static float scaled(float *s, float scale, int a, int e)
{
    const __m512i at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 bm = _mm512_set1_ps(-INFINITY);
    for (int c = 0; c < 4; c++) {
        const __m512i j = _mm512_add_epi32(at, _mm512_set1_epi32(16 * c));
        const __mmask16 in = _mm512_cmpge_epi32_mask(j, _mm512_set1_epi32(a))
                             & _mm512_cmplt_epi32_mask(j, _mm512_set1_epi32(e));
        const __m512 x = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), in,
                                            _mm512_loadu_ps(s + 16 * c), _mm512_set1_ps(scale));
        _mm512_storeu_ps(s + 16 * c, x);
        bm = _mm512_max_ps(bm, x);
    }
    return _mm512_reduce_max_ps(bm);
}

static float exps(float *s, float mn)
{
    const __m512 m = _mm512_set1_ps(mn);
    __m512 v[4];
    for (int c = 0; c < 4; c++) {
        v[c] = exp_neg_v(_mm512_sub_ps(_mm512_loadu_ps(s + 16 * c), m));
        _mm512_storeu_ps(s + 16 * c, v[c]);
    }
    float t[16];
    _mm512_storeu_ps(t, _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(v[0], v[1]), v[2]), v[3]));
    return tree16(t);
}

/* A 16 x 16 block of floats transposed in registers (data moves only: no arithmetic). */
static inline void transpose16(__m512 r[16])
{
    __m512 t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
#define PD(x) _mm512_castps_pd(x)
    for (int i = 0; i < 4; i++) {
        r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(PD(t[4 * i]), PD(t[4 * i + 2])));
        r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(PD(t[4 * i]), PD(t[4 * i + 2])));
        r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(PD(t[4 * i + 1]), PD(t[4 * i + 3])));
        r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(PD(t[4 * i + 1]), PD(t[4 * i + 3])));
    }
#undef PD
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_f32x4(r[i], r[4 + i], 0x88);
        t[4 + i] = _mm512_shuffle_f32x4(r[i], r[4 + i], 0xdd);
        t[8 + i] = _mm512_shuffle_f32x4(r[8 + i], r[12 + i], 0x88);
        t[12 + i] = _mm512_shuffle_f32x4(r[8 + i], r[12 + i], 0xdd);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0x88);
        r[8 + i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0xdd);
        r[4 + i] = _mm512_shuffle_f32x4(t[4 + i], t[12 + i], 0x88);
        r[12 + i] = _mm512_shuffle_f32x4(t[4 + i], t[12 + i], 0xdd);
    }
}

static void keys(const float *kc, int64_t b0, int64_t n, int G, int g, int D, float *kt)
{
    if (D % 16) {
        keys_c(kc, b0, n, G, g, D, kt);
        return;
    }
    __m512 r[16];
    for (int c = 0; c < KB / 16; c++)
        for (int e = 0; e < D; e += 16) {
            for (int i = 0; i < 16; i++) {
                const int64_t j = 16 * c + i;
                r[i] = j < n ? _mm512_loadu_ps(kc + ((b0 + j) * G + g) * D + e)
                             : _mm512_setzero_ps();
            }
            transpose16(r);
            for (int k = 0; k < 16; k++)
                _mm512_storeu_ps(kt + (e + k) * KB + 16 * c, r[k]);
        }
}

static void values(float *acc, int Dv, float alpha, const float *p, int a, int e,
                   const float *v, int64_t stride)
{
    int d = 0;
    for (; d + 64 <= Dv; d += 64) {
        __m512 x[4];
        for (int c = 0; c < 4; c++)
            x[c] = _mm512_mul_ps(_mm512_loadu_ps(acc + d + 16 * c), _mm512_set1_ps(alpha));
        for (int j = a; j < e; j++) {
            const __m512 pj = _mm512_set1_ps(p[j]);
            for (int c = 0; c < 4; c++)
                x[c] = _mm512_fmadd_ps(pj, _mm512_loadu_ps(v + j * stride + d + 16 * c), x[c]);
        }
        for (int c = 0; c < 4; c++)
            _mm512_storeu_ps(acc + d + 16 * c, x[c]);
    }
    if (d < Dv)
        values_c(acc + d, Dv - d, alpha, p, a, e, v + d, stride);
}
#elif defined(SKQ_AVX2)
/* ---- AVX2: the same floats, 8 at a time ------------------------------------------------ */
static inline void transpose8(__m256 r[8])
{
    __m256 t[8], u[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++) {
        u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm256_permute2f128_ps(u[i], u[4 + i], 0x20);
        r[4 + i] = _mm256_permute2f128_ps(u[i], u[4 + i], 0x31);
    }
}

static void keys(const float *kc, int64_t b0, int64_t n, int G, int g, int D, float *kt)
{
    if (D % 8) {
        keys_c(kc, b0, n, G, g, D, kt);
        return;
    }
    __m256 r[8];
    for (int c = 0; c < KB / 8; c++)
        for (int e = 0; e < D; e += 8) {
            for (int i = 0; i < 8; i++) {
                const int64_t j = 8 * c + i;
                r[i] = j < n ? _mm256_loadu_ps(kc + ((b0 + j) * G + g) * D + e)
                             : _mm256_setzero_ps();
            }
            transpose8(r);
            for (int k = 0; k < 8; k++)
                _mm256_storeu_ps(kt + (e + k) * KB + 8 * c, r[k]);
        }
}

/* Two pairs' scores over one half of the block (32 keys): 8 chains of fmas. */
static inline __attribute__((always_inline)) void
scores_half(const float *kt, const float *const *q, const int NQ, int D, int h,
            float s[QR][KB])
{
    __m256 acc[2][4];
    for (int r = 0; r < NQ; r++)
        for (int c = 0; c < 4; c++)
            acc[r][c] = _mm256_setzero_ps();
    for (int d = 0; d < D; d++)
        for (int r = 0; r < NQ; r++) {
            const __m256 qd = _mm256_set1_ps(q[r][d]);
            for (int c = 0; c < 4; c++)
                acc[r][c] = _mm256_fmadd_ps(qd, _mm256_loadu_ps(kt + d * KB + 32 * h + 8 * c),
                                            acc[r][c]);
        }
    for (int r = 0; r < NQ; r++)
        for (int c = 0; c < 4; c++)
            _mm256_storeu_ps(s[r] + 32 * h + 8 * c, acc[r][c]);
}

static void scores(const float *kt, const float *const *q, int nq, int D, float s[QR][KB])
{
    for (int r = 0; r < nq; r += 2)
        for (int h = 0; h < 2; h++) {
            if (nq - r >= 2)
                scores_half(kt, q + r, 2, D, h, s + r);
            else
                scores_half(kt, q + r, 1, D, h, s + r);
        }
}

static float scaled(float *s, float scale, int a, int e)
{
    const __m256i at = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 none = _mm256_set1_ps(-INFINITY);
    __m256 bm = none;
    for (int c = 0; c < KB / 8; c++) {
        const __m256i j = _mm256_add_epi32(at, _mm256_set1_epi32(8 * c));
        const __m256i in = _mm256_and_si256(_mm256_cmpgt_epi32(j, _mm256_set1_epi32(a - 1)),
                                            _mm256_cmpgt_epi32(_mm256_set1_epi32(e), j));
        const __m256 x = _mm256_blendv_ps(none, _mm256_mul_ps(_mm256_loadu_ps(s + 8 * c),
                                                              _mm256_set1_ps(scale)),
                                          _mm256_castsi256_ps(in));
        _mm256_storeu_ps(s + 8 * c, x);
        bm = _mm256_max_ps(bm, x);
    }
    float l[8], m = -INFINITY;
    _mm256_storeu_ps(l, bm);
    for (int i = 0; i < 8; i++)
        m = l[i] > m ? l[i] : m;
    return m;
}

static inline __m256 exp_neg_v(__m256 x)
{
    const __m256 live = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_NLT_UQ);
    const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504f));
    const __m256 big = _mm256_set1_ps(12582912.0f);
    const __m256 n = _mm256_and_ps(live, _mm256_sub_ps(_mm256_add_ps(t, big), big));
    const __m256 r = _mm256_sub_ps(_mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693145752f))),
                                   _mm256_mul_ps(n, _mm256_set1_ps(1.42860677e-6f)));
    static const float c[6] = {1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f, 0.5f, 1.0f, 1.0f};
    __m256 p = _mm256_set1_ps(1.0f / 720.0f);
    for (int i = 0; i < 6; i++)
        p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(c[i]));
    const __m256i e = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(live, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

static float exps(float *s, float mn)
{
    const __m256 m = _mm256_set1_ps(mn);
    __m256 v[8];
    for (int c = 0; c < 8; c++) {
        v[c] = exp_neg_v(_mm256_sub_ps(_mm256_loadu_ps(s + 8 * c), m));
        _mm256_storeu_ps(s + 8 * c, v[c]);
    }
    float t[16];
    _mm256_storeu_ps(t, _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(v[0], v[2]), v[4]), v[6]));
    _mm256_storeu_ps(t + 8, _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(v[1], v[3]), v[5]), v[7]));
    return tree16(t);
}

static void values(float *acc, int Dv, float alpha, const float *p, int a, int e,
                   const float *v, int64_t stride)
{
    int d = 0;
    for (; d + 32 <= Dv; d += 32) {
        __m256 x[4];
        for (int c = 0; c < 4; c++)
            x[c] = _mm256_mul_ps(_mm256_loadu_ps(acc + d + 8 * c), _mm256_set1_ps(alpha));
        for (int j = a; j < e; j++) {
            const __m256 pj = _mm256_set1_ps(p[j]);
            for (int c = 0; c < 4; c++)
                x[c] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + j * stride + d + 8 * c), x[c]);
        }
        for (int c = 0; c < 4; c++)
            _mm256_storeu_ps(acc + d + 8 * c, x[c]);
    }
    if (d < Dv)
        values_c(acc + d, Dv - d, alpha, p, a, e, v + d, stride);
}
#else
#define keys keys_c
#define scaled scaled_c
#define scores scores_c
#define exps exps_c
#define values values_c
#endif

/* ---- one tile ------------------------------------------------------------------------ */

typedef struct {
    const attn_shape *A;
    const float *q;
    int64_t width;
    const int64_t *pos, *tile0; /* tile t: rows [tile0[t], tile0[t + 1]) of one lane */
    float *const *kcache, *const *vcache;
    float *out;
    int group, groups; /* a kv head's query heads in `groups` groups of `group` */
    atomic_int failed;
} attn_job;

/* Row-head pair k's fold of its block scores s (raw dot products) at b0: scale, cap, mask
 * to its keys [lo, hi), then the online softmax step into m, l, acc. */
static void fold(const attn_shape *A, float *s, int64_t b0, int64_t lo, int64_t hi,
                 const float *vc, int g, float *m, float *l, float *acc)
{
    const int a = (int)((lo > b0 ? lo : b0) - b0), e = (int)((hi < b0 + KB ? hi : b0 + KB) - b0);
    if (a >= e)
        return; /* none of this row's keys: not one of its blocks */
    const float bm = A->softcap > 0.0f ? capped_c(s, A->scale, A->softcap, a, e)
                                       : scaled(s, A->scale, a, e);
    const float mn = *m > bm ? *m : bm;
    const float alpha = exp_poly(*m - mn); /* 0 before the first block, 1 while m stays */
    *l = *l * alpha + exps(s, mn);
    *m = mn;
    const int Dv = A->v_head_dim;
    const int64_t row = A->v_row ? A->v_row : (int64_t)A->kv_heads * Dv;
    values(acc, Dv, alpha, s, a, e, vc + b0 * row + (int64_t)g * Dv, row);
}

/* Tile t's rows for kv head g's query heads [h0, h0 + hn) (counted within g): every
 * (row, head) pair, block by block. */
static int attend_tile(const attn_job *J, int64_t t, int g, int h0, int hn)
{
    const attn_shape *A = J->A;
    const int H = A->heads, G = A->kv_heads, D = A->head_dim, Dv = A->v_head_dim;
    const int hg = H / G;
    const int64_t r0 = J->tile0[t];
    const int tr = (int)(J->tile0[t + 1] - r0), pairs = tr * hn;
    const float *kc = J->kcache[r0], *vc = J->vcache[r0];
    int64_t lo[TR], hi[TR], first = INT64_MAX, last = 0;
    for (int i = 0; i < tr; i++) {
        hi[i] = J->pos[r0 + i] + 1;
        lo[i] = A->window && hi[i] > A->window ? hi[i] - A->window : 0;
        first = lo[i] < first ? lo[i] : first;
        last = hi[i] > last ? hi[i] : last;
    }
    /* per pair k = hh * tr + i: its q row; then kt [D][KB], and per pair max, sum,
     * accumulator [Dv] */
    const float **q = malloc(sizeof(float *) * (size_t)pairs
                             + sizeof(float) * ((size_t)D * KB + (size_t)pairs * (Dv + 2)));
    if (!q)
        return -1;
    float *kt = (float *)(q + pairs);
    float *m = kt + (size_t)D * KB, *l = m + pairs, *acc = l + pairs;
    for (int k = 0; k < pairs; k++) {
        m[k] = -INFINITY, l[k] = 0.0f;
        q[k] = J->q + (r0 + k % tr) * J->width + (int64_t)(g * hg + h0 + k / tr) * D;
    }
    memset(acc, 0, sizeof(float) * (size_t)pairs * Dv);
    float s[QR][KB];
    for (int64_t b0 = first / KB * KB; b0 < last; b0 += KB) {
        const int64_t n = last - b0 < KB ? last - b0 : KB; /* keys past `last`: zeros */
        keys(kc, b0, n, G, g, D, kt);
        for (int k0 = 0; k0 < pairs; k0 += QR) {
            const int nq = pairs - k0 < QR ? pairs - k0 : QR;
            scores(kt, q + k0, nq, D, s);
            for (int k = k0; k < k0 + nq; k++)
                fold(A, s[k - k0], b0, lo[k % tr], hi[k % tr], vc, g, m + k, l + k,
                     acc + (size_t)k * Dv);
        }
    }
    for (int k = 0; k < pairs; k++) {
        const float inv = 1.0f / l[k];
        float *o = J->out + ((r0 + k % tr) * H + g * hg + h0 + k / tr) * Dv;
        for (int d = 0; d < Dv; d++)
            o[d] = acc[(size_t)k * Dv + d] * inv;
    }
    free(q);
    return 0;
}

/* (tile, kv head, head group) items [b, e): each one thread's. */
static void attend_items(void *arg, int64_t b, int64_t e)
{
    attn_job *J = arg;
    const int G = J->A->kv_heads, hg = J->A->heads / G;
    for (int64_t it = b; it < e; it++) {
        const int64_t tg = it / J->groups;
        const int h0 = (int)(it % J->groups) * J->group;
        const int hn = hg - h0 < J->group ? hg - h0 : J->group;
        if (attend_tile(J, tg / G, (int)(tg % G), h0, hn))
            atomic_store(&J->failed, 1);
    }
}

/* Above this many rows (prefill) the threads are torch's OpenMP team, as in qmatmul.c. */
#define OMP_ROWS 4

/* Attention of `rows` query rows (q: [rows, width], row r's heads first), row r the token
 * of a lane at pos[r] whose k and v are already in that lane's cache (kcache[r]:
 * token-major [cap, kv_heads, D]; vcache[r] likewise with v_head_dim, or as v_row says),
 * over its keys [lo, pos[r]] (lo: the sliding window's start). out: [rows, heads *
 * v_head_dim]. Consecutive rows of one lane at consecutive positions form tiles; tiles,
 * kv heads and head groups run in parallel. */
static int attend_rows(const attn_shape *A, const float *q, int64_t width, int64_t rows,
                       const int64_t *pos, float *const *kcache, float *const *vcache,
                       float *out, int threads)
{
    const int hg = A->heads / A->kv_heads;
    /* many heads per kv head (MLA: all of them): fewer rows per tile, bounding its scratch */
    const int tr = hg >= PAIRS ? 1 : (PAIRS / hg < TR ? PAIRS / hg : TR);
    int64_t *tile0 = malloc(sizeof(int64_t) * (size_t)(rows + 1));
    if (!tile0)
        return -1;
    int64_t tiles = 0, work = 0;
    for (int64_t r = 0; r < rows; r++) {
        if (!(r && r - tile0[tiles - 1] < tr && kcache[r] == kcache[r - 1]
              && pos[r] == pos[r - 1] + 1))
            tile0[tiles++] = r;
        work += pos[r] + 1;
    }
    tile0[tiles] = rows;
    /* threads pay off on long contexts only */
    const int n = work * A->heads * A->head_dim > 65536 ? threads : 1;
    /* fewer (tile, kv head) items than threads (a decode step of MLA's one kv head): the
     * heads split in groups, each pair still computed alone */
    const int64_t base = tiles * A->kv_heads;
    int split = base < n ? (int)((n + base - 1) / base) : 1;
    split = split < hg ? split : hg;
    const int group = (hg + split - 1) / split;
    attn_job J = {A, q, width, pos, tile0, kcache, vcache, out, group,
                  (hg + group - 1) / group, 0};
    const int64_t items = base * J.groups;
    if (rows > OMP_ROWS) {
#pragma omp parallel for schedule(static) num_threads(n)
        for (int64_t it = 0; it < items; it++)
            attend_items(&J, it, it + 1);
    } else {
        skp_run(n, items, attend_items, &J);
    }
    free(tile0);
    return atomic_load(&J.failed) ? -1 : 0;
}

/* Attention for `rows` rows, decode or prefill: row r's qkv output (q heads, k heads,
 * v heads unless v_row) takes its q/k norms and rope at pos[r] and writes its k and v at
 * pos[r] of its lane's cache; then every row attends as attend_rows says (a prefill row
 * sees the keys of the rows before it in the same call). */
int skr_attend_rows(const attn_shape *A, float *qkv, int64_t rows, const int64_t *pos,
                    float *const *kcache, float *const *vcache, float *out, int threads)
{
    const int H = A->heads, G = A->kv_heads, D = A->head_dim, Dv = A->v_head_dim;
    const int64_t width = (int64_t)(H + G) * D + (A->v_row ? 0 : (int64_t)G * Dv);
    if (A->rope_at + A->rope_dim > D)
        return -1;
    for (int64_t r = 0; r < rows; r++) {
        float *qk = qkv + r * width;
        if (A->qk_norm)
            skr_rms_norm(qk, A->qk_norm, H + G, D, H + G, A->eps, qk);
        skr_rope(qk + A->rope_at, H + G, D, A->rope_dim, A->cos + pos[r] * (A->rope_dim / 2),
                 A->sin + pos[r] * (A->rope_dim / 2), A->rope_style);
        memcpy(kcache[r] + pos[r] * G * D, qk + (int64_t)H * D, sizeof(float) * G * D);
        if (!A->v_row)
            memcpy(vcache[r] + pos[r] * G * Dv, qk + (int64_t)(H + G) * D,
                   sizeof(float) * G * Dv);
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
