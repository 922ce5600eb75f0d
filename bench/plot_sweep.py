#!/usr/bin/env python3
"""Throughput against batch size from `dspark bench spec --sweep --json`:
plain decoding and each verify schedule, with the speed-up over plain below.
(`bench spec --plot` draws the first panel itself; this script is for runs on
machines without PLplot's cairo driver, and adds the ratio panel.)

  python3 bench/plot_sweep.py SWEEP.json OUT.png [--title TEXT]
"""
import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sweep")
    parser.add_argument("out")
    parser.add_argument("--title", default=None)
    args = parser.parse_args()
    result = json.load(open(args.sweep))
    points = result["points"]
    batches = [p["batch"] for p in points]
    schedules = sorted(points[0]["schedules"])
    figure, (throughput, ratio) = plt.subplots(1, 2, figsize=(12, 4.2))
    throughput.plot(batches, [p["plain_tokens_per_s"] for p in points], "o-", label="plain")
    for name, marker in zip(schedules, "s^Dx"):
        throughput.plot(batches, [p["schedules"][name]["tokens_per_s"] for p in points], marker + "-", label=name)
        ratio.plot(batches, [p["schedules"][name]["speedup"] for p in points], marker + "-", label=name)
    ratio.axhline(1.0, color="gray", linestyle="--", linewidth=1)
    ratio.axhline(0.98, color="red", linestyle=":", linewidth=1, label="0.98 (issue 8 floor)")
    for axes, label in ((throughput, "tokens/s"), (ratio, "speculative / plain tokens/s")):
        axes.set_xscale("log", base=2)
        axes.set_xticks(batches, [str(b) for b in batches])
        axes.set_xlabel("batch size (requests decoded together)")
        axes.set_ylabel(label)
        axes.grid(alpha=0.3)
        axes.legend()
    figure.suptitle(args.title or f"{result['device']}: plain vs speculative decoding, gamma {result['gamma']}")
    figure.tight_layout()
    figure.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
