/* A small pool of worker threads for ssd_matmul: the calling thread takes the first share of the tiles, each
 * worker one more. Workers poll for the next job for spin_us microseconds, then sleep on a condition variable. */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <time.h>
#include <immintrin.h>
#include "ssd_kernels.h"

typedef struct {
    int count;
    const ssd_weight *const *w;
    const ssd_act *a;
    float *y;
    int64_t ldy;
    const int64_t *col_offset;
    int total_tiles;
} job;

typedef struct {
    ssd_pool *pool;
    int index;
    int core;
} worker_arg;

struct ssd_pool {
    const ssd_isa *isa;
    int threads, spin_us;
    pthread_t *workers;
    worker_arg *args;
    pthread_mutex_t mutex;
    pthread_cond_t wake;
    atomic_uint generation;     /* bumped once per job */
    atomic_int pending;         /* workers still on the current job */
    atomic_int sleeping;
    int stop;
    job current;
};

static int tiles_of(const ssd_weight *w) { return (w->n + SSD_TILE - 1) / SSD_TILE; }

/* share `part` of `parts` of the job's tiles, the weights' tiles taken as one sequence */
static void run_share(const ssd_isa *isa, const job *jb, int part, int parts) {
    const int begin = (int)((int64_t)jb->total_tiles * part / parts);
    const int end = (int)((int64_t)jb->total_tiles * (part + 1) / parts);
    int first = 0;
    for (int i = 0; i < jb->count && first < end; i++) {
        const int tiles = tiles_of(jb->w[i]);
        const int lo = begin > first ? begin - first : 0, hi = end - first < tiles ? end - first : tiles;
        if (lo < hi)
            isa->matmul_tiles(jb->w[i], jb->a, jb->y + jb->col_offset[i], jb->ldy, lo, hi);
        first += tiles;
    }
}

static double now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e6 + ts.tv_nsec * 1e-3;
}

static void *worker_main(void *p) {
    worker_arg *arg = p;
    ssd_pool *pool = arg->pool;
    if (arg->core >= 0) {
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(arg->core, &set);
        pthread_setaffinity_np(pthread_self(), sizeof set, &set);
    }
    unsigned seen = 0;
    for (;;) {
        const double start = now_us();
        unsigned gen;
        while ((gen = atomic_load_explicit(&pool->generation, memory_order_acquire)) == seen) {
            if (now_us() - start < pool->spin_us) {
                _mm_pause();
                continue;
            }
            pthread_mutex_lock(&pool->mutex);
            atomic_fetch_add(&pool->sleeping, 1);
            while (atomic_load(&pool->generation) == seen && !pool->stop)
                pthread_cond_wait(&pool->wake, &pool->mutex);
            atomic_fetch_sub(&pool->sleeping, 1);
            pthread_mutex_unlock(&pool->mutex);
        }
        seen = gen;
        if (pool->stop)
            return NULL;
        run_share(pool->isa, &pool->current, arg->index, pool->threads);
        atomic_fetch_sub_explicit(&pool->pending, 1, memory_order_release);
    }
}

ssd_pool *ssd_pool_create(const ssd_isa *isa, int threads, const int *cores, int spin_us) {
    if (!isa || threads < 1)
        return NULL;
    ssd_pool *pool = calloc(1, sizeof *pool);
    pool->isa = isa;
    pool->threads = threads;
    pool->spin_us = spin_us;
    pthread_mutex_init(&pool->mutex, NULL);
    pthread_cond_init(&pool->wake, NULL);
    pool->workers = calloc(threads, sizeof *pool->workers);
    pool->args = calloc(threads, sizeof *pool->args);
    for (int i = 1; i < threads; i++) {
        pool->args[i] = (worker_arg){pool, i, cores ? cores[i] : -1};
        pthread_create(&pool->workers[i], NULL, worker_main, &pool->args[i]);
    }
    return pool;
}

void ssd_pool_destroy(ssd_pool *pool) {
    if (!pool)
        return;
    pthread_mutex_lock(&pool->mutex);
    pool->stop = 1;
    atomic_fetch_add(&pool->generation, 1);
    pthread_cond_broadcast(&pool->wake);
    pthread_mutex_unlock(&pool->mutex);
    for (int i = 1; i < pool->threads; i++)
        pthread_join(pool->workers[i], NULL);
    pthread_mutex_destroy(&pool->mutex);
    pthread_cond_destroy(&pool->wake);
    free(pool->workers);
    free(pool->args);
    free(pool);
}

const char *ssd_pool_path(const ssd_pool *pool) { return pool->isa->name; }
int ssd_pool_threads(const ssd_pool *pool) { return pool->threads; }

void ssd_quantize(ssd_pool *pool, const float *x, int64_t ldx, ssd_act *a) { pool->isa->quantize(x, ldx, a); }

void ssd_matmul(ssd_pool *pool, int count, const ssd_weight *const *w, const ssd_act *a, float *y, int64_t ldy,
                const int64_t *col_offset) {
    job jb = {count, w, a, y, ldy, col_offset, 0};
    for (int i = 0; i < count; i++)
        jb.total_tiles += tiles_of(w[i]);
    if (pool->threads == 1) {
        run_share(pool->isa, &jb, 0, 1);
        return;
    }
    pool->current = jb;
    atomic_store(&pool->pending, pool->threads - 1);
    atomic_fetch_add(&pool->generation, 1);   /* seq_cst: ordered before the read of sleeping */
    if (atomic_load(&pool->sleeping)) {
        pthread_mutex_lock(&pool->mutex);
        pthread_cond_broadcast(&pool->wake);
        pthread_mutex_unlock(&pool->mutex);
    }
    run_share(pool->isa, &jb, 0, pool->threads);
    while (atomic_load_explicit(&pool->pending, memory_order_acquire) > 0)
        _mm_pause();
}

void ssd_matmul_each(ssd_pool *pool, int count, const ssd_weight *const *w, const float *const *x, ssd_act *const *act,
                     float *const *y) {
    const int64_t zero = 0;
    for (int i = 0; i < count; i++) {
        pool->isa->quantize(x[i], act[i]->k, act[i]);
        ssd_matmul(pool, 1, &w[i], act[i], y[i], w[i]->n, &zero);
    }
}
