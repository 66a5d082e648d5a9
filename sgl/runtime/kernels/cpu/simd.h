/* Scalar bf16 conversions and the AVX-512 exp shared by the CPU kernels. */
#pragma once

#include <stdint.h>
#include <string.h>
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define SGL_BF16_SIMD 1
#endif

typedef uint16_t bf16;

static inline float bf2f(bf16 h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline bf16 f2bf(float f) { /* round to nearest even, NaN kept quiet */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16)(u >> 16);
}

static inline float rf(float f) { return bf2f(f2bf(f)); } /* value rounded through bf16 */

#ifdef SGL_BF16_SIMD
/* exp(x): a degree-6 polynomial on x - t ln2 (relative error ~2e-7, far below bf16's
 * 4e-3), scaled by 2^t. The clamp keeps infinities out of the reduction: exp(-110) is 0
 * in float and 2^144 overflows to inf, as the exact values would. */
static inline __m512 exp512(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-110.f)), _mm512_set1_ps(100.f));
    __m512 t = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_fnmadd_ps(t, _mm512_set1_ps(0.69314718f), x); /* x - t ln2, in [-ln2/2, ln2/2] */
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, t);
}
#endif
