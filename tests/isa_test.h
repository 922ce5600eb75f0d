// A fixture for tests of the CPU kernels that switch instruction sets, thread
// counts or bf16 products: it lists the instruction sets this machine runs and
// restores the settings the process started with, whatever a test picked.
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
    cpu::set_bf16_products(initial_bf16_products_);
  }
  std::vector<cpu::MatmulIsa> supported() const {
    std::vector<cpu::MatmulIsa> isas;
    for (cpu::MatmulIsa isa : cpu::kMatmulIsas)
      if (cpu::matmul_isa_supported(isa)) isas.push_back(isa);
    return isas;
  }

 private:
  cpu::MatmulIsa initial_isa_ = cpu::matmul_isa();
  int initial_threads_ = cpu::parallel_threads();
  bool initial_bf16_products_ = cpu::bf16_products();
};

}  // namespace dspark::testing
