#!/usr/bin/env python3
"""One line per batch size and schedule from `dspark bench spec --json`.

Reads either shape of the output (one point: a flat object; a sweep or several
schedules: "points") and prints each schedule's speed-up (under continuous
batching also with every place taken), tau, plain decoding's step and prefill,
the round's phases (ms, on the host's clock; "admissions": what prefilling
the requests admitted later adds to a plain step and to a round), the
undrafted rounds' cost and share, the rounds and steps that ran a shape for
its first times, and how many outputs matched plain decoding: what to set
side by side when two builds are alternated on the GPU machine.

    python3 bench/spec_phases.py spec.json [LABEL]
"""
import json
import sys


def points_of(result):
    if "points" in result:
        return result["points"]
    return [dict(result, schedules={result["schedule"]: result})]


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    label = sys.argv[2] if len(sys.argv) > 2 else ""
    with open(sys.argv[1]) as file:
        result = json.load(file)
    for point in points_of(result):
        for name, mode in point["schedules"].items():
            phases = mode["ms_per_batch_round"]
            print(
                "%s b%d %s speedup %.3f full %s tau %.2f | plain step %.4f (admissions %.4f) prefill %.1f steps %s | "
                "round %.4f: draft %.4f verify %.4f accept %.4f admissions %.4f undrafted-round %.4f prefill %.1f "
                "rounds %d | undrafted %d of %d | "
                "verified %.2f proposed %.2f | warm-ups %s | matched %d"
                % (label, point["batch"], name, mode["speedup"],
                   "%.3f (%d rounds)" % (mode["full_batch_speedup"], mode["full_batch_rounds"])
                   if "full_batch_speedup" in mode else "-", mode["tau"], point.get("plain_ms_per_step", 0.0),
                   point.get("plain_admission_prefill_ms", 0.0) / max(point.get("plain_steps", 1), 1),
                   point.get("plain_prefill_ms", 0.0), point.get("plain_steps", "-"), phases["total"],
                   phases["draft"], phases["verify"], phases["accept"], phases.get("admission_prefill", 0.0),
                   mode.get("ms_per_undrafted_round", 0.0),
                   mode["prefill_ms"], mode["batch_rounds"], mode["undrafted_rounds"], mode["rounds"],
                   mode["verified_per_round"], mode["proposed_per_round"],
                   "%d in %.1f ms (plain %d in %.1f)" % (mode["warm_up_rounds"], mode["ms_in_warm_up_rounds"],
                                                         point["plain_warm_up_steps"],
                                                         point["plain_ms_in_warm_up_steps"])
                   if "warm_up_rounds" in mode else "-", mode["outputs_matched"]))


if __name__ == "__main__":
    main()
