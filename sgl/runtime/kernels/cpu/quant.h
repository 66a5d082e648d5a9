/* Matrix-vector products over GGUF-quantized weight rows (quant.c), for the decode step.
 *
 * A weight is a matrix of `out` rows, each row `sgl_quant_row_bytes(type, in)` bytes of
 * GGUF blocks (type tags are GGML's: SGL_T_* in sgl_kernels.h). The activation rows are
 * first quantized once per product into "Q8 rows" (q8_row): per 32 inputs one int8 block
 * with an fp32 scale d and the scaled block sum d * sum(q) (for the weight types with a
 * per-block offset). Each weight row's dot product is then integer dot products per block,
 * scaled in fp32. A row's result depends only on that row and its own activation row.
 */
#pragma once

#include "simd.h"

#include <stdint.h>
#include <string.h>
#if defined(__F16C__)
#include <immintrin.h>
#endif

/* An IEEE half at p (unaligned) as float: exact either way. */
static inline float h2f(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, man = h & 0x3ffu, u;
    if (e == 0 && man == 0) u = sign;
    else if (e == 0) { /* subnormal: normalize into float's range */
        e = 127 - 15 + 1;
        while (!(man & 0x400u)) man <<= 1, e--;
        u = sign | (e << 23) | ((man & 0x3ffu) << 13);
    } else if (e == 31) u = sign | 0x7f800000u | (man << 13);
    else u = sign | ((e + 127 - 15) << 23) | (man << 13);
    float f;
    memcpy(&f, &u, 4);
    return f;
#endif
}

/* Q4_K's packed 6-bit scales and mins of its 8 sub-blocks (gguf-py's get_scale_min). */
static inline void k4_scales(const uint8_t *s, uint8_t *sc, uint8_t *mn) {
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 63;
        mn[j] = s[j + 4] & 63;
        sc[j + 4] = (s[j + 8] & 0xF) | ((s[j] >> 6) << 4);
        mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
    }
}

/* Bytes of one quantized activation row of `in` inputs (a multiple of 32): the int8
 * values, then nb = in / 32 scales, then nb scaled sums. */
static inline int64_t q8_row_bytes(int in) { return (int64_t)in + 8 * (int64_t)(in / 32); }

/* x[0, in) (bf16) quantized into a Q8 row at `out` (q8_row_bytes(in) bytes). The same
 * scalar code in every build, so every build sees the same int8 activations. */
void q8_row(const bf16 *x, int in, uint8_t *out);
/* One block of 32 inputs: int8 values q, scale d, scaled sum s (what q8_row stores). A
 * block holding NaN or inf gets q = 0 and d = s = NaN (its products are NaN); one whose
 * largest magnitude is below Q8_MIN_AMAX (where 127 / amax overflows) gets q = 0. */
#define Q8_MIN_AMAX (127.f / 3.40282347e+38f)
void q8_block(const bf16 *x, int8_t *q, float *d, float *s);

/* y[b, o] for rows o in [lo, hi) of W (type `type`) against B Q8 rows (stride
 * q8_row_bytes(in)): written as bf16(sum + bias[o]) into Y (row stride `out`) when Y is
 * set, else as the float sum into Yf. */
void qgemv_rows(int type, const uint8_t *W, const uint8_t *XQ, int B, int out, int in, const bf16 *bias, bf16 *Y,
                float *Yf, int lo, int hi);

/* Row `row` of W dequantized to floats (as gguf-py's dequantize computes them). */
void q_dequant_row(int type, const uint8_t *W, int in, int64_t row, float *out);

/* Whether `type` has a product here and `in` is a whole number of its blocks. */
int q_supported(int type, int in);
