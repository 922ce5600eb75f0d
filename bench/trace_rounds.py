#!/usr/bin/env python3
"""A speculative round's phases from a kernel trace (bench/kernel_trace.cpp).

    python3 bench/trace_rounds.py trace.csv [--top 12]

Every kernel and copy belongs to the target (the stream that runs
select_tokens_kernel, and the tap ring's) or to the drafter (the stream that
runs bidirectional_attention_kernel). Consecutive records of one owner form a
burst. A target burst right after another is a plain step; a drafter burst and
the target burst after it form a drafted round. Printed, as medians over the
bursts of the most common shape (the token selection's grid tells verify steps
of different sizes apart): each phase's span on the GPU, the idle time between
phases (the host's work and its launches), and each kernel's time per burst
(what it adds to the span). Tracing adds about a microsecond to each kernel of
a graph: compare traces with each other, not with untraced timings.
"""
import argparse
import bisect
import collections
import csv
import dataclasses
import statistics

TARGET_MARKS = ("select_tokens_kernel", "tap_ring_write_kernel")
DRAFTER_MARKS = ("bidirectional_attention_kernel",)


def short(name):
    """The kernel's function name and its grid, without namespaces or arguments."""
    grid = name[name.rfind("[") :] if name.endswith("]") else ""
    function = name.replace("(anonymous namespace)", "").split("(")[0].split("<")[0].split("::")[-1].split(" ")[-1]
    return f"{function} {grid}".strip()


@dataclasses.dataclass
class Burst:
    owner: str  # target, drafter or other
    start: int
    end: int
    records: list = dataclasses.field(default_factory=list)  # (name, marginal time)
    shape: str = ""  # the token selection's kernel and grid (target steps)


def most_common_shape(items, burst_of):
    """The items whose burst has the most common shape: one kind of step, not a mix of sizes."""
    shape = collections.Counter(burst_of(item).shape for item in items).most_common(1)[0][0]
    return shape, [item for item in items if burst_of(item).shape == shape]


def median(values):
    return statistics.median(values) if values else float("nan")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace")
    parser.add_argument("--top", type=int, default=12, help="kernels listed per phase")
    args = parser.parse_args()

    device, api = [], []
    with open(args.trace) as f:
        for row in csv.DictReader(f):
            record = (int(row["start_ns"]), int(row["end_ns"]), row["kind"], row["name"], row["stream"])
            (api if row["kind"] == "api" else device).append(record)
    device.sort()
    owner_of_stream = {}
    for start, end, kind, name, stream in device:
        if any(mark in name for mark in TARGET_MARKS):
            owner_of_stream.setdefault(stream, "target")
        if any(mark in name for mark in DRAFTER_MARKS):
            owner_of_stream.setdefault(stream, "drafter")

    # A record's time is its marginal time: what it adds to the burst's span
    # past every record that started before it (with programmatic launches a
    # kernel starts while the one before it runs, and waits).
    bursts = []
    for start, end, kind, name, stream in device:
        owner = owner_of_stream.get(stream, "other")
        # a target step starts with its embedding, after the step before it chose its tokens
        new_step = "embedding_kernel" in name and bursts and bursts[-1].shape and start - bursts[-1].end > 3000
        if not bursts or bursts[-1].owner != owner or new_step:
            bursts.append(Burst(owner, start, end))
        burst = bursts[-1]
        marginal = max(0, end - max(start, burst.end))
        burst.end = max(burst.end, end)
        burst.records.append((short(name) if kind == "kernel" else name, marginal))
        if "select_tokens_kernel" in name:
            burst.shape = short(name)

    plain, rounds = [], []  # (step, idle before, period); (draft, verify, idle between, idle after)
    for i in range(1, len(bursts) - 1):
        before, burst, after = bursts[i - 1], bursts[i], bursts[i + 1]
        if burst.owner == "target" and before.owner == "target" and after.owner == "target":
            plain.append((burst, burst.start - before.end, after.start - burst.start))
        if burst.owner == "drafter" and after.owner == "target" and i + 2 < len(bursts) and bursts[i + 2].owner == "drafter":
            rounds.append((burst, after, after.start - burst.end, bursts[i + 2].start - after.end))

    def kernel_table(phase_bursts, title):
        per_name = collections.defaultdict(list)
        for burst in phase_bursts:
            sums = collections.Counter()
            for name, duration in burst.records:
                sums[name] += duration
            for name, total in sums.items():
                per_name[name].append(total)
        busy = median([sum(d for _, d in burst.records) for burst in phase_bursts])
        span = median([burst.end - burst.start for burst in phase_bursts])
        print(f"  {title}: kernels {busy / 1e3:.1f} us of span {span / 1e3:.1f}")
        ranked = sorted(per_name.items(), key=lambda item: -sum(item[1]))
        for name, totals in ranked[: args.top]:
            share = len(totals) / len(phase_bursts)
            print(f"    {median(totals) / 1e3:7.2f} us  x{share:4.2f}  {name}")

    if plain:
        shape, chosen = most_common_shape(plain, lambda step: step[0])
        print(f"plain steps: {len(chosen)} of {len(plain)} ({shape})")
        print(f"  period {median([p[2] for p in chosen]) / 1e3:.1f} us, idle before {median([p[1] for p in chosen]) / 1e3:.1f} us")
        kernel_table([p[0] for p in chosen], "step")
    if rounds:
        shape, chosen = most_common_shape(rounds, lambda round_: round_[1])
        draft_span = median([draft.end - draft.start for draft, _, _, _ in chosen])
        verify_span = median([verify.end - verify.start for _, verify, _, _ in chosen])
        period = median([verify.end - draft.start + idle_after for draft, verify, _, idle_after in chosen])
        print(f"drafted rounds: {len(chosen)} of {len(rounds)} ({shape})")
        print(f"  period {period / 1e3:.1f} us: draft {draft_span / 1e3:.1f}, idle {median([r[2] for r in chosen]) / 1e3:.1f},"
              f" verify {verify_span / 1e3:.1f}, idle {median([r[3] for r in chosen]) / 1e3:.1f}")
        kernel_table([r[0] for r in chosen], "draft")
        kernel_table([r[1] for r in chosen], "verify")
        # The host's runtime calls of these rounds: from a draft's first record to the next draft's.
        api.sort()
        api_starts = [call[0] for call in api]
        counts, times = collections.Counter(), collections.Counter()
        for draft, verify, _, idle_after in chosen:
            first = bisect.bisect_left(api_starts, draft.start)
            for start, end, kind, name, stream in api[first:]:
                if start >= verify.end + idle_after:
                    break
                counts[name] += 1
                times[name] += end - start
        print("  runtime calls a round (count, us):")
        for name, total in times.most_common(args.top):
            print(f"    {counts[name] / len(chosen):6.2f} {total / len(chosen) / 1e3:8.2f}  {name}")


if __name__ == "__main__":
    main()
