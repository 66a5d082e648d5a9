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
 * (team.c): one core reads ~22 GB/s here, two ~30 GB/s; attention splits its rows' keys
 * into blocks the same way (decode_attn.c). Everything else runs on the caller's thread.
 *
 * Each matrix has a type tag (SGL_T_*, sgl_kernels.h): bf16 as above, or rows of GGUF
 * blocks (--quantization gguf), multiplied by quant.c after the activation rows are
 * quantized to int8 once per product; the embedding row of a block type is dequantized.
 */
#include "rows.h"
#include "sgl_kernels.h"
#include "team.h"
#include "quant.h"
#include "decode_attn.h"

#include <math.h>

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
int64_t sgl_decode_fws(const sgl_decode_model *m, int max_len, int max_rows) {
    return attn_ws_floats(max_len, max_rows, m->nh, m->d, m->nh / m->nkv);
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
    int64_t longest = 0;
    for (int b = 0; b < B; b++) {
        if (bt->seq_lens[b] > bt->max_len) return SGL_ERR_CONTEXT_TOO_LONG;
        if (bt->seq_lens[b] < 1) return SGL_ERR_UNSUPPORTED; /* a row attends at least to its own token */
        longest = bt->seq_lens[b] > longest ? bt->seq_lens[b] : longest;
    }
    if (!types_ok(m) || B > bt->max_rows) return SGL_ERR_UNSUPPORTED;
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
        AttnJob aj = {qkv, K, V, bt->req_to_token, bt->req_rows, bt->seq_lens, bt->r2t_stride, qkv_n, nh, nkv, d,
                      (int)((longest + KEY_BLOCK - 1) / KEY_BLOCK), (bt->max_len + KEY_BLOCK - 1) / KEY_BLOCK,
                      bt->fws, att};
        if (g_team) {
            team_run(attn_block_chunk, &aj, B * aj.blocks);
            if (aj.blocks > 1) team_run(attn_merge_chunk, &aj, B * nh);
        } else {
            for (int c = 0; c < B * aj.blocks; c++) attn_block_chunk(&aj, c);
            for (int c = 0; aj.blocks > 1 && c < B * nh; c++) attn_merge_chunk(&aj, c);
        }
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
