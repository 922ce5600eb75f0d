// Drafters whose every parameter is redrawn, so that no head or confidence is
// trivially zero (a fresh init has markov.w2 = conf.w = 0).
#pragma once
#include <cmath>

#include "core/random.h"
#include "spec/drafter.h"

namespace dspark::testing {

// Norm weights 1 ± 0.34; markov.w1 (a lookup table) ±1.7·scale; every other
// matrix ±1.7·scale/sqrt(fan-in); uniform draws from Rng(seed).
inline void randomize_parameters(Drafter& drafter, uint64_t seed, float scale) {
  Rng rng(seed);
  for (auto& [name, tensor] : drafter.parameters) {
    const bool norm = name.find("norm") != std::string::npos;
    const float spread = norm                  ? 0.2f
                         : name == "markov.w1" ? scale
                                               : scale / std::sqrt(float(tensor.shape[0]));
    for (long i = 0; i < tensor.numel(); ++i)
      tensor.data[i] = (norm ? 1.0f : 0.0f) + spread * float(2.0 * rng.uniform() - 1.0) * 1.7f;
  }
}

}  // namespace dspark::testing
