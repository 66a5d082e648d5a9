/* Scalar bf16 conversions and the vector helpers (exp, bf16 widening) shared by the CPU
 * kernels. Two SIMD levels: SGL_BF16_SIMD (AVX512-BF16: dot products on bf16 pairs) and,
 * below it, SGL_AVX2_SIMD (AVX2 + FMA, e.g. AMD Zen 2/3, Intel before Cooper Lake: bf16
 * widened to fp32 by a shift, then fp32 FMAs). Without either, plain C. */
#pragma once

#include <stdint.h>
#include <math.h>
#include <string.h>
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define SGL_BF16_SIMD 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SGL_AVX2_SIMD 1
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

/* Rows gathered through a slot table have a stride the hardware prefetcher cannot see:
 * the kernels ask for the bytes of a row some rows ahead, a cache line at a time, into L1
 * (read next), L2 (read by a later pass) or for writing. Portable (a no-op where the
 * compiler has no prefetch). */
static inline void prefetch_l1(const void *p, int64_t bytes) {
    for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch((const char *)p + o, 0, 3);
}
static inline void prefetch_l2(const void *p, int64_t bytes) {
    for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch((const char *)p + o, 0, 2);
}
static inline void prefetch_write(void *p, int64_t bytes) {
    for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch((char *)p + o, 1, 3);
}

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

#ifdef SGL_AVX2_SIMD
/* 16 bf16 values (32 bytes at p) widened to fp32 without a permute: `ev` gets elements
 * 0, 2, ..., 14 (the low half of each 32-bit word, shifted up) and `od` elements 1, 3,
 * ..., 15 (the high half, masked). A dot product pairs them with an operand split the
 * same way (split16 on both, or x pre-split by split_row). */
static inline void split16(const bf16 *p, __m256 *ev, __m256 *od) {
    __m256i w = _mm256_loadu_si256((const __m256i *)p);
    *ev = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
    *od = _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32((int)0xffff0000u)));
}

/* x[0, n) widened into xf as split16 lays it out: per 16 elements, 8 even then 8 odd
 * floats; zero-padded to a multiple of 16 (n16 floats written). */
static inline void split_row(const bf16 *x, int n, float *xf) {
    int k = 0;
    __m256 e, o;
    for (; k + 16 <= n; k += 16) {
        split16(x + k, &e, &o);
        _mm256_storeu_ps(xf + k, e);
        _mm256_storeu_ps(xf + k + 8, o);
    }
    if (k < n) {
        bf16 tail[16] = {0};
        memcpy(tail, x + k, sizeof(bf16) * (n - k));
        split16(tail, &e, &o);
        _mm256_storeu_ps(xf + k, e);
        _mm256_storeu_ps(xf + k + 8, o);
    }
}

/* Lanes of the products w[0, n) . x, x pre-split by split_row (zero-padded to 16): two
 * accumulators, even and odd elements, added at the end. */
static inline __m256 dotv(const bf16 *w, const float *xf, int n) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), e, o;
    int k = 0;
    for (; k + 16 <= n; k += 16) {
        split16(w + k, &e, &o);
        a0 = _mm256_fmadd_ps(e, _mm256_loadu_ps(xf + k), a0);
        a1 = _mm256_fmadd_ps(o, _mm256_loadu_ps(xf + k + 8), a1);
    }
    if (k < n) {
        bf16 tail[16] = {0};
        memcpy(tail, w + k, sizeof(bf16) * (n - k));
        split16(tail, &e, &o);
        a0 = _mm256_fmadd_ps(e, _mm256_loadu_ps(xf + k), a0);
        a1 = _mm256_fmadd_ps(o, _mm256_loadu_ps(xf + k + 8), a1);
    }
    return _mm256_add_ps(a0, a1);
}

/* Sum of the 8 lanes, always in the same order. */
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* out lane i = the lane sum of v[i], for 8 vectors (an add tree instead of 8 hsum8s). */
static inline __m256 hsum8x8(const __m256 *v) {
    __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
    __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
    /* u0: lanes 0-3 the low-half sums of v[0..3], lanes 4-7 their high-half sums; u1: v[4..7] */
    __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* exp(x) as exp512 does it, with 2^t built in the exponent field: x is clamped to
 * [-87.3, 88] so t stays in the normal range, then results below the clamp are 0 and
 * above it inf, as float's exact exp would round. */
static inline __m256 exp256(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.3f), hi = _mm256_set1_ps(88.0f);
    __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ), over = _mm256_cmp_ps(x, hi, _CMP_GT_OQ);
    __m256 c = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
    __m256 t = _mm256_round_ps(_mm256_mul_ps(c, _mm256_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 f = _mm256_fnmadd_ps(t, _mm256_set1_ps(0.69314718f), c);
    __m256 p = _mm256_set1_ps(1.0f / 720);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(t), _mm256_set1_epi32(127)), 23);
    p = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
    p = _mm256_andnot_ps(under, p);
    return _mm256_blendv_ps(p, _mm256_set1_ps(INFINITY), over);
}
#endif

/* ---- dot products of bf16 vectors, fp32 accumulation ------------------------------ */
#ifdef SGL_BF16_SIMD
static inline __m512 dot_acc(__m512 acc, const bf16 *w, const bf16 *x, int n) {
    int k = 0;
    for (; k + 32 <= n; k += 32)
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(w + k), (__m512bh)_mm512_loadu_si512(x + k));
    if (k < n) {
        __mmask32 m = (__mmask32)((1ull << (n - k)) - 1);
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_maskz_loadu_epi16(m, w + k),
                               (__m512bh)_mm512_maskz_loadu_epi16(m, x + k));
    }
    return acc;
}
#endif

static inline float dot(const bf16 *w, const bf16 *x, int n) {
#ifdef SGL_BF16_SIMD
    return _mm512_reduce_add_ps(dot_acc(_mm512_setzero_ps(), w, x, n));
#else
    float s = 0.f;
    for (int k = 0; k < n; k++) s += bf2f(w[k]) * bf2f(x[k]);
    return s;
#endif
}
