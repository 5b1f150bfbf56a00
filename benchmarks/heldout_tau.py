"""Held-out tau of a trained head on more prompts than `train` measures per epoch (its 4 prompts x 48 tokens move
by about 0.1 between runs): greedy decoding of the last N ShareGPT conversations' first turns (which training never
reads; never Spec-Bench), tokens per target forward, and whether each output equals plain greedy decoding's.

The drafter is built as `generate` builds it: options not given come from the target's tuned profile, or else the
tree's size from this machine's forward-cost curve (`specdecode cost`).

    python benchmarks/heldout_tau.py --model smollm2-135m-instruct --kind eagle3 --head DIR [--prompts 16]
        [--tokens 64] [--quant int4] [-o budget=20 -o depth=6]
"""

from __future__ import annotations

import argparse
import json

from specdecode.drafters import build_drafter
from specdecode.drafters.base import parse_options
from specdecode.engine import generate
from specdecode.heads.store import load_head
from specdecode.kernels import cpu_flags
from specdecode.models.loading import load_model
from specdecode.sampling import SamplingParams
from specdecode.text import prompt_ids
from specdecode.train.data import sharegpt_text, split
from specdecode.tune.profile import tuned_drafter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--kind", default="eagle3")
    parser.add_argument("--head", required=True, help="the head's folder")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--quant", default="none", help="the target's weights: none, int8 or int4")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("-o", dest="options", action="append", default=[], help="drafter option KEY=VALUE")
    args = parser.parse_args()
    target = load_model(args.model, args.dtype, quant=args.quant)
    drafter = tuned_drafter(args.kind, target, load_head(args.head), **parse_options(args.options))
    plain = build_drafter("none", target)
    _, held_out = split(sharegpt_text(), 0, args.prompts)  # the conversations training keeps apart
    new = forwards = identical = 0
    for conversation in held_out:
        ids = prompt_ids(target.tokenizer, [{"role": "user", "content": conversation.prompt}])
        tokens, stats = generate(target, drafter, ids, args.tokens, SamplingParams())
        identical += tokens == generate(target, plain, ids, args.tokens, SamplingParams())[0]
        new, forwards = new + stats.new_tokens, forwards + stats.target_forwards
    print(json.dumps({"head": args.head, "options": drafter.options, "sized": list(drafter.sized),
                      "prompts": args.prompts, "tokens": args.tokens,
                      "tau": round(new / forwards, 3), "identical": f"{identical}/{len(held_out)}",
                      "new_tokens": new, "target_forwards": forwards,
                      "cpu_flags": sorted(cpu_flags() & {"avx2", "avx512f", "avx512_vnni", "avx512_bf16"})}))


if __name__ == "__main__":
    main()
