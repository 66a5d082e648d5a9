/* Row kernels of the bf16 Llama forward shared by the decode step (decode.c) and the
 * fused ops (ops.c): RMSNorm (optionally after a residual add), rotate-half RoPE and
 * SiLU*up, one row at a time. One definition, one summation order: torch's (see sumsq),
 * so the fused ops give torch's exact bits and the decode step rounds as they do.
 *
 * Rounding follows the torch expressions they replace: every intermediate that torch
 * materializes as a bf16 tensor is rounded to bf16 here too (round to nearest even). (The
 * vector conversion flushes float32 denormals, which activations never are.)
 */
#pragma once

#include "simd.h"

#include <math.h>

#if defined(SGL_BF16_SIMD) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define SGL_ROWS_SIMD 1
#endif

static inline float silu(float g) { return g / (1.0f + expf(-g)); }

#ifdef SGL_ROWS_SIMD
/* 16 bf16 lanes (the first `m` of them where masked) widened to float, and back. */
static inline __m512 ld(const bf16 *p, __mmask16 m) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
static inline __m256i to_bf(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }
static inline void st(bf16 *p, __m512 v, __mmask16 m) { _mm256_mask_storeu_epi16(p, m, to_bf(v)); }
static inline __m512 rnd(__m512 v) { /* v rounded through bf16 */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf(v)), 16));
}
static inline __mmask16 lanes(int left) { return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1); }

#endif

/* Sum of squares of a bf16 row, added in the order of torch's float sum over a contiguous
 * last dim (ATen's SumKernel, cascade_sum: 8-float vectors in 4 accumulators with a 4-level
 * cascade, leftover vectors into the first, the accumulators in order, then the scalar tail
 * and the 8 lanes in order). Summed in any other order, ~1 norm value in 10^5 lands 1 ulp
 * away from F.rms_norm's, and 30 layers amplify that into visibly different logits; in
 * this order the norms are bit-identical to torch's on this machine. The fixed-size lane
 * loops vectorize; without -ffast-math the compiler keeps each lane's order. */
enum { SUM_W = 8, SUM_ILP = 4, SUM_LEVELS = 4, SUM_ROW = SUM_W * SUM_ILP };

static inline void add_sq(float *acc, const bf16 *x, int cnt) {
    for (int l = 0; l < cnt; l++) {
        float v = bf2f(x[l]);
        acc[l] += v * v;
    }
}

static inline float sumsq(const bf16 *x, int n) {
    int nv = n / SUM_W, size = nv / SUM_ILP;
    int clog = 1; /* ATen's CeilLog2 (1 for size <= 2) */
    while ((1ll << clog) < size) clog++;
    int lp = clog / SUM_LEVELS > 4 ? clog / SUM_LEVELS : 4;
    int64_t step = 1ll << lp, mask = step - 1;
    float acc[SUM_LEVELS][SUM_ROW];
    memset(acc, 0, sizeof acc);
    int64_t i = 0;
    while (i + step <= size) {
        for (int64_t j = 0; j < step; j++, i++) add_sq(acc[0], x + i * SUM_ROW, SUM_ROW);
        for (int j = 1; j < SUM_LEVELS; j++) {
            for (int l = 0; l < SUM_ROW; l++) acc[j][l] += acc[j - 1][l], acc[j - 1][l] = 0.f;
            if ((i & (mask << (j * lp))) != 0) break;
        }
    }
    for (; i < size; i++) add_sq(acc[0], x + i * SUM_ROW, SUM_ROW);
    for (int j = 1; j < SUM_LEVELS; j++)
        for (int l = 0; l < SUM_ROW; l++) acc[0][l] += acc[j][l];
    float *p = acc[0];
    for (int v = size * SUM_ILP; v < nv; v++) add_sq(p, x + v * SUM_W, SUM_W);
    for (int k = 1; k < SUM_ILP; k++)
        for (int l = 0; l < SUM_W; l++) p[l] += p[k * SUM_W + l];
    float s = 0.f;
    for (int k = nv * SUM_W; k < n; k++) s += bf2f(x[k]) * bf2f(x[k]);
    for (int l = 0; l < SUM_W; l++) s += p[l];
    return s;
}

/* out = bf16(w * bf16(x * rsqrt(mean(x^2) + eps))) for one row: torch's
 * `w * F.rms_norm(x.float(), ...).to(bf16)`. With y, x first becomes bf16(x + y) in place. */
static inline void norm_row(bf16 *x, const bf16 *y, const bf16 *w, int n, float eps, bf16 *out) {
#ifdef SGL_ROWS_SIMD
    if (y)
        for (int k = 0; k < n; k += 16) {
            __mmask16 m = lanes(n - k);
            st(x + k, _mm512_add_ps(ld(x + k, m), ld(y + k, m)), m);
        }
    if (!out) return;
    __m512 r = _mm512_set1_ps(1.0f / sqrtf(sumsq(x, n) / (float)n + eps));
    for (int k = 0; k < n; k += 16) {
        __mmask16 m = lanes(n - k);
        st(out + k, _mm512_mul_ps(ld(w + k, m), rnd(_mm512_mul_ps(ld(x + k, m), r))), m);
    }
#else
    if (y)
        for (int k = 0; k < n; k++) x[k] = f2bf(bf2f(x[k]) + bf2f(y[k]));
    if (!out) return;
    float r = 1.0f / sqrtf(sumsq(x, n) / (float)n + eps);
    for (int k = 0; k < n; k++) out[k] = f2bf(bf2f(w[k]) * rf(bf2f(x[k]) * r));
#endif
}

/* Rotate-half RoPE of `nh` heads of size d in place, as torch's bf16
 * `x * (c, c) + flip(x) * (-s, s)`: each product rounded, then the sum. */
static inline void rope_row(bf16 *v, int nh, int d, const bf16 *cs, const bf16 *sn) {
    int h2 = d / 2;
    for (int h = 0; h < nh; h++, v += d) {
#ifdef SGL_ROWS_SIMD
        for (int i = 0; i < h2; i += 16) {
            __mmask16 m = lanes(h2 - i);
            __m512 a = ld(v + i, m), b = ld(v + h2 + i, m), c = ld(cs + i, m), s = ld(sn + i, m);
            st(v + i, _mm512_sub_ps(rnd(_mm512_mul_ps(a, c)), rnd(_mm512_mul_ps(b, s))), m);
            st(v + h2 + i, _mm512_add_ps(rnd(_mm512_mul_ps(b, c)), rnd(_mm512_mul_ps(a, s))), m);
        }
#else
        for (int i = 0; i < h2; i++) {
            float a = bf2f(v[i]), b = bf2f(v[i + h2]), c = bf2f(cs[i]), s = bf2f(sn[i]);
            v[i] = f2bf(rf(a * c) + rf(-b * s));
            v[i + h2] = f2bf(rf(b * c) + rf(a * s));
        }
#endif
    }
}

/* out = bf16(bf16(silu(g)) * u) for one row laid out as [g (n), u (n)]. */
static inline void silu_mul_row(const bf16 *gu, int n, bf16 *out) {
    const bf16 *u = gu + n;
#ifdef SGL_ROWS_SIMD
    for (int k = 0; k < n; k += 16) {
        __mmask16 m = lanes(n - k);
        __m512 g = ld(gu + k, m);
        __m512 s = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp512(_mm512_sub_ps(_mm512_setzero_ps(), g))));
        st(out + k, _mm512_mul_ps(rnd(s), ld(u + k, m)), m);
    }
#else
    for (int k = 0; k < n; k++) out[k] = f2bf(rf(silu(bf2f(gu[k]))) * bf2f(u[k]));
#endif
}
