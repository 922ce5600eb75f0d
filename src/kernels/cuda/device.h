// The CUDA devices this process can see.
#pragma once
#include <cuda_runtime.h>

#include <functional>
#include <string>

namespace dspark::cuda {

// Number of usable CUDA devices; 0 when there is no driver or no GPU.
int device_count();

// "NVIDIA H200, 132 SMs, 139.8 GiB, cc 9.0" for device `index`.
std::string device_description(int index);

// Streaming multiprocessors of the current device.
int multiprocessor_count();

// The most shared memory one block of the current device can opt in to, in bytes.
int max_shared_bytes();

}  // namespace dspark::cuda

namespace dspark::cuda {

// Median milliseconds of `work` on the default stream over 10 runs, after 2
// that warm up (the measurements below time their kernels with it).
double median_milliseconds(const std::function<void()>& work);

// Device-to-device copy bandwidth in GB/s (1e9 bytes), counting bytes read
// plus bytes written, median of several copies of `bytes` after a warm-up:
// the ceiling a memory-bound kernel can be compared against.
double measure_copy_bandwidth(size_t bytes);

// Read-only bandwidth in GB/s: one kernel streaming `bytes` once with 16-byte
// loads (median of several runs after a warm-up): the ceiling for a kernel
// that only reads, such as a GEMV's weight stream.
double measure_read_bandwidth(size_t bytes);

// Keeps `stream` busy for about `microseconds` with one spinning thread, so
// that the host can queue the work after it ahead of the GPU: a profiler's
// events then time kernels back to back, not the host's launch rate.
void hold_stream(cudaStream_t stream, int microseconds);

// The work `work` queues on `stream`, captured as a CUDA graph and
// instantiated (the caller owns the result: cudaGraphExecDestroy). When
// `work` throws, the capture is ended and dropped, so the stream stays usable,
// and the exception goes on.
cudaGraphExec_t capture_graph(cudaStream_t stream, const std::function<void()>& work);

}  // namespace dspark::cuda
