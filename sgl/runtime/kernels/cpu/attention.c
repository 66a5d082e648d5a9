/* Attention of a step's new tokens over the KV pool, on the CPU (AVX512-BF16).
 *
 * One call per layer covers every shape a step has: a long prefill, extends after a
 * cached prefix, single-token decode rows, or a mix. Request i's queries are T rows
 * q_start[i] ... + extend[i] - 1; its keys are the pool slots rows[i, 0 .. prefix[i] +
 * extend[i]), and query j sees key c iff c <= prefix[i] + j.
 *
 * Two phases, each split over the two-thread team (team.c):
 *  1. pack: each segment of keys is copied once out of the pool into tiles laid out for
 *     the dot-product instruction (K: 16 keys x d/2 pairs, V: key pairs x d). The first
 *     `shared` slots, identical for every request (a few-shot prompt, forks), are one
 *     segment packed once for all of them; each request's other keys are another. A work
 *     item packs PACK_KEYS keys of one segment and KV head, so both threads share the
 *     packing of a single request (a cache hit's short extend over a long prefix, where
 *     one item per head split the three heads 2:1).
 *  2. attend: a work item is (request, KV head, block of up to 16 tokens). Its rows are
 *     the tokens x the query heads of that KV group, so every K/V tile loaded serves all
 *     of the group's heads (GQA). Rows go through in chunks of up to 4 (d = 64) that keep
 *     their scores, running softmax and outputs in registers over all their keys: a
 *     flash-attention loop whose scores are never written out.
 *
 * Numerics follow torch's CPU flash kernel for bf16: q.k summed in fp32, softmax in fp32,
 * probabilities rounded to bf16 for the value products, fp32 accumulation, output
 * rounded to bf16.
 */
#include "sgl_kernels.h"
#include "simd.h"
#include "team.h"

#include <math.h>
#include <stdlib.h>

#define QBLOCK 16   /* tokens per work item */
#define KTILE 16    /* keys per K tile (one vector of scores) */
#define KSTEP 32    /* keys per softmax step: two K tiles */
#define PACK_KEYS 256 /* keys per pack work item (a multiple of KSTEP) */

typedef struct {
    const bf16 *q;
    int64_t qs; /* elements between tokens of q (heads are contiguous inside a token) */
    bf16 *out;  /* [T, nh, d] */
    const bf16 *kb, *vb; /* pool [slots, nkv, d] */
    const int64_t *rows;
    int64_t rs;
    const int32_t *qst, *pre, *ext;
    int nreq, shared, nh, nkv, d, group;
    float scale;
    char *ws;
    int64_t *seg_off; /* byte offset of segment s (0: shared, 1 + i: request i's own keys) */
    int *seg_pad;     /* its key count rounded up to KSTEP */
    int32_t *items;   /* (request, kv head, first token) per work item */
    int32_t *packs;   /* (segment, kv head, first key) per pack item */
} job_t;

static int pad_keys(int n) { return (n + KSTEP - 1) / KSTEP * KSTEP; }

/* Bytes of packed K/V for this step (the caller's workspace). */
int64_t sgl_attn_ws_bytes(const sgl_attn_params *p) {
    int64_t keys = pad_keys(p->shared);
    for (int i = 0; i < p->nreq; i++) keys += pad_keys(p->prefix[i] + p->extend[i] - p->shared);
    return keys * p->nkv * p->d * 2 * (int64_t)sizeof(bf16);
}

int sgl_attn_simd(void) {
#ifdef SGL_BF16_SIMD
    return 1;
#else
    return 0;
#endif
}

#ifdef SGL_BF16_SIMD
/* Segment s, KV head g: K tiles then V pairs. */
static bf16 *seg_k(const job_t *J, int s, int g) {
    return (bf16 *)(J->ws + J->seg_off[s]) + (int64_t)g * J->seg_pad[s] * J->d * 2;
}
static bf16 *seg_v(const job_t *J, int s, int g) { return seg_k(J, s, g) + (int64_t)J->seg_pad[s] * J->d; }

/* dst row p (16 words, 64 bytes apart) = word p of the 16 source rows: a 16 x 16
 * transpose of 32-bit words (unpack within 128-bit lanes, then regroup the lanes). */
static void transpose16(const uint32_t *const *src, int col, uint32_t *dst) {
    __m512i r[16], t[16];
    for (int j = 0; j < 16; j++) r[j] = _mm512_loadu_si512(src[j] + col);
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) { /* r[4i + c], lane L: rows 4i..4i+3 of word 4L + c */
        r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int c = 0; c < 4; c++) {
        __m512i w0 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x44), w1 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xEE);
        __m512i w2 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x44), w3 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xEE);
        _mm512_storeu_si512(dst + (0 + c) * 16, _mm512_shuffle_i32x4(w0, w2, 0x88));
        _mm512_storeu_si512(dst + (4 + c) * 16, _mm512_shuffle_i32x4(w0, w2, 0xDD));
        _mm512_storeu_si512(dst + (8 + c) * 16, _mm512_shuffle_i32x4(w1, w3, 0x88));
        _mm512_storeu_si512(dst + (12 + c) * 16, _mm512_shuffle_i32x4(w1, w3, 0xDD));
    }
}

/* Keys of segment s (0: the shared prefix, 1 + i: request i's own keys). */
static int seg_len(const job_t *J, int s) { return s == 0 ? J->shared : J->pre[s - 1] + J->ext[s - 1] - J->shared; }

/* Pack item c: keys [k0, k0 + PACK_KEYS) of segment s, KV head g (J->packs). Rows past the
 * segment's keys are zero, so a zero probability never meets a NaN. */
static void pack_chunk(void *arg, int c) {
    const job_t *J = arg;
    int s = J->packs[3 * c], g = J->packs[3 * c + 1], k0 = J->packs[3 * c + 2], d = J->d, hp = d / 2;
    int row = s == 0 ? 0 : s - 1, first = s == 0 ? 0 : J->shared;
    int n = seg_len(J, s), npad = J->seg_pad[s];
    int k1 = k0 + PACK_KEYS < npad ? k0 + PACK_KEYS : npad;
    const int64_t *slots = J->rows + row * J->rs + first;
    static const bf16 zeros[128] __attribute__((aligned(64))) = {0};
    const bf16 *(src[KTILE]);
    uint32_t *kp = (uint32_t *)seg_k(J, s, g);
    bf16 *vp = seg_v(J, s, g);
    /* K: per tile of 16 keys, [hp][16] words (word = a pair of dims) */
    for (int c0 = k0; c0 < k1; c0 += KTILE) {
        for (int j = c0 + KTILE; j < c0 + 2 * KTILE && j < n; j++) /* the next tile's rows (simd.h) */
            prefetch_l1(J->kb + (slots[j] * J->nkv + g) * d, d * (int)sizeof(bf16));
        for (int j = 0; j < KTILE; j++)
            src[j] = c0 + j < n ? J->kb + (slots[c0 + j] * J->nkv + g) * d : zeros;
        for (int col = 0; col < hp; col += 16)
            transpose16((const uint32_t *const *)src, col, kp + (int64_t)c0 * hp + col * KTILE);
    }
    /* V: [npad / 2][d][2], each pair of keys interleaved per dimension */
    const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                        37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    for (int c0 = k0; c0 < k1; c0 += 2) {
        for (int j = c0 + KTILE; j < c0 + KTILE + 2 && j < n; j++)
            prefetch_l1(J->vb + (slots[j] * J->nkv + g) * d, d * (int)sizeof(bf16));
        const bf16 *a = c0 < n ? J->vb + (slots[c0] * J->nkv + g) * d : zeros;
        const bf16 *b = c0 + 1 < n ? J->vb + (slots[c0 + 1] * J->nkv + g) * d : zeros;
        bf16 *dst = vp + (int64_t)c0 * d;
        for (int i = 0; i < d; i += 32) {
            __m512i x = _mm512_loadu_si512(a + i), y = _mm512_loadu_si512(b + i);
            _mm512_storeu_si512(dst + 2 * i, _mm512_permutex2var_epi16(x, lo, y));
            _mm512_storeu_si512(dst + 2 * i + 32, _mm512_permutex2var_epi16(x, hi, y));
        }
    }
}

/* R rows (R <= 4) of one KV group over one segment's keys [0, nk) (already packed),
 * updating each row's running max m, sum vector lv and output accumulators acc[R][NV].
 * Key k of the segment is key base + k of the request; row r sees it iff base + k <
 * lim[r] (and k < nvalid). */
static inline __attribute__((always_inline)) void attend_segment(
    int R, int NV, const bf16 *kp, const bf16 *vp, int nk, int nvalid, int base, const int *lim,
    const bf16 *const *qr, float scale, float *m, __m512 *lv, __m512 *acc) {
    const int hp = NV * 8; /* d / 2 */
    const __m512 ninf = _mm512_set1_ps(-INFINITY), sc = _mm512_set1_ps(scale);
    int minlim = lim[0];
    for (int r = 1; r < R; r++) minlim = lim[r] < minlim ? lim[r] : minlim;
    for (int k0 = 0; k0 < nk; k0 += KSTEP) {
        __m512 s0[4], s1[4];
        for (int r = 0; r < R; r++) s0[r] = s1[r] = _mm512_setzero_ps();
        const bf16 *t0 = kp + (int64_t)k0 * hp * 2, *t1 = t0 + KTILE * hp * 2;
        for (int p = 0; p < hp; p++) {
            __m512bh a = (__m512bh)_mm512_loadu_si512(t0 + p * 32), b = (__m512bh)_mm512_loadu_si512(t1 + p * 32);
            for (int r = 0; r < R; r++) {
                int32_t qpair;
                memcpy(&qpair, qr[r] + 2 * p, 4);
                __m512bh qb = (__m512bh)_mm512_set1_epi32(qpair);
                s0[r] = _mm512_dpbf16_ps(s0[r], a, qb);
                s1[r] = _mm512_dpbf16_ps(s1[r], b, qb);
            }
        }
        int masked = base + k0 + KSTEP > minlim || k0 + KSTEP > nvalid;
        uint32_t pbuf[4][16];
        for (int r = 0; r < R; r++) {
            __m512 x0 = _mm512_mul_ps(s0[r], sc), x1 = _mm512_mul_ps(s1[r], sc);
            __mmask16 m0 = 0xffff, m1 = 0xffff;
            if (masked) {
                int v = lim[r] - base - k0, w = nvalid - k0;
                v = v < w ? v : w;
                m0 = v >= 16 ? 0xffff : v <= 0 ? 0 : (__mmask16)((1u << v) - 1);
                m1 = v >= 32 ? 0xffff : v <= 16 ? 0 : (__mmask16)((1u << (v - 16)) - 1);
                x0 = _mm512_mask_mov_ps(ninf, m0, x0);
                x1 = _mm512_mask_mov_ps(ninf, m1, x1);
            }
            float tmax = _mm512_reduce_max_ps(_mm512_max_ps(x0, x1));
            if (tmax > m[r]) { /* new running max: rescale what was summed so far */
                __m512 alpha = _mm512_set1_ps(expf(m[r] - tmax));
                m[r] = tmax;
                lv[r] = _mm512_mul_ps(lv[r], alpha);
                for (int c = 0; c < NV; c++) acc[r * NV + c] = _mm512_mul_ps(acc[r * NV + c], alpha);
            }
            __m512 mx = _mm512_set1_ps(m[r]);
            __m512 p0 = _mm512_maskz_mov_ps(m0, exp512(_mm512_sub_ps(x0, mx)));
            __m512 p1 = _mm512_maskz_mov_ps(m1, exp512(_mm512_sub_ps(x1, mx)));
            lv[r] = _mm512_add_ps(lv[r], _mm512_add_ps(p0, p1));
            /* keys 0..31 as bf16, two per 32-bit word: word j = keys 2j, 2j + 1 */
            _mm512_storeu_si512(pbuf[r], (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
        }
        const bf16 *vt = vp + (int64_t)k0 * hp * 2;
        for (int j = 0; j < KSTEP / 2; j++) {
            __m512bh v[8];
            for (int c = 0; c < NV; c++) v[c] = (__m512bh)_mm512_loadu_si512(vt + ((int64_t)j * hp * 2 + c * 16) * 2);
            for (int r = 0; r < R; r++) {
                __m512bh pb = (__m512bh)_mm512_set1_epi32((int)pbuf[r][j]);
                for (int c = 0; c < NV; c++) acc[r * NV + c] = _mm512_dpbf16_ps(acc[r * NV + c], v[c], pb);
            }
        }
    }
}

/* R rows: row r is (T row tok[r], query head hq[r]) of request i, seeing lim[r] keys. */
static inline __attribute__((always_inline)) void attend_rows(int R, int NV, const job_t *J, int i, int g,
                                                              const int *tok, const int *hq, const int *lim) {
    const bf16 *qr[4];
    float m[4];
    __m512 lv[4], acc[4 * 8];
    for (int r = 0; r < R; r++) {
        qr[r] = J->q + tok[r] * J->qs + (int64_t)hq[r] * J->d;
        m[r] = -1e30f; /* finite: a fully masked first step must not give inf - inf */
        lv[r] = _mm512_setzero_ps();
        for (int c = 0; c < NV; c++) acc[r * NV + c] = _mm512_setzero_ps();
    }
    int maxlim = lim[0];
    for (int r = 1; r < R; r++) maxlim = lim[r] > maxlim ? lim[r] : maxlim;
    if (J->shared > 0)
        attend_segment(R, NV, seg_k(J, 0, g), seg_v(J, 0, g), pad_keys(J->shared), J->shared, 0, lim, qr,
                       J->scale, m, lv, acc);
    int own = maxlim - J->shared;
    if (own > 0)
        attend_segment(R, NV, seg_k(J, 1 + i, g), seg_v(J, 1 + i, g), pad_keys(own), own, J->shared, lim, qr,
                       J->scale, m, lv, acc);
    for (int r = 0; r < R; r++) {
        __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(lv[r]));
        bf16 *o = J->out + ((int64_t)tok[r] * J->nh + hq[r]) * J->d;
        for (int c = 0; c < NV; c++)
            _mm256_storeu_si256((__m256i *)(o + c * 16), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[r * NV + c], inv)));
    }
}

#define ROWS_FN(R, NV) \
    static void rows_##R##_##NV(const job_t *J, int i, int g, const int *t, const int *h, const int *l) { \
        attend_rows(R, NV, J, i, g, t, h, l); \
    }
ROWS_FN(1, 4) ROWS_FN(2, 4) ROWS_FN(3, 4) ROWS_FN(4, 4) ROWS_FN(1, 8) ROWS_FN(2, 8)

static void attend_chunk(void *arg, int c) {
    const job_t *J = arg;
    int i = J->items[3 * c], g = J->items[3 * c + 1], j0 = J->items[3 * c + 2];
    int ntok = J->ext[i] - j0 < QBLOCK ? J->ext[i] - j0 : QBLOCK;
    int nrows = ntok * J->group, per = J->d == 64 ? 4 : 2;
    for (int r0 = 0; r0 < nrows; r0 += per) {
        int R = nrows - r0 < per ? nrows - r0 : per, tok[4], hq[4], lim[4];
        for (int r = 0; r < R; r++) {
            int j = j0 + (r0 + r) / J->group;
            tok[r] = J->qst[i] + j;
            hq[r] = g * J->group + (r0 + r) % J->group;
            lim[r] = J->pre[i] + j + 1;
        }
        if (J->d == 64) {
            if (R == 4) rows_4_4(J, i, g, tok, hq, lim);
            else if (R == 3) rows_3_4(J, i, g, tok, hq, lim);
            else if (R == 2) rows_2_4(J, i, g, tok, hq, lim);
            else rows_1_4(J, i, g, tok, hq, lim);
        } else {
            if (R == 2) rows_2_8(J, i, g, tok, hq, lim);
            else rows_1_8(J, i, g, tok, hq, lim);
        }
    }
}
#endif

/* out [T, nh, d] = attention of the step's queries (see the top of the file). ws holds
 * sgl_attn_ws_bytes(p) bytes. Returns SGL_ERR_UNSUPPORTED where this build or shape is
 * not supported (no AVX512-BF16, d not 64 or 128): the caller then uses torch. */
sgl_status sgl_attn_forward(const sgl_attn_params *p) {
#ifdef SGL_BF16_SIMD
    const int nreq = p->nreq, shared = p->shared, nkv = p->nkv, d = p->d;
    const int32_t *pre = p->prefix, *ext = p->extend;
    if ((d != 64 && d != 128) || p->nh % nkv != 0) return SGL_ERR_UNSUPPORTED;
    job_t J = {p->q, p->q_stride, p->out, p->k_pool, p->v_pool, p->rows, p->row_stride, p->q_start, pre, ext,
               nreq, shared, p->nh, nkv, d, p->nh / nkv, p->scale, p->ws};
    int nitems = 0;
    for (int i = 0; i < nreq; i++) nitems += (ext[i] + QBLOCK - 1) / QBLOCK * nkv;
    J.seg_off = malloc(sizeof(int64_t) * (nreq + 1));
    J.seg_pad = malloc(sizeof(int) * (nreq + 1));
    J.items = malloc(sizeof(int32_t) * 3 * (nitems + 1));
    int npack = 0;
    for (int s = 0; s <= nreq; s++) npack += (seg_len(&J, s) + PACK_KEYS - 1) / PACK_KEYS * nkv;
    J.packs = malloc(sizeof(int32_t) * 3 * (npack + 1));
    if (!J.seg_off || !J.seg_pad || !J.items || !J.packs) {
        free(J.seg_off), free(J.seg_pad), free(J.items), free(J.packs);
        return SGL_ERR_NO_MEMORY;
    }
    int64_t off = 0;
    npack = 0;
    for (int s = 0; s <= nreq; s++) {
        J.seg_pad[s] = pad_keys(seg_len(&J, s));
        J.seg_off[s] = off;
        off += (int64_t)J.seg_pad[s] * nkv * d * 2 * sizeof(bf16);
        for (int k0 = 0; k0 < seg_len(&J, s); k0 += PACK_KEYS)
            for (int g = 0; g < nkv; g++) {
                J.packs[3 * npack] = s, J.packs[3 * npack + 1] = g, J.packs[3 * npack + 2] = k0;
                npack++;
            }
    }
    int n = 0;
    /* Last token blocks first: under the causal mask they see the most keys, and the two
     * threads finish together when the heavy items are claimed early. */
    for (int i = 0; i < nreq; i++)
        for (int j0 = (ext[i] - 1) / QBLOCK * QBLOCK; j0 >= 0; j0 -= QBLOCK)
            for (int g = 0; g < nkv; g++) {
                J.items[3 * n] = i, J.items[3 * n + 1] = g, J.items[3 * n + 2] = j0;
                n++;
            }
    int team = p->threads > 1 && team_acquire();
    if (team) {
        team_run(pack_chunk, &J, npack);
        team_run(attend_chunk, &J, nitems);
        team_rest(); /* torch's GEMM threads come next */
        team_release();
    } else {
        for (int c = 0; c < npack; c++) pack_chunk(&J, c);
        for (int c = 0; c < nitems; c++) attend_chunk(&J, c);
    }
    free(J.seg_off), free(J.seg_pad), free(J.items), free(J.packs);
    return SGL_OK;
#else
    (void)p;
    return SGL_ERR_UNSUPPORTED;
#endif
}
