/* The two-thread team declared in team.h (pthreads and C11 atomics).
 *
 * `ticket` packs the job number (high 32 bits) and the next unclaimed chunk (low 32):
 * a compare-and-swap claims a chunk of the current job only, and the caller does not
 * return from team_run while a claimed chunk is still running.
 *
 * A new job first closes the ticket (next job number, chunk CLOSED), then writes its
 * fn/arg/nchunks, then opens it (chunk 0). Without the closing step a helper that had
 * read the previous job's ticket with every chunk claimed, and was descheduled before
 * reading `nchunks`, could read the NEXT job's larger count, win the compare-and-swap
 * on the stale ticket and run a chunk with the next job's fn on a half-written job,
 * then count it as finished, so the caller could return while one of its chunks was
 * still writing (the SIGSEGV of issue #19 needed a loaded machine to open that window).
 * With it, any ticket a helper can still win belongs to a job whose fields are fixed.
 */
#include "team.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#if defined(__x86_64__)
#include <immintrin.h>
#define SPIN_PAUSE() _mm_pause()
#else
#define SPIN_PAUSE() ((void)0)
#endif

/* ~0.2 ms of pause instructions before the helper sleeps: longer than any gap inside a
 * decode step, shorter than the scheduler's work between steps (the core is then free). */
#define IDLE_SPINS 8000
#define CLOSED 0xffffffffu /* a chunk index no job has: nothing can be claimed */

#ifdef SGL_TEAM_RACE_WINDOW
/* Tests only: short, varying pauses where a descheduled thread used to open the race
 * (see the top): the helper between reading the ticket and claiming from it, the
 * caller between writing a job's fields and opening its ticket. */
static _Thread_local unsigned race_seed = 12345;
#define RACE_WINDOW()                                                           \
    do {                                                                        \
        race_seed = race_seed * 1103515245u + 12345u;                           \
        for (unsigned i_ = 0; i_ < ((race_seed >> 16) & 255u); i_++) SPIN_PAUSE(); \
    } while (0)
#else
#define RACE_WINDOW() ((void)0)
#endif

static struct {
    pthread_mutex_t use; /* held by the thread running a step */
    pthread_mutex_t mu;  /* guards the helper's sleep */
    pthread_cond_t cv;
    _Atomic uint64_t ticket; /* job << 32 | next chunk; chunk CLOSED while a job is set up */
    atomic_int finished; /* chunks of the current job done, by either thread */
    atomic_int sleeping;
    atomic_int rest; /* sleep now instead of spinning: other threads want the core next */
    int started;
    /* Written by the caller only while the ticket is CLOSED; read after claiming. */
    team_fn fn;
    void *arg;
    atomic_int nchunks;
} T = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER};

/* Claim and run chunks of job `job` until none are left (or the job changed). */
static void work(uint32_t job) {
    for (;;) {
        uint64_t t = atomic_load_explicit(&T.ticket, memory_order_acquire);
        RACE_WINDOW();
        uint32_t chunk = (uint32_t)t;
        if ((uint32_t)(t >> 32) != job || chunk == CLOSED ||
            chunk >= (uint32_t)atomic_load_explicit(&T.nchunks, memory_order_acquire))
            return;
        if (!atomic_compare_exchange_weak_explicit(&T.ticket, &t, t + 1, memory_order_acq_rel,
                                                   memory_order_relaxed))
            continue;
        T.fn(T.arg, (int)chunk);
        atomic_fetch_add_explicit(&T.finished, 1, memory_order_release);
    }
}

/* The job of an open ticket that the helper has not worked on yet, or 0. */
static uint32_t new_job(uint64_t t, uint32_t seen) {
    uint32_t job = (uint32_t)(t >> 32);
    return job != seen && (uint32_t)t != CLOSED ? job : 0;
}

static _Thread_local int lane; /* 1 on the helper thread */

int team_lane(void) { return lane; }

static void *helper(void *unused) {
    (void)unused;
    lane = 1;
    uint32_t seen = (uint32_t)(atomic_load(&T.ticket) >> 32);
    for (;;) {
        int spins = 0;
        uint32_t job;
        while (!(job = new_job(atomic_load_explicit(&T.ticket, memory_order_acquire), seen))) {
            if (++spins < IDLE_SPINS && !atomic_load_explicit(&T.rest, memory_order_relaxed)) {
                SPIN_PAUSE();
                continue;
            }
            /* sleeping and ticket are both seq_cst on both sides (Dekker): either the
             * caller sees sleeping = 1 and signals, or this thread sees the new job. */
            pthread_mutex_lock(&T.mu);
            atomic_store(&T.sleeping, 1);
            while (!new_job(atomic_load(&T.ticket), seen)) pthread_cond_wait(&T.cv, &T.mu);
            atomic_store(&T.sleeping, 0);
            pthread_mutex_unlock(&T.mu);
            spins = 0;
        }
        seen = job;
        work(job);
    }
    return NULL;
}

static void after_fork_child(void) {
    T.started = 0; /* the helper thread did not survive the fork */
    pthread_mutex_init(&T.use, NULL);
    pthread_mutex_init(&T.mu, NULL);
    pthread_cond_init(&T.cv, NULL);
}

int team_acquire(void) {
    if (pthread_mutex_trylock(&T.use) != 0) return 0;
    if (!T.started) {
        static int atfork_set = 0;
        if (!atfork_set) atfork_set = pthread_atfork(NULL, NULL, after_fork_child) == 0;
        pthread_t th;
        pthread_attr_t at;
        pthread_attr_init(&at);
        pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
        int ok = pthread_create(&th, &at, helper, NULL) == 0;
        pthread_attr_destroy(&at);
        if (!ok) {
            pthread_mutex_unlock(&T.use);
            return 0;
        }
        T.started = 1;
    }
    return 1;
}

void team_release(void) { pthread_mutex_unlock(&T.use); }

void team_rest(void) { atomic_store_explicit(&T.rest, 1, memory_order_relaxed); }

void team_run(team_fn fn, void *arg, int nchunks) {
    uint32_t job = (uint32_t)(atomic_load(&T.ticket) >> 32) + 1;
    job += job == 0; /* 0 means "no job" to new_job */
    /* Close first: a helper holding the previous ticket now fails its compare-and-swap
     * whatever it reads below (see the top); an idle helper waits for the ticket to open. */
    atomic_store(&T.ticket, (uint64_t)job << 32 | CLOSED);
    T.fn = fn;
    T.arg = arg;
    atomic_store_explicit(&T.nchunks, nchunks, memory_order_relaxed);
    atomic_store_explicit(&T.rest, 0, memory_order_relaxed);
    atomic_store_explicit(&T.finished, 0, memory_order_relaxed);
    RACE_WINDOW();
    atomic_store(&T.ticket, (uint64_t)job << 32); /* seq_cst: ordered before the sleeping load */
    if (atomic_load(&T.sleeping)) {
        pthread_mutex_lock(&T.mu);
        pthread_cond_signal(&T.cv);
        pthread_mutex_unlock(&T.mu);
    }
    work(job);
    while (atomic_load_explicit(&T.finished, memory_order_acquire) < nchunks) SPIN_PAUSE();
}
