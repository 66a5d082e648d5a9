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

/* Bytes of one quantized activation row of `in` inputs (a multiple of 32): the int8
 * values, then nb = in / 32 scales, then nb scaled sums. */
static inline int64_t q8_row_bytes(int in) { return (int64_t)in + 8 * (int64_t)(in / 32); }

/* x[0, in) (bf16) quantized into a Q8 row at `out` (q8_row_bytes(in) bytes). The same
 * scalar code in every build, so every build sees the same int8 activations. */
void q8_row(const bf16 *x, int in, uint8_t *out);

/* y[b, o] for rows o in [lo, hi) of W (type `type`) against B Q8 rows (stride
 * q8_row_bytes(in)): written as bf16(sum + bias[o]) into Y (row stride `out`) when Y is
 * set, else as the float sum into Yf. */
void qgemv_rows(int type, const uint8_t *W, const uint8_t *XQ, int B, int out, int in, const bf16 *bias, bf16 *Y,
                float *Yf, int lo, int hi);

/* Row `row` of W dequantized to floats (as gguf-py's dequantize computes them). */
void q_dequant_row(int type, const uint8_t *W, int in, int64_t row, float *out);

/* Whether `type` has a product here and `in` is a whole number of its blocks. */
int q_supported(int type, int in);
