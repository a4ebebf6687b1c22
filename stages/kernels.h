/* What our kernels' files call of each other: the attention layer's shape and the
 * functions one file exports to another (the Python side declares the same in qkernel.py). */

#ifndef SKIPPY_KERNELS_H
#define SKIPPY_KERNELS_H

#include <stdint.h>

typedef struct {
    int heads, kv_heads, head_dim, v_head_dim, rope_dim, rope_style, window;
    float eps, scale;
    const float *qk_norm; /* [(heads + kv_heads), head_dim] or NULL */
    const float *cos, *sin; /* angle tables [positions, rope_dim / 2] */
    float softcap; /* > 0: scores become softcap * tanh(score / softcap) (Gemma 2) */
    /* != 0: value rows lie v_row floats apart inside other rows (MLA: vcache[r] is the key
     * cache), and skr_attend_rows's rows carry no v part; 0: a value cache of its own,
     * [cap, kv_heads, v_head_dim] */
    int v_row;
    int rope_at; /* where in each head its rope_dim rotated floats start (MLA: the end) */
} attn_shape;

/* A matrix on our integer kernel: skq_matmul's kind (4 or 8, and its half flags), blocks,
 * scales, zeros (may be NULL); n outputs, k inputs. */
typedef struct {
    int kind;
    const uint8_t *w;
    const void *s, *z;
    int64_t n, k;
} qmat;

/* pool.c */
void skp_run(int threads, int64_t items, void (*fn)(void *, int64_t, int64_t), void *arg);
/* qmatmul.c; kind 4 or 8, with these flags where the scales / zeros are halves, and
 * SKQ_TEAM to run on torch's OpenMP team whatever the row count */
#define SKQ_S16 16
#define SKQ_Z16 32
#define SKQ_TEAM 64
int skq_matmul(int kind, const uint8_t *w, const void *s, const void *z, int64_t N,
               int64_t K, const float *x, int64_t M, float *y, int threads, int use_c);
static inline int qmat_run(const qmat *m, const float *x, int64_t rows, float *y, int threads)
{
    return skq_matmul(m->kind, m->w, m->s, m->z, m->n, m->k, x, rows, y, threads, 0);
}
/* rowops.c */
void skr_rms_norm(const float *x, const float *w, int64_t rows, int64_t k, int64_t w_rows,
                  float eps, float *out);
void skr_layer_norm(const float *x, int64_t rows, int64_t k, float eps, float *out);
int skr_q8_rows(const int8_t *codes, const float *scale, int64_t k, int64_t rows,
                const int64_t *ids, int64_t n, float *out);
int skr_f16_rows(const float *x, int64_t n, float limit, uint16_t *out);
void skr_f16_values(const uint16_t *h, const float *scale, int64_t rows, int64_t k,
                    float *out);
void skr_rope(float *x, int heads, int hd, int dim, const float *c, const float *s,
              int style);
void skr_gated(int act, const float *gate, const float *up, int64_t rows, int64_t n,
               int64_t stride, float *out, int threads);
void skr_linear_f32(const float *x, int64_t x_stride, const float *w, int64_t rows, int64_t k,
                    int64_t n_out, float *out, int64_t out_stride, int threads);
void skr_linear_f32_heads(const float *x, int64_t x_stride, int64_t x_head, const float *w,
                          int64_t w_head, int64_t heads, int64_t rows, int64_t k,
                          int64_t n_out, float *out, int64_t out_stride, int64_t out_head,
                          int threads);
void skr_gate(int kind, const float *x, int64_t rows, int64_t n, float *out);
/* attention.c */
int skr_attend_rows(const attn_shape *A, float *qkv, int64_t rows, const int64_t *pos,
                    float *const *kcache, float *const *vcache, float *out, int threads);
int skr_attend_cached(const attn_shape *A, float *q, int64_t rows, const int64_t *pos,
                      float *const *kcache, float *const *vcache, float *out, int threads);

/* moe.c: a mixture-of-experts block (stages/moe.py builds its description) */
typedef struct moe_block moe_block;
int skm_moe(const moe_block *B, const float *x, int64_t rows, const uint8_t *real,
            const float *given, float *out, int threads);

#endif
