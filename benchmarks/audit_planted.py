"""`specdecode audit` with a planted bug in the engine, to show on a real model that the audit calls a bug a bug.

    python benchmarks/audit_planted.py --model qwen2.5-coder-1.5b-instruct --quant int4 --drafter pld --per-group 2

takes the same arguments as `specdecode audit`. The planted bug is subtle: draft nodes below depth 1 are verified
at a position one too far (their rotary embedding is shifted), so most steps still accept something and outputs
part only where the shift changes the target's choice. The audit must exit 1 with every divergence a bug.
"""

from __future__ import annotations

import dataclasses
import sys

from specdecode import engine
from specdecode.cli import main
from specdecode.models import base


def off_by_one_positions(*args, **kwargs):
    request = base.tree_request(*args, **kwargs)
    positions = request.positions.clone()  # [N+1]
    positions[positions > positions[0] + 1] += 1
    return dataclasses.replace(request, positions=positions)


if __name__ == "__main__":
    engine.tree_request = off_by_one_positions
    sys.exit(main(["audit", *sys.argv[1:]]))
