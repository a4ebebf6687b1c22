/* Per-row operations of a stage, each one call instead of several torch ops: a decode
 * step runs ~35 small ops per layer, and at one row their dispatch costs more than their
 * arithmetic (evals/README.md, torch runtime). Attention is in attention.c.
 *
 * Every row is computed alone, by a fixed sequence of float operations: a row's bits do
 * not depend on the rows beside it, the thread count or the instruction set (the plain C
 * loops below are what the compiler vectorizes; sums go through 8 fixed lanes, then
 * ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))). */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fmath.h"
#include "kernels.h" /* the prototypes of what this file exports */

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

/* out[r] = (x[r] - mean) / sqrt(var + eps), no weight or bias (OLMo's LayerNorm): the mean
 * and the variance summed in double in input order and rounded to float where ggml_norm
 * rounds them. */
void skr_layer_norm(const float *x, int64_t rows, int64_t k, float eps, float *out)
{
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * k;
        float *o = out + r * k;
        double sum = 0.0;
        for (int64_t i = 0; i < k; i++)
            sum += (double)xr[i];
        const float mean = (float)sum / (float)k;
        double sq = 0.0;
        for (int64_t i = 0; i < k; i++) {
            o[i] = xr[i] - mean;
            sq += (double)(o[i] * o[i]);
        }
        const float scale = 1.0f / sqrtf((float)(sq / (double)k) + eps);
        for (int64_t i = 0; i < k; i++)
            o[i] = o[i] * scale;
    }
}

/* Rotate the first `dim` values of each of `heads` rows of length `hd` in place by the
 * angle table row (cos, sin: dim / 2 each). style 0: pairs (2i, 2i + 1); 1 (neox):
 * (i, i + dim / 2). */
void skr_rope(float *x, int heads, int hd, int dim, const float *c, const float *s,
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

/* out[r][c] = x[r] . w[idx[r][c]]: float32 rows of a [n][k] matrix at the rows idx picks
 * (the head's rescoring from the file's own values), dot()'s sum. */
void skr_rows_dot_f32(const float *w, int64_t k, const int64_t *idx, int64_t rows,
                      int64_t top, const float *x, float *out)
{
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < top; c++)
            out[r * top + c] = dot(x + r * k, w + idx[r * top + c] * k, k);
}

/* Sift the min-heap h (values v) of n entries down from slot i. */
static void sift(int64_t *h, const float *v, int64_t n, int64_t i)
{
    for (;;) {
        int64_t m = i, l = 2 * i + 1, r = l + 1;
        if (l < n && v[h[l]] < v[h[m]])
            m = l;
        if (r < n && v[h[r]] < v[h[m]])
            m = r;
        if (m == i)
            return;
        const int64_t t = h[i];
        h[i] = h[m];
        h[m] = t;
        i = m;
    }
}

/* idx[r] = the indices of the top highest of y[r]'s n values, in no order (the head's
 * candidates): one pass with a min-heap of the best so far; a value equal to the least
 * kept does not displace it (the earlier index stays). NaN is never taken over a number. */
void skr_top_rows(const float *y, int64_t rows, int64_t n, int64_t top, int64_t *idx)
{
    for (int64_t r = 0; r < rows; r++) {
        const float *v = y + r * n;
        int64_t *h = idx + r * top;
        for (int64_t i = 0; i < top; i++)
            h[i] = i;
        for (int64_t i = top / 2 - 1; i >= 0; i--)
            sift(h, v, top, i);
        for (int64_t i = top; i < n; i++)
            if (v[i] > v[h[0]]) {
                h[0] = i;
                sift(h, v, top, 0);
            }
    }
}

/* out[r] = act(gate[r]) * up[r] for `rows` rows of n (gate and up rows `stride` apart:
 * halves of one product's rows), act 0: silu(x) = x / (1 + exp(-x)), 1: GELU's tanh form,
 * 0.5 x (1 + tanh(z)) = x / (1 + exp(-2z)), z = sqrt(2 / pi) (x + 0.044715 x^3), 2: GELU
 * as llama.cpp's f16 table gives it (layers.gelu_f16: x rounded to f16 and looked up, 0 at
 * or below -10, x at or above 10; skr_set_gelu_f16 sets the table first). Rows above
 * OMP_ROWS split over torch's OpenMP team; every element is its own. */
static const float *gelu_f16_table; /* [65536], by an f16's bits */

void skr_set_gelu_f16(const float *table)
{
    gelu_f16_table = table;
}

/* x's nearest f16 (ties to even, as torch's .half()), as its bits; any NaN gives a NaN.
 * Plain integer arithmetic: compilers before GCC 12 have no _Float16 on x86. */
static inline uint16_t half_bits(float x)
{
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    const uint16_t sign = (uint16_t)((u >> 16) & 0x8000);
    const uint32_t a = u & 0x7fffffff;
    if (a > 0x7f800000)
        return sign | 0x7e00;                 /* NaN */
    if (a >= 0x477ff000)
        return sign | 0x7c00;                 /* 65520 and up round to infinity */
    if (a >= 0x38800000) {                    /* a normal half: drop 13 mantissa bits */
        const uint32_t r = a - 0x38000000;    /* the exponent rebiased from 127 to 15 */
        const uint32_t kept = r >> 13, rest = r & 0x1fff;
        return sign | (uint16_t)(kept + (rest > 0x1000 || (rest == 0x1000 && (kept & 1))));
    }
    if (a < 0x33000000)
        return sign;                          /* at or below half the least subnormal: 0 */
    /* a subnormal half: the mantissa with its implicit bit, shifted to units of 2^-24 */
    const uint32_t m = (a & 0x7fffff) | 0x800000;
    const int shift = 126 - (int)(a >> 23);   /* 14 .. 24 */
    const uint32_t kept = m >> shift, rest = m & ((1u << shift) - 1), half = 1u << (shift - 1);
    return sign | (uint16_t)(kept + (rest > half || (rest == half && (kept & 1))));
}

static inline float gelu_f16(float x)
{
    return x >= 10.0f ? x : (x <= -10.0f ? 0.0f : gelu_f16_table[half_bits(x)]);
}

void skr_gated(int act, const float *gate, const float *up, int64_t rows, int64_t n,
               int64_t stride, float *out, int threads)
{
#pragma omp parallel for schedule(static) num_threads(threads) if (rows > 4)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate + r * stride, *u = up + r * stride;
        float *o = out + r * n;
        if (act == 0)
            for (int64_t i = 0; i < n; i++)
                o[i] = g[i] / (1.0f + exp_poly(-g[i])) * u[i];
        else if (act == 2)
            for (int64_t i = 0; i < n; i++)
                o[i] = gelu_f16(g[i]) * u[i];
        else
            for (int64_t i = 0; i < n; i++) {
                const float x = g[i];
                const float z2 = 1.59576912f * (x + 0.044715f * (x * x * x));
                o[i] = x / (1.0f + exp_poly(-z2)) * u[i];
            }
    }
}

/* out[r][o] = x[r] . w[o] for `rows` rows of k against n_out float32 rows of w ([n_out, k]):
 * each product by dot()'s fixed lanes, so a row's outputs do not depend on how many rows
 * share the call or on the thread count (a float32 GEMM blocks its sums by both). For the
 * small float32 matrices quantizers leave alone: MoE routers, latent attention's per-head
 * up-projections (x and out rows `x_stride` / `out_stride` floats apart). Blocks of RB rows
 * x OB outputs keep their rows in cache (5-7x one dot at a time); each output's lanes
 * still take dot()'s additions in dot()'s order. */
#define RB 4
#define OB 4
static void linear_block(const float *x, int64_t xs, const float *w, int64_t k, float *out,
                         int64_t os)
{
    float l[RB][OB][LANES] = {{{0}}};
    int64_t i = 0;
    for (; i + LANES <= k; i += LANES)
        for (int r = 0; r < RB; r++)
            for (int o = 0; o < OB; o++)
                for (int j = 0; j < LANES; j++)
                    l[r][o][j] += x[r * xs + i + j] * w[o * k + i + j];
    for (int r = 0; r < RB; r++)
        for (int o = 0; o < OB; o++) {
            int64_t t = i;
            for (int j = 0; t < k; t++, j++)
                l[r][o][j] += x[r * xs + t] * w[o * k + t];
            out[r * os + o] = hsum8(l[r][o]);
        }
}

void skr_linear_f32(const float *x, int64_t x_stride, const float *w, int64_t rows, int64_t k,
                    int64_t n_out, float *out, int64_t out_stride, int threads)
{
    const int64_t rb = rows / RB, ob = n_out / OB;
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * n_out * k > 1 << 20)
    for (int64_t b = 0; b < rb * ob; b++) {
        const int64_t r0 = b / ob * RB, o0 = b % ob * OB;
        linear_block(x + r0 * x_stride, x_stride, w + o0 * k, k, out + r0 * out_stride + o0,
                     out_stride);
    }
    for (int64_t r = 0; r < rows; r++)  /* what the blocks leave: last outputs, last rows */
        for (int64_t o = r < rb * RB ? ob * OB : 0; o < n_out; o++)
            out[r * out_stride + o] = dot(x + r * x_stride, w + o * k, k);
}

/* skr_linear_f32 for each of `heads` heads in one call (latent attention's per-head up-
 * projections): head h reads x + h * x_head against its own weight w + h * w_head and
 * writes out + h * out_head. The same function per head: the same bits as one call each,
 * without a Python call per head and layer. */
void skr_linear_f32_heads(const float *x, int64_t x_stride, int64_t x_head, const float *w,
                          int64_t w_head, int64_t heads, int64_t rows, int64_t k,
                          int64_t n_out, float *out, int64_t out_stride, int64_t out_head,
                          int threads)
{
    for (int64_t h = 0; h < heads; h++)
        skr_linear_f32(x + h * x_head, x_stride, w + h * w_head, rows, k, n_out,
                       out + h * out_head, out_stride, threads);
}

/* A router's gate over each row of n logits, alone: 0 softmax (max, exp(x - max), their
 * sum in order, each divided by it), 1 sigmoid 1 / (1 + exp(-x)), 2 sqrt(softplus(x))
 * (softplus x above 20, as torch's). torch's would round a vector's body and its tail
 * by different exps, so a row's bits would depend on where the call put it. */
void skr_gate(int kind, const float *x, int64_t rows, int64_t n, float *out)
{
    for (int64_t r = 0; r < rows; r++) {
        const float *a = x + r * n;
        float *o = out + r * n;
        if (kind == 0) {
            float m = -INFINITY, sum = 0.0f;
            for (int64_t i = 0; i < n; i++)
                m = a[i] > m ? a[i] : m;
            for (int64_t i = 0; i < n; i++)
                o[i] = exp_poly(a[i] - m);
            for (int64_t i = 0; i < n; i++)
                sum += o[i];
            const float inv = 1.0f / sum;
            for (int64_t i = 0; i < n; i++)
                o[i] = o[i] * inv;
        } else if (kind == 1) {
            for (int64_t i = 0; i < n; i++)
                o[i] = 1.0f / (1.0f + exp_poly(-a[i]));
        } else {
            for (int64_t i = 0; i < n; i++)
                o[i] = sqrtf(a[i] > 20.0f ? a[i] : log1pf(exp_poly(a[i])));
        }
    }
}

/* tanh(y) by fixed float operations, branch-free so that a loop of it vectorizes: below
 * |y| = 0.25 its odd Taylor series to y^9 (the next term is under 2e-9 there), above it
 * 1 - 2 / (exp(2|y|) + 1) by exp_poly; within ~4e-7 of libm's tanhf (ggml's) everywhere,
 * +-1 at +-inf. */
static inline float tanh_poly(float y)
{
    const float a = fabsf(y), a2 = a * a;
    float p = 62.0f / 2835.0f;
    p = p * a2 - 17.0f / 315.0f;
    p = p * a2 + 2.0f / 15.0f;
    p = p * a2 - 1.0f / 3.0f;
    const float small = a + a * (a2 * p);
    const float big = 1.0f - 2.0f / (exp_poly(2.0f * a) + 1.0f);
    return copysignf(a < 0.25f ? small : big, y);
}

/* out[i] = tanh(x[i] * inv) * cap for n values (Gemma's capped logits): one thread, every
 * value by the same float operations wherever it sits (torch's tanh rounds a vector's
 * tail by another function than its body, and each of its three ops wakes its thread
 * team: 0.2 ms of a 49k-entry head's 1-row step, 0.9 ms at Gemma 4's 262k). */
void skr_soft_cap(const float *x, int64_t n, float inv, float cap, float *out)
{
    for (int64_t i = 0; i < n; i++)
        out[i] = tanh_poly(x[i] * inv) * cap;
}

/* An f16's value (every f16 is exactly a float). */
static inline float half_value(uint16_t h)
{
    const uint32_t e = (h >> 10) & 0x1f, m = h & 0x3ff;
    float f;
    if (e == 0) {
        f = (float)m * 5.9604644775390625e-8f; /* subnormal: m * 2^-24, exact */
    } else if (e == 31) {
        f = m ? NAN : INFINITY;
    } else {
        const uint32_t u = ((e + 112) << 23) | (m << 13);
        memcpy(&f, &u, sizeof f);
    }
    return h & 0x8000 ? -f : f;
}

/* Rows ids[r] of a Q6_K table held as its bytes (raw: row_bytes a row, whole blocks of 210
 * bytes: 128 low nibbles, 64 bytes of 2-bit highs, 16 int8 scales, an f16 d) dequantized
 * into out [n][blocks * 256]: value e of a block = (d * scale[e / 16]) * (q[e] - 32), the
 * float operations of gguf's Q6_K.dequantize_blocks, without its ~30 numpy calls a lookup
 * (Gemma 4's per-layer table, looked up once per forward: 0.2 ms of a 1-row step). */
void skr_q6k_rows(const uint8_t *raw, int64_t row_bytes, const int64_t *ids, int64_t n,
                  float *out)
{
    const int64_t blocks = row_bytes / 210;
    for (int64_t r = 0; r < n; r++)
        for (int64_t b = 0; b < blocks; b++) {
            const uint8_t *ql = raw + ids[r] * row_bytes + b * 210, *qh = ql + 128;
            const int8_t *sc = (const int8_t *)(ql + 192);
            uint16_t dh;
            memcpy(&dh, ql + 208, sizeof dh);
            const float d = half_value(dh);
            float *o = out + (r * blocks + b) * 256;
            for (int e = 0; e < 256; e++) {
                const int g = e / 128, i = e % 128;
                const int lo = (ql[g * 64 + i % 64] >> (4 * (i / 64))) & 0x0f;
                const int hi = (qh[g * 32 + i % 32] >> (2 * (i / 32))) & 0x03;
                o[e] = (d * (float)sc[e / 16]) * (float)((lo | (hi << 4)) - 32);
            }
        }
}

/* skr_q6k_rows for a Q8_0 table (blocks of 34 bytes: an f16 d, 32 int8 codes): value
 * (float)code * d, gguf's Q8_0.dequantize_blocks. */
void skr_q8_0_rows(const uint8_t *raw, int64_t row_bytes, const int64_t *ids, int64_t n,
                   float *out)
{
    const int64_t blocks = row_bytes / 34;
    for (int64_t r = 0; r < n; r++)
        for (int64_t b = 0; b < blocks; b++) {
            const uint8_t *block = raw + ids[r] * row_bytes + b * 34;
            const int8_t *x = (const int8_t *)(block + 2);
            uint16_t dh;
            memcpy(&dh, block, sizeof dh);
            const float d = half_value(dh);
            float *o = out + (r * blocks + b) * 32;
            for (int e = 0; e < 32; e++)
                o[e] = (float)x[e] * d;
        }
}

/* The float32 rows `ids` picks of a Q8_0 matrix kept as codes [rows][k] and scales
 * [rows][k / 32]: (float)code * scale, Int8Blocks.rows's arithmetic in one call (a decode
 * step's embedding lookup took 7 torch ops). -1, nothing written, where an id is not a row. */
int skr_q8_rows(const int8_t *codes, const float *scale, int64_t k, int64_t rows,
                const int64_t *ids, int64_t n, float *out)
{
    for (int64_t r = 0; r < n; r++)
        if (ids[r] < 0 || ids[r] >= rows)
            return -1;
    for (int64_t r = 0; r < n; r++) {
        const int8_t *c = codes + ids[r] * k;
        const float *s = scale + ids[r] * (k / 32);
        for (int64_t i = 0; i < k; i++)
            out[r * k + i] = (float)c[i] * s[i / 32];
    }
    return 0;
}

/* A frame's f16 values of n floats (frame.py's to_wire), and 1 where every |x| is below
 * `limit` (no NaN): rows that scale 1 sends as they are. Else 0, and out is not used. */
int skr_f16_rows(const float *x, int64_t n, float limit, uint16_t *out)
{
    int in_range = 1;
    for (int64_t i = 0; i < n; i++) {
        in_range &= fabsf(x[i]) < limit;
        out[i] = half_bits(x[i]);
    }
    return in_range;
}

/* A frame's float32 rows (frame.py's from_wire): f16 value * its row's scale. */
void skr_f16_values(const uint16_t *h, const float *scale, int64_t rows, int64_t k,
                    float *out)
{
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < k; i++)
            out[r * k + i] = half_value(h[r * k + i]) * scale[r];
}
