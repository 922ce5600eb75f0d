// The CPU kernels' persistent worker pool (small-row matmul, attention).
//
// A job is cut into chunks that the calling thread and the pool's workers
// claim one at a time from a shared counter. Claiming (rather than a fixed
// split) matters on a shared 2-core machine: a worker the scheduler has not
// run yet simply claims nothing, and the caller never waits for work nobody
// started. Workers spin briefly after each job (a decode step issues ~80 of
// 5-500 us each, a few us apart) and then sleep on a futex. The pool has
// openblas_get_num_threads() threads, caller included, so together with
// OpenBLAS (used by the same process for prefill, training and the drafter's
// attention) it never runs more compute threads than OpenBLAS was given. Own
// threads rather than OpenMP: no second runtime whose spinning pool competes
// with OpenBLAS's, and no libgomp to link into every binary.
//
// Which thread runs which chunk is unpredictable; a kernel whose results must
// be reproducible computes every output element inside one chunk, in an order
// that does not depend on the chunking.
#pragma once

namespace dspark::cpu {

// Runs task(context, chunk) for every chunk in [0, chunks) on the calling
// thread and the workers; returns when all are done. One job at a time: a
// second thread calling meanwhile runs its chunks alone.
using ParallelTask = void (*)(const void* context, int chunk);
void parallel_run(ParallelTask task, const void* context, int chunks);

// Threads a job is spread over: the caller plus the workers in use.
int parallel_threads();

// Uses only `threads` of the pool's threads (at least 1, at most the pool's
// size; 1 runs every job on the calling thread). For tests that check a
// kernel's results do not depend on the thread count, and for benchmarks.
void set_parallel_threads(int threads);

}  // namespace dspark::cpu
