#!/usr/bin/env python3
"""Training curve of a drafter: held-out and training tau^ (and loss) against
the step, from the train_log.jsonl that `dspark train` writes.

  python3 bench/plot_training.py DRAFT/train_log.jsonl OUT.png [--title TEXT]
"""
import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("log")
    parser.add_argument("out")
    parser.add_argument("--title", default="DSpark drafter training")
    parser.add_argument("--smooth", type=int, default=200, help="training steps averaged per point")
    args = parser.parse_args()
    rows = [json.loads(line) for line in open(args.log)]
    train = [r for r in rows if r.get("split") == "train"]
    held_out = [r for r in rows if r.get("split") == "held_out"]
    steps, taus, losses = [], [], []
    for begin in range(0, len(train), args.smooth):
        chunk = train[begin:begin + args.smooth]
        steps.append(chunk[-1]["step"])
        taus.append(sum(r["tau"] for r in chunk) / len(chunk))
        losses.append(sum(r["loss"] for r in chunk) / len(chunk))
    figure, (tau_axis, loss_axis) = plt.subplots(1, 2, figsize=(11, 4))
    tau_axis.plot(steps, taus, label=f"training batches (mean of {args.smooth} steps)")
    tau_axis.plot([r["step"] for r in held_out], [r["tau"] for r in held_out], "o-", label="held-out anchors")
    tau_axis.set_xlabel("step")
    tau_axis.set_ylabel("tau^ = 1 + sum_j prod_{i<=j} (1 - L1_i / 2)")
    tau_axis.legend()
    tau_axis.grid(alpha=0.3)
    loss_axis.plot(steps, losses, label="training")
    loss_axis.plot([r["step"] for r in held_out], [r["loss"] for r in held_out], "o-", label="held-out")
    loss_axis.set_xlabel("step")
    loss_axis.set_ylabel("loss = 0.1 CE + 0.9 L1 + 1.0 BCE")
    loss_axis.legend()
    loss_axis.grid(alpha=0.3)
    figure.suptitle(args.title)
    figure.tight_layout()
    figure.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
