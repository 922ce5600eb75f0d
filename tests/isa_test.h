// A fixture for tests of the CPU kernels that switch instruction sets or
// thread counts: it lists the instruction sets this machine runs and restores
// the ones the process started with, whatever a test picked.
#pragma once
#include <gtest/gtest.h>

#include <vector>

#include "kernels/cpu/matmul.h"
#include "kernels/cpu/parallel.h"

namespace dspark::testing {

class IsaTest : public ::testing::Test {
 protected:
  void TearDown() override {
    cpu::set_matmul_isa(initial_isa_);
    cpu::set_parallel_threads(initial_threads_);
  }
  std::vector<cpu::MatmulIsa> supported() const {
    std::vector<cpu::MatmulIsa> isas;
    for (cpu::MatmulIsa isa :
         {cpu::MatmulIsa::Baseline, cpu::MatmulIsa::Avx2, cpu::MatmulIsa::Avx512, cpu::MatmulIsa::Avx512Bf16})
      if (cpu::matmul_isa_supported(isa)) isas.push_back(isa);
    return isas;
  }

 private:
  cpu::MatmulIsa initial_isa_ = cpu::matmul_isa();
  int initial_threads_ = cpu::parallel_threads();
};

}  // namespace dspark::testing
