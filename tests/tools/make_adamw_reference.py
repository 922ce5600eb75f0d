#!/usr/bin/env python3
"""Reference trajectory for tests/test_optimizer.cpp: torch.optim.AdamW with
torch.nn.utils.clip_grad_norm_ over three steps of fixed gradients.

Two tensors: "vector" [3] (no weight decay, as a norm weight) and "matrix"
[2, 2] (weight decay 0.1). Gradients at step s (1-based), element i of the
flattened tensor: vector g = 3·sin(s·(i+1)), matrix g = 2·cos(s + 0.5·i) -
so step 1's global norm exceeds 1.0 and clipping is exercised. Learning
rates 0.01, 0.02, 0.015; betas (0.9, 0.95); eps 1e-8. Prints the parameters
after every step (float32, 9 significant digits), pasted into the test.

    python3 tests/tools/make_adamw_reference.py
"""
import math

import torch

vector = torch.nn.Parameter(torch.tensor([0.5, -0.25, 1.0], dtype=torch.float32))
matrix = torch.nn.Parameter(torch.tensor([[0.3, -0.7], [1.2, 0.05]], dtype=torch.float32))
optimizer = torch.optim.AdamW([{"params": [vector], "weight_decay": 0.0},
                               {"params": [matrix], "weight_decay": 0.1}],
                              lr=0.01, betas=(0.9, 0.95), eps=1e-8)
for step, lr in enumerate([0.01, 0.02, 0.015], start=1):
    vector.grad = torch.tensor([3 * math.sin(step * (i + 1)) for i in range(3)], dtype=torch.float32)
    matrix.grad = torch.tensor([2 * math.cos(step + 0.5 * i) for i in range(4)], dtype=torch.float32).reshape(2, 2)
    norm = torch.nn.utils.clip_grad_norm_([vector, matrix], 1.0)
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    print(f"step {step} norm {norm.item():.9g}")
    print("  vector", ", ".join(f"{x:.9g}f" for x in vector.detach().tolist()))
    print("  matrix", ", ".join(f"{x:.9g}f" for x in matrix.detach().flatten().tolist()))
