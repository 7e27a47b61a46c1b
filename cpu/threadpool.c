/* See threadpool.h. One pool per process, started on first use.
 *
 * Callers: one job at a time. A second thread that calls in (two LLM objects in one process, a
 * user thread beside a running engine) waits on job_lock until the job in flight is done. Not
 * one pool per caller: the pool already has a thread per CPU, so concurrent jobs could only
 * share the same cores (at twice the threads spinning).
 * A range function that calls back in (or a worker) runs the inner job itself, in one range.
 *
 * Ranges, claimed: a job is cut into one range per thread (the cut depends only on n and the
 * thread count) and each range goes to whichever thread claims it first, the caller included. A
 * worker the OS has not run when the job starts (descheduled while it waited: the server's niced
 * tokenizing threads, another process, a noisy neighbour) leaves its range to the others, where a
 * fixed range per thread made every job of the step wait out that worker's time slice: with 4 MB
 * texts tokenized beside it, a 15-token step took 0.1-0.2 s instead of 15 ms. Finer chunks
 * would also cover a worker descheduled in mid-range, but cost a quiet step 3-4% here (4 chunks a
 * thread, SmolLM2 on 2 Zen 4 cores: 256-token prefill 300 against 286 ms, decode 4.9 against
 * 4.7 ms a token): the kernels' ranges keep their weights' blocks whole. What a range computes does
 * not depend on which thread runs it, so the bits stay the same.
 *
 * Waiting (a worker for its next job, the caller for the workers): pure spinning for spin_ns,
 * then sleeping on a condition variable. Never sched_yield(): on a machine whose cores are busy
 * with lower-priority threads (the server's niced tokenizing and grammar threads) a yield hands
 * the core to one of them for its whole time slice, so a layer's ~10 joins cost milliseconds
 * each and a 25 ms step took 170-350 ms while large texts were tokenized.
 *
 * fork(): the child has only the forking thread, none of the workers. The atfork handlers take
 * the locks around fork() (so the child never inherits a job in flight or a held lock) and the
 * child forgets its workers: its first parallel job starts new ones. */
#define _GNU_SOURCE
#include "threadpool.h"

#include "common.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <time.h>

#define MAX_THREADS 256
#define CHUNKS_PER_THREAD 1   /* see the header comment */

/* The claim word of the job in flight: its generation's low 32 bits, its chunk count, the next
 * chunk to hand out. One compare-and-swap claims a chunk of exactly the job it names. */
#define CLAIM(generation, chunks, next) (((uint64_t)(uint32_t)(generation) << 32) | ((uint64_t)(chunks) << 16) | (next))
#define CLAIM_CHUNKS(word) ((int64_t)(((word) >> 16) & 0xffff))
#define CLAIM_NEXT(word) ((int64_t)((word) & 0xffff))

static struct {
    pthread_mutex_t lock;
    pthread_cond_t wake;
    pthread_cond_t done;               /* the caller sleeps on it until the last worker ends */
    int requested, started;            /* threads wanted, workers running (excluding the caller) */
    long long spin_ns;
    atomic_uint_fast64_t generation;   /* bumped for every job */
    atomic_uint_fast64_t claim;        /* CLAIM(generation, chunks, next) of the job in flight */
    atomic_int_fast64_t chunks_done;   /* chunks of the job in flight finished */
    atomic_int sleepers;
    atomic_int caller_asleep;
    ember_range_fn fn;
    void *ctx;
    int64_t n;
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_COND_INITIALIZER, 1, 0, 200000,
          0, 0, 0, 0, 0, 0, 0, 0};

static pthread_mutex_t start_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t job_lock = PTHREAD_MUTEX_INITIALIZER;   /* held by the caller of the job in flight */
static _Thread_local int inside_job;                           /* this thread runs a range of a job */
static uint64_t first_seen[MAX_THREADS];   /* the generation a worker starts from: no job yet for it */

static long long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (long long)t.tv_sec * 1000000000LL + t.tv_nsec;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* Claim and run chunks of the job in flight until none is left. A claim names its job, so a
 * thread that arrives late claims nothing of a job already handed out, nor of the next one by
 * mistake; the job cannot finish (nor fn, ctx, n change) while a claimed chunk still runs. */
static void run_chunks(void) {
    uint64_t word = atomic_load(&pool.claim);
    for (;;) {
        const int64_t chunks = CLAIM_CHUNKS(word), next = CLAIM_NEXT(word);
        if (next >= chunks) return;
        if (!atomic_compare_exchange_weak(&pool.claim, &word, word + 1)) continue;
        const int64_t begin = pool.n * next / chunks, end = pool.n * (next + 1) / chunks;
        if (begin < end) pool.fn(pool.ctx, begin, end);
        if (atomic_fetch_add(&pool.chunks_done, 1) == chunks - 1 && atomic_load(&pool.caller_asleep)) {
            pthread_mutex_lock(&pool.lock);
            pthread_cond_signal(&pool.done);
            pthread_mutex_unlock(&pool.lock);
        }
        word = atomic_load(&pool.claim);
    }
}

/* Spin, then sleep until the generation moves past `seen`. */
static uint64_t wait_for_job(uint64_t seen) {
    long long start = now_ns();
    for (unsigned spins = 0;; spins++) {
        uint64_t generation = atomic_load(&pool.generation);
        if (generation != seen) return generation;
        if ((spins & 63) == 0 && now_ns() - start > pool.spin_ns) break;
        cpu_relax();
    }
    pthread_mutex_lock(&pool.lock);
    atomic_fetch_add(&pool.sleepers, 1);
    uint64_t generation;
    while ((generation = atomic_load(&pool.generation)) == seen) pthread_cond_wait(&pool.wake, &pool.lock);
    atomic_fetch_sub(&pool.sleepers, 1);
    pthread_mutex_unlock(&pool.lock);
    return generation;
}

static void *worker(void *arg) {
    const int index = (int)(intptr_t)arg;
    uint64_t seen = first_seen[index];
    inside_job = 1;
    for (;;) {
        seen = wait_for_job(seen);
        run_chunks();
    }
    return NULL;
}

static void start_workers(void) {
    pthread_mutex_lock(&start_lock);
    const char *spin = getenv("EMBER_SPIN_US");
    if (spin) pool.spin_ns = atoll(spin) * 1000LL;
    while (pool.started + 1 < pool.requested) {
        pthread_t thread;
        first_seen[pool.started + 1] = atomic_load(&pool.generation);
        if (pthread_create(&thread, NULL, worker, (void *)(intptr_t)(pool.started + 1)) != 0) break;
        pthread_detach(thread);
        pool.started++;
    }
    pthread_mutex_unlock(&start_lock);
}

EMBER_EXPORT void ember_set_num_threads(int n) {
    pthread_mutex_lock(&job_lock);
    pool.requested = n < 1 ? 1 : n > MAX_THREADS ? MAX_THREADS : n;
    pthread_mutex_unlock(&job_lock);
}

EMBER_EXPORT int ember_max_threads(void) { return pool.requested; }

/* Spin, then sleep until every chunk is done. (The caller announces its sleep before it looks at
 * `chunks_done`, the thread finishing the last chunk looks at the announcement after it counts:
 * one of the two sees the other, so the caller never sleeps through the last chunk's signal.) */
static void wait_for_chunks(int64_t chunks) {
    long long start = now_ns();
    for (unsigned spins = 0; atomic_load(&pool.chunks_done) < chunks; spins++) {
        if ((spins & 63) == 0 && now_ns() - start > pool.spin_ns) {
            pthread_mutex_lock(&pool.lock);
            atomic_store(&pool.caller_asleep, 1);
            while (atomic_load(&pool.chunks_done) < chunks) pthread_cond_wait(&pool.done, &pool.lock);
            atomic_store(&pool.caller_asleep, 0);
            pthread_mutex_unlock(&pool.lock);
            return;
        }
        cpu_relax();
    }
}

/* The calling thread holds job_lock: publish the job, claim chunks beside the workers, wait for
 * the chunks the workers still run. */
static void run_job(int64_t n, ember_range_fn fn, void *ctx) {
    if (pool.started + 1 < pool.requested) start_workers();
    const int threads = pool.started + 1 < pool.requested ? pool.started + 1 : pool.requested;
    if (threads <= 1 || n <= 1) {
        if (n > 0) fn(ctx, 0, n);
        return;
    }
    const int64_t chunks = n < (int64_t)threads * CHUNKS_PER_THREAD ? n : (int64_t)threads * CHUNKS_PER_THREAD;
    pool.fn = fn;
    pool.ctx = ctx;
    pool.n = n;
    atomic_store(&pool.chunks_done, 0);
    const uint64_t generation = atomic_load(&pool.generation) + 1;
    atomic_store(&pool.claim, CLAIM(generation, chunks, 0));
    atomic_store(&pool.generation, generation);
    if (atomic_load(&pool.sleepers) > 0) {
        pthread_mutex_lock(&pool.lock);
        pthread_cond_broadcast(&pool.wake);
        pthread_mutex_unlock(&pool.lock);
    }
    run_chunks();
    wait_for_chunks(chunks);
}

EMBER_EXPORT void ember_parallel_for(int64_t n, ember_range_fn fn, void *ctx) {
    if (inside_job) {   /* called from a range: the pool is busy with the outer job */
        if (n > 0) fn(ctx, 0, n);
        return;
    }
    pthread_mutex_lock(&job_lock);
    inside_job = 1;
    run_job(n, fn, ctx);
    inside_job = 0;
    pthread_mutex_unlock(&job_lock);
}

/* ---- fork ---------------------------------------------------------------------------------- */
static void before_fork(void) {
    pthread_mutex_lock(&job_lock);
    pthread_mutex_lock(&start_lock);
    pthread_mutex_lock(&pool.lock);
}

static void after_fork_in_parent(void) {
    pthread_mutex_unlock(&pool.lock);
    pthread_mutex_unlock(&start_lock);
    pthread_mutex_unlock(&job_lock);
}

/* The workers did not survive: none started, none pending or asleep (a fresh condition
 * variable: the old one may count the parent's sleepers as waiters). */
static void after_fork_in_child(void) {
    pool.started = 0;
    atomic_store(&pool.sleepers, 0);
    atomic_store(&pool.caller_asleep, 0);
    pool.wake = (pthread_cond_t)PTHREAD_COND_INITIALIZER;
    pool.done = (pthread_cond_t)PTHREAD_COND_INITIALIZER;
    after_fork_in_parent();
}

__attribute__((constructor)) static void register_fork_handlers(void) {
    pthread_atfork(before_fork, after_fork_in_parent, after_fork_in_child);
}
