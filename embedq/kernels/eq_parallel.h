/* The one thread fan-out of embedq's C kernels: run(jobs[t]) for t < n, in parallel.

   Built with -fopenmp (build.LazyLibrary(openmp=True)) the jobs run on an OpenMP team. The
   library is loaded after torch, whose CPU wheels link libgomp.so.1 (and ship it as
   torch/lib/libgomp.so.1): the dynamic loader gives this library that same runtime, so the
   team is torch's own intra-op thread pool. Why it matters: after each torch op those
   workers spin-wait for the next one (GOMP_SPINCOUNT); threads of our own started beside
   them share the cores with spinners. Measured in a transformers decode step on 2 cores
   (scripts/profile_decode.py): the head took 1.5-1.9x its microbenchmark time with
   pthreads; on torch's team it gets both cores at once, and torch's next op finds its
   workers awake. Without OpenMP (a compiler that lacks it) the same jobs run on pthreads. */
#ifndef EQ_PARALLEL_H
#define EQ_PARALLEL_H
#include <stddef.h>
#ifdef _OPENMP
#include <omp.h>
#else
#include <pthread.h>
#endif

#define EQ_MAX_THREADS 64

/* run(job) returns NULL on success; the result is non-zero when any job failed. */
static int eq_fanout(void* (*run)(void*), void* jobs, size_t job_size, int n) {
    int rc = 0;
#ifdef _OPENMP
    #pragma omp parallel for num_threads(n) schedule(static, 1) reduction(| : rc)
    for (int t = 0; t < n; t++) rc |= run((char*)jobs + (size_t)t * job_size) != NULL;
#else
    pthread_t th[EQ_MAX_THREADS];
    int started[EQ_MAX_THREADS] = {0};
    for (int t = 1; t < n; t++)
        started[t] = pthread_create(&th[t], NULL, run, (char*)jobs + (size_t)t * job_size) == 0;
    rc |= run(jobs) != NULL;
    for (int t = 1; t < n; t++) {
        void* r = NULL;
        if (started[t]) pthread_join(th[t], &r); else r = run((char*)jobs + (size_t)t * job_size);
        rc |= r != NULL;
    }
#endif
    return rc;
}
#endif
