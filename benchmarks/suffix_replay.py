"""The suffix drafter's acceptance with and without its datastore, replayed against the target's own greedy outputs:
no model runs in the replay, so a grid of options costs seconds. Prompts: the first turns of the ShareGPT
conversations the datastore holds out (datastore.HELD_OUT, the last of the file) and the shipped tuning prompts;
never Spec-Bench.

    python benchmarks/suffix_replay.py --model qwen2.5-coder-1.5b-instruct --quant int4 --out DIR

Step 1 (resumable, written to DIR/truth.json after every prompt): plain greedy decoding of each prompt.
Step 2: each option set drafts at every position of those outputs; the longest path of its tree that the recorded
output follows is accepted, plus the bonus token. Printed per prompt set: tau (tokens per target forward), drafted
nodes per step, and the estimated speedup over plain decoding on this machine's forward-cost curve
(`specdecode cost`; tune/cost.py: the drafting time is left out, a lookup costs well under a millisecond).
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

from tqdm import tqdm

from specdecode.drafters import build_drafter
from specdecode.drafters.datastore import HELD_OUT
from specdecode.engine import generate
from specdecode.models.loading import load_model
from specdecode.sampling import SamplingParams
from specdecode.text import prompt_ids
from specdecode.tune.cost import verify_seconds
from specdecode.tune.machine import capability, cost_report, seconds_by_rows
from specdecode.tune.measure import tune_prompts
from specdecode.train.data import sharegpt_text, split
from specdecode.verify.base import Verdict

GRID = {"corpus": ["none", "sharegpt"], "max_nodes": [3, 5, 7], "alpha": [1.0, 2.0, 4.0], "min_prob": [0.1, 0.2]}


def truth(target, out: Path, tokens: int) -> list[dict]:
    path = out / "truth.json"
    done = json.loads(path.read_text()) if path.exists() else []
    _, held_out = split(sharegpt_text(), 0, HELD_OUT)
    prompts = [("sharegpt", prompt_ids(target.tokenizer, [{"role": "user", "content": c.prompt}])) for c in held_out]
    prompts += [("tune", ids) for ids in tune_prompts(target.tokenizer)]
    for kind, ids in tqdm(prompts[len(done) :], desc="plain greedy outputs", unit="prompt"):
        output, _ = generate(target, build_drafter("none", target), ids, tokens, SamplingParams())
        done.append({"kind": kind, "prompt_ids": ids, "output_ids": output})
        path.write_text(json.dumps(done))
    return done


def replay(target, records: list[dict], options: dict) -> tuple[float, float]:
    """(tokens per target forward, drafted nodes per forward) of the suffix drafter over the recorded outputs."""
    drafter = build_drafter("suffix", target, max_history=0, **options)
    steps = produced = nodes = 0
    for record in records:
        prompt, output = record["prompt_ids"], record["output_ids"]
        drafter.start(prompt, len(prompt) + len(output) + 1)
        done = 1  # the first token comes from the prefill
        while done < len(output):
            draft = drafter.propose(prompt + output[:done], SamplingParams(), None)
            tokens, parents = draft.tokens.tolist(), draft.parents.tolist()
            path, node = [], -1
            while done + len(path) < len(output):
                follow = [i for i, t in enumerate(tokens) if parents[i] == node and t == output[done + len(path)]]
                if not follow:
                    break
                node = follow[0]
                path.append(node)
            new = min(len(path) + 1, len(output) - done)
            accepted = path[: new - 1]
            bonus = output[done + len(accepted)]
            drafter.commit(Verdict(accepted, [tokens[i] for i in accepted], bonus), draft, None)
            done += new
            steps, produced, nodes = steps + 1, produced + new, nodes + len(tokens)
    return produced / steps, nodes / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--quant", default="int4")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    target = load_model(args.model, "bfloat16", "auto", args.quant)
    records = truth(target, args.out, args.tokens)
    curve = seconds_by_rows(cost_report(target))
    one_row = verify_seconds(curve, 1)
    cpu = capability()
    print(f"# {args.model} {args.quant}; {cpu['model']}, {cpu['threads']} threads, flags {' '.join(cpu['flags'])}")
    print(f"{len(records)} plain greedy outputs of up to {args.tokens} tokens; one-row forward {one_row * 1e3:.1f} ms\n")
    print("| prompts | corpus | max_nodes | alpha | min_prob | tau | nodes/step | est. speedup |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for kind in ("sharegpt", "tune"):
        chosen = [r for r in records if r["kind"] == kind]
        for values in itertools.product(*GRID.values()):
            options = dict(zip(GRID, values))
            tau, nodes = replay(target, chosen, options)
            estimate = tau * one_row / verify_seconds(curve, 1 + nodes)
            row = " | ".join(str(options[key]) for key in GRID)
            print(f"| {kind} ({len(chosen)}) | {row} | {tau:.3f} | {nodes:.2f} | {estimate:.3f}x |", flush=True)


if __name__ == "__main__":
    main()
