/* Many-row products over GGUF-quantized weights (prefill, extends, wide decode steps):
 * int8 activations times the weights' integer values in AVX512-VNNI dot products, where
 * the bf16 GEMM would first need the weights dequantized.
 *
 * Every supported type is a value d * u + m per 32-input block with u an unsigned byte:
 * Q4_1 (u = q, m its min), Q4_0 (u = q, m = -8 d), Q8_0 (u = q + 128, m = -128 d), Q4_K
 * (per 32-value sub-block: d * scale, -dmin * min). `sgl_qgemm_pack` rewrites a matrix
 * once into tiles of 16 outputs x 32 inputs: 512 bytes of u in the order vpdpbusd reads
 * them (register j, lane c: u[c][4j .. 4j + 3]), then the 16 d's and the 16 m's as
 * floats. Activation rows are quantized as quant.c's q8_row does (the same int8 values,
 * scale d_x and d_x * sum(q) per block), so a block's part of output c is
 *   d_w d_x sum(u q) + m_w d_x sum(q),
 * the sum exact in int32, then two fp32 FMAs per block in block order. The plain-C path
 * computes the same integers and the same FMAs (fmaf), so both builds give the same bits,
 * and a row's result never depends on how many rows share the product. (quant.c's decode
 * step sums the same blocks in another float order: the two differ by fp32 rounding.)
 * Q6_K (two scales per 32 values) has no tile form here: such a matrix keeps its bf16 path.
 */
#include "quant.h"
#include "sgl_kernels.h"
#include "team.h"

#include <math.h>
#include <stdlib.h>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define QG_VNNI 1
#endif

#define TILE_OUT 16
#define TILE_U 512                      /* bytes of u per tile */
#define TILE_BYTES (TILE_U + 2 * 64)    /* + 16 d's and 16 m's */
#define MR 8                            /* activation rows per register block */

static int tile_type(int type) {
    return type == SGL_T_Q4_0 || type == SGL_T_Q4_1 || type == SGL_T_Q8_0 || type == SGL_T_Q4_K;
}

int64_t sgl_qgemm_packed_bytes(int type, int out, int in) {
    if (!tile_type(type) || out < 1 || sgl_quant_row_bytes(type, in) == 0) return 0;
    return (int64_t)((out + TILE_OUT - 1) / TILE_OUT) * (in / 32) * TILE_BYTES;
}

/* Block i of a weight row as (u[32], d, m) with value d * u + m. */
static void block_um(int type, const uint8_t *row, int i, uint8_t *u, float *d, float *m) {
    if (type == SGL_T_Q8_0) {
        const uint8_t *w = row + 34 * i;
        *d = h2f(w);
        *m = -128.f * *d;
        for (int k = 0; k < 32; k++) u[k] = (uint8_t)((int)(int8_t)w[2 + k] + 128);
    } else if (type == SGL_T_Q4_0 || type == SGL_T_Q4_1) {
        int q41 = type == SGL_T_Q4_1;
        const uint8_t *w = row + (q41 ? 20 : 18) * i, *qs = w + (q41 ? 4 : 2);
        *d = h2f(w);
        *m = q41 ? h2f(w + 2) : -8.f * *d;
        for (int k = 0; k < 16; k++) u[k] = qs[k] & 0xF, u[k + 16] = qs[k] >> 4;
    } else { /* Q4_K: super-block i / 8, sub-block i % 8 */
        const uint8_t *w = row + 144 * (i / 8);
        int j = i % 8, p = j / 2;
        uint8_t sc[8], mn[8];
        k4_scales(w + 4, sc, mn);
        *d = h2f(w) * (float)sc[j];
        *m = -(h2f(w + 2) * (float)mn[j]);
        for (int k = 0; k < 32; k++) u[k] = j % 2 ? w[16 + 32 * p + k] >> 4 : w[16 + 32 * p + k] & 0xF;
    }
}

sgl_status sgl_qgemm_pack(int type, const void *W, int out, int in, void *packed) {
    if (sgl_qgemm_packed_bytes(type, out, in) == 0) return SGL_ERR_UNSUPPORTED;
    int64_t rb = sgl_quant_row_bytes(type, in);
    int nb = in / 32, nt = (out + TILE_OUT - 1) / TILE_OUT;
    uint8_t *P = (uint8_t *)packed;
    for (int t = 0; t < nt; t++)
        for (int b = 0; b < nb; b++) {
            uint8_t *tile = P + ((int64_t)t * nb + b) * TILE_BYTES;
            float *dv = (float *)(tile + TILE_U), *mv = dv + TILE_OUT;
            memset(tile, 0, TILE_BYTES); /* columns past `out` stay zero */
            for (int c = 0; c < TILE_OUT && t * TILE_OUT + c < out; c++) {
                uint8_t u[32];
                block_um(type, (const uint8_t *)W + (int64_t)(t * TILE_OUT + c) * rb, b, u, &dv[c], &mv[c]);
                for (int k = 0; k < 32; k++) tile[(k / 4) * 64 + c * 4 + k % 4] = u[k];
            }
        }
    return SGL_OK;
}

/* Activations are quantized as quant.c's q8_row does (the same int8 values, scales and
 * scaled sums), but stored interleaved for the kernel: groups of MR rows, per block b
 * the MR rows' 32 int8 values, then their MR scales d_x, then their MR scaled sums
 * (GROUP_BLK bytes), so one pointer and constant offsets reach every operand. A last,
 * partial group is padded with zero rows. */
#define GROUP_BLK (MR * 32 + 2 * MR * 4)

static void quant_row_into_group(const bf16 *x, int in, uint8_t *g, int r) {
    int nb = in / 32;
#ifdef QG_VNNI
    for (int i = 0; i < nb; i++) {
        uint8_t *blk = g + (int64_t)i * GROUP_BLK;
        int8_t *q = (int8_t *)blk + 32 * r;
        float *d = (float *)(blk + MR * 32) + r, *s = d + MR;
        __m512i raw = _mm512_loadu_si512((const void *)(x + 32 * i)); /* 32 bf16 */
        __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(raw)), 16));
        __m512 hi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(raw, 1)), 16));
        const __m512 fmax = _mm512_set1_ps(3.40282347e+38f);
        if ((__mmask16)(_mm512_cmp_ps_mask(_mm512_abs_ps(lo), fmax, _CMP_LE_OQ) &
                        _mm512_cmp_ps_mask(_mm512_abs_ps(hi), fmax, _CMP_LE_OQ)) != 0xffff) {
            memset(q, 0, 32); /* NaN or inf: as q8_block */
            *d = *s = NAN;
            continue;
        }
        float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
        float id = amax >= Q8_MIN_AMAX ? 127.f / amax : 0.f;
        __m512 vid = _mm512_set1_ps(id), lim = _mm512_set1_ps(127.f), nlim = _mm512_set1_ps(-127.f);
        /* nearbyintf under the default rounding mode: to nearest, ties to even */
        __m512 a = _mm512_roundscale_ps(_mm512_mul_ps(lo, vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        __m512 c = _mm512_roundscale_ps(_mm512_mul_ps(hi, vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        __m512i ia = _mm512_cvtps_epi32(_mm512_max_ps(_mm512_min_ps(a, lim), nlim));
        __m512i ic = _mm512_cvtps_epi32(_mm512_max_ps(_mm512_min_ps(c, lim), nlim));
        _mm_storeu_si128((__m128i *)q, _mm512_cvtepi32_epi8(ia));
        _mm_storeu_si128((__m128i *)(q + 16), _mm512_cvtepi32_epi8(ic));
        int sum = _mm512_reduce_add_epi32(_mm512_add_epi32(ia, ic));
        *d = amax / 127.f;
        *s = *d * (float)sum;
    }
#else
    for (int i = 0; i < nb; i++) {
        uint8_t *blk = g + (int64_t)i * GROUP_BLK;
        float *d = (float *)(blk + MR * 32) + r;
        q8_block(x + 32 * i, (int8_t *)blk + 32 * r, d, d + MR);
    }
#endif
}

typedef struct {
    const uint8_t *P;
    const bf16 *X, *bias;
    uint8_t *XQ;
    bf16 *Y;
    int out, in, rows, nt;
} QgemmJob;

static void quant_chunk(void *arg, int g) { /* one group of MR rows */
    QgemmJob *j = (QgemmJob *)arg;
    uint8_t *grp = j->XQ + (int64_t)g * (j->in / 32) * GROUP_BLK;
    for (int r = 0; r < MR; r++) {
        int row = g * MR + r;
        if (row < j->rows) quant_row_into_group(j->X + (int64_t)row * j->in, j->in, grp, r);
        else
            for (int i = 0; i < j->in / 32; i++) { /* padding row: zeros, scale 0 */
                uint8_t *blk = grp + (int64_t)i * GROUP_BLK;
                memset(blk + 32 * r, 0, 32);
                memset(blk + MR * 32 + 4 * r, 0, 4);
                memset(blk + MR * 32 + 4 * MR + 4 * r, 0, 4);
            }
    }
}

/* bf16(acc + bias) for the `n` valid columns of a tile starting at column o. */
static void store_tile(const float *acc, const bf16 *bias, int o, int n, bf16 *y) {
    for (int c = 0; c < n; c++) y[c] = f2bf(acc[c] + (bias ? bf2f(bias[o + c]) : 0.f));
}

#ifdef QG_VNNI
/* One group of MR activation rows against one tile column group, all blocks. The
 * integer sums run weight register outer, row inner: MR independent vpdpbusd chains in
 * flight (row outer made each row one chain of 8 dependent products, and the core waited
 * on their latency). Integer sums are exact, so the order changes no bit. */
static void tile_group(const uint8_t *T, int nb, const uint8_t *G, float *acc_out) {
    __m512 f[MR];
    for (int r = 0; r < MR; r++) f[r] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++, T += TILE_BYTES, G += GROUP_BLK) {
        __m512i s[MR];
        const int32_t *a = (const int32_t *)G; /* row r's 4-byte group k at a[8 * r + k] */
#pragma GCC unroll 8
        for (int r = 0; r < MR; r++) s[r] = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int k = 0; k < 8; k++) {
            __m512i w = _mm512_loadu_si512(T + 64 * k);
#pragma GCC unroll 8
            for (int r = 0; r < MR; r++) s[r] = _mm512_dpbusd_epi32(s[r], w, _mm512_set1_epi32(a[8 * r + k]));
        }
        __m512 dw = _mm512_loadu_ps(T + TILE_U), mw = _mm512_loadu_ps(T + TILE_U + 64);
        const float *xd = (const float *)(G + MR * 32);
#pragma GCC unroll 8
        for (int r = 0; r < MR; r++) {
            f[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r]), _mm512_mul_ps(dw, _mm512_set1_ps(xd[r])), f[r]);
            f[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(xd[MR + r]), f[r]);
        }
    }
    for (int r = 0; r < MR; r++) _mm512_storeu_ps(acc_out + TILE_OUT * r, f[r]);
}
#else
static void tile_group(const uint8_t *T, int nb, const uint8_t *G, float *acc_out) {
    for (int r = 0; r < MR; r++)
        for (int c = 0; c < TILE_OUT; c++) {
            float f = 0.f;
            const uint8_t *t = T, *g = G;
            for (int b = 0; b < nb; b++, t += TILE_BYTES, g += GROUP_BLK) {
                const float *dv = (const float *)(t + TILE_U), *mv = dv + TILE_OUT, *xd = (const float *)(g + MR * 32);
                const int8_t *xv = (const int8_t *)(g + 32 * r);
                int32_t s = 0;
                for (int k = 0; k < 32; k++) s += (int32_t)t[(k / 4) * 64 + c * 4 + k % 4] * xv[k];
                f = fmaf((float)s, dv[c] * xd[r], f);
                f = fmaf(mv[c], xd[MR + r], f);
            }
            acc_out[TILE_OUT * r + c] = f;
        }
}
#endif

/* Rows are taken RBLOCK at a time (their int8 values stay in L2 while every tile of the
 * weight passes): a chunk is one tile against one row block. */
#define RBLOCK 256

static void tile_chunk(void *arg, int c) {
    QgemmJob *j = (QgemmJob *)arg;
    int t = c % j->nt, rb = c / j->nt, nb = j->in / 32;
    int o = t * TILE_OUT, n = j->out - o < TILE_OUT ? j->out - o : TILE_OUT;
    const uint8_t *T = j->P + (int64_t)t * nb * TILE_BYTES;
    float acc[MR * TILE_OUT];
    int hi = (rb + 1) * RBLOCK < j->rows ? (rb + 1) * RBLOCK : j->rows;
    for (int r0 = rb * RBLOCK; r0 < hi; r0 += MR) {
        tile_group(T, nb, j->XQ + (int64_t)(r0 / MR) * nb * GROUP_BLK, acc);
        int R = hi - r0 < MR ? hi - r0 : MR;
        for (int r = 0; r < R; r++) store_tile(acc + TILE_OUT * r, j->bias, o, n, j->Y + (int64_t)(r0 + r) * j->out + o);
    }
}

/* The caller thread's buffer for quantized activation groups, kept between products: a
 * fresh one per product (MBs for a prefill chunk) came from mmap and faulted in every time. */
static __thread uint8_t *g_xq;
static __thread size_t g_xq_cap;

static uint8_t *xq_scratch(size_t bytes) {
    if (bytes > g_xq_cap) {
        free(g_xq);
        g_xq_cap = (bytes + 4095) / 4096 * 4096;
        g_xq = (uint8_t *)aligned_alloc(64, g_xq_cap);
        if (!g_xq) g_xq_cap = 0;
    }
    return g_xq;
}

sgl_status sgl_qgemm(const void *packed, int type, int out, int in, const uint16_t *X, int rows, const uint16_t *bias,
                     uint16_t *Y, int threads) {
    if (sgl_qgemm_packed_bytes(type, out, in) == 0 || rows < 1) return SGL_ERR_UNSUPPORTED;
    int groups = (rows + MR - 1) / MR;
    uint8_t *xq = xq_scratch((size_t)groups * (in / 32) * GROUP_BLK);
    if (!xq) return SGL_ERR_NO_MEMORY;
    int nt = (out + TILE_OUT - 1) / TILE_OUT, rblocks = (rows + RBLOCK - 1) / RBLOCK;
    QgemmJob j = {(const uint8_t *)packed, X, bias, xq, Y, out, in, rows, nt};
    if (threads > 1 && team_acquire()) {
        team_run(quant_chunk, &j, groups);
        team_run(tile_chunk, &j, nt * rblocks);
        team_rest(); /* torch's ops come next: free the helper's core */
        team_release();
    } else {
        for (int g = 0; g < groups; g++) quant_chunk(&j, g);
        for (int c = 0; c < nt * rblocks; c++) tile_chunk(&j, c);
    }
    return SGL_OK;
}

int sgl_qgemm_simd(void) {
#ifdef QG_VNNI
    return 1;
#else
    return 0;
#endif
}
