/* Attention of the decode step (decode.c): for each new token row, block of KEY_BLOCK
 * cached keys and K/V head, the scores of the head's query group against the block's keys
 * (each K row fetched once for the group), their exponentials against the block's maximum
 * and the weighted sum of V rows (each V row fetched once for the group, the sums held in
 * registers); then each head's blocks are merged (flash-decoding). Blocks are chunks
 * split over the two-thread team, so one long row keeps both cores busy; every sum runs in
 * the same order whatever thread or batch runs it, so a row's output depends on neither.
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
 * fetched from memory once for the G heads (the others read it from L1 or L2). */
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
#if defined(SGL_BF16_SIMD) /* shapes block_fused does not take */
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

/* Floats of one lane's scratch for one block of keys: the nh heads' scores, the widened
 * queries (d + 16 each) of one group of `group` heads, and nh heads' accumulators (also
 * the merge's d + 2). */
static int64_t lane_floats(int nh, int d, int group) { return nh * up16(KEY_BLOCK) + group * up16(d + 16) + nh * up16(d + 2); }

/* Floats of one partial result: the block's score maximum, its sum of exponentials and
 * the unnormalized weighted sum of V (d). */
static inline int64_t part_floats(int d) { return up16(d + 2); }

int64_t attn_ws_floats(int max_len, int max_rows, int nh, int d, int group) {
    if (max_rows < 1) max_rows = 1;
    int64_t blocks = (max_len + KEY_BLOCK - 1) / KEY_BLOCK;
    return 2 * lane_floats(nh, d, group) + (int64_t)max_rows * blocks * nh * part_floats(d);
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

#ifdef SGL_BF16_SIMD
#define MAX_TILE_HEADS 32 /* query heads block_fused takes (its per-head state lives on the stack) */

/* a[r * d + i0 + i] += sum_{jj < cnt} p[r * 16 + jj] * V[slots[jj], g, i0 + i] for the G
 * query heads of K/V head g (Vg = V + g d) and i < 16 W, the G x W sums in registers for
 * the tile's keys, one fma per key in key order. */
static inline __attribute__((always_inline)) void v_tile(const float *p, const bf16 *Vg, const int64_t *slots, int cnt,
                                                          int64_t row, int i0, float *a, int d, const int G, const int W) {
    __m512 acc[KEY_HEADS][4], v16[4];
    for (int r = 0; r < G; r++)
        for (int w = 0; w < W; w++) acc[r][w] = _mm512_loadu_ps(a + r * d + i0 + 16 * w);
    for (int jj = 0; jj < cnt; jj++) {
        const bf16 *v = Vg + slots[jj] * row + i0;
        for (int w = 0; w < W; w++)
            v16[w] = _mm512_castsi512_ps(
                _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(v + 16 * w))), 16));
        for (int r = 0; r < G; r++) {
            __m512 sc = _mm512_set1_ps(p[r * 16 + jj]);
            for (int w = 0; w < W; w++) acc[r][w] = _mm512_fmadd_ps(sc, v16[w], acc[r][w]);
        }
    }
    for (int r = 0; r < G; r++)
        for (int w = 0; w < W; w++) _mm512_storeu_ps(a + r * d + i0 + 16 * w, acc[r][w]);
}

#define V_TILE(W)                                                                                     \
    switch (G) {                                                                                      \
    case 1: v_tile(p, Vg, slots, cnt, row, i0, a, d, 1, W); break;                                    \
    case 2: v_tile(p, Vg, slots, cnt, row, i0, a, d, 2, W); break;                                    \
    case 3: v_tile(p, Vg, slots, cnt, row, i0, a, d, 3, W); break;                                    \
    default: v_tile(p, Vg, slots, cnt, row, i0, a, d, 4, W); break;                                   \
    }

/* v_tile over every dimension (d a multiple of 16, G <= KEY_HEADS): 64 at a time. */
static void v_tile_all(const float *p, const bf16 *Vg, const int64_t *slots, int cnt, int64_t row, float *a, int d,
                       int G) {
    int i0 = 0;
    for (; i0 + 64 <= d; i0 += 64) V_TILE(4)
    for (; i0 < d; i0 += 16) V_TILE(1)
}

/* attend_block in one pass over the block (flash-decoding): per tile of 16 keys, every
 * head's scores (each slot's K row, every K/V head adjacent in the pool, read once in
 * address order for all nh heads), the running maximum (the head's sums rescaled when it
 * rises), the exponentials, and their V sums while the tile's V rows are in L1; the K and
 * V rows 16 keys ahead are prefetched meanwhile. p: nh * 16 floats, a: nh * d floats. */
static void block_fused(const bf16 *q, const bf16 *K, const bf16 *V, const int64_t *slots, int len, int nkv, int nh,
                        int d, float scale, float *p, float *a, float *part, int64_t ps) {
    const int64_t row = (int64_t)nkv * d, bytes = row * (int64_t)sizeof(bf16); /* one slot */
    const int group = nh / nkv;
    const __m512 sc = _mm512_set1_ps(scale);
    float m[MAX_TILE_HEADS], l[MAX_TILE_HEADS];
    __m512 tile[MAX_TILE_HEADS][16];
    for (int h = 0; h < nh; h++) m[h] = -INFINITY, l[h] = 0.f;
    memset(a, 0, sizeof(float) * nh * d);
    for (int j = 0; j < len; j += 16) {
        const int cnt = len - j < 16 ? len - j : 16;
        const __mmask16 live = (__mmask16)((1u << cnt) - 1);
        for (int jj = 0; jj < 16; jj++) {
            if (jj >= cnt) {
                for (int h = 0; h < nh; h++) tile[h][jj] = _mm512_setzero_ps();
                continue;
            }
            if (j + jj + 16 < len) {
                prefetch_l1(K + slots[j + jj + 16] * row, bytes);
                prefetch_l1(V + slots[j + jj + 16] * row, bytes);
            }
            const bf16 *k = K + slots[j + jj] * row;
            for (int h = 0; h < nh; h++)
                tile[h][jj] = dot_acc(_mm512_setzero_ps(), k + (int64_t)(h / group) * d, q + (int64_t)h * d, d);
        }
        for (int h = 0; h < nh; h++) {
            __m512 s = _mm512_mul_ps(hsum16(tile[h]), sc);
            float top = _mm512_mask_reduce_max_ps(live, s);
            if (top > m[h]) {
                if (m[h] > -INFINITY) { /* earlier tiles' sums were taken against a lower max */
                    float f = expf(m[h] - top);
                    l[h] *= f;
                    for (int i = 0; i < d; i++) a[h * d + i] *= f;
                }
                m[h] = top;
            }
            __m512 e = _mm512_maskz_mov_ps(live, exp512(_mm512_sub_ps(s, _mm512_set1_ps(m[h]))));
            l[h] += _mm512_reduce_add_ps(e);
            _mm512_storeu_ps(p + h * 16, e);
        }
        for (int g = 0; g < nkv; g++)
            v_tile_all(p + g * group * 16, V + (int64_t)g * d, slots + j, cnt, row, a + (int64_t)g * group * d, d, group);
    }
    for (int h = 0; h < nh; h++) {
        part[h * ps] = m[h];
        part[h * ps + 1] = l[h];
        memcpy(part + h * ps + 2, a + (int64_t)h * d, sizeof(float) * d);
    }
}
#endif

/* Every head of one row over the `len` keys of one block (slots), in `lane` scratch: head
 * h's partial result goes to part + h * ps (the block's max score, sum of exponentials,
 * unnormalized V sum). Each K and V row is fetched once for its query group, and the sums
 * run in the same order whatever thread runs the block and whatever rows share the step. */
static void attend_block(const bf16 *q, const bf16 *K, const bf16 *V, const int64_t *slots, int len, int nh, int nkv,
                         int d, float *lane, float *part, int64_t ps) {
    const int64_t ss = up16(KEY_BLOCK);
    const int group = nh / nkv;
    float *scores = lane, *qf = scores + nh * ss, *a = qf + group * up16(d + 16);
    const float scale = 1.0f / sqrtf((float)d);
#ifdef SGL_BF16_SIMD
    if (nh <= MAX_TILE_HEADS && d % 16 == 0 && group <= KEY_HEADS) {
        block_fused(q, K, V, slots, len, nkv, nh, d, scale, scores, a, part, ps);
        return;
    }
#endif
    for (int g = 0; g < nkv; g++)
        for (int r0 = 0; r0 < group; r0 += KEY_HEADS) {
            int G = group - r0 < KEY_HEADS ? group - r0 : KEY_HEADS, h = g * group + r0;
            key_scores(q + (int64_t)h * d, G, K, V, slots, len, nkv, g, d, scale, scores + h * ss, ss, qf);
        }
    for (int h = 0; h < nh; h++) {
        float *s = scores + h * ss, mx = -INFINITY;
        for (int j = 0; j < len; j++) mx = s[j] > mx ? s[j] : mx;
        part[h * ps] = mx;
        part[h * ps + 1] = exp_shift(s, len, mx);
    }
    for (int g = 0; g < nkv; g++) {
        const float *sg = scores + g * group * ss;
        memset(a, 0, sizeof(float) * group * d);
#ifdef V_SIMD
        if (d % 8 == 0 && group <= KEY_HEADS) {
            values_sum(sg, ss, V, slots, len, nkv, g, group, d, a);
        } else
#endif
        for (int j = 0; j < len; j++) {
            const bf16 *v = V + (slots[j] * nkv + g) * d;
            for (int r = 0; r < group; r++)
                for (int t = 0; t < d; t++) a[r * d + t] = fmaf(sg[r * ss + j], bf2f(v[t]), a[r * d + t]);
        }
        for (int r = 0; r < group; r++) memcpy(part + (g * group + r) * ps + 2, a + r * d, sizeof(float) * d);
    }
}

/* out = a head's normalized output from a partial result (max, sum, V sums). */
static void finish_head(const float *part, int d, bf16 *out) {
    const float inv = 1.0f / part[1]; /* >= 1: the block's top key contributes exp(0) */
    for (int i = 0; i < d; i++) out[i] = f2bf(part[2 + i] * inv);
}

/* The step's attention is split into blocks of KEY_BLOCK keys so that one long row keeps
 * both threads busy and a thread reads a block's K and V rows (every K/V head of a slot,
 * adjacent in the pool) while they are in its cache. Chunk c = (row, block) of the first
 * pass computes every head's partial result for the block; the second pass (chunk = row,
 * query head) merges a row's blocks in block order. Block bounds are fixed positions in
 * the sequence, so a row's output depends on neither the thread nor the batch. */
void attn_block_chunk(void *arg, int c) {
    const AttnJob *j = (const AttnJob *)arg;
    int b = c / j->blocks, blk = c % j->blocks, len = (int)j->seq_lens[b] - blk * KEY_BLOCK;
    if (len <= 0) return;
    if (len > KEY_BLOCK) len = KEY_BLOCK;
    const int64_t ps = part_floats(j->d), lane_n = lane_floats(j->nh, j->d, j->nh / j->nkv);
    const int64_t *slots = j->r2t + j->req_rows[b] * j->r2t_stride + (int64_t)blk * KEY_BLOCK;
    float *part = j->fws + 2 * lane_n + ((int64_t)b * j->block_cap + blk) * j->nh * ps;
    attend_block(j->qkv + (int64_t)b * j->qkv_n, j->K, j->V, slots, len, j->nh, j->nkv, j->d,
                 j->fws + team_lane() * lane_n, part, ps);
    if (j->seq_lens[b] <= KEY_BLOCK) /* the row's only block: its output now, as the merge would */
        for (int h = 0; h < j->nh; h++) finish_head(part + h * ps, j->d, j->att + ((int64_t)b * j->nh + h) * j->d);
}

/* Merge pass, chunk c = (row, query head) of a row of several blocks (a one-block row got
 * its output in the first pass: the merge of one block, weight exp(0) = 1, is the same). */
void attn_merge_chunk(void *arg, int c) {
    const AttnJob *j = (const AttnJob *)arg;
    const int b = c / j->nh, h = c % j->nh, d = j->d, group = j->nh / j->nkv;
    const int nb = (int)((j->seq_lens[b] + KEY_BLOCK - 1) / KEY_BLOCK);
    if (nb <= 1) return;
    const int64_t ps = part_floats(d), lane_n = lane_floats(j->nh, d, group);
    const float *part = j->fws + 2 * lane_n + (int64_t)b * j->block_cap * j->nh * ps + h * ps;
    const int64_t bs = j->nh * ps; /* from one block's partials to the next */
    /* the merged result in the lane's accumulators (the first pass is over; d + 2 floats fit) */
    float *acc = j->fws + team_lane() * lane_n + j->nh * up16(KEY_BLOCK) + group * up16(d + 16);
    float mx = -INFINITY;
    for (int k = 0; k < nb; k++) mx = part[k * bs] > mx ? part[k * bs] : mx;
    for (int i = 0; i < d + 2; i++) acc[i] = 0.f;
    for (int k = 0; k < nb; k++) {
        const float *p = part + k * bs, w = expf(p[0] - mx);
        for (int i = 1; i < d + 2; i++) acc[i] = fmaf(w, p[i], acc[i]);
    }
    finish_head(acc, d, j->att + ((int64_t)b * j->nh + h) * d);
}
