/* Attention of the decode step (decode.c): for each new token row and K/V head, the
 * scores of the head's query group against the cached keys (each K row fetched once for
 * the group), a softmax, and the weighted sum of V rows (each V row fetched once for the
 * group, the sums held in registers). Rows and heads are independent chunks split over
 * the two-thread team; a chunk's sums run in the same order whatever thread or batch runs
 * it, so a row's output depends on neither.
 */
#include "decode_attn.h"
#include "team.h"

#include <math.h>
#include <string.h>

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

/* Keys ahead of the one being scored whose K (and V) rows are prefetched (simd.h). */
#define KV_AHEAD 16

#define KEY_HEADS 4 /* query heads scored per pass over the keys */

/* scores[r * ss + j] = scale * (q_r . K[slots[j], g]) for the G (<= KEY_HEADS) query
 * heads q_r = q + r * d and j < len. qf: scratch of G * (d + 16) floats. Each K row is
 * fetched from memory once for the G heads (the others read it from L1). */
static void key_scores(const bf16 *q, int G, const bf16 *K, const bf16 *V, const int64_t *slots, int len, int nkv, int g, int d,
                       float scale, float *scores, int64_t ss, float *qf) {
    (void)qf;
    (void)V; /* prefetched only */
#if defined(SGL_AVX2_SIMD)
    /* keys in groups of 8, the last group padded with zero vectors: every key's sum is
     * reduced by the same tree whatever len is */
    const int qs = d + 16;
    for (int r = 0; r < G; r++) split_row(q + (int64_t)r * d, d, qf + r * qs);
    __m256 part[KEY_HEADS][8];
    for (int j = 0; j < len; j += 8) {
        int cnt = len - j < 8 ? len - j : 8;
        for (int jj = 0; jj < 8; jj++) {
            if (j + jj + KV_AHEAD < len) {
                int64_t row = (slots[j + jj + KV_AHEAD] * nkv + g) * d;
                prefetch_l1(K + row, d * (int)sizeof(bf16));
                prefetch_l2(V + row, d * (int)sizeof(bf16)); /* for the value pass */
            }
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
            if (r == 0) /* the first head's pass brings the rows in; the others find them in L2 */
                for (int jj = 0; jj < 16 && j + jj + KV_AHEAD < len; jj++) {
                    int64_t row = (slots[j + jj + KV_AHEAD] * nkv + g) * d;
                    prefetch_l1(K + row, d * (int)sizeof(bf16));
                    prefetch_l2(V + row, d * (int)sizeof(bf16)); /* for the value pass */
                }
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
int64_t attn_lane_floats(int max_len, int d, int group) {
    return group * (up16(max_len) + up16(d + 16) + up16(d));
}

/* The V sums use AVX2 at both SIMD levels (every AVX512 CPU has it). */
#if defined(SGL_AVX2_SIMD) || defined(SGL_BF16_SIMD)
#define V_SIMD 1
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
        key_scores(q + (int64_t)r0 * d, G, K, V, slots, len, nkv, g, d, scale, scores + r0 * ss, ss, qf);
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

void attn_chunk(void *arg, int c) {
    const AttnJob *j = (const AttnJob *)arg;
    int b = c / j->nkv, g = c % j->nkv, group = j->nh / j->nkv;
    int64_t h0 = (int64_t)g * group; /* the group's first query head */
    attend_group(j->qkv + (int64_t)b * j->qkv_n + h0 * j->d, j->K, j->V, j->r2t + j->req_rows[b] * j->r2t_stride,
                 (int)j->seq_lens[b], j->nkv, g, group, j->d, j->fws + team_lane() * j->lane_n,
                 j->att + ((int64_t)b * j->nh + h0) * j->d);
}

