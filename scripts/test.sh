#!/usr/bin/env bash
# Install (once) and run the test suite. The real-weights tests pull smollm2-135m-instruct (98 MB) on first use.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest "$@"
