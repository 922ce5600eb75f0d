// The CPU kernels' backward passes against central finite differences of
// their own forwards. Each check takes a random linear objective
// f = Σ R ⊙ forward(inputs), feeds dout = R to the backward, and compares
// every input's gradient with (f(x + h) - f(x - h)) / 2h element by element.
// Gradients are pre-filled with noise first, to check that they accumulate (+=).
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "gradient_check.h"
#include "kernels/cpu/activation.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/rmsnorm.h"
#include "kernels/cpu/softmax.h"

namespace dspark {
namespace {

using testing::numeric_gradient;
using testing::random_values;
using testing::relative_difference;
using testing::weighted_sum;

// The gradient a backward accumulated onto `before`, in double.
std::vector<double> accumulated(const std::vector<float>& after, const std::vector<float>& before) {
  std::vector<double> gradient(after.size());
  for (size_t i = 0; i < after.size(); ++i) gradient[i] = double(after[i]) - before[i];
  return gradient;
}

// Runs `backward` on gradients pre-filled with noise and checks each one against
// finite differences of `objective` with respect to the matching input.
struct Check {
  std::vector<float>* input;
  std::vector<float> gradient;
};

void check_gradients(std::vector<Check> checks, const std::function<double()>& objective,
                     const std::function<void(std::vector<Check>&)>& backward, float step, double tolerance,
                     const char* what) {
  Rng rng(99);
  std::vector<std::vector<float>> before;
  for (Check& check : checks) {
    check.gradient = random_values(rng, check.input->size(), 1.0f);
    before.push_back(check.gradient);
  }
  backward(checks);
  for (size_t i = 0; i < checks.size(); ++i) {
    const std::vector<double> analytic = accumulated(checks[i].gradient, before[i]);
    const std::vector<double> numeric =
        numeric_gradient(checks[i].input->data(), checks[i].input->size(), objective, step);
    EXPECT_LE(relative_difference(analytic, numeric), tolerance) << what << " input " << i;
  }
}

TEST(KernelBackward, MatmulInOut) {
  Rng rng(1);
  const int rows = 5, in = 7, out = 3;
  std::vector<float> x = random_values(rng, rows * in, 1.0f), weight = random_values(rng, in * out, 1.0f);
  const std::vector<float> r = random_values(rng, rows * out, 1.0f);
  std::vector<float> y(rows * out);
  auto objective = [&] {
    cpu::matmul_in_out_forward(y.data(), x.data(), weight.data(), rows, in, out);
    return weighted_sum(y.data(), r);
  };
  check_gradients(
      {{&x, {}}, {&weight, {}}}, objective,
      [&](std::vector<Check>& g) {
        cpu::matmul_in_out_backward(g[0].gradient.data(), g[1].gradient.data(), r.data(), x.data(), weight.data(), rows,
                                    in, out);
      },
      1e-2f, 1e-4, "matmul_in_out");
  // One row: the forward's GEMV path.
  std::vector<float> x1 = random_values(rng, in, 1.0f);
  const std::vector<float> r1 = random_values(rng, out, 1.0f);
  auto objective1 = [&] {
    cpu::matmul_in_out_forward(y.data(), x1.data(), weight.data(), 1, in, out);
    return weighted_sum(y.data(), r1);
  };
  check_gradients(
      {{&x1, {}}, {&weight, {}}}, objective1,
      [&](std::vector<Check>& g) {
        cpu::matmul_in_out_backward(g[0].gradient.data(), g[1].gradient.data(), r1.data(), x1.data(), weight.data(), 1,
                                    in, out);
      },
      1e-2f, 1e-4, "matmul_in_out, one row");
}

TEST(KernelBackward, MatmulOutIn) {
  Rng rng(2);
  const int rows = 4, in = 6, out = 9;
  std::vector<float> x = random_values(rng, rows * in, 1.0f), weight = random_values(rng, out * in, 1.0f);
  const std::vector<float> r = random_values(rng, rows * out, 1.0f);
  std::vector<float> y(rows * out);
  auto objective = [&] {
    cpu::matmul_forward(y.data(), x.data(), weight.data(), nullptr, rows, in, out);
    return weighted_sum(y.data(), r);
  };
  check_gradients(
      {{&x, {}}, {&weight, {}}}, objective,
      [&](std::vector<Check>& g) {
        cpu::matmul_backward(g[0].gradient.data(), g[1].gradient.data(), r.data(), x.data(), weight.data(), rows, in,
                             out);
      },
      1e-2f, 1e-4, "matmul");
  // A frozen weight: only dx.
  std::vector<float> dx(rows * in, 0.0f);
  cpu::matmul_backward(dx.data(), nullptr, r.data(), x.data(), weight.data(), rows, in, out);
  const std::vector<double> numeric = numeric_gradient(x.data(), x.size(), objective, 1e-2f);
  EXPECT_LE(relative_difference(accumulated(dx, std::vector<float>(dx.size(), 0.0f)), numeric), 1e-4);
}

TEST(KernelBackward, RmsNorm) {
  Rng rng(3);
  const int rows = 4, dim = 12;
  const float eps = 1e-5f;
  std::vector<float> x = random_values(rng, rows * dim, 1.5f), weight = random_values(rng, dim, 1.0f);
  for (float& w : weight) w += 1.0f;
  const std::vector<float> r = random_values(rng, rows * dim, 1.0f);
  std::vector<float> y(rows * dim);
  auto objective = [&] {
    cpu::rmsnorm_forward(y.data(), x.data(), weight.data(), rows, dim, eps);
    return weighted_sum(y.data(), r);
  };
  check_gradients(
      {{&x, {}}, {&weight, {}}}, objective,
      [&](std::vector<Check>& g) {
        cpu::rmsnorm_backward(g[0].gradient.data(), g[1].gradient.data(), r.data(), x.data(), weight.data(), rows, dim,
                              eps);
      },
      1e-3f, 1e-3, "rmsnorm");
}

TEST(KernelBackward, GeluTanhGate) {
  Rng rng(4);
  const int count = 40;
  std::vector<float> gate = random_values(rng, count, 3.0f), up = random_values(rng, count, 1.0f);
  const std::vector<float> r = random_values(rng, count, 1.0f);
  std::vector<float> y(count);
  auto objective = [&] {
    cpu::gelu_tanh_gate_forward(y.data(), gate.data(), up.data(), count);
    return weighted_sum(y.data(), r);
  };
  check_gradients(
      {{&gate, {}}, {&up, {}}}, objective,
      [&](std::vector<Check>& g) {
        cpu::gelu_tanh_gate_backward(g[0].gradient.data(), g[1].gradient.data(), r.data(), gate.data(), up.data(),
                                     count);
      },
      1e-3f, 1e-3, "gelu_tanh_gate");
}

TEST(KernelBackward, Softmax) {
  Rng rng(5);
  const int rows = 3, dim = 10;
  std::vector<float> logits = random_values(rng, rows * dim, 3.0f);
  const std::vector<float> r = random_values(rng, rows * dim, 1.0f);
  std::vector<float> probs(rows * dim), log_normalizers(rows);
  auto objective = [&] {
    cpu::softmax_forward(probs.data(), logits.data(), rows, dim);
    return weighted_sum(probs.data(), r);
  };
  objective();
  check_gradients(
      {{&logits, {}}}, objective,
      [&](std::vector<Check>& g) { cpu::softmax_backward(g[0].gradient.data(), r.data(), probs.data(), rows, dim); },
      1e-3f, 1e-3, "softmax");
  // The log normaliser: log probs = logits - log Σ exp(logits).
  cpu::softmax_forward(probs.data(), logits.data(), rows, dim, log_normalizers.data());
  for (int row = 0; row < rows; ++row)
    for (int i = 0; i < dim; ++i)
      EXPECT_NEAR(std::log(probs[row * dim + i]), logits[row * dim + i] - log_normalizers[row], 1e-5);
}

TEST(KernelBackward, BidirectionalAttention) {
  const int heads = 2, head_dim = 4, width = heads * head_dim, rows = 3;
  for (int context : {0, 1, 5}) {  // a block alone, one context row, several: kv_rows = context + rows
    Rng rng(6 + context);
    const int kv_rows = context + rows;
    std::vector<float> q = random_values(rng, rows * width, 1.5f), keys = random_values(rng, kv_rows * width, 1.5f),
                       values = random_values(rng, kv_rows * width, 1.0f);
    const std::vector<float> r = random_values(rng, rows * width, 1.0f);
    std::vector<float> out(rows * width), scores(kv_rows), scratch(2 * rows * kv_rows);
    auto objective = [&] {
      cpu::bidirectional_attention_forward(out.data(), q.data(), keys.data(), values.data(), rows, kv_rows, heads,
                                           head_dim, scores.data());
      return weighted_sum(out.data(), r);
    };
    check_gradients(
        {{&q, {}}, {&keys, {}}, {&values, {}}}, objective,
        [&](std::vector<Check>& g) {
          cpu::bidirectional_attention_backward(g[0].gradient.data(), g[1].gradient.data(), g[2].gradient.data(),
                                                r.data(), q.data(), keys.data(), values.data(), rows, kv_rows, heads,
                                                head_dim, scratch.data());
        },
        1e-3f, 2e-3, context == 0 ? "attention, no context" : "attention");
  }
}

}  // namespace
}  // namespace dspark
