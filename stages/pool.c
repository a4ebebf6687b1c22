/* The worker threads of our kernels (qmatmul.c, attention.c).
 *
 * Why not OpenMP: two stages often share a node's cores, computing in turn. libgomp's
 * idle workers spin a fixed count before they sleep, through the other stage's step,
 * and that stage's team then waits at every barrier for a thread whose core is taken:
 * a 2-stage decode ran 1.4-2x one stage's time (evals/README.md, torch runtime). Here an
 * idle worker spins for at most SPIN_NS and yields the core while it spins, so a step of
 * another process on the same core runs at once; then it sleeps.
 *
 * Work is split into `threads` contiguous ranges of items (shares), and a share is
 * claimed, not assigned: the caller and the workers take the next unclaimed one until
 * none is left, and the caller waits only for shares a thread has begun. A worker whose
 * core another process holds therefore never holds up a call: the caller runs its share
 * (with 2 xdist workers of 2 threads on 2 cores, test_family_bar + test_certify took 586 s
 * when each call waited for its second thread). An item's result never depends on which
 * thread, or how many, computed it: one thread may run every share (fn over [0, items)
 * gives the same bits, skp_run's inline path below). */

#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>

#define MAX_THREADS 64
#define SPIN_NS 100000 /* an idle worker yields and polls this long before it sleeps */

typedef void (*task_fn)(void *arg, int64_t begin, int64_t end);

static struct {
    pthread_mutex_t lock;
    pthread_cond_t wake;
    int started;                  /* workers running */
    atomic_uint_fast64_t gen;     /* bumped for each job */
    atomic_int sleepers;          /* workers in cond_wait */
    /* the current job's claims: job number << 32 | shares << 16 | next unclaimed share;
     * a claim is a compare-and-swap of the whole word, so a thread late from an earlier
     * job can never take a share of a later one */
    atomic_uint_fast64_t claims;
    atomic_int done;              /* shares of the current job finished */
    atomic_flag busy;             /* a job is running (a second caller runs inline) */
    task_fn fn;
    void *arg;
    int64_t items;
    int threads;
} P = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0, 0, 0, 0, ATOMIC_FLAG_INIT,
       0, 0, 0, 0};

static int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static void run_share(int i)
{
    const int64_t b = P.items * i / P.threads, e = P.items * (i + 1) / P.threads;
    if (b < e)
        P.fn(P.arg, b, e);
}

/* Run unclaimed shares of the current job until none is left. */
static void claim_shares(void)
{
    for (;;) {
        uint_fast64_t c = atomic_load(&P.claims);
        const int next = (int)(c & 0xffff), shares = (int)((c >> 16) & 0xffff);
        if (next >= shares)
            return;
        if (atomic_compare_exchange_weak(&P.claims, &c, c + 1)) {
            run_share(next); /* the job's fields stay until every share is done */
            atomic_fetch_add(&P.done, 1);
        }
    }
}

static uint_fast64_t born_at[MAX_THREADS]; /* the job count when each worker was made */

static void *worker(void *index)
{
    const int i = (int)(intptr_t)index;
    uint_fast64_t seen = born_at[i]; /* so a job bumped before it ran is still seen */
    for (;;) {
        const int64_t t0 = now_ns();
        while (atomic_load(&P.gen) == seen && now_ns() - t0 < SPIN_NS)
            sched_yield();
        if (atomic_load(&P.gen) == seen) {
            pthread_mutex_lock(&P.lock);
            atomic_fetch_add(&P.sleepers, 1);
            while (atomic_load(&P.gen) == seen)
                pthread_cond_wait(&P.wake, &P.lock);
            atomic_fetch_sub(&P.sleepers, 1);
            pthread_mutex_unlock(&P.lock);
        }
        seen = atomic_load(&P.gen);
        claim_shares();
    }
    return 0;
}

/* A forked child has none of the parent's workers. */
static void forked(void)
{
    pthread_mutex_init(&P.lock, 0);
    pthread_cond_init(&P.wake, 0);
    P.started = 0;
    atomic_store(&P.sleepers, 0);
    atomic_flag_clear(&P.busy);
}

/* Workers 1 .. n - 1 (the caller is thread 0); fewer when threads cannot be made. */
static int ensure_workers(int n)
{
    static int hooked;
    if (!hooked)
        hooked = !pthread_atfork(0, 0, forked);
    while (P.started < n - 1) {
        pthread_t t;
        born_at[P.started + 1] = atomic_load(&P.gen);
        if (pthread_create(&t, 0, worker, (void *)(intptr_t)(P.started + 1)))
            break;
        pthread_detach(t);
        P.started++;
    }
    return P.started + 1;
}

/* fn(arg, begin, end) over [0, items) in `threads` ranges; returns when all are done. */
void skp_run(int threads, int64_t items, task_fn fn, void *arg)
{
    threads = threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : threads;
    if (threads > items)
        threads = (int)(items > 0 ? items : 1);
    if (threads == 1 || atomic_flag_test_and_set(&P.busy)) {
        if (items > 0)
            fn(arg, 0, items); /* same items, same results: only the split differs */
        return;
    }
    threads = ensure_workers(threads) < threads ? P.started + 1 : threads;
    static uint_fast64_t job;
    P.fn = fn, P.arg = arg, P.items = items, P.threads = threads;
    atomic_store(&P.done, 0);
    atomic_store(&P.claims, (++job & 0xffffffffu) << 32 | (uint_fast64_t)threads << 16);
    atomic_fetch_add(&P.gen, 1);
    if (atomic_load(&P.sleepers) > 0) {
        pthread_mutex_lock(&P.lock);
        pthread_cond_broadcast(&P.wake);
        pthread_mutex_unlock(&P.lock);
    }
    claim_shares();
    while (atomic_load(&P.done) < threads) /* only shares a worker has begun */
        sched_yield();
    atomic_flag_clear(&P.busy);
}
