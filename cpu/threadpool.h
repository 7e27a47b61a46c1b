/* The host kernels' thread pool: the calling thread plus (threads - 1) workers that spin briefly
 * between calls (kernels come back to back within a step) and sleep once idle for EMBER_SPIN_US
 * microseconds (default 200). Callers from several threads take turns (one job at a time); a
 * fork()ed child starts its own workers on first use. */
#ifndef EMBER_CPU_THREADPOOL_H
#define EMBER_CPU_THREADPOOL_H

#include <stdint.h>

typedef void (*ember_range_fn)(void *ctx, int64_t begin, int64_t end);

/* fn(ctx, begin, end) over [0, n) split into one contiguous range per thread, each run once, by
 * whichever thread of the pool claims it first (a late worker's range goes to a thread that is
 * free); returns when all ranges are done. The split depends only on n and the thread count. */
void ember_parallel_for(int64_t n, ember_range_fn fn, void *ctx);

/* Threads of the pool, the caller included. */
int ember_max_threads(void);

#endif
