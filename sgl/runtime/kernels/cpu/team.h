/* A team of two threads for the decode kernel: the caller plus one spinning helper.
 *
 * `team_run(fn, arg, n)` runs fn(arg, i) for chunks i = 0..n-1; the caller and the
 * helper claim chunks from a shared counter, so the caller never waits for the helper
 * to start: if the helper is descheduled (a loaded machine), the caller simply does
 * every chunk, and waits at most for the one chunk the helper holds. The helper spins
 * between jobs (the gaps inside a decode step are microseconds; waking a sleeping thread
 * costs tens at each of the ~120 products of a step) and sleeps on a condition variable
 * after ~0.2 ms without work, so the core is free between steps and an idle server burns
 * no CPU. One caller at
 * a time: `team_acquire` fails (run single-threaded) if another thread holds the team.
 * A forked child starts without a helper and makes a new one.
 */
#pragma once

typedef void (*team_fn)(void *arg, int chunk);

int team_acquire(void); /* 1 if this thread may use the team now */
void team_release(void);
void team_run(team_fn fn, void *arg, int nchunks);
/* 0 on the caller's thread, 1 on the helper: which half of a per-lane scratch a chunk uses. */
int team_lane(void);
/* Let the helper sleep right away after the current job (the caller's next work is
 * someone else's threads, e.g. torch's GEMMs, which need the core). */
void team_rest(void);
