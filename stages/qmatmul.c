/* y = x @ W.T for weights held in blocks of 32 inputs, as GGUF stores them:
 *   kind 4: 4-bit codes c in 0..15, value = (c - 8) * s + z per block (z = 0 for Q4_0);
 *   kind 8: 8-bit codes c in -127..127, value = c * s per block (Q8_0);
 *   kind 6: 6-bit codes c in 0..63, value = d * sc * (c - 32) with an int8 sc per 16
 *           inputs and a half d per 256 (Q6_K, most 4-bit files' head: read at 6.56 bits
 *           a weight, as llama.cpp reads it, not as 8.5-bit Q8_0).
 * Rows of x are quantized per block of 32 to int8 (d = amax / 127, q = rint(x / d)), as
 * llama.cpp quantizes activations for its Q4_0 / Q8_0 dot products (one level for every
 * row: stages/linear.py says why).
 *
 * Why a kernel of our own: torch's int4 / int8 kernels want bfloat16 rows and are slow
 * without AVX-512 BF16 (evals/README.md, torch runtime); decode reads each 4-bit weight
 * once here and prefill multiplies integer blocks without a bfloat16 copy of the weights.
 *
 * Exactness: every output y[m][n] is one fixed sequence of float operations, whatever the
 * row count, thread count or instruction set. A block's dot product is an exact integer;
 * then, in block order, y = fma((float)dot, s * d, y) and, where z is held,
 * y = fma(z, d * sum(q), y). The AVX2, AVX-512 VNNI and plain C paths compute those same
 * integers and floats, so they give the same bits (tests/test_qkernel.py).
 *
 * Packed layout: columns in tiles of TN = 16; per tile and block,
 *   kind 4: 256 bytes, byte [j][i][u] (j < 4 groups, i < 16 columns, u < 4) holds the
 *           code of input 4j + u of column i in its low nibble and of input 16 + 4j + u
 *           in its high nibble;
 *   kind 8: 512 bytes, byte [j][i][u] (j < 8) the code of input 4j + u of column i;
 *   kind 6: 384 bytes: 256 as kind 4's with the codes' low 4 bits, then two planes of 64,
 *           byte [h][i][u] holding in bits 2j, 2j + 1 the codes' top 2 bits of input
 *           16h + 4j + u; its sc as int8 [h][i] (32 bytes) per tile and block, its d as
 *           16 halves per tile and 256 inputs. Per block and column the integer
 *           sc0 * (dot0 - 32 sum0) + sc1 * (dot1 - 32 sum1) over the halves h, then
 *           y = fma((float)that, d * dx, y).
 * scales (and zeros) per tile and block as 16 floats, or as 16 halves (SKQ_S16, SKQ_Z16)
 * where every one of them is a half: GGUF's Q4_0 / Q8_0 / Q4_1 scales are, and a half's
 * float is exact, so the bits are the same while a weight costs 4.5 / 8.5 bits to read
 * rather than 5 / 9 (one-row calls are bound by that read). A 32-bit lane of a vector
 * then holds one column's four codes, and one column's dot product ends in one lane. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fmath.h"
#include "kernels.h"
#if defined(SKQ_AVX2) || defined(SKQ_AVX512)
#include <immintrin.h>
#endif

#define QK 32
#define TN 16

/* A half's exact float (every half is a float; subnormals and signs included). */
static inline float half_float(uint16_t h)
{
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 31, m = h & 1023;
    uint32_t bits;
    if (e == 31)
        bits = sign | 0x7f800000u | (m << 13);
    else if (e)
        bits = sign | ((e + 112) << 23) | (m << 13);
    else if (!m)
        bits = sign;
    else { /* subnormal: m * 2^-24, exact in float */
        const float v = (float)m * 0x1p-24f;
        memcpy(&bits, &v, 4);
        bits |= sign;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* One block of 32 values: q (int8) with d = amax / 127, the sum of q, and d * sum(q). */
static void quantize_block(const float *xb, int8_t *qb, float *d, int32_t *sum, float *dsum)
{
    /* fmaxf and lrintf as library calls kept this loop scalar (7 % of a 16-row prefill):
     * a > amax ignores a NaN as fmaxf does, and rintf rounds half to even as lrintf does
     * (an integral float of at most 127 converts exactly) */
    float amax = 0.0f;
    for (int i = 0; i < QK; i++) {
        const float a = fabsf(xb[i]);
        amax = a > amax ? a : amax;
    }
    const float dd = amax / 127.0f;
    const float id = dd != 0.0f ? 1.0f / dd : 0.0f;
    int32_t s = 0;
    for (int i = 0; i < QK; i++) {
        const int32_t v = (int32_t)rintf(xb[i] * id);
        qb[i] = (int8_t)v;
        s += v;
    }
    *d = dd, *sum = s, *dsum = dd * (float)s;
}

/* Each row of x as int8 blocks. */
static void quantize(const float *x, int64_t M, int64_t K, int8_t *q, float *d,
                     int32_t *sum, float *dsum)
{
    const int64_t nb = K / QK;
    for (int64_t m = 0; m < M; m++)
        for (int64_t b = 0; b < nb; b++) {
            const int64_t at = m * nb + b;
            quantize_block(x + m * K + b * QK, q + m * K + b * QK, d + at, sum + at, dsum + at);
        }
}

typedef struct {
    int kind, s16, z16; /* s16 / z16: scales / zeros stored as halves */
    const uint8_t *w;
    const void *s, *z;
    int64_t N, K, nb;
    const int8_t *q;
    const float *d, *dsum;
    const int32_t *sum;
    const int32_t *sum16; /* kind 6: per row and block, the sums of q's two halves */
    float *y;
    int64_t M;
    int use_c;
} job;

/* Scale (or zero) i of a packed table, as a float. */
static inline float at(const void *v, int half, int64_t i)
{
    return half ? half_float(((const uint16_t *)v)[i]) : ((const float *)v)[i];
}

/* Copy an accumulator's first n lanes to y (the last tile of a matrix may be short). */
static inline void store(float *y, const float *lanes, int n)
{
    memcpy(y, lanes, (size_t)n * sizeof(float));
}

/* Kind 6: ask for tile-block tb + PF_BLOCKS's codes and sub-scales now. Its unpacking
 * costs about as much as the memory it waits on, and without this a one-row call waited,
 * then computed, in turn (Zen 4, a 49k x 512 Q6_K head evicted by other work: 1.5-1.9 ms,
 * 1.1-1.2 with it; in cache 0.36-0.43 ms, 0.28-0.32). Kinds 4 and 8 gained nothing: the
 * hardware's prefetch keeps up with them. A prefetch never faults, even past the end. */
#define PF_BLOCKS 16
static inline void prefetch6(const job *J, int64_t tb)
{
    const char *w = (const char *)J->w + (tb + PF_BLOCKS) * 384;
    for (int l = 0; l < 384; l += 64)
        __builtin_prefetch(w + l, 0, 3);
    __builtin_prefetch((const char *)J->s + (tb + PF_BLOCKS) * 32, 0, 3);
}

/* ---- plain C: the definition every vector path reproduces -------------------------- */
/* Kind 6's integer for column i of tile t's block b: sc0 * (dot0 - 32 sum0) +
 * sc1 * (dot1 - 32 sum1) over the block's halves (s16: the halves' sums of q). */
static int32_t dot6(const job *J, int64_t t, int64_t b, int i, const int8_t *xb,
                    const int32_t *s16)
{
    const uint8_t *wb = J->w + (t * J->nb + b) * 384;
    const int8_t *sc = (const int8_t *)J->s + (t * J->nb + b) * 32;
    int32_t total = 0;
    for (int h = 0; h < 2; h++) {
        int32_t dot = 0;
        for (int j = 0; j < 4; j++)
            for (int u = 0; u < 4; u++) {
                const uint8_t lo = wb[j * 64 + i * 4 + u], hi = wb[256 + h * 64 + i * 4 + u];
                const int code = (h ? lo >> 4 : lo & 15) | (((hi >> (2 * j)) & 3) << 4);
                dot += code * xb[16 * h + 4 * j + u];
            }
        total += sc[h * TN + i] * (dot - 32 * s16[h]);
    }
    return total;
}

static void tile_c(const job *J, int64_t t, int64_t m0, int mr)
{
    const int64_t nb = J->nb;
    const int ncols = (int)(J->N - t * TN < TN ? J->N - t * TN : TN);
    for (int r = 0; r < mr; r++) {
        const int64_t m = m0 + r;
        float acc[TN] = {0};
        for (int64_t b = 0; b < nb; b++) {
            const int8_t *xb = J->q + m * J->K + b * QK;
            const int64_t sb = (t * nb + b) * TN;
            const float dx = J->d[m * nb + b];
            for (int i = 0; i < TN; i++) {
                int32_t dot = 0;
                if (J->kind == 6) {
                    acc[i] = fmaf((float)dot6(J, t, b, i, xb, J->sum16 + (m * nb + b) * 2),
                                  half_float(((const uint16_t *)J->z)[
                                      (t * (nb / 8) + b / 8) * TN + i]) * dx, acc[i]);
                    continue;
                }
                if (J->kind == 4) {
                    const uint8_t *wb = J->w + (t * nb + b) * 256;
                    for (int j = 0; j < 4; j++)
                        for (int u = 0; u < 4; u++) {
                            const uint8_t c = wb[j * 64 + i * 4 + u];
                            dot += (c & 15) * xb[4 * j + u] + (c >> 4) * xb[16 + 4 * j + u];
                        }
                    dot -= 8 * J->sum[m * nb + b];
                } else {
                    const int8_t *wb = (const int8_t *)J->w + (t * nb + b) * 512;
                    for (int j = 0; j < 8; j++)
                        for (int u = 0; u < 4; u++)
                            dot += wb[j * 64 + i * 4 + u] * xb[4 * j + u];
                }
                acc[i] = fmaf((float)dot, at(J->s, J->s16, sb + i) * dx, acc[i]);
                if (J->z)
                    acc[i] = fmaf(at(J->z, J->z16, sb + i), J->dsum[m * nb + b], acc[i]);
            }
        }
        store(J->y + m * J->N + t * TN, acc, ncols);
    }
}


#if defined(SKQ_AVX2) && !defined(SKQ_AVX512)
/* AVX2: a tile as two halves of 8 columns; MR rows share each unpacked weight vector.
 * 4-bit: eight maddubs products (|each| <= 2 * 15 * 127) add up in int16 without
 * overflow (8 * 3810 = 30480), then one madd to int32. 8-bit: codes signed, so
 * maddubs(|w|, sign(q, w)) per group (|each| <= 2 * 127 * 127), madd to int32 at once. */
#define ACC_T __m256
/* Rows m0.. of accumulators (8 columns from c0; a matrix's last tile may be short) to y. */
static inline void store8(const job *J, const __m256 *acc, int MR, int64_t m0, int64_t c0)
{
    const int ncols = (int)(J->N - c0 < 8 ? J->N - c0 : 8);
    for (int r = 0; r < MR; r++) {
        float lanes[8];
        _mm256_storeu_ps(lanes, acc[r]);
        if (ncols > 0)
            store(J->y + (m0 + r) * J->N + c0, lanes, ncols);
    }
}

static inline __m256 load8(const void *v, int half, int64_t i)
{
    return half ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)v + i)))
                : _mm256_loadu_ps((const float *)v + i);
}

static inline __attribute__((always_inline)) void
half_avx2(const job *J, int64_t t, int h, int64_t m0, const int MR, const int HASZ)
{
    const int64_t nb = J->nb, K = J->K;
    const __m256i m0f = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    __m256 acc[8];
    for (int r = 0; r < MR; r++)
        acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m256i dot[8];
        const int8_t *xb = J->q + m0 * K + b * QK;
        if (J->kind == 4) {
            /* the block's 8 weight vectors stay in registers while each row passes */
            const uint8_t *wb = J->w + (t * nb + b) * 256 + h * 32;
            __m256i w[8];
            for (int j = 0; j < 4; j++) {
                const __m256i raw = _mm256_loadu_si256((const __m256i *)(wb + j * 64));
                w[j] = _mm256_and_si256(raw, m0f);
                w[4 + j] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m0f);
            }
            for (int r = 0; r < MR; r++) {
                const int8_t *xr = xb + r * K;
                __m256i p[8];
                for (int j = 0; j < 8; j++) {
                    int32_t xv; /* inputs 4j..4j+3, then 16+4j.. for the high nibbles */
                    memcpy(&xv, xr + (j < 4 ? 4 * j : 16 + 4 * (j - 4)), 4);
                    p[j] = _mm256_maddubs_epi16(w[j], _mm256_set1_epi32(xv));
                }
                const __m256i sum16 = _mm256_add_epi16(
                    _mm256_add_epi16(_mm256_add_epi16(p[0], p[1]), _mm256_add_epi16(p[2], p[3])),
                    _mm256_add_epi16(_mm256_add_epi16(p[4], p[5]), _mm256_add_epi16(p[6], p[7])));
                dot[r] = _mm256_add_epi32(_mm256_madd_epi16(sum16, ones),
                                          _mm256_set1_epi32(-8 * J->sum[(m0 + r) * nb + b]));
            }
        } else {
            const uint8_t *wb = J->w + (t * nb + b) * 512 + h * 32;
            for (int r = 0; r < MR; r++)
                dot[r] = _mm256_setzero_si256();
            for (int j = 0; j < 8; j++) {
                const __m256i w = _mm256_loadu_si256((const __m256i *)(wb + j * 64));
                const __m256i wa = _mm256_abs_epi8(w);
                for (int r = 0; r < MR; r++) {
                    int32_t xv;
                    memcpy(&xv, xb + r * K + 4 * j, 4);
                    const __m256i xs = _mm256_sign_epi8(_mm256_set1_epi32(xv), w);
                    dot[r] = _mm256_add_epi32(dot[r], _mm256_madd_epi16(_mm256_maddubs_epi16(wa, xs), ones));
                }
            }
        }
        const __m256 sv = load8(J->s, J->s16, (t * nb + b) * TN + h * 8);
        for (int r = 0; r < MR; r++) {
            const __m256 sd = _mm256_mul_ps(sv, _mm256_set1_ps(J->d[(m0 + r) * nb + b]));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r]), sd, acc[r]);
        }
        if (HASZ) {
            const __m256 zv = load8(J->z, J->z16, (t * nb + b) * TN + h * 8);
            for (int r = 0; r < MR; r++)
                acc[r] = _mm256_fmadd_ps(zv, _mm256_set1_ps(J->dsum[(m0 + r) * nb + b]), acc[r]);
        }
    }
    store8(J, acc, MR, m0, t * TN + h * 8);
}


/* Bits 2j, 2j + 1 of each byte of a top plane moved to bits 4, 5 (the code's top two):
 * one shift of the 16-bit lanes and a mask, as the bits that cross into a byte from its
 * neighbour fall outside 0x30. */
static inline __m256i top_avx2(__m256i top, int j, __m256i m30)
{
    switch (j) {
    case 0: return _mm256_and_si256(_mm256_slli_epi16(top, 4), m30);
    case 1: return _mm256_and_si256(_mm256_slli_epi16(top, 2), m30);
    case 2: return _mm256_and_si256(top, m30);
    default: return _mm256_and_si256(_mm256_srli_epi16(top, 2), m30);
    }
}

/* Kind 6 on AVX2, a tile as two halves of 8 columns: maddubs of a 6-bit code and a q
 * (|each pair| <= 2 * 63 * 127) summed two at a time in int16 (<= 32004), then to int32. */
static inline __attribute__((always_inline)) void
half6_avx2(const job *J, int64_t t, int hh, int64_t m0, const int MR)
{
    const int64_t nb = J->nb, K = J->K;
    const __m256i m0f = _mm256_set1_epi8(0x0f), m30 = _mm256_set1_epi8(0x30);
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[8];
    for (int r = 0; r < MR; r++)
        acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *wb = J->w + (t * nb + b) * 384 + hh * 32;
        if (hh == 0)
            prefetch6(J, t * nb + b);
        const int8_t *sc = (const int8_t *)J->s + (t * nb + b) * 32 + hh * 8;
        const __m256i top0 = _mm256_loadu_si256((const __m256i *)(wb + 256));
        const __m256i top1 = _mm256_loadu_si256((const __m256i *)(wb + 320));
        __m256i c0[4], c1[4];
        for (int j = 0; j < 4; j++) {
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(wb + j * 64));
            c0[j] = _mm256_or_si256(_mm256_and_si256(raw, m0f), top_avx2(top0, j, m30));
            c1[j] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(raw, 4), m0f),
                                    top_avx2(top1, j, m30));
        }
        const __m256i s0 = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)sc));
        const __m256i s1 = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(sc + 16)));
        const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(
            (const uint16_t *)J->z + (t * (nb / 8) + b / 8) * TN + hh * 8)));
        for (int r = 0; r < MR; r++) {
            const int8_t *xr = J->q + (m0 + r) * K + b * QK;
            const int32_t *s16 = J->sum16 + ((m0 + r) * nb + b) * 2;
            __m256i p0[4], p1[4];
            for (int j = 0; j < 4; j++) {
                int32_t x0, x1;
                memcpy(&x0, xr + 4 * j, 4);
                memcpy(&x1, xr + 16 + 4 * j, 4);
                p0[j] = _mm256_maddubs_epi16(c0[j], _mm256_set1_epi32(x0));
                p1[j] = _mm256_maddubs_epi16(c1[j], _mm256_set1_epi32(x1));
            }
            const __m256i d0 = _mm256_add_epi32(
                _mm256_madd_epi16(_mm256_add_epi16(p0[0], p0[1]), ones),
                _mm256_madd_epi16(_mm256_add_epi16(p0[2], p0[3]), ones));
            const __m256i d1 = _mm256_add_epi32(
                _mm256_madd_epi16(_mm256_add_epi16(p1[0], p1[1]), ones),
                _mm256_madd_epi16(_mm256_add_epi16(p1[2], p1[3]), ones));
            const __m256i tot = _mm256_add_epi32(
                _mm256_mullo_epi32(s0, _mm256_sub_epi32(d0, _mm256_set1_epi32(32 * s16[0]))),
                _mm256_mullo_epi32(s1, _mm256_sub_epi32(d1, _mm256_set1_epi32(32 * s16[1]))));
            const __m256 sd = _mm256_mul_ps(dv, _mm256_set1_ps(J->d[(m0 + r) * nb + b]));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(tot), sd, acc[r]);
        }
    }
    store8(J, acc, MR, m0, t * TN + hh * 8);
}

static void tile6_vec(const job *J, int64_t t, int64_t m0, int mr)
{
    for (int h = 0; h < 2; h++) {
        switch (mr) {
        case 4: half6_avx2(J, t, h, m0, 4); break;
        case 3: half6_avx2(J, t, h, m0, 3); break;
        case 2: half6_avx2(J, t, h, m0, 2); break;
        default: half6_avx2(J, t, h, m0, 1);
        }
    }
}

#define MR_MAX 4
static void tile_vec(const job *J, int64_t t, int64_t m0, int mr)
{
    for (int h = 0; h < 2; h++) {
        if (J->z) {
            switch (mr) {
            case 4: half_avx2(J, t, h, m0, 4, 1); break;
            case 3: half_avx2(J, t, h, m0, 3, 1); break;
            case 2: half_avx2(J, t, h, m0, 2, 1); break;
            default: half_avx2(J, t, h, m0, 1, 1);
            }
        } else {
            switch (mr) {
            case 4: half_avx2(J, t, h, m0, 4, 0); break;
            case 3: half_avx2(J, t, h, m0, 3, 0); break;
            case 2: half_avx2(J, t, h, m0, 2, 0); break;
            default: half_avx2(J, t, h, m0, 1, 0);
            }
        }
    }
}
#endif

#if defined(SKQ_AVX512)
/* Rows m0.. of accumulators (tile t's columns; the last tile may be short) to y. */
static inline void store16(const job *J, const __m512 *acc, int MR, int64_t m0, int64_t t)
{
    const int ncols = (int)(J->N - t * TN < TN ? J->N - t * TN : TN);
    for (int r = 0; r < MR; r++) {
        float lanes[TN];
        _mm512_storeu_ps(lanes, acc[r]);
        store(J->y + (m0 + r) * J->N + t * TN, lanes, ncols);
    }
}

static inline __m512 load16(const void *v, int half, int64_t i)
{
    return half ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)v + i)))
                : _mm512_loadu_ps((const float *)v + i);
}

/* AVX-512 VNNI: a whole tile of 16 columns per vector; dpbusd takes unsigned x signed
 * bytes, so 8-bit codes go in as c + 128 (xor 0x80) and 128 * sum(q) comes off. */
static inline __attribute__((always_inline)) void
tile_avx512(const job *J, int64_t t, int64_t m0, const int MR, const int HASZ)
{
    const int64_t nb = J->nb, K = J->K;
    const __m512i m0f = _mm512_set1_epi8(0x0f), flip = _mm512_set1_epi8((char)0x80);
    __m512 acc[8];
    for (int r = 0; r < MR; r++)
        acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        /* two integer chains per row (exact sums: their order changes no bit), so that a
         * one-row call is not one dependent dpbusd after another */
        __m512i dot[8], dot2[8];
        const int8_t *xb = J->q + m0 * K + b * QK;
        if (J->kind == 4) {
            const uint8_t *wb = J->w + (t * nb + b) * 256;
            for (int r = 0; r < MR; r++) {
                dot[r] = _mm512_set1_epi32(-8 * J->sum[(m0 + r) * nb + b]);
                dot2[r] = _mm512_setzero_si512();
            }
            for (int j = 0; j < 4; j++) {
                const __m512i raw = _mm512_loadu_si512((const void *)(wb + j * 64));
                const __m512i lo = _mm512_and_si512(raw, m0f);
                const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m0f);
                for (int r = 0; r < MR; r++) {
                    int32_t xl, xh;
                    memcpy(&xl, xb + r * K + 4 * j, 4);
                    memcpy(&xh, xb + r * K + 16 + 4 * j, 4);
                    dot[r] = _mm512_dpbusd_epi32(dot[r], lo, _mm512_set1_epi32(xl));
                    dot2[r] = _mm512_dpbusd_epi32(dot2[r], hi, _mm512_set1_epi32(xh));
                }
            }
        } else {
            const uint8_t *wb = J->w + (t * nb + b) * 512;
            for (int r = 0; r < MR; r++) {
                dot[r] = _mm512_set1_epi32(-128 * J->sum[(m0 + r) * nb + b]);
                dot2[r] = _mm512_setzero_si512();
            }
            for (int j = 0; j < 8; j += 2) {
                const __m512i w0 = _mm512_xor_si512(
                    _mm512_loadu_si512((const void *)(wb + j * 64)), flip);
                const __m512i w1 = _mm512_xor_si512(
                    _mm512_loadu_si512((const void *)(wb + j * 64 + 64)), flip);
                for (int r = 0; r < MR; r++) {
                    int32_t x0, x1;
                    memcpy(&x0, xb + r * K + 4 * j, 4);
                    memcpy(&x1, xb + r * K + 4 * j + 4, 4);
                    dot[r] = _mm512_dpbusd_epi32(dot[r], w0, _mm512_set1_epi32(x0));
                    dot2[r] = _mm512_dpbusd_epi32(dot2[r], w1, _mm512_set1_epi32(x1));
                }
            }
        }
        for (int r = 0; r < MR; r++)
            dot[r] = _mm512_add_epi32(dot[r], dot2[r]);
        const __m512 sv = load16(J->s, J->s16, (t * nb + b) * TN);
        for (int r = 0; r < MR; r++) {
            const __m512 sd = _mm512_mul_ps(sv, _mm512_set1_ps(J->d[(m0 + r) * nb + b]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), sd, acc[r]);
        }
        if (HASZ) {
            const __m512 zv = load16(J->z, J->z16, (t * nb + b) * TN);
            for (int r = 0; r < MR; r++)
                acc[r] = _mm512_fmadd_ps(zv, _mm512_set1_ps(J->dsum[(m0 + r) * nb + b]), acc[r]);
        }
    }
    store16(J, acc, MR, m0, t);
}


/* top_avx2's on 512 bits. */
static inline __m512i top_avx512(__m512i top, int j, __m512i m30)
{
    switch (j) {
    case 0: return _mm512_and_si512(_mm512_slli_epi16(top, 4), m30);
    case 1: return _mm512_and_si512(_mm512_slli_epi16(top, 2), m30);
    case 2: return _mm512_and_si512(top, m30);
    default: return _mm512_and_si512(_mm512_srli_epi16(top, 2), m30);
    }
}

/* Kind 6 on AVX-512 VNNI: a tile's 16 columns per vector; a code (0..63) is unsigned,
 * as dpbusd takes it. */
static inline __attribute__((always_inline)) void
tile6_avx512(const job *J, int64_t t, int64_t m0, const int MR)
{
    const int64_t nb = J->nb, K = J->K;
    const __m512i m0f = _mm512_set1_epi8(0x0f), m30 = _mm512_set1_epi8(0x30);
    __m512 acc[8];
    for (int r = 0; r < MR; r++)
        acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *wb = J->w + (t * nb + b) * 384;
        const int8_t *sc = (const int8_t *)J->s + (t * nb + b) * 32;
        prefetch6(J, t * nb + b);
        const __m512i top0 = _mm512_loadu_si512((const void *)(wb + 256));
        const __m512i top1 = _mm512_loadu_si512((const void *)(wb + 320));
        __m512i d0[8], d1[8];
        for (int r = 0; r < MR; r++)
            d0[r] = d1[r] = _mm512_setzero_si512();
        for (int j = 0; j < 4; j++) {
            const __m512i raw = _mm512_loadu_si512((const void *)(wb + j * 64));
            const __m512i c0 = _mm512_or_si512(_mm512_and_si512(raw, m0f),
                                               top_avx512(top0, j, m30));
            const __m512i c1 = _mm512_or_si512(
                _mm512_and_si512(_mm512_srli_epi16(raw, 4), m0f), top_avx512(top1, j, m30));
            for (int r = 0; r < MR; r++) {
                int32_t x0, x1;
                memcpy(&x0, J->q + (m0 + r) * K + b * QK + 4 * j, 4);
                memcpy(&x1, J->q + (m0 + r) * K + b * QK + 16 + 4 * j, 4);
                d0[r] = _mm512_dpbusd_epi32(d0[r], c0, _mm512_set1_epi32(x0));
                d1[r] = _mm512_dpbusd_epi32(d1[r], c1, _mm512_set1_epi32(x1));
            }
        }
        const __m512i s0 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)sc));
        const __m512i s1 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(sc + 16)));
        const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(
            (const uint16_t *)J->z + (t * (nb / 8) + b / 8) * TN)));
        for (int r = 0; r < MR; r++) {
            const int32_t *s16 = J->sum16 + ((m0 + r) * nb + b) * 2;
            const __m512i tot = _mm512_add_epi32(
                _mm512_mullo_epi32(s0, _mm512_sub_epi32(d0[r], _mm512_set1_epi32(32 * s16[0]))),
                _mm512_mullo_epi32(s1, _mm512_sub_epi32(d1[r], _mm512_set1_epi32(32 * s16[1]))));
            const __m512 sd = _mm512_mul_ps(dv, _mm512_set1_ps(J->d[(m0 + r) * nb + b]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(tot), sd, acc[r]);
        }
    }
    store16(J, acc, MR, m0, t);
}

static void tile6_vec(const job *J, int64_t t, int64_t m0, int mr)
{
    switch (mr) {
    case 8: tile6_avx512(J, t, m0, 8); break;
    case 7: tile6_avx512(J, t, m0, 7); break;
    case 6: tile6_avx512(J, t, m0, 6); break;
    case 5: tile6_avx512(J, t, m0, 5); break;
    case 4: tile6_avx512(J, t, m0, 4); break;
    case 3: tile6_avx512(J, t, m0, 3); break;
    case 2: tile6_avx512(J, t, m0, 2); break;
    default: tile6_avx512(J, t, m0, 1);
    }
}

#define MR_MAX 8
static void tile_vec(const job *J, int64_t t, int64_t m0, int mr)
{
#define CASES(Z)                                                          \
    switch (mr) {                                                         \
    case 8: tile_avx512(J, t, m0, 8, Z); break;                          \
    case 7: tile_avx512(J, t, m0, 7, Z); break;                          \
    case 6: tile_avx512(J, t, m0, 6, Z); break;                          \
    case 5: tile_avx512(J, t, m0, 5, Z); break;                          \
    case 4: tile_avx512(J, t, m0, 4, Z); break;                          \
    case 3: tile_avx512(J, t, m0, 3, Z); break;                          \
    case 2: tile_avx512(J, t, m0, 2, Z); break;                          \
    default: tile_avx512(J, t, m0, 1, Z);                                \
    }
    if (J->z) {
        CASES(1)
    } else {
        CASES(0)
    }
#undef CASES
}
#endif

#if !defined(MR_MAX)
#define MR_MAX 4
#define tile_vec tile_c
#define tile6_vec tile_c
#endif


/* Above this many rows the threads are torch's OpenMP team: torch's own ops between our
 * calls run on it from a few rows on (a [16, 2048] activation is its grain), and two teams
 * on the same cores spin through each other's work (AVX2 prefill ran 3-4x slower; a
 * 16-row Gemma 3 prefill 3x, until this was 4 rather than 16). One to four rows (a
 * lane's decode step, a short tail), between which torch runs little in parallel, take
 * pool.c's workers, which leave the cores to a stage sharing them. Either way each tile
 * is one thread's: the same bits. */
#define OMP_ROWS 4

/* Column tiles [t0, t1) for every row. Rows in groups of MR_MAX share each weight
 * vector; a weight tile (K / 2 bytes for 4-bit) stays in cache over the groups. */
static void tiles(void *arg, int64_t t0, int64_t t1)
{
    const job *J = arg;
    for (int64_t t = t0; t < t1; t++)
        for (int64_t m0 = 0; m0 < J->M; m0 += MR_MAX) {
            const int mr = (int)(J->M - m0 < MR_MAX ? J->M - m0 : MR_MAX);
            if (J->use_c)
                tile_c(J, t, m0, mr);
            else if (J->kind == 6)
                tile6_vec(J, t, m0, mr);
            else
                tile_vec(J, t, m0, mr);
        }
}

/* The build's instruction set, as loaded: "avx512-vnni", "avx2" or "c". */
const char *skq_isa(void)
{
#if defined(SKQ_AVX512)
    return "avx512-vnni";
#elif defined(SKQ_AVX2)
    return "avx2";
#else
    return "c";
#endif
}

/* y[M][N] = x[M][K] @ W.T. kind 4 or 8, | SKQ_S16 and | SKQ_Z16 where s / z hold halves
 * (kind 6: s its int8 sub-scales, z its halves d, as the layout above), | SKQ_TEAM for the OpenMP team at any row count (a prefill's head row: its team is awake);
 * w, s, z (z may be NULL) packed as above, with ceil(N / 16) tiles. Threads (pool.c) split the column tiles: each output is one
 * thread's.
 * use_c: run the plain C definition (tests compare the paths). Returns 0, or -1 when
 * scratch memory could not be had. */
int skq_matmul(int kind, const uint8_t *w, const void *s, const void *z, int64_t N,
               int64_t K, const float *x, int64_t M, float *y, int threads, int use_c)
{
    const int64_t nb = K / QK;
    int8_t *q = malloc((size_t)(M * K));
    float *d = malloc((size_t)(M * nb) * sizeof(float));
    float *dsum = malloc((size_t)(M * nb) * sizeof(float));
    int32_t *sum = malloc((size_t)(M * nb) * sizeof(int32_t));
    if (!q || !d || !dsum || !sum) {
        free(q); free(d); free(dsum); free(sum);
        return -1;
    }
    quantize(x, M, K, q, d, sum, dsum);
    int32_t *sum16 = NULL;
    if ((kind & 15) == 6) { /* the two halves' sums of each block's q */
        sum16 = malloc((size_t)(M * nb * 2) * sizeof(int32_t));
        if (!sum16) {
            free(q); free(d); free(dsum); free(sum);
            return -1;
        }
        for (int64_t i = 0; i < M * nb * 2; i++) {
            int32_t v = 0;
            for (int u = 0; u < 16; u++)
                v += q[i * 16 + u];
            sum16[i] = v;
        }
    }
    job J = {kind & 15, !!(kind & SKQ_S16), !!(kind & SKQ_Z16), w, s, z, N, K, nb, q, d, dsum,
             sum, sum16, y, M, use_c};
    const int64_t n_tiles = (N + TN - 1) / TN;
    if (M > OMP_ROWS || (kind & SKQ_TEAM)) { /* prefill: on torch's OpenMP team, which runs
                                               * the ops around it */
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int64_t t = 0; t < n_tiles; t++)
            tiles(&J, t, t + 1);
    } else {
        skp_run(threads, n_tiles, tiles, &J);
    }
    free(q); free(d); free(dsum); free(sum); free(sum16);
    return 0;
}


/* Kind 6's float32 values of row n (k inputs) from the packed tables, as GGUF's own
 * dequantization computes them: (d * sc) * (c - 32), each product rounded to float. */
static void row6(const uint8_t *w, const int8_t *s, const uint16_t *z, int64_t k, int64_t n,
                 float *out)
{
    const int64_t nb = k / QK, t = n / TN;
    const int i = (int)(n % TN);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *wb = w + (t * nb + b) * 384;
        const int8_t *sc = s + (t * nb + b) * 32;
        const float d = half_float(z[(t * (nb / 8) + b / 8) * TN + i]);
        for (int h = 0; h < 2; h++) {
            const float ds = d * (float)sc[h * TN + i];
            for (int j = 0; j < 4; j++)
                for (int u = 0; u < 4; u++) {
                    const uint8_t lo = wb[j * 64 + i * 4 + u];
                    const uint8_t hi = wb[256 + h * 64 + i * 4 + u];
                    const int code = (h ? lo >> 4 : lo & 15) | (((hi >> (2 * j)) & 3) << 4);
                    out[b * QK + 16 * h + 4 * j + u] = ds * (float)(code - 32);
                }
        }
    }
}

/* out[r] = the float32 values of row ids[r] of a kind-6 matrix of `rows` rows (a Q6_K
 * embedding table's rows, the bits of its dequantized copy, which it then need not
 * keep). -1, nothing written, where an id is not a row. */
int skq_rows6(const uint8_t *w, const int8_t *s, const uint16_t *z, int64_t k, int64_t rows,
              const int64_t *ids, int64_t n, float *out)
{
    for (int64_t r = 0; r < n; r++)
        if (ids[r] < 0 || ids[r] >= rows)
            return -1;
    for (int64_t r = 0; r < n; r++)
        row6(w, s, z, k, ids[r], out + r * k);
    return 0;
}

/* out[r][c] = x[r] . (the float32 values of row idx[r][c] of a kind-6 matrix): the same
 * bits as skr_rows_dot_f32 over its dequantized copy, which a rescored Q6_K head then
 * need not keep (4 bytes a weight: Gemma 3's 262k x 640 head, 671 MB). Returns 0, or -1
 * without scratch memory. */
int skq_rows_dot6(const uint8_t *w, const int8_t *s, const uint16_t *z, int64_t k,
                  const int64_t *idx, int64_t rows, int64_t top, const float *x, float *out)
{
    float *row = malloc(sizeof(float) * (size_t)k);
    if (!row)
        return -1;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < top; c++) {
            row6(w, s, z, k, idx[r * top + c], row);
            out[r * top + c] = dot(x + r * k, row, k);
        }
    free(row);
    return 0;
}
