/* Fused elementwise ops of the bf16 Llama forward on the CPU (prefill and wide batches).
 *
 * Between its matmuls a decoder layer runs a chain of small torch ops: RMSNorm (a float32
 * up-cast, the norm, a down-cast, the weight product), RoPE (flip, two products, a sum),
 * SiLU times up, residual adds. Each is a pass over memory plus dispatch; here each group
 * is one pass per row: `sgl_ops_rmsnorm`, `sgl_ops_add_rmsnorm` (the residual add fused
 * with the norm that follows it), `sgl_ops_rope` (in place on the q and k heads of the
 * fused qkv rows) and `sgl_ops_silu_mul`.
 *
 * Rounding follows the torch expressions they replace: every intermediate that torch
 * materializes as a bf16 tensor is rounded to bf16 here too (round to nearest even), so
 * RoPE, SiLU*up, the adds and (summing in torch's order, see sumsq) the norms give the
 * same bits. (The vector conversion flushes float32 denormals, which activations never
 * are.) Rows are split across the two-thread team (team.c) when a call has enough work.
 * All bf16 tensors are passed as uint16_t; all are contiguous except the qkv rows of
 * RoPE, which take a row stride.
 */
#include "simd.h"
#include "team.h"

#include <math.h>
#if defined(SGL_BF16_SIMD) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define OPS_SIMD 1
#endif

static inline float ops_silu(float g) { return g / (1.0f + expf(-g)); }

#ifdef OPS_SIMD
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

static float sumsq(const bf16 *x, int n) {
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
static void norm_row(bf16 *x, const bf16 *y, const bf16 *w, int n, float eps, bf16 *out) {
#ifdef OPS_SIMD
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
static void rope_row(bf16 *v, int nh, int d, const bf16 *cs, const bf16 *sn) {
    int h2 = d / 2;
    for (int h = 0; h < nh; h++, v += d) {
#ifdef OPS_SIMD
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
static void silu_mul_row(const bf16 *gu, int n, bf16 *out) {
    const bf16 *u = gu + n;
#ifdef OPS_SIMD
    for (int k = 0; k < n; k += 16) {
        __mmask16 m = lanes(n - k);
        __m512 g = ld(gu + k, m);
        __m512 s = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp512(_mm512_sub_ps(_mm512_setzero_ps(), g))));
        st(out + k, _mm512_mul_ps(rnd(s), ld(u + k, m)), m);
    }
#else
    for (int k = 0; k < n; k++) out[k] = f2bf(rf(ops_silu(bf2f(gu[k]))) * bf2f(u[k]));
#endif
}

/* ---- rows split across the team ------------------------------------------------------ */

typedef struct OpsJob OpsJob;
typedef void (*rows_fn)(const OpsJob *j, int lo, int hi);

struct OpsJob {
    rows_fn fn;
    int rows, chunk;
    bf16 *x;
    const bf16 *y, *w, *cs, *sn;
    bf16 *out;
    const int64_t *pos;
    int64_t stride;
    int n, nh, d;
    float eps;
};

/* Below this many elements a call runs on the caller alone: handing chunks to the helper
 * costs a few microseconds, about what one thread needs for ~16k elements. */
#define SPLIT_MIN_ELEMS 16384
#define CHUNKS 16 /* per call, so a late or preempted helper leaves little to wait for */

static void run_chunk(void *arg, int c) {
    const OpsJob *j = (const OpsJob *)arg;
    int lo = c * j->chunk, hi = lo + j->chunk < j->rows ? lo + j->chunk : j->rows;
    if (lo < hi) j->fn(j, lo, hi);
}

static void run(OpsJob *j, int64_t elems, int threads) {
    if (threads >= 2 && j->rows >= 2 && elems >= SPLIT_MIN_ELEMS && team_acquire()) {
        j->chunk = (j->rows + CHUNKS - 1) / CHUNKS;
        team_run(run_chunk, j, (j->rows + j->chunk - 1) / j->chunk);
        team_rest(); /* torch's GEMM threads come next: the helper must not spin on their core */
        team_release();
        return;
    }
    j->fn(j, 0, j->rows);
}

static void norm_rows(const OpsJob *j, int lo, int hi) {
    for (int r = lo; r < hi; r++)
        norm_row(j->x + (int64_t)r * j->n, j->y ? j->y + (int64_t)r * j->n : 0, j->w, j->n, j->eps,
                 j->out ? j->out + (int64_t)r * j->n : 0);
}

static void rope_rows(const OpsJob *j, int lo, int hi) {
    int h2 = j->d / 2;
    for (int r = lo; r < hi; r++)
        rope_row(j->x + r * j->stride, j->nh, j->d, j->cs + j->pos[r] * h2, j->sn + j->pos[r] * h2);
}

static void silu_rows(const OpsJob *j, int lo, int hi) {
    for (int r = lo; r < hi; r++) silu_mul_row(j->y + (int64_t)r * 2 * j->n, j->n, j->out + (int64_t)r * j->n);
}

/* ---- exported ------------------------------------------------------------------------- */

int sgl_ops_simd(void) {
#ifdef OPS_SIMD
    return 1;
#else
    return 0;
#endif
}

/* out[r] = RMSNorm(x[r]) * w for `rows` rows of n. */
void sgl_ops_rmsnorm(const bf16 *x, const bf16 *w, bf16 *out, int rows, int n, float eps, int threads) {
    OpsJob j = {.fn = norm_rows, .rows = rows, .x = (bf16 *)x, .w = w, .out = out, .n = n, .eps = eps};
    run(&j, (int64_t)rows * n, threads);
}

/* x[r] = bf16(x[r] + y[r]) in place, then (unless out is NULL) out[r] = RMSNorm(x[r]) * w. */
void sgl_ops_add_rmsnorm(bf16 *x, const bf16 *y, const bf16 *w, bf16 *out, int rows, int n, float eps,
                         int threads) {
    OpsJob j = {.fn = norm_rows, .rows = rows, .x = x, .y = y, .w = w, .out = out, .n = n, .eps = eps};
    run(&j, (int64_t)rows * n, threads);
}

/* RoPE in place on the first nh heads (size d) of each row of qkv (row stride in elements),
 * with the [max_pos, d/2] cos/sin tables at positions[r]. Returns -1 (and changes nothing)
 * if a position is outside [0, max_pos). */
int sgl_ops_rope(bf16 *qkv, int64_t stride, int rows, int nh, int d, const bf16 *cos_t, const bf16 *sin_t,
                 const int64_t *positions, int64_t max_pos, int threads) {
    for (int r = 0; r < rows; r++)
        if (positions[r] < 0 || positions[r] >= max_pos) return -1;
    OpsJob j = {.fn = rope_rows, .rows = rows, .x = qkv, .cs = cos_t, .sn = sin_t, .pos = positions,
                .stride = stride, .nh = nh, .d = d};
    run(&j, (int64_t)rows * nh * d, threads);
    return 0;
}

/* out[r] = bf16(bf16(silu(g)) * u) where row r of gu is [g (n), u (n)]. */
void sgl_ops_silu_mul(const bf16 *gu, bf16 *out, int rows, int n, int threads) {
    /* silu's exp and division cost several adds' worth per element: split earlier */
    OpsJob j = {.fn = silu_rows, .rows = rows, .y = gu, .out = out, .n = n};
    run(&j, (int64_t)rows * n * 4, threads);
}
