// Rotary position embedding, the HF "rotate_half" layout: within each head,
// element i pairs with element i + head_dim/2 and the pair is rotated by
// angle position * inverse_frequency[i].
// x [rows, heads, head_dim] rotated in place; positions [rows];
// inverse_frequency [head_dim/2] (scaling, e.g. Llama 3's, already applied).
#pragma once

namespace dspark::cpu {

void rope_forward(float* x, const int* positions, int rows, int heads, int head_dim,
                  const double* inverse_frequency);

}  // namespace dspark::cpu
