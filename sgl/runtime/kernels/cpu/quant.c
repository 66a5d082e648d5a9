/* Dot products of GGUF-quantized weight rows with int8-quantized activation rows:
 * Q8_0, Q4_0, Q4_1 (32-element blocks) and Q4_K, Q6_K (256-element super-blocks), block
 * layouts as gguf-py's gguf/quants.py dequantizes them.
 *
 * As llama.cpp's vec_dot does on x86: the activation row is quantized once per product
 * (q8_row: per 32 inputs int8 q with scale d = amax / 127, and d * sum(q)); a weight
 * block's integer values meet it in integer dot products (AVX2: _mm256_maddubs_epi16 +
 * _mm256_madd_epi16 into 8 int32 lanes; AVX512-VNNI / AVX-VNNI builds: one
 * _mm256_dpbusd_epi32, the same exact integers), converted to float and scaled per block
 * by d_w * d_x in one fp32 accumulator; the blocks' offsets (Q4_0's -8, Q4_1's min, Q4_K's
 * mins) go through the scaled sums into a second, scalar one. Weights are decoded in
 * registers; nothing is dequantized to memory. The plain-C build computes the same
 * per-block integers and sums them in another float order.
 *
 * Error: with exact weights, the only rounding that matters is the activation's,
 * |x - d q| <= d / 2 = amax / 254 per element, so |y - y~| <= sum_b amax_b / 254 *
 * sum_{k in b} |w_k| <= sqrt(32) / 254 * ||w|| ||x|| (Cauchy-Schwarz twice): the bound the
 * tests assert, plus fp32 noise.
 */
#include "quant.h"
#include "sgl_kernels.h"

#include <float.h>
#include <math.h>
#include <stdlib.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define Q_AVX2 1
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define Q_VNNI 1
#define DPBUSD(a, u, s) _mm256_dpbusd_epi32(a, u, s)
#elif defined(__AVXVNNI__)
#define Q_VNNI 1
#define DPBUSD(a, u, s) _mm256_dpbusd_avx_epi32(a, u, s)
#endif
#elif defined(__F16C__)
#include <immintrin.h>
#endif

void q8_block(const bf16 *x, int8_t *q, float *d, float *s) {
    float amax = 0.f;
    int finite = 1;
    for (int k = 0; k < 32; k++) {
        float a = fabsf(bf2f(x[k]));
        finite &= a <= FLT_MAX; /* false for NaN and inf */
        amax = a > amax ? a : amax;
    }
    if (!finite) { /* NaN or inf in the block: the product is NaN, not a clamped finite value */
        memset(q, 0, 32);
        *d = *s = NAN;
        return;
    }
    /* Q8_MIN_AMAX: below it 127 / amax overflows; such a block (~1e-37) counts as zeros */
    float id = amax >= Q8_MIN_AMAX ? 127.f / amax : 0.f;
    int sum = 0;
    for (int k = 0; k < 32; k++) {
        int v = (int)nearbyintf(bf2f(x[k]) * id);
        v = v > 127 ? 127 : v < -127 ? -127 : v;
        q[k] = (int8_t)v;
        sum += v;
    }
    *d = amax / 127.f;
    *s = *d * (float)sum;
}

void q8_row(const bf16 *x, int in, uint8_t *out) {
    int nb = in / 32;
    float *d = (float *)(out + in), *s = d + nb;
    for (int i = 0; i < nb; i++) q8_block(x + 32 * i, (int8_t *)out + 32 * i, &d[i], &s[i]);
}

#ifdef Q_AVX2
/* int32 lanes: lane j = sum of u[4j..4j+3] * s[4j..4j+3] (u unsigned, s signed bytes). */
static inline __m256i mul_us(__m256i u, __m256i s) {
#ifdef Q_VNNI
    return DPBUSD(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}
/* the same for two signed operands: |a| times b with a's sign */
static inline __m256i mul_ss(__m256i a, __m256i b) { return mul_us(_mm256_sign_epi8(a, a), _mm256_sign_epi8(b, a)); }
/* 16 bytes of packed nibbles as 32 bytes: the low nibbles, then the high ones */
static inline __m256i nib32(const uint8_t *p) {
    __m128i v = _mm_loadu_si128((const __m128i *)p), m = _mm_set1_epi8(0xF);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m), _mm_and_si128(v, m));
}
static inline __m256i ld32(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline __m256 fma_blk(__m256 acc, float scale, __m256i lanes) {
    return _mm256_fmadd_ps(_mm256_set1_ps(scale), _mm256_cvtepi32_ps(lanes), acc);
}
static inline float qhsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#define ACC_T __m256
#define ACC_ZERO _mm256_setzero_ps()
#define ACC_SUM(a) qhsum8(a)
#else
/* plain C: the exact integer dot product of one 32-element block */
static inline int idot32(const uint8_t *wq, int w_signed, const int8_t *x) {
    int s = 0;
    for (int k = 0; k < 32; k++) s += (w_signed ? (int)(int8_t)wq[k] : (int)wq[k]) * x[k];
    return s;
}
static inline void nib_unpack(const uint8_t *p, uint8_t *u) {
    for (int k = 0; k < 16; k++) u[k] = p[k] & 0xF, u[k + 16] = p[k] >> 4;
}
#define ACC_T float
#define ACC_ZERO 0.f
#define ACC_SUM(a) (a)
#endif

/* The products of one weight row with R <= QR activation rows (Q8 rows at xq[r]): the
 * weight's blocks are decoded once and used for every row. Each row has its own
 * accumulators and sees the same operations in the same order whatever R is, so a row's
 * result does not depend on the rows it is grouped with. Instantiated for constant R. */
#define QR 4
#define INL static inline __attribute__((always_inline))
#define XQ_VIEWS(xq, in, R)                                                            \
    const int8_t *xv[QR];                                                              \
    const float *xd[QR], *xs[QR];                                                      \
    ACC_T acc[QR];                                                                     \
    float accm[QR];                                                                    \
    for (int r = 0; r < (R); r++) {                                                    \
        xv[r] = (const int8_t *)(xq)[r];                                               \
        xd[r] = (const float *)((xq)[r] + (in));                                       \
        xs[r] = xd[r] + (in) / 32;                                                     \
        acc[r] = ACC_ZERO;                                                             \
        accm[r] = 0.f;                                                                 \
    }                                                                                  \
    (void)xs;
#define XQ_DONE(R, out)                                                                \
    for (int r = 0; r < (R); r++) (out)[r] = ACC_SUM(acc[r]) + accm[r];

INL void dot_q8_0(const uint8_t *w, const uint8_t *const *xq, int R, int in, float *out) {
    XQ_VIEWS(xq, in, R)
    for (int i = 0; i < in / 32; i++, w += 34) {
        float dw = h2f(w);
#ifdef Q_AVX2
        __m256i a = ld32(w + 2), ua = _mm256_sign_epi8(a, a);
        for (int r = 0; r < R; r++)
            acc[r] = fma_blk(acc[r], dw * xd[r][i], mul_us(ua, _mm256_sign_epi8(ld32(xv[r] + 32 * i), a)));
#else
        for (int r = 0; r < R; r++) acc[r] += dw * xd[r][i] * (float)idot32(w + 2, 1, xv[r] + 32 * i);
#endif
    }
    XQ_DONE(R, out)
}

/* Q4_0 (d, q; value d (q - 8)) and Q4_1 (d, m, q; value d q + m) */
INL void dot_q4_01(const uint8_t *w, const uint8_t *const *xq, int R, int in, int q41, float *out) {
    XQ_VIEWS(xq, in, R)
    const int bs = q41 ? 20 : 18, qo = q41 ? 4 : 2;
    for (int i = 0; i < in / 32; i++, w += bs) {
        float dw = h2f(w), m = q41 ? h2f(w + 2) : -8.f * dw;
#ifdef Q_AVX2
        __m256i u = nib32(w + qo);
        for (int r = 0; r < R; r++) acc[r] = fma_blk(acc[r], dw * xd[r][i], mul_us(u, ld32(xv[r] + 32 * i)));
#else
        uint8_t u[32];
        nib_unpack(w + qo, u);
        for (int r = 0; r < R; r++) acc[r] += dw * xd[r][i] * (float)idot32(u, 0, xv[r] + 32 * i);
#endif
        for (int r = 0; r < R; r++) accm[r] += m * xs[r][i];
    }
    XQ_DONE(R, out)
}

INL void dot_q4_k(const uint8_t *w, const uint8_t *const *xq, int R, int in, float *out) {
    XQ_VIEWS(xq, in, R)
    for (int sb = 0; sb < in / 256; sb++, w += 144) {
        float d = h2f(w), dmin = h2f(w + 2);
        uint8_t sc[8], mn[8];
        k4_scales(w + 4, sc, mn);
        for (int p = 0; p < 4; p++) { /* 32 bytes of qs: sub-block 2p (low nibbles), 2p + 1 (high) */
            int i = 8 * sb + 2 * p;
            const uint8_t *qs = w + 16 + 32 * p;
            float d0 = d * (float)sc[2 * p], d1 = d * (float)sc[2 * p + 1];
            float m0 = dmin * (float)mn[2 * p], m1 = dmin * (float)mn[2 * p + 1];
#ifdef Q_AVX2
            __m256i v = ld32(qs), m4 = _mm256_set1_epi8(0xF);
            __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
            for (int r = 0; r < R; r++) {
                acc[r] = fma_blk(acc[r], d0 * xd[r][i], mul_us(lo, ld32(xv[r] + 32 * i)));
                acc[r] = fma_blk(acc[r], d1 * xd[r][i + 1], mul_us(hi, ld32(xv[r] + 32 * (i + 1))));
            }
#else
            uint8_t lo[32], hi[32];
            for (int k = 0; k < 32; k++) lo[k] = qs[k] & 0xF, hi[k] = qs[k] >> 4;
            for (int r = 0; r < R; r++) {
                acc[r] += d0 * xd[r][i] * (float)idot32(lo, 0, xv[r] + 32 * i);
                acc[r] += d1 * xd[r][i + 1] * (float)idot32(hi, 0, xv[r] + 32 * (i + 1));
            }
#endif
            for (int r = 0; r < R; r++) {
                accm[r] -= m0 * xs[r][i];
                accm[r] -= m1 * xs[r][i + 1];
            }
        }
    }
    XQ_DONE(R, out)
}

/* Q6_K: per half h (128 values), group g (32 values, activation block 8 sb + 4h + g) takes
 * the low (g < 2) or high nibbles of ql[64h + 32 (g & 1) ...] and bits 2g of qh[32h ...];
 * value d * scale[8h + 2g + (l >= 16)] * (q - 32). */
INL void dot_q6_k(const uint8_t *w, const uint8_t *const *xq, int R, int in, float *out) {
    XQ_VIEWS(xq, in, R)
    for (int sb = 0; sb < in / 256; sb++, w += 210) {
        const int8_t *sc = (const int8_t *)(w + 192);
        float d = h2f(w + 208);
        for (int h = 0; h < 2; h++)
            for (int g = 0; g < 4; g++) {
                int i = 8 * sb + 4 * h + g, s0 = sc[8 * h + 2 * g], s1 = sc[8 * h + 2 * g + 1];
                const uint8_t *ql = w + 64 * h + 32 * (g & 1), *qh = w + 128 + 32 * h;
#ifdef Q_AVX2
                __m256i L = ld32(ql), H = ld32(qh);
                if (g >= 2) L = _mm256_srli_epi16(L, 4);
                L = _mm256_and_si256(L, _mm256_set1_epi8(0xF));
                H = _mm256_and_si256(_mm256_srli_epi16(H, 2 * g), _mm256_set1_epi8(3));
                __m256i q = _mm256_or_si256(L, _mm256_slli_epi16(H, 4));
                __m256i scv = _mm256_set_m128i(_mm_set1_epi32(s1), _mm_set1_epi32(s0));
                for (int r = 0; r < R; r++) {
                    __m256i x = ld32(xv[r] + 32 * i);
                    __m256i p = _mm256_sub_epi32(mul_us(q, x), mul_us(_mm256_set1_epi8(32), x));
                    acc[r] = fma_blk(acc[r], d * xd[r][i], _mm256_mullo_epi32(p, scv));
                }
#else
                int8_t q[32];
                for (int l = 0; l < 32; l++)
                    q[l] = (int8_t)((((ql[l] >> (4 * (g >> 1))) & 0xF) | (((qh[l] >> (2 * g)) & 3) << 4)) - 32);
                for (int r = 0; r < R; r++) {
                    const int8_t *x = xv[r] + 32 * i;
                    int a0 = 0, a1 = 0;
                    for (int l = 0; l < 16; l++) a0 += q[l] * x[l], a1 += q[l + 16] * x[l + 16];
                    acc[r] += d * xd[r][i] * (float)(s0 * a0 + s1 * a1);
                }
#endif
            }
    }
    XQ_DONE(R, out)
}

typedef void (*qdot_fn)(const uint8_t *w, const uint8_t *const *xq, int in, float *out);

#define QDOT_R(name, call, R) \
    static void name##_##R(const uint8_t *w, const uint8_t *const *xq, int in, float *out) { call; }
#define QDOT_ALL(name, ...)                                                   \
    QDOT_R(name, name##_k(w, xq, 1, in, ##__VA_ARGS__, out), 1)               \
    QDOT_R(name, name##_k(w, xq, 2, in, ##__VA_ARGS__, out), 2)               \
    QDOT_R(name, name##_k(w, xq, 3, in, ##__VA_ARGS__, out), 3)               \
    QDOT_R(name, name##_k(w, xq, 4, in, ##__VA_ARGS__, out), 4)
#define dot_q8_0_k dot_q8_0
#define dot_q4_0_k(w, xq, R, in, out) dot_q4_01(w, xq, R, in, 0, out)
#define dot_q4_1_k(w, xq, R, in, out) dot_q4_01(w, xq, R, in, 1, out)
#define dot_q4_k_k dot_q4_k
#define dot_q6_k_k dot_q6_k
QDOT_ALL(dot_q8_0)
QDOT_ALL(dot_q4_0)
QDOT_ALL(dot_q4_1)
QDOT_ALL(dot_q4_k)
QDOT_ALL(dot_q6_k)
#define QDOT_TABLE(name) {name##_1, name##_2, name##_3, name##_4}

/* The R-row product (R = 1..QR) for a type, or 0. */
static qdot_fn q_fn(int type, int R) {
    static const qdot_fn q8_0[QR] = QDOT_TABLE(dot_q8_0), q4_0[QR] = QDOT_TABLE(dot_q4_0),
                         q4_1[QR] = QDOT_TABLE(dot_q4_1), q4_k[QR] = QDOT_TABLE(dot_q4_k),
                         q6_k[QR] = QDOT_TABLE(dot_q6_k);
    switch (type) {
    case SGL_T_Q8_0: return q8_0[R - 1];
    case SGL_T_Q4_0: return q4_0[R - 1];
    case SGL_T_Q4_1: return q4_1[R - 1];
    case SGL_T_Q4_K: return q4_k[R - 1];
    case SGL_T_Q6_K: return q6_k[R - 1];
    default: return 0;
    }
}

int64_t sgl_quant_row_bytes(int type, int in) {
    int blk = type == SGL_T_Q4_K || type == SGL_T_Q6_K ? 256 : 32;
    int64_t per = type == SGL_T_Q8_0 ? 34 : type == SGL_T_Q4_0 ? 18 : type == SGL_T_Q4_1 ? 20
                : type == SGL_T_Q4_K ? 144 : type == SGL_T_Q6_K ? 210 : 0;
    if (per == 0 || in <= 0 || in % blk) return 0;
    return per * (in / blk);
}

int q_supported(int type, int in) { return sgl_quant_row_bytes(type, in) > 0; }

void qgemv_rows(int type, const uint8_t *W, const uint8_t *XQ, int B, int out, int in, const bf16 *bias, bf16 *Y,
                float *Yf, int lo, int hi) {
    int64_t rb = sgl_quant_row_bytes(type, in), xs = q8_row_bytes(in);
    for (int o = lo; o < hi; o++) {
        const uint8_t *w = W + o * rb;
        float bo = bias ? bf2f(bias[o]) : 0.f;
        /* groups of QR rows: the weight row is decoded from memory once per group */
        for (int b = 0; b < B; b += QR) {
            int R = B - b < QR ? B - b : QR;
            const uint8_t *xq[QR];
            float s[QR];
            for (int r = 0; r < R; r++) xq[r] = XQ + (b + r) * xs;
            q_fn(type, R)(w, xq, in, s);
            for (int r = 0; r < R; r++) {
                if (Y) Y[(int64_t)(b + r) * out + o] = f2bf(s[r] + bo);
                else Yf[(int64_t)(b + r) * out + o] = s[r];
            }
        }
    }
}

void q_dequant_row(int type, const uint8_t *W, int in, int64_t row, float *y) {
    const uint8_t *w = W + row * sgl_quant_row_bytes(type, in);
    if (type == SGL_T_Q8_0 || type == SGL_T_Q4_0 || type == SGL_T_Q4_1) {
        int bs = type == SGL_T_Q8_0 ? 34 : type == SGL_T_Q4_0 ? 18 : 20;
        for (int i = 0; i < in / 32; i++, w += bs, y += 32) {
            float d = h2f(w);
            if (type == SGL_T_Q8_0) {
                for (int k = 0; k < 32; k++) y[k] = (float)(int8_t)w[2 + k] * d;
                continue;
            }
            const uint8_t *qs = w + (type == SGL_T_Q4_1 ? 4 : 2);
            float m = type == SGL_T_Q4_1 ? h2f(w + 2) : 0.f;
            for (int k = 0; k < 16; k++) {
                int lo = qs[k] & 0xF, hi = qs[k] >> 4;
                if (type == SGL_T_Q4_0) y[k] = d * (float)(lo - 8), y[k + 16] = d * (float)(hi - 8);
                else y[k] = d * (float)lo + m, y[k + 16] = d * (float)hi + m;
            }
        }
    } else if (type == SGL_T_Q4_K) {
        for (int sb = 0; sb < in / 256; sb++, w += 144, y += 256) {
            float d = h2f(w), dmin = h2f(w + 2);
            uint8_t sc[8], mn[8];
            k4_scales(w + 4, sc, mn);
            for (int p = 0; p < 4; p++)
                for (int k = 0; k < 32; k++) {
                    uint8_t q = w[16 + 32 * p + k];
                    y[64 * p + k] = d * (float)sc[2 * p] * (float)(q & 0xF) - dmin * (float)mn[2 * p];
                    y[64 * p + 32 + k] = d * (float)sc[2 * p + 1] * (float)(q >> 4) - dmin * (float)mn[2 * p + 1];
                }
        }
    } else if (type == SGL_T_Q6_K) {
        for (int sb = 0; sb < in / 256; sb++, w += 210, y += 256) {
            const int8_t *sc = (const int8_t *)(w + 192);
            float d = h2f(w + 208);
            for (int h = 0; h < 2; h++)
                for (int g = 0; g < 4; g++)
                    for (int l = 0; l < 32; l++) {
                        const uint8_t *ql = w + 64 * h + 32 * (g & 1), *qh = w + 128 + 32 * h;
                        int q = (((ql[l] >> (4 * (g >> 1))) & 0xF) | (((qh[l] >> (2 * g)) & 3) << 4)) - 32;
                        y[128 * h + 32 * g + l] = d * (float)sc[8 * h + 2 * g + l / 16] * (float)q;
                    }
        }
    }
}

int sgl_quant_simd(void) {
#if defined(Q_VNNI)
    return 3;
#elif defined(Q_AVX2)
    return 2;
#else
    return 0;
#endif
}

sgl_status sgl_quant_gemv(int type, const void *W, int out, int in, const uint16_t *X, int B, float *Y) {
    if (!q_supported(type, in) || B < 1) return SGL_ERR_UNSUPPORTED;
    int64_t xs = q8_row_bytes(in);
    uint8_t *xq = (uint8_t *)malloc((size_t)(xs * B));
    if (!xq) return SGL_ERR_NO_MEMORY;
    for (int b = 0; b < B; b++) q8_row(X + (int64_t)b * in, in, xq + b * xs);
    qgemv_rows(type, (const uint8_t *)W, xq, B, out, in, 0, 0, Y, 0, out);
    free(xq);
    return SGL_OK;
}

sgl_status sgl_quant_dequant(int type, const void *W, int rows, int in, float *out) {
    if (!q_supported(type, in)) return SGL_ERR_UNSUPPORTED;
    for (int r = 0; r < rows; r++) q_dequant_row(type, (const uint8_t *)W, in, r, out + (int64_t)r * in);
    return SGL_OK;
}
