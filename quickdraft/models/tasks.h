/* How the threads of a weight-streaming kernel share its tasks (runs of output columns).
 *
 * The tasks are cut into one contiguous segment per thread; each thread walks its own segment front to back,
 * claiming CLAIM_TASKS at a time from the segment's counter, and when it is done it claims from the fronts of the
 * other segments. So every thread reads one long run of weight rows (what the prefetchers follow), and no thread
 * idles at the closing barrier while another still has tasks. Why not OpenMP's schedules: with a static split two
 * threads that read memory at unequal rates (their share of the bandwidth varies from moment to moment) wait for
 * each other at every call, a tenth of a decode step; dynamic chunks interleave the threads through one run of
 * rows, which the prefetchers follow worse (docs/MEASUREMENTS.md, "Kernels").
 *
 * Which thread computes a task never changes its result: a task's outputs are computed by one thread with the
 * same operations whatever the thread count.
 *
 *     task_front fronts[MAX_TASK_THREADS];
 *     const int threads = task_fronts_reset(fronts);
 *     #pragma omp parallel num_threads(threads)
 *     {
 *         task_cursor cursor = task_cursor_start(fronts, ntasks);
 *         int t0, t1;
 *         while (task_claim(&cursor, &t0, &t1))
 *             for (int task = t0; task < t1; task++) ...
 *     }
 */
#ifndef QUICKDRAFT_TASKS_H
#define QUICKDRAFT_TASKS_H
/* OpenMP's calls, declared here rather than by <omp.h>, whose prototype of omp_pause_resource_all clashes with the
 * weak one of cpu_ops.c */
int omp_get_max_threads(void);
int omp_get_num_threads(void);
int omp_get_thread_num(void);

#define MAX_TASK_THREADS 256
#define CLAIM_TASKS 2 /* a task streams kilobytes: the claim's atomic add is a small part of it */

typedef struct {
    _Alignas(64) int next; /* tasks of the segment claimed so far (each counter on its own cache line) */
} task_front;

typedef struct {
    task_front *fronts;
    int ntasks, threads, me, visited; /* visited: segments walked so far, the thread's own first */
} task_cursor;

/* Zeroes the counters of the threads the next parallel region will have, and returns that count. */
static inline int task_fronts_reset(task_front *fronts) {
    const int max = omp_get_max_threads();
    const int threads = max < 1 ? 1 : max > MAX_TASK_THREADS ? MAX_TASK_THREADS : max;
    for (int i = 0; i < threads; i++) fronts[i].next = 0;
    return threads;
}

/* Called by every thread of the region. */
static inline task_cursor task_cursor_start(task_front *fronts, int ntasks) {
    task_cursor c = {fronts, ntasks, omp_get_num_threads(), omp_get_thread_num(), 0};
    return c;
}

/* The next run [*t0, *t1) of tasks for this thread; 0 when every task is claimed. */
static inline int task_claim(task_cursor *c, int *t0, int *t1) {
    for (; c->visited < c->threads; c->visited++) {
        const int seg = (c->me + c->visited) % c->threads;
        const int lo = (int)((long)seg * c->ntasks / c->threads), hi = (int)((long)(seg + 1) * c->ntasks / c->threads);
        const int start = lo + __atomic_fetch_add(&c->fronts[seg].next, CLAIM_TASKS, __ATOMIC_RELAXED);
        if (start < hi) {
            *t0 = start;
            *t1 = start + CLAIM_TASKS < hi ? start + CLAIM_TASKS : hi;
            return 1;
        }
    }
    return 0;
}
#endif
