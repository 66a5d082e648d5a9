/* The C decode step's attention alone (kernels/cpu/decode_attn.c), on SmolLM2-135M's
 * shapes: 30 layers, 9 query heads over 3 K/V heads of 64 dims, bf16 K/V in one pool per
 * layer. Driven by benchmarks/bench_decode_attn.py, which builds it against two versions
 * of the kernel (or runs one build on 4 KB and on 2 MB pages) and interleaves the runs.
 *
 * Usage: decode_attn_bench ROWS CONTEXT SCATTERED THREADS POOL_SLOTS HUGE REPS
 *   SCATTERED 1: each row's slots are drawn at random from the whole pool (a pool after a
 *   while of serving), 2: random pages of 16 slots (the engine's default page size), 0: in
 *   order. HUGE 1: the pool on 2 MB pages (MADV_HUGEPAGE).
 * Prints one line: median_ms min_ms kv_mb output_hash (FNV-1a of the last layer's output
 * bytes, so two versions can be checked for the same bits).
 */
#include "decode_attn.h"
#include "team.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

enum { LAYERS = 30, NH = 9, NKV = 3, D = 64, STEPS = 5 };

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static int by_value(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* n bytes, 2 MB-aligned; advised onto huge pages when `huge`, else off them (THP mode
 * `always` would give them anyway), before the first touch */
static void *pool_alloc(size_t n, int huge) {
    const size_t align = (size_t)2 << 20, size = (n + align - 1) / align * align;
    void *p = aligned_alloc(align, size);
    if (p) madvise(p, size, huge ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
    return p;
}

static uint64_t rng = 88172645463325252ull;
static float unit(void) { /* xorshift64: uniform in [-0.5, 0.5) */
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return (float)(rng >> 40) / 16777216.f - 0.5f;
}

int main(int argc, char **argv) {
    if (argc != 8) {
        fprintf(stderr, "usage: %s ROWS CONTEXT SCATTERED THREADS POOL_SLOTS HUGE REPS\n", argv[0]);
        return 2;
    }
    const int B = atoi(argv[1]), ctx = atoi(argv[2]), scattered = atoi(argv[3]), threads = atoi(argv[4]);
    const int huge = atoi(argv[6]), reps = atoi(argv[7]), qkv_n = (NH + 2 * NKV) * D;
    int64_t slots = (int64_t)B * ctx + 1, pool = atoll(argv[5]);
    if (pool > slots) slots = pool;
    if (B < 1 || ctx < 1 || reps < 1) return 2;
    bf16 *K[LAYERS], *V[LAYERS];
    const int64_t per_layer = slots * NKV * D;
    /* slot 0 is the pool's scratch slot: rows use 1 .. slots - 1 */
    int64_t *order = malloc(sizeof(int64_t) * (slots - 1));
    for (int64_t i = 0; i < slots - 1; i++) order[i] = 1 + i;
    /* shuffled in units of 1 slot (SCATTERED 1) or of 16-slot pages (2: the engine's default page size) */
    const int64_t unit_n = scattered == 2 ? 16 : 1, units = (slots - 1) / unit_n;
    for (int64_t i = units - 1; scattered && i > 0; i--) {
        int64_t j = (int64_t)(((rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17)) % (uint64_t)(i + 1));
        for (int64_t k = 0; k < unit_n; k++) {
            int64_t t = order[i * unit_n + k];
            order[i * unit_n + k] = order[j * unit_n + k], order[j * unit_n + k] = t;
        }
    }
    /* the whole pool zeroed first, as the engine's is (so every page is backed by memory),
     * then the rows' slots filled */
    for (int l = 0; l < LAYERS; l++) {
        K[l] = pool_alloc(sizeof(bf16) * per_layer, huge);
        V[l] = pool_alloc(sizeof(bf16) * per_layer, huge);
        if (!K[l] || !V[l]) return 3;
        memset(K[l], 0, sizeof(bf16) * per_layer), memset(V[l], 0, sizeof(bf16) * per_layer);
        for (int64_t s = 0; s < (int64_t)B * ctx; s++)
            for (int i = 0; i < NKV * D; i++)
                K[l][order[s] * NKV * D + i] = f2bf(unit()), V[l][order[s] * NKV * D + i] = f2bf(unit());
    }
    const int64_t stride = ctx;
    int64_t *r2t = malloc(sizeof(int64_t) * B * stride), *rows = malloc(sizeof(int64_t) * B),
            *lens = malloc(sizeof(int64_t) * B);
    for (int b = 0; b < B; b++) {
        rows[b] = b, lens[b] = ctx;
        for (int j = 0; j < ctx; j++) r2t[b * stride + j] = order[(int64_t)b * ctx + j];
    }
    bf16 *qkv = malloc(sizeof(bf16) * B * qkv_n), *att = malloc(sizeof(bf16) * B * NH * D);
    for (int i = 0; i < B * qkv_n; i++) qkv[i] = f2bf(unit());
    const int blocks = (ctx + KEY_BLOCK - 1) / KEY_BLOCK;
    float *fws = malloc(sizeof(float) * attn_ws_floats(ctx, B, NH, D, NH / NKV));
    double *ms = malloc(sizeof(double) * reps);
    for (int rep = 0; rep < reps; rep++) {
        const int team = threads >= 2 && team_acquire();
        const double t0 = now_s();
        for (int step = 0; step < STEPS; step++)
            for (int l = 0; l < LAYERS; l++) { /* as decode.c runs it */
                AttnJob job = {qkv, K[l], V[l], r2t, rows, lens, stride, qkv_n, NH, NKV, D, blocks, blocks, fws, att};
                if (team) {
                    team_run(attn_block_chunk, &job, B * blocks);
                    if (blocks > 1) team_run(attn_merge_chunk, &job, B * NH);
                } else {
                    for (int c = 0; c < B * blocks; c++) attn_block_chunk(&job, c);
                    for (int c = 0; blocks > 1 && c < B * NH; c++) attn_merge_chunk(&job, c);
                }
            }
        ms[rep] = (now_s() - t0) / STEPS * 1e3;
        if (team) team_release();
    }
    qsort(ms, reps, sizeof(double), by_value);
    uint64_t hash = 1469598103934665603ull;
    const unsigned char *bytes = (const unsigned char *)att;
    for (size_t i = 0; i < sizeof(bf16) * (size_t)B * NH * D; i++) hash = (hash ^ bytes[i]) * 1099511628211ull;
    const double kv_mb = (double)B * ctx * LAYERS * NKV * D * sizeof(bf16) * 2 / 1e6;
    printf("%.4f %.4f %.2f %016llx\n", ms[reps / 2], ms[0], kv_mb, (unsigned long long)hash);
    return 0;
}
