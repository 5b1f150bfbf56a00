"""How far a bench run's drafters are from what their acceptance allows: for each method, its measured end-to-end
speedup over plain decoding next to the speedup it would have if verifying any draft cost exactly one plain
decoding step (a perfectly flat forward-cost curve), with its own tau and its own drafting time kept; and the same
if it had also drafted at the steps the governor ran plain, as well as it did at the steps it drafted (an upper
bound: the governor rests a drafter where its drafts were being rejected).

    python benchmarks/speedup_bound.py benchmarks/results/RUN [RUN ...]

From each run's records.jsonl (greedy runs; every method answered the same questions): T1 = plain decoding's
seconds per target forward; a method's bound = plain seconds / (plain's time outside its forwards + the method's
forwards x T1 + its drafting seconds); with every step drafted, its forwards are its new tokens / the tau of its
drafted steps. What plain decoding spends outside its forwards (prefill, bookkeeping) is
charged to every method alike, so a bound below a target speedup says that no kernel can reach it with this
drafter's acceptance: the drafter has to accept more, or prefill cost less.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


def totals(run: Path) -> dict[str, dict[str, float]]:
    """method -> summed seconds, verify seconds, draft seconds, forwards and new tokens over the run's records."""
    sums: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for line in (run / "records.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("verify_seconds") is None:  # a peer (transformers, llama.cpp): no forwards timed
            continue
        total = sums[record["method"]]
        for key in ("seconds", "verify_seconds", "draft_seconds", "target_forwards", "new_tokens", "plain_steps"):
            total[key] += record.get(key) or 0
    return sums


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path)
    args = parser.parse_args()
    print("| run | method | speedup | tau | drafting share | plain steps | bound: one-step verification | "
          "and every step drafted |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for run in args.runs:
        sums = totals(run)
        if "none" not in sums:
            print(f"| {run.name} | (no plain decoding rows) | | | | | | |")
            continue
        plain = sums["none"]
        step = plain["verify_seconds"] / plain["target_forwards"]  # T1: one plain step
        outside = plain["seconds"] - plain["verify_seconds"]  # prefill and bookkeeping
        for method, total in sums.items():
            if method == "none":
                continue
            drafted_steps = max(total["target_forwards"] - total["plain_steps"], 1)
            drafted_tau = max((total["new_tokens"] - total["plain_steps"]) / drafted_steps, 1.0)
            bounds = [plain["seconds"] / (outside + forwards * step + total["draft_seconds"])
                      for forwards in (total["target_forwards"], total["new_tokens"] / drafted_tau)]
            print(f"| {run.name} | {method} | {plain['seconds'] / total['seconds']:.2f}x | "
                  f"{total['new_tokens'] / total['target_forwards']:.2f} | "
                  f"{total['draft_seconds'] / total['seconds']:.0%} | "
                  f"{total['plain_steps'] / total['target_forwards']:.0%} | {bounds[0]:.2f}x | {bounds[1]:.2f}x |")
        share = outside / plain["seconds"]
        print(f"| {run.name} | (plain: {share:.0%} of its time outside its forwards) | | | | | | |")


if __name__ == "__main__":
    main()
