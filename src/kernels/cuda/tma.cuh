// Hopper's tensor memory accelerator (TMA) and shared-memory barriers
// (mbarrier), as the streamed GEMV (matmul.cu) uses them: a box of a tensor
// copied from global into shared memory without registers, its arrival
// counted in bytes on a barrier; and the 16-byte loads that read the boxes.
// Boxes whose rows are 128 bytes are copied with the 128-byte swizzle: in
// each 1 KB atom (8 rows of 128 bytes) the 16-byte chunk j of row r sits at
// chunk j ^ r, so that rows whose numbers differ modulo 8 put a chunk in
// different banks.
#pragma once
#include <cuda.h>

#include <cstdint>

#include "kernels/cuda/common.cuh"

namespace dspark::cuda {

__device__ __forceinline__ uint32_t shared_address(const void* pointer) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(pointer));
}

// The byte offset of 16-byte chunk `chunk` of row `row` in a swizzled tile
// whose rows are 128 bytes (64 bf16), from a 1 KB-aligned start.
__device__ __forceinline__ uint32_t swizzled_offset(int row, int chunk) {
  return static_cast<uint32_t>(row * 128 + ((chunk ^ (row & 7)) << 4));
}

__device__ __forceinline__ void barrier_init(uint64_t* barrier, int arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(shared_address(barrier)), "r"(arrivals) : "memory");
}

// After the barriers' init, before any copy may complete on them.
__device__ __forceinline__ void barrier_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// One arrival that also expects `bytes` of copies to land before the phase completes.
__device__ __forceinline__ void barrier_arrive_expecting(uint64_t* barrier, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(shared_address(barrier)), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void barrier_arrive(uint64_t* barrier) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(shared_address(barrier)) : "memory");
}

// Returns once the barrier's phase of this parity (0 for its 1st, 3rd, ...
// completion; 1 for its 2nd, ...) has completed.
__device__ __forceinline__ void barrier_wait(uint64_t* barrier, uint32_t parity) {
  const uint32_t address = shared_address(barrier);
  uint32_t done = 0;
  while (!done)
    asm volatile(
        "{\n"
        ".reg .pred complete;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 complete, [%1], %2;\n"
        "selp.u32 %0, 1, 0, complete;\n"
        "}\n"
        : "=r"(done)
        : "r"(address), "r"(parity)
        : "memory");
}

// The box of a three-dimensional `map` whose first element is at
// coordinates (x, y, z) (innermost first) into shared memory at `destination`
// (1 KB-aligned for the 128-byte swizzle); its bytes, those of elements
// outside the tensor included (they arrive as zeros), count on `barrier`.
__device__ __forceinline__ void tma_load_box(void* destination, const CUtensorMap* map, int x, int y, int z,
                                             uint64_t* barrier) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];" ::
          "r"(shared_address(destination)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(z), "r"(shared_address(barrier))
      : "memory");
}

// 16 bytes of shared memory at `address` (16-byte aligned).
__device__ __forceinline__ uint4 load_shared_16(uint32_t address) {
  uint4 value;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(value.x), "=r"(value.y), "=r"(value.z), "=r"(value.w)
               : "r"(address)
               : "memory");  // ordered after the barrier wait that made the slot visible
  return value;
}

}  // namespace dspark::cuda
