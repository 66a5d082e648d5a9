/* One decode step of a Llama-family model on the CPU, for a few single-token rows.
 *
 * A decode step at batch 1 is bound by streaming the bf16 weights (269 MB per token for
 * SmolLM2-135M) and, in eager torch, by ~700 small ops around them. Here the whole step
 * (embedding, 30 x [RMSNorm, QKV, RoPE, KV write, attention over the pool, O, residual,
 * RMSNorm, gate/up, SiLU*up, down, residual], final norm, vocab projection) is one call:
 * no per-op dispatch, and the matrix-vector products stream each weight row once with
 * AVX512-BF16 dot products (fp32 accumulation) where the CPU has them, else with bf16
 * widened to fp32 and fp32 FMAs (AVX2 + FMA), else in plain C.
 *
 * Rounding follows the torch path: activations are rounded to bf16 after every op that
 * rounds there (norm, projections, RoPE terms, residual adds, SiLU, product); the norms,
 * RoPE and SiLU*up are the fused ops' row kernels (rows.h), torch's bits, so the results
 * agree with the eager model to bf16 rounding of the products' sums, taken in another
 * order. Arguments travel in the structs of sgl_kernels.h; all tensors are contiguous.
 * With `threads` = 2 the matrix-vector products split their rows with one helper thread
 * (team.c): one core reads ~22 GB/s here, two ~30 GB/s; attention splits its (row, K/V
 * head) pairs the same way. Everything else runs on the caller's thread.
 *
 * Each matrix has a type tag (SGL_T_*, sgl_kernels.h): bf16 as above, or rows of GGUF
 * blocks (--quantization gguf), multiplied by quant.c after the activation rows are
 * quantized to int8 once per product; the embedding row of a block type is dequantized.
 */
#include "rows.h"
#include "sgl_kernels.h"
#include "team.h"
#include "quant.h"

#include <math.h>

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

static float dot(const bf16 *w, const bf16 *x, int n) {
#ifdef SGL_BF16_SIMD
    return _mm512_reduce_add_ps(dot_acc(_mm512_setzero_ps(), w, x, n));
#else
    float s = 0.f;
    for (int k = 0; k < n; k++) s += bf2f(w[k]) * bf2f(x[k]);
    return s;
#endif
}

#define MAX_SIMD_ROWS 8

#ifdef SGL_AVX2_SIMD
/* sums[r] = W row w . X row r for R rows (R <= 3: 4R accumulators, two widened weight
 * vectors and the mask fit the 16 registers). X is pre-split (split_row), row stride xs floats,
 * zero-padded to a multiple of 32. Per row: four accumulators (even and odd elements of
 * each 16-element half of a 32-element step), the weight tail zero-padded into a last
 * step, then (a0 + a1) + (a2 + a3) and the lanes in a fixed order: the same operations
 * whatever R, so a row's sum does not depend on the rows grouped with it. */
static inline __attribute__((always_inline)) void gemv_group(int R, const bf16 *w, const float *xf, int64_t xs,
                                                             int in, float *sums) {
    __m256 a[3][4], e, o;
    for (int r = 0; r < R; r++) a[r][0] = a[r][1] = a[r][2] = a[r][3] = _mm256_setzero_ps();
    /* one 32-element step: per 16-element half h, accumulators 2h (even) and 2h + 1 (odd) */
#define GEMV_STEP(wk, k)                                                                      \
    for (int h = 0; h < 2; h++) {                                                             \
        split16((wk) + 16 * h, &e, &o);                                                       \
        for (int r = 0; r < R; r++) {                                                         \
            const float *x = xf + r * xs + (k) + 16 * h;                                      \
            a[r][2 * h] = _mm256_fmadd_ps(e, _mm256_loadu_ps(x), a[r][2 * h]);                \
            a[r][2 * h + 1] = _mm256_fmadd_ps(o, _mm256_loadu_ps(x + 8), a[r][2 * h + 1]);    \
        }                                                                                     \
    }
    int k = 0;
    for (; k + 32 <= in; k += 32) GEMV_STEP(w + k, k)
    if (k < in) { /* the tail, zero-padded: zero products leave the sums as they are */
        bf16 tail[32] = {0};
        memcpy(tail, w + k, sizeof(bf16) * (in - k));
        GEMV_STEP(tail, k)
    }
#undef GEMV_STEP
    for (int r = 0; r < R; r++)
        sums[r] = hsum8(_mm256_add_ps(_mm256_add_ps(a[r][0], a[r][1]), _mm256_add_ps(a[r][2], a[r][3])));
}

static void gemv_group1(const bf16 *w, const float *xf, int64_t xs, int in, float *sums) {
    gemv_group(1, w, xf, xs, in, sums);
}
static void gemv_group2(const bf16 *w, const float *xf, int64_t xs, int in, float *sums) {
    gemv_group(2, w, xf, xs, in, sums);
}
static void gemv_group3(const bf16 *w, const float *xf, int64_t xs, int in, float *sums) {
    gemv_group(3, w, xf, xs, in, sums);
}

/* Floats per pre-split X row for an input of `in`: padded to whole 32-element steps. */
static inline int split_stride(int in) { return (in + 31) / 32 * 32; }
#endif

/* y[b, o] = bf16(sum_k W[o, k] x[b, k] (+ bias[o])) for B rows; W streamed once, row by
 * row in address order (interleaving several rows' streams measured ~2x slower here).
 * Every row is summed in the same order whatever B is (even and odd 32-wide chunks in two
 * accumulators, then the tail), so a request's logits do not depend on its batch. */
static void gemv_rows(const bf16 *W, const bf16 *X, const float *XF, int B, int out, int in, const bf16 *bias,
                      bf16 *Y, int lo, int hi) {
    (void)XF;
    for (int o = lo; o < hi; o++) {
        const bf16 *w = W + (int64_t)o * in;
        float bo = bias ? bf2f(bias[o]) : 0.f;
#ifdef SGL_AVX2_SIMD
        /* the row of W is read from memory by the first group, from L1 by the others */
        int64_t xs = split_stride(in);
        float sums[3];
        for (int b = 0; b < B; b += 3) {
            int R = B - b < 3 ? B - b : 3;
            if (R == 3) gemv_group3(w, XF + b * xs, xs, in, sums);
            else if (R == 2) gemv_group2(w, XF + b * xs, xs, in, sums);
            else gemv_group1(w, XF + b * xs, xs, in, sums);
            for (int r = 0; r < R; r++) Y[(int64_t)(b + r) * out + o] = f2bf(sums[r] + bo);
        }
        continue;
#endif
#ifdef SGL_BF16_SIMD
        if (B <= MAX_SIMD_ROWS) {
            __m512 a0[MAX_SIMD_ROWS], a1[MAX_SIMD_ROWS];
            for (int b = 0; b < B; b++) a0[b] = a1[b] = _mm512_setzero_ps();
            int k = 0;
            for (; k + 64 <= in; k += 64) {
                __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + k), w1 = (__m512bh)_mm512_loadu_si512(w + k + 32);
                for (int b = 0; b < B; b++) {
                    const bf16 *x = X + (int64_t)b * in + k;
                    a0[b] = _mm512_dpbf16_ps(a0[b], w0, (__m512bh)_mm512_loadu_si512(x));
                    a1[b] = _mm512_dpbf16_ps(a1[b], w1, (__m512bh)_mm512_loadu_si512(x + 32));
                }
            }
            for (int b = 0; b < B; b++) {
                if (k < in) a0[b] = dot_acc(a0[b], w + k, X + (int64_t)b * in + k, in - k);
                Y[(int64_t)b * out + o] = f2bf(_mm512_reduce_add_ps(_mm512_add_ps(a0[b], a1[b])) + bo);
            }
            continue;
        }
#endif
        for (int b = 0; b < B; b++) Y[(int64_t)b * out + o] = f2bf(dot(w, X + (int64_t)b * in, in) + bo);
    }
}

#define GEMV_CHUNK 64 /* rows per claimed piece of a product split across the team */

typedef struct {
    const bf16 *W, *X, *bias;
    const float *XF; /* X pre-split (AVX2 builds) */
    bf16 *Y;
    int B, out, in;
} GemvJob;

static void gemv_chunk(void *arg, int c) {
    GemvJob *j = (GemvJob *)arg;
    int lo = c * GEMV_CHUNK, hi = lo + GEMV_CHUNK < j->out ? lo + GEMV_CHUNK : j->out;
    gemv_rows(j->W, j->X, j->XF, j->B, j->out, j->in, j->bias, j->Y, lo, hi);
}

static __thread int g_team; /* this step holds the two-thread team */

static __thread float *g_xf; /* this step's scratch for pre-split X rows */

typedef struct {
    int type, B, out, in;
    const uint8_t *W, *XQ;
    const bf16 *bias;
    bf16 *Y;
} QGemvJob;

static void qgemv_chunk(void *arg, int c) {
    QGemvJob *j = (QGemvJob *)arg;
    int lo = c * GEMV_CHUNK, hi = lo + GEMV_CHUNK < j->out ? lo + GEMV_CHUNK : j->out;
    qgemv_rows(j->type, j->W, j->XQ, j->B, j->out, j->in, j->bias, j->Y, 0, lo, hi);
}

/* The product over a matrix of GGUF blocks: X quantized once (q8_row, into the scratch
 * the bf16 path splits X into), then each weight row against each Q8 row (quant.c). */
static void qgemv(int type, const uint8_t *W, const bf16 *X, int B, int out, int in, const bf16 *bias, bf16 *Y) {
    uint8_t *xq = (uint8_t *)g_xf;
    for (int b = 0; b < B; b++) q8_row(X + (int64_t)b * in, in, xq + b * q8_row_bytes(in));
    if (!g_team || out < 2 * GEMV_CHUNK) {
        qgemv_rows(type, W, xq, B, out, in, bias, Y, 0, 0, out);
        return;
    }
    QGemvJob j = {type, B, out, in, W, xq, bias, Y};
    team_run(qgemv_chunk, &j, (out + GEMV_CHUNK - 1) / GEMV_CHUNK);
}

/* Y = X W^T (+ bias) for a weight of type `type` (SGL_T_*). */
static void gemv(int type, const void *Wv, const bf16 *X, int B, int out, int in, const bf16 *bias, bf16 *Y) {
    if (type != SGL_T_BF16) {
        qgemv(type, (const uint8_t *)Wv, X, B, out, in, bias, Y);
        return;
    }
    const bf16 *W = (const bf16 *)Wv;
    float *xf = g_xf;
#ifdef SGL_AVX2_SIMD
    /* widen X once per product, not once per weight row */
    int xs = split_stride(in);
    for (int b = 0; b < B; b++) {
        float *r = xf + (int64_t)b * xs;
        split_row(X + (int64_t)b * in, in, r);
        int n16 = (in + 15) / 16 * 16;
        memset(r + n16, 0, sizeof(float) * (xs - n16));
    }
#endif
    if (!g_team || out < 2 * GEMV_CHUNK) {
        gemv_rows(W, X, xf, B, out, in, bias, Y, 0, out);
        return;
    }
    GemvJob j = {W, X, bias, xf, Y, B, out, in};
    team_run(gemv_chunk, &j, (out + GEMV_CHUNK - 1) / GEMV_CHUNK);
}

/* s[j] = exp(s[j] - mx) in place; returns the sum. */
static float exp_shift(float *s, int n, float mx) {
    float sum = 0.f;
    int j = 0;
#if defined(SGL_AVX2_SIMD)
    const __m256 m = _mm256_set1_ps(mx);
    __m256 vs = _mm256_setzero_ps();
    for (; j + 8 <= n; j += 8) {
        __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + j), m));
        _mm256_storeu_ps(s + j, e);
        vs = _mm256_add_ps(vs, e);
    }
    sum = hsum8(vs);
#elif defined(SGL_BF16_SIMD)
    const __m512 m = _mm512_set1_ps(mx);
    __m512 vs = _mm512_setzero_ps();
    for (; j + 16 <= n; j += 16) {
        __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(s + j), m));
        _mm512_storeu_ps(s + j, e);
        vs = _mm512_add_ps(vs, e);
    }
    sum = _mm512_reduce_add_ps(vs);
#endif
    for (; j < n; j++) sum += (s[j] = expf(s[j] - mx));
    return sum;
}

#ifdef SGL_BF16_SIMD
/* out lane i = horizontal sum of v[i], for 16 vectors: a transpose-and-add tree (four
 * shuffle stages) instead of sixteen separate horizontal reductions. */
static inline __m512 hsum16(const __m512 *v) {
    __m512 t[8], u[4], w[2];
    for (int i = 0; i < 8; i++) /* 256-bit halves: quarters 0-1 -> v[2i], 2-3 -> v[2i+1] */
        t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++) /* quarter k -> v[4i + k] */
        u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++) /* in quarter k: lanes 0-1 -> v[8i + k], 2-3 -> v[8i + 4 + k] */
        w[i] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0xEE));
    __m512 z = _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], 0x88), _mm512_shuffle_ps(w[0], w[1], 0xDD));
    /* z lane 4k + m holds v[4m + k] */
    const __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(idx, z);
}
#endif

#ifdef SGL_AVX2_SIMD
/* K/V rows are gathered through the slot table, a stride the hardware prefetcher does not
 * follow far enough ahead: each loop asks for the row KV_AHEAD keys on. */
#define KV_AHEAD 16
static inline void prefetch_row(const bf16 *p, int d) {
    for (int b = 0; b < d * (int)sizeof(bf16); b += 64) _mm_prefetch((const char *)p + b, _MM_HINT_T0);
}
#endif

#define KEY_HEADS 4 /* query heads scored per pass over the keys */

/* scores[r * ss + j] = scale * (q_r . K[slots[j], g]) for the G (<= KEY_HEADS) query
 * heads q_r = q + r * d and j < len. qf: scratch of G * (d + 16) floats. Each K row is
 * fetched from memory once for the G heads (the others read it from L1). */
static void key_scores(const bf16 *q, int G, const bf16 *K, const int64_t *slots, int len, int nkv, int g, int d,
                       float scale, float *scores, int64_t ss, float *qf) {
    (void)qf;
#if defined(SGL_AVX2_SIMD)
    /* keys in groups of 8, the last group padded with zero vectors: every key's sum is
     * reduced by the same tree whatever len is */
    const int qs = d + 16;
    for (int r = 0; r < G; r++) split_row(q + (int64_t)r * d, d, qf + r * qs);
    __m256 part[KEY_HEADS][8];
    for (int j = 0; j < len; j += 8) {
        int cnt = len - j < 8 ? len - j : 8;
        for (int jj = 0; jj < 8; jj++) {
            if (j + jj + KV_AHEAD < len) prefetch_row(K + (slots[j + jj + KV_AHEAD] * nkv + g) * d, d);
            const bf16 *k = K + (slots[j + jj < len ? j + jj : j] * nkv + g) * d;
            for (int r = 0; r < G; r++) part[r][jj] = jj < cnt ? dotv(k, qf + r * qs, d) : _mm256_setzero_ps();
        }
        for (int r = 0; r < G; r++) {
            __m256 sc = _mm256_mul_ps(hsum8x8(part[r]), _mm256_set1_ps(scale));
            float *out = scores + r * ss + j;
            if (cnt == 8) _mm256_storeu_ps(out, sc);
            else {
                float tmp[8];
                _mm256_storeu_ps(tmp, sc);
                memcpy(out, tmp, sizeof(float) * cnt);
            }
        }
    }
#else
    for (int r = 0; r < G; r++) {
        const bf16 *qr = q + (int64_t)r * d;
        float *sr = scores + r * ss;
        int j = 0;
#if defined(SGL_BF16_SIMD)
        __m512 part[16];
        for (; j + 16 <= len; j += 16) {
            for (int jj = 0; jj < 16; jj++)
                part[jj] = dot_acc(_mm512_setzero_ps(), K + (slots[j + jj] * nkv + g) * d, qr, d);
            _mm512_storeu_ps(sr + j, _mm512_mul_ps(hsum16(part), _mm512_set1_ps(scale)));
        }
#endif
        for (; j < len; j++) sr[j] = dot(K + (slots[j] * nkv + g) * d, qr, d) * scale;
    }
#endif
}

static inline int64_t up16(int64_t n) { return (n + 15) / 16 * 16; }

/* Floats of one lane's attention scratch for contexts up to max_len and `group` query
 * heads per K/V head: their scores, widened queries (d + 16 each) and accumulators. */
static int64_t lane_floats(int max_len, int d, int group) {
    return group * (up16(max_len) + up16(d + 16) + up16(d));
}

/* The V sums use AVX2 at both SIMD levels (every AVX512 CPU has it). */
#if defined(SGL_AVX2_SIMD) || defined(SGL_BF16_SIMD)
#define V_SIMD 1
#ifndef KV_AHEAD
#define KV_AHEAD 16
#endif
#endif

#ifdef V_SIMD
/* a[r * d + i] += sum_j scores[r * ss + j] * V[slots[j], g, i] for i in [i0, i0 + 8 W) and
 * the G query heads of the group, the G x W vectors of sums held in registers for the
 * whole pass over the keys (a sum kept in memory costs a load and a store per key). One
 * fma per key in key order, as the plain loop does, so the sums are the same bits. */
static inline __attribute__((always_inline)) void values_pass(const float *scores, int64_t ss, const bf16 *V,
                                                               const int64_t *slots, int len, int nkv, int g, int d,
                                                               int i0, float *a, const int G, const int W) {
    __m256 acc[KEY_HEADS][4];
    for (int r = 0; r < G; r++)
        for (int w = 0; w < W; w++) acc[r][w] = _mm256_loadu_ps(a + r * d + i0 + 8 * w);
    for (int j = 0; j < len; j++) {
        const bf16 *v = V + (slots[j] * nkv + g) * d + i0;
        if (j + KV_AHEAD < len) _mm_prefetch((const char *)(V + (slots[j + KV_AHEAD] * nkv + g) * d + i0), _MM_HINT_T0);
        __m256 v8[4];
        for (int w = 0; w < W; w++)
            v8[w] = _mm256_castsi256_ps(
                _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(v + 8 * w))), 16));
        for (int r = 0; r < G; r++) {
            __m256 s = _mm256_set1_ps(scores[r * ss + j]);
            for (int w = 0; w < W; w++) acc[r][w] = _mm256_fmadd_ps(s, v8[w], acc[r][w]);
        }
    }
    for (int r = 0; r < G; r++)
        for (int w = 0; w < W; w++) _mm256_storeu_ps(a + r * d + i0 + 8 * w, acc[r][w]);
}

/* The weighted sum of V rows for `group` (<= KEY_HEADS) heads, d a multiple of 8: passes of
 * 32 dimensions (one cache line of a bf16 row) with at most 12 accumulators, 8 at the end. */
static void values_sum(const float *scores, int64_t ss, const bf16 *V, const int64_t *slots, int len, int nkv, int g,
                       int group, int d, float *a) {
    int i0 = 0;
    for (; i0 + 32 <= d; i0 += 32) {
        if (group == 1) values_pass(scores, ss, V, slots, len, nkv, g, d, i0, a, 1, 4);
        else if (group == 2) values_pass(scores, ss, V, slots, len, nkv, g, d, i0, a, 2, 4);
        else if (group == 3) values_pass(scores, ss, V, slots, len, nkv, g, d, i0, a, 3, 4);
        else {
            values_pass(scores, ss, V, slots, len, nkv, g, d, i0, a, 4, 2);
            values_pass(scores, ss, V, slots, len, nkv, g, d, i0 + 16, a, 4, 2);
        }
    }
    for (; i0 < d; i0 += 8) {
        if (group == 1) values_pass(scores, ss, V, slots, len, nkv, g, d, i0, a, 1, 1);
        else if (group == 2) values_pass(scores, ss, V, slots, len, nkv, g, d, i0, a, 2, 1);
        else if (group == 3) values_pass(scores, ss, V, slots, len, nkv, g, d, i0, a, 3, 1);
        else values_pass(scores, ss, V, slots, len, nkv, g, d, i0, a, 4, 1);
    }
}
#endif

/* Attention of the `group` query heads q + r * d that share K/V head g, over `len` cached
 * slots, in `lane` scratch; out + r * d gets head r. Each K and V row is fetched once
 * for the group. The sums run in the same order whatever thread runs the group and
 * whatever rows share the step, so a row's output depends on neither. */
static void attend_group(const bf16 *q, const bf16 *K, const bf16 *V, const int64_t *slots, int len, int nkv,
                         int g, int group, int d, float *lane, bf16 *out) {
    int64_t ss = up16(len);
    float *scores = lane, *qf = scores + group * ss, *a = qf + group * up16(d + 16);
    float scale = 1.0f / sqrtf((float)d);
    for (int r0 = 0; r0 < group; r0 += KEY_HEADS) {
        int G = group - r0 < KEY_HEADS ? group - r0 : KEY_HEADS;
        key_scores(q + (int64_t)r0 * d, G, K, slots, len, nkv, g, d, scale, scores + r0 * ss, ss, qf);
    }
    for (int r = 0; r < group; r++) {
        float *s = scores + r * ss, mx = -INFINITY;
        for (int j = 0; j < len; j++) mx = s[j] > mx ? s[j] : mx;
        float inv = 1.0f / exp_shift(s, len, mx);
        for (int j = 0; j < len; j++) s[j] *= inv;
    }
    memset(a, 0, sizeof(float) * group * d);
#ifdef V_SIMD
    if (d % 8 == 0 && group <= KEY_HEADS) {
        values_sum(scores, ss, V, slots, len, nkv, g, group, d, a);
    } else
#endif
    for (int j = 0; j < len; j++) {
        const bf16 *v = V + (slots[j] * nkv + g) * d;
        for (int r = 0; r < group; r++)
            for (int t = 0; t < d; t++) a[r * d + t] = fmaf(scores[r * ss + j], bf2f(v[t]), a[r * d + t]);
    }
    for (int r = 0; r < group; r++)
        for (int i = 0; i < d; i++) out[(int64_t)r * d + i] = f2bf(a[r * d + i]);
}

/* The step's attention: one chunk per (row, K/V head), split over the team, each chunk
 * in its thread's lane of the float scratch. At long contexts this is as much work as
 * the weight products, so it must not run on one core. */
typedef struct {
    const bf16 *qkv, *K, *V;
    const int64_t *r2t, *req_rows, *seq_lens;
    int64_t r2t_stride, lane_n;
    int qkv_n, nh, nkv, d;
    float *fws;
    bf16 *att;
} AttnJob;

static void attn_chunk(void *arg, int c) {
    const AttnJob *j = (const AttnJob *)arg;
    int b = c / j->nkv, g = c % j->nkv, group = j->nh / j->nkv;
    int64_t h0 = (int64_t)g * group; /* the group's first query head */
    attend_group(j->qkv + (int64_t)b * j->qkv_n + h0 * j->d, j->K, j->V, j->r2t + j->req_rows[b] * j->r2t_stride,
                 (int)j->seq_lens[b], j->nkv, g, group, j->d, j->fws + team_lane() * j->lane_n,
                 j->att + ((int64_t)b * j->nh + h0) * j->d);
}

int sgl_decode_fields(void) { return SGL_L_FIELDS; }

int sgl_decode_simd(void) {
#if defined(SGL_BF16_SIMD)
    return 1;
#elif defined(SGL_AVX2_SIMD)
    return 2;
#else
    return 0;
#endif
}

/* The widest input of the step's products (hidden, nh * d or inter). */
static int max_in(const sgl_decode_model *m) {
    int n = m->hidden > m->nh * m->d ? m->hidden : m->nh * m->d;
    return n > m->inter ? n : m->inter;
}

/* bf16 elements of the workspace before the float scratch for pre-split X rows, rounded
 * up to 16 (32 bytes). */
static int64_t ws_bf16(const sgl_decode_model *m, int rows) {
    int64_t n = (int64_t)rows * (3 * m->hidden + (m->nh + 2 * m->nkv) * m->d + m->nh * m->d + 3 * m->inter + m->vocab);
    return (n + 15) / 16 * 16;
}

/* Workspace sizes for `rows` rows: bf16 elements and float elements. */
int64_t sgl_decode_ws(const sgl_decode_model *m, int rows) {
    return ws_bf16(m, rows) + 2 * (int64_t)rows * ((max_in(m) + 31) / 32 * 32); /* two bf16 per float */
}
int64_t sgl_decode_fws(const sgl_decode_model *m, int max_len) {
    return 2 * lane_floats(max_len, m->d, m->nh / m->nkv); /* one lane per team thread */
}

/* Whether every matrix is bf16 or whole blocks of a type quant.c multiplies. */
static int type_ok(int type, int in) { return type == SGL_T_BF16 || q_supported(type, in); }
static int types_ok(const sgl_decode_model *m) {
    if (!type_ok(m->embed_t, m->hidden) || !type_ok(m->head_t, m->hidden)) return 0;
    for (int l = 0; l < m->n_layers; l++) {
        const int64_t *p = m->layers + (int64_t)l * SGL_L_FIELDS;
        if (!type_ok((int)p[SGL_L_QKV_T], m->hidden) || !type_ok((int)p[SGL_L_O_T], m->nh * m->d) ||
            !type_ok((int)p[SGL_L_GU_T], m->hidden) || !type_ok((int)p[SGL_L_DOWN_T], m->inter))
            return 0;
    }
    return 1;
}

sgl_status sgl_decode_step(const sgl_decode_model *m, const sgl_decode_batch *bt) {
    const int B = bt->rows, hidden = m->hidden, nh = m->nh, nkv = m->nkv, d = m->d, inter = m->inter;
    const int64_t *positions = bt->positions, *out_loc = bt->out_loc;
    const float eps = m->eps;
    int qkv_n = (nh + 2 * nkv) * d, h2 = d / 2;
    for (int b = 0; b < B; b++)
        if (bt->seq_lens[b] > bt->max_len) return SGL_ERR_CONTEXT_TOO_LONG;
    if (!types_ok(m)) return SGL_ERR_UNSUPPORTED;
    g_team = bt->threads >= 2 && team_acquire();
    /* bf16 workspace, B rows each: x, xn, qkv, attn, gate/up, act, tmp, bf16 logits */
    bf16 *x = bt->ws, *xn = x + B * hidden, *qkv = xn + B * hidden, *att = qkv + B * qkv_n;
    bf16 *gu = att + B * nh * d, *act = gu + B * 2 * inter, *tmp = act + B * inter;
    bf16 *lb = tmp + B * hidden;
    g_xf = (float *)(bt->ws + ws_bf16(m, B));
    for (int b = 0; b < B; b++) {
        if (m->embed_t == SGL_T_BF16) {
            memcpy(x + b * hidden, (const bf16 *)m->embed + bt->input_ids[b] * hidden, sizeof(bf16) * hidden);
            continue;
        }
        /* a quantized row: dequantized as the converter does (float), rounded to bf16 */
        q_dequant_row(m->embed_t, (const uint8_t *)m->embed, hidden, bt->input_ids[b], g_xf);
        for (int k = 0; k < hidden; k++) x[b * hidden + k] = f2bf(g_xf[k]);
    }
    for (int l = 0; l < m->n_layers; l++) {
        const int64_t *p = m->layers + (int64_t)l * SGL_L_FIELDS;
        const bf16 *qkv_b = (const bf16 *)p[SGL_L_QKV_B], *o_b = (const bf16 *)p[SGL_L_O_B];
        bf16 *K = (bf16 *)p[SGL_L_K], *V = (bf16 *)p[SGL_L_V];
        for (int b = 0; b < B; b++)
            norm_row(x + b * hidden, 0, (const bf16 *)p[SGL_L_LN1], hidden, eps, xn + b * hidden);
        gemv((int)p[SGL_L_QKV_T], (const void *)p[SGL_L_QKV], xn, B, qkv_n, hidden, qkv_b, qkv);
        for (int b = 0; b < B; b++) {
            bf16 *r = qkv + b * qkv_n;
            rope_row(r, nh + nkv, d, m->rope_cos + positions[b] * h2, m->rope_sin + positions[b] * h2);
            memcpy(K + out_loc[b] * nkv * d, r + nh * d, sizeof(bf16) * nkv * d);
            memcpy(V + out_loc[b] * nkv * d, r + (nh + nkv) * d, sizeof(bf16) * nkv * d);
        }
        AttnJob aj = {qkv, K, V, bt->req_to_token, bt->req_rows, bt->seq_lens, bt->r2t_stride,
                      lane_floats(bt->max_len, d, nh / nkv), qkv_n, nh, nkv, d, bt->fws, att};
        if (g_team) team_run(attn_chunk, &aj, B * nkv);
        else
            for (int c = 0; c < B * nkv; c++) attn_chunk(&aj, c);
        gemv((int)p[SGL_L_O_T], (const void *)p[SGL_L_O], att, B, hidden, nh * d, o_b, tmp);
        for (int b = 0; b < B; b++) /* the residual add, then the norm */
            norm_row(x + b * hidden, tmp + b * hidden, (const bf16 *)p[SGL_L_LN2], hidden, eps, xn + b * hidden);
        gemv((int)p[SGL_L_GU_T], (const void *)p[SGL_L_GU], xn, B, 2 * inter, hidden, 0, gu);
        for (int b = 0; b < B; b++) silu_mul_row(gu + b * 2 * inter, inter, act + b * inter);
        gemv((int)p[SGL_L_DOWN_T], (const void *)p[SGL_L_DOWN], act, B, hidden, inter, 0, tmp);
        for (int b = 0; b < B; b++) norm_row(x + b * hidden, tmp + b * hidden, 0, hidden, eps, 0); /* add only */
    }
    for (int b = 0; b < B; b++) norm_row(x + b * hidden, 0, m->norm_w, hidden, eps, xn + b * hidden);
    /* as the torch path: the projection rounds to bf16, then widens to float */
    gemv(m->head_t, m->head_w, xn, B, m->vocab, hidden, 0, lb);
    for (int64_t i = 0; i < (int64_t)B * m->vocab; i++) bt->logits[i] = bf2f(lb[i]);
    if (g_team) team_release();
    g_team = 0;
    return SGL_OK;
}
