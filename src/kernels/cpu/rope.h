// Rotary position embedding, the HF "rotate_half" layout: within each head,
// element i pairs with element i + head_dim/2 and the pair is rotated by
// angle position * inverse_frequency[i].
// x [rows, heads, head_dim] rotated in place; positions [rows];
// inverse_frequency [head_dim/2] (scaling, e.g. Llama 3's, already applied).
#pragma once

namespace dspark::cpu {

void rope_forward(float* x, const int* positions, int rows, int heads, int head_dim, const double* inverse_frequency);

// rope_forward in two steps, so a forward that rotates q and k in every layer
// computes the angles once: cosines, sines [rows, head_dim/2] (angles in
// double, rounded to f32), then the rotation. Same results as rope_forward.
void rope_angles(float* cosines, float* sines, const int* positions, int rows, int head_dim,
                 const double* inverse_frequency);
void rope_apply(float* x, const float* cosines, const float* sines, int rows, int heads, int head_dim);

}  // namespace dspark::cpu
