/* The two-thread team declared in team.h (pthreads and C11 atomics).
 *
 * `ticket` packs the job number (high 32 bits) and the next unclaimed chunk (low 32):
 * a compare-and-swap claims a chunk of the current job only, so a helper that wakes
 * late can never touch a finished job's arguments (the caller does not return from
 * team_run while a claimed chunk is still running).
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

static struct {
    pthread_mutex_t use; /* held by the thread running a step */
    pthread_mutex_t mu;  /* guards the helper's sleep */
    pthread_cond_t cv;
    _Atomic uint64_t ticket;
    atomic_int finished; /* chunks of the current job done, by either thread */
    atomic_int sleeping;
    atomic_int rest; /* sleep now instead of spinning: other threads want the core next */
    int started;
    team_fn fn;
    void *arg;
    int nchunks;
} T = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER};

/* Claim and run chunks of job `job` until none are left (or the job changed). */
static void work(uint32_t job) {
    for (;;) {
        uint64_t t = atomic_load_explicit(&T.ticket, memory_order_acquire);
        if ((uint32_t)(t >> 32) != job || (int)(uint32_t)t >= T.nchunks) return;
        if (!atomic_compare_exchange_weak_explicit(&T.ticket, &t, t + 1, memory_order_acq_rel,
                                                   memory_order_relaxed))
            continue;
        T.fn(T.arg, (int)(uint32_t)t);
        atomic_fetch_add_explicit(&T.finished, 1, memory_order_release);
    }
}

static void *helper(void *unused) {
    (void)unused;
    uint32_t seen = (uint32_t)(atomic_load(&T.ticket) >> 32);
    for (;;) {
        int spins = 0;
        uint32_t job;
        while ((job = (uint32_t)(atomic_load_explicit(&T.ticket, memory_order_acquire) >> 32)) == seen) {
            if (++spins < IDLE_SPINS && !atomic_load_explicit(&T.rest, memory_order_relaxed)) {
                SPIN_PAUSE();
                continue;
            }
            pthread_mutex_lock(&T.mu);
            atomic_store(&T.sleeping, 1);
            while ((uint32_t)(atomic_load(&T.ticket) >> 32) == seen) pthread_cond_wait(&T.cv, &T.mu);
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
    T.fn = fn;
    T.arg = arg;
    T.nchunks = nchunks;
    atomic_store_explicit(&T.rest, 0, memory_order_relaxed);
    atomic_store_explicit(&T.finished, 0, memory_order_relaxed);
    uint32_t job = (uint32_t)(atomic_load(&T.ticket) >> 32) + 1;
    atomic_store_explicit(&T.ticket, (uint64_t)job << 32, memory_order_release);
    if (atomic_load(&T.sleeping)) {
        pthread_mutex_lock(&T.mu);
        pthread_cond_signal(&T.cv);
        pthread_mutex_unlock(&T.mu);
    }
    work(job);
    while (atomic_load_explicit(&T.finished, memory_order_acquire) < nchunks) SPIN_PAUSE();
}
