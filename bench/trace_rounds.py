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
import statistics

TARGET_MARKS = ("select_tokens_kernel", "tap_ring_write_kernel")
DRAFTER_MARKS = ("bidirectional_attention_kernel",)


def short(name):
    """The kernel's function name and its grid, without namespaces or arguments."""
    grid = name[name.rfind("[") :] if name.endswith("]") else ""
    function = name.replace("(anonymous namespace)", "").split("(")[0].split("<")[0].split("::")[-1].split(" ")[-1]
    return f"{function} {grid}".strip()


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
    bursts = []  # [owner, start, end, [(name, marginal time)], shape]
    for start, end, kind, name, stream in device:
        owner = owner_of_stream.get(stream, "other")
        # a target step starts with its embedding, after the step before it chose its tokens
        new_step = "embedding_kernel" in name and bursts and bursts[-1][4] and start - bursts[-1][2] > 3000
        if not bursts or bursts[-1][0] != owner or new_step:
            bursts.append([owner, start, end, [], ""])
        burst = bursts[-1]
        marginal = max(0, end - max(start, burst[2]))
        burst[2] = max(burst[2], end)
        burst[3].append((short(name) if kind == "kernel" else name, marginal))
        if "select_tokens_kernel" in name:
            burst[4] = short(name)

    plain, rounds = [], []
    for i in range(1, len(bursts) - 1):
        before, burst, after = bursts[i - 1], bursts[i], bursts[i + 1]
        if burst[0] == "target" and before[0] == "target" and after[0] == "target":
            plain.append((burst, burst[1] - before[2], after[1] - burst[1]))
        if burst[0] == "drafter" and after[0] == "target" and i + 2 < len(bursts) and bursts[i + 2][0] == "drafter":
            rounds.append((burst, after, after[1] - burst[2], bursts[i + 2][1] - after[2]))

    def kernel_table(phase_bursts, title):
        per_name = collections.defaultdict(list)
        for burst in phase_bursts:
            sums = collections.Counter()
            for name, duration in burst[3]:
                sums[name] += duration
            for name, total in sums.items():
                per_name[name].append(total)
        busy = median([sum(d for _, d in burst[3]) for burst in phase_bursts])
        print(f"  {title}: kernels {busy / 1e3:.1f} us of span {median([b[2] - b[1] for b in phase_bursts]) / 1e3:.1f}")
        ranked = sorted(per_name.items(), key=lambda item: -sum(item[1]))
        for name, totals in ranked[: args.top]:
            share = len(totals) / len(phase_bursts)
            print(f"    {median(totals) / 1e3:7.2f} us  x{share:4.2f}  {name}")

    if plain:
        shape = collections.Counter(b[4] for b, _, _ in plain).most_common(1)[0][0]
        chosen = [p for p in plain if p[0][4] == shape]
        print(f"plain steps: {len(chosen)} of {len(plain)} ({shape})")
        print(f"  period {median([p[2] for p in chosen]) / 1e3:.1f} us, idle before {median([p[1] for p in chosen]) / 1e3:.1f} us")
        kernel_table([p[0] for p in chosen], "step")
    if rounds:
        shape = collections.Counter(r[1][4] for r in rounds).most_common(1)[0][0]
        chosen = [r for r in rounds if r[1][4] == shape]
        draft_span = median([r[0][2] - r[0][1] for r in chosen])
        verify_span = median([r[1][2] - r[1][1] for r in chosen])
        period = median([r[1][2] - r[0][1] + r[3] for r in chosen])
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
            first = bisect.bisect_left(api_starts, draft[1])
            for start, end, kind, name, stream in api[first:]:
                if start >= verify[2] + idle_after:
                    break
                counts[name] += 1
                times[name] += end - start
        print("  runtime calls a round (count, us):")
        for name, total in times.most_common(args.top):
            print(f"    {counts[name] / len(chosen):6.2f} {total / len(chosen) / 1e3:8.2f}  {name}")


if __name__ == "__main__":
    main()
