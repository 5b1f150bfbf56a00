#!/usr/bin/env bash
# Install (once) and run the test suite. The real-weights tests pull smollm2-135m-instruct (98 MB) on first use.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
# One worker per core (pytest-xdist; most tests compute on one thread), tests handed out as workers free up.
exec .venv/bin/python -m pytest -n auto --dist worksteal "$@"
