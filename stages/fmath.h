/* Float functions shared by our kernels (rowops.c, scan.c), each a fixed sequence of float
 * operations: the same bits in every build, for every row, wherever a call puts it. */

#ifndef SKIPPY_FMATH_H
#define SKIPPY_FMATH_H

#include <math.h>
#include <stdint.h>

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

/* exp(x) by fixed float operations, branch-free, so the loops that call it vectorize and
 * a vector lane computes what the scalar tail computes (torch's elementwise kernels run
 * a vector's body through Sleef and its tail through libm: an element's bits then depend
 * on where the call's rows put it). x = n ln2 + r, |r| <= ln2 / 2, exp(r) by its degree-6
 * Taylor polynomial (relative error ~2e-7); 0 below -87, +inf above 88. */
static inline float exp_poly(float x)
{
    const float c = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    const float t = c * 1.44269504f;
    const float n = (t + 12582912.0f) - 12582912.0f; /* round to nearest */
    const float r = (c - n * 0.693145752f) - n * 1.42860677e-6f;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    union { float f; int32_t i; } s = {.i = ((int32_t)n + 127) << 23};
    const float e = p * s.f;
    return x < -87.0f ? 0.0f : (x > 88.0f ? INFINITY : e);
}

#endif
