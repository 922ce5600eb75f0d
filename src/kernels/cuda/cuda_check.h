// CUDA error checks: every runtime and cuBLAS call's status is checked and
// turned into a dspark::Error naming the call and where it was made.
#pragma once
#include <cublasLt.h>
#include <cuda_runtime.h>

#include "core/error.h"

#define CUDA_CHECK(call)                                                                   \
  do {                                                                                     \
    cudaError_t status_ = (call);                                                          \
    if (status_ != cudaSuccess)                                                            \
      ::dspark::fail("CUDA error ", cudaGetErrorString(status_), " in ", #call, " at ",   \
                     __FILE__, ":", __LINE__);                                             \
  } while (0)

#define CUBLAS_CHECK(call)                                                                 \
  do {                                                                                     \
    cublasStatus_t status_ = (call);                                                       \
    if (status_ != CUBLAS_STATUS_SUCCESS)                                                  \
      ::dspark::fail("cuBLAS error ", cublasLtGetStatusString(status_), " in ", #call, " at ", \
                     __FILE__, ":", __LINE__);                                             \
  } while (0)

// After a kernel launch: reports a bad launch configuration at once.
#define CUDA_CHECK_LAUNCH() CUDA_CHECK(cudaGetLastError())
