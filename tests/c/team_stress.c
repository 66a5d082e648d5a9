/* Stress driver for kernels/cpu/team.c: runs many jobs of varying chunk counts through
 * team_run and checks the team's contract:
 *   - every chunk of a job runs exactly once, with that job's arguments;
 *   - no chunk is still running (or starts) after team_run has returned.
 * A job's argument lives on the caller's stack frame, as in the kernels, and is
 * poisoned right after team_run returns; chunks check it on entry and exit.
 * Usage: team_stress JOBS SEED. Prints "jobs N violations V" and exits 1 if V > 0.
 */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>

#include "team.h"

#define MAX_CHUNKS 64

typedef struct {
    atomic_int live; /* 1 while the job is inside team_run */
    int job;
    int nchunks;
    atomic_int runs[MAX_CHUNKS];
} Job;

static atomic_long violations;

static void chunk(void *arg, int c) {
    Job *j = (Job *)arg;
    if (atomic_load(&j->live) != 1 || c < 0 || c >= j->nchunks) {
        atomic_fetch_add(&violations, 1);
        return;
    }
    atomic_fetch_add(&j->runs[c], 1);
    for (volatile int i = 0; i < (c * 7 + j->job) % 200; i++) { /* uneven chunk lengths */
    }
    if (atomic_load(&j->live) != 1) atomic_fetch_add(&violations, 1); /* caller returned early */
}

static void run_one(int job, int nchunks) {
    Job j;
    atomic_store(&j.live, 1);
    j.job = job;
    j.nchunks = nchunks;
    for (int c = 0; c < MAX_CHUNKS; c++) atomic_store(&j.runs[c], 0);
    team_run(chunk, &j, nchunks);
    atomic_store(&j.live, 0);
    for (int c = 0; c < nchunks; c++)
        if (atomic_load(&j.runs[c]) != 1) atomic_fetch_add(&violations, 1);
    for (int c = nchunks; c < MAX_CHUNKS; c++)
        if (atomic_load(&j.runs[c]) != 0) atomic_fetch_add(&violations, 1);
}

int main(int argc, char **argv) {
    long jobs = argc > 1 ? atol(argv[1]) : 100000;
    unsigned seed = argc > 2 ? (unsigned)atoi(argv[2]) : 1;
    if (!team_acquire()) {
        fprintf(stderr, "could not acquire the team\n");
        return 2;
    }
    for (long i = 0; i < jobs; i++) {
        /* alternate small and larger jobs: a helper's stale view of a small job must
         * never let it claim from the next, larger one */
        int n = (i & 1) ? 1 + (int)(rand_r(&seed) % 4) : 8 + (int)(rand_r(&seed) % (MAX_CHUNKS - 8));
        run_one((int)i, n);
        if (i % 1000 == 999) team_rest(); /* exercise the sleep / wake path too */
    }
    team_release();
    long v = atomic_load(&violations);
    printf("jobs %ld violations %ld\n", jobs, v);
    return v > 0;
}
