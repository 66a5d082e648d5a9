/* Fused elementwise ops of the bf16 Llama forward on the CPU (prefill and wide batches).
 *
 * Between its matmuls a decoder layer runs a chain of small torch ops: RMSNorm (a float32
 * up-cast, the norm, a down-cast, the weight product), RoPE (flip, two products, a sum),
 * SiLU times up, residual adds. Each is a pass over memory plus dispatch; here each group
 * is one pass per row: `sgl_ops_rmsnorm`, `sgl_ops_add_rmsnorm` (the residual add fused
 * with the norm that follows it), `sgl_ops_rope` (in place on the q and k heads of the
 * fused qkv rows) and `sgl_ops_silu_mul`.
 *
 * The row kernels (rows.h) round as the torch expressions they replace, so RoPE,
 * SiLU*up, the adds and the norms give the same bits. Here rows are split across the
 * two-thread team (team.c) when a call has enough work. All bf16 tensors are contiguous
 * except the qkv rows of RoPE, which take a row stride (sgl_kernels.h).
 */
#include "rows.h"
#include "sgl_kernels.h"
#include "team.h"

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
#ifdef SGL_ROWS_SIMD
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

/* RoPE in place on the first nh heads (size d) of each row of qkv, with the cos/sin
 * tables at positions[r]. Changes nothing if a position is outside [0, max_pos). */
sgl_status sgl_ops_rope(const sgl_rope_params *p) {
    for (int r = 0; r < p->rows; r++)
        if (p->positions[r] < 0 || p->positions[r] >= p->max_pos) return SGL_ERR_POSITION_OUT_OF_RANGE;
    OpsJob j = {.fn = rope_rows, .rows = p->rows, .x = p->qkv, .cs = p->cos_t, .sn = p->sin_t,
                .pos = p->positions, .stride = p->stride, .nh = p->nh, .d = p->d};
    run(&j, (int64_t)p->rows * p->nh * p->d, p->threads);
    return SGL_OK;
}

/* out[r] = bf16(bf16(silu(g)) * u) where row r of gu is [g (n), u (n)]. */
void sgl_ops_silu_mul(const bf16 *gu, bf16 *out, int rows, int n, int threads) {
    /* silu's exp and division cost several adds' worth per element: split earlier */
    OpsJob j = {.fn = silu_rows, .rows = rows, .y = gu, .out = out, .n = n};
    run(&j, (int64_t)rows * n * 4, threads);
}
