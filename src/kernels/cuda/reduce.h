// Deterministic reductions for training (the gradients of vectors and the
// global gradient norm). Every sum runs in a fixed order that depends only on
// the shapes, never on scheduling: no atomics, so a training step is
// reproducible run to run on the same GPU.
#pragma once
#include <cuda_runtime.h>

namespace dspark::cuda {

// Scratch floats column_sums needs for `rows` x `dim` (0 when one pass suffices).
long column_sums_scratch(int rows, int dim);

// out[i] += Σ_r a[r·lda + i] · (b ? b[r·ldb + i] : 1) · (row_scale ? row_scale[r] : 1), for i < dim:
// the gradient of a bias, of a norm weight (b = the normed input, row_scale = its inverse rms),
// or of a weight vector applied to every row. Rows are summed in chunks of kColumnChunk, each
// chunk's rows in order, then the chunks in order. `partials` holds column_sums_scratch floats.
constexpr int kColumnChunk = 256;
void column_sums(float* out, const float* a, long lda, const float* b, long ldb, const float* row_scale, int rows,
                 int dim, float* partials, cudaStream_t stream);

// Doubles sum_of_squares needs as scratch.
constexpr int kSquareBlocks = 264;
// *out = Σ x[i]² in double: a fixed grid of kSquareBlocks blocks, each summing a
// fixed stride of x, then one block adding the kSquareBlocks partials in order.
void sum_of_squares(double* out, const float* x, long count, double* partials, cudaStream_t stream);

}  // namespace dspark::cuda
