"""What this machine makes of a target: the CPU's capability, the kernels that run, and the cost of one target
forward per number of scored rows (`specdecode cost`). Cached per machine, model and weight format.

The curve sizes drafts where nobody tuned them: `sized_options` picks the chain depth and the tree size that
maximize E[tokens per step] / t_verify(rows) under a generic acceptance model (Sequoia's objective, Chen et al.,
2024), so a drafter's defaults follow the hardware (a flat curve affords deep trees, a steep one short chains)
instead of numbers fixed in code. `specdecode tune` refines this with measured acceptance.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import torch
from tqdm import tqdm

from .. import kernels
from ..files import cache_root, write_text_atomic
from ..tree import sequoia_tree
from .cost import verify_seconds

ROWS = (1, 2, 4, 8, 16, 32)
CONTEXT = 300  # tokens before the measured forwards
FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_bf16",
         "amx_int8")
# The generic acceptance model behind the sized defaults: a chain's next token is accepted with CHAIN_ACCEPT; in a
# tree, a node's r-th ranked child is the accepted one with TREE_ACCEPT[r] (Sequoia's default shape).
CHAIN_ACCEPT = 0.6
TREE_ACCEPT = (0.6, 0.12, 0.05, 0.03)


def capability() -> dict:
    """The CPU: model, threads torch uses, the flags that matter here, and how bfloat16 runs."""
    flags = kernels.cpu_flags()
    return {
        "model": kernels.cpu_model(),
        "threads": torch.get_num_threads(),
        "flags": [flag for flag in FLAGS if flag in flags],
        "bfloat16": "native" if kernels.bfloat16_native() else "emulated (no AVX512_BF16/AMX)",
        "isa": kernels.native().isa if kernels.native() else kernels.best_isa(),  # what the build runs
    }


def kernels_in_use(target) -> dict:
    """Which kernels a target's forward runs."""
    ops = getattr(target, "ops", None)
    if ops is not None and ops.exact:
        return {
            "linear": f"specdecode {target.quant} x int8 ({ops.kernels.isa})",
            "attention": f"specdecode tree attention ({ops.kernels.isa})",
            "rows": "bit-exact: an N-row forward equals N one-row forwards",
        }
    quantized = target.quant != "none"
    return {
        "linear": f"torch ({'dequantized ' if quantized else ''}{str(target.dtype).removeprefix('torch.')})",
        "attention": "torch scaled_dot_product_attention",
        "rows": "rounding may differ between an N-row and a one-row forward",
        "note": kernels.status() if quantized else "dense weights run on torch's kernels",
    }


def curve_path(target, context: int = CONTEXT) -> Path:
    """Where the curve after `context` tokens is cached for this machine, kernel build and target."""
    cpu = capability()
    # a new build of the kernels is measured anew: its speed is what the curve is about
    machine = f"{cpu['model']}:{','.join(cpu['flags'])}:{cpu['threads']}:{cpu['isa']}:{kernels.build_id()}"
    digest = hashlib.sha256(machine.encode()).hexdigest()[:12]
    key = f"{target.name}-{str(target.dtype).removeprefix('torch.')}-{target.quant}-{type(target).__name__}-{digest}"
    if target.kv_cache != "auto":
        key += f"-kv{target.kv_cache}"
    if context != CONTEXT:
        key += f"-context{context}"
    return cache_root() / "cost" / (re.sub(r"[^A-Za-z0-9._-]+", "_", key) + ".json")


def context_ids(vocab_size: int, length: int = CONTEXT) -> list[int]:
    """`length` token ids spread over the vocabulary: a forward's cost does not depend on which tokens they are."""
    return [(7919 * i + 13) % vocab_size for i in range(length)]


def measure(target, repeats: int = 5, context: int = CONTEXT) -> dict:
    """The report `specdecode cost` prints: cpu, kernels, and the curve [{rows, ms, ratio}, ...] of forwards after
    `context` tokens (at long contexts attention, which every row pays over every cached key, steepens it).

    The first run on a machine measures right after converting and caching gigabytes of weights: pending writes are
    flushed first, so that writing them back does not compete with the forwards, and each size keeps its fastest of
    `repeats` rounds. The curve is cached and sizes every draft on this machine: a curve measured in a busy moment
    comes out steep and makes every draft too small."""
    from .measure import verify_curve

    if hasattr(os, "sync"):
        os.sync()
    with tqdm(total=len(ROWS) * repeats, desc="forward cost", unit="forward") as bar:
        seconds = verify_curve(target, context_ids(target.vocab_size, context), 0, repeats, bar, sizes=list(ROWS))
    one = seconds[1]
    curve = [{"rows": q, "ms": round(s * 1e3, 3), "ratio": round(s / one, 3)} for q, s in sorted(seconds.items())]
    return {"cpu": capability(), "kernels": kernels_in_use(target), "context": context, "curve": curve}


_reports: dict[Path, dict] = {}  # curve file -> its report, read once per process (drafters are built per request)


def cost_report(target, refresh: bool = False, context: int = CONTEXT) -> dict:
    """The cached report for this machine and target after `context` tokens, measured (and cached) when missing or
    `refresh`."""
    path = curve_path(target, context)
    if path in _reports and not refresh:
        return _reports[path]
    report = None
    if path.exists() and not refresh:
        try:
            report = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            pass
    if report is None:
        report = measure(target, context=context)
        write_text_atomic(path, json.dumps(report, indent=1))
    _reports[path] = report
    return report


def seconds_by_rows(report: dict) -> dict[int, float]:
    return {point["rows"]: point["ms"] / 1e3 for point in report["curve"]}


def sized(curve: dict[int, float]) -> dict[str, int]:
    """The chain depth and the tree size (nodes) that make the most tokens per second on this curve under the
    generic acceptance model (module docstring); the root is scored with every draft."""

    def chain_rate(depth: int) -> float:
        expected = sum(CHAIN_ACCEPT**i for i in range(depth + 1))
        return expected / verify_seconds(curve, depth + 1)

    def tree_rate(nodes: int) -> float:
        expected, _ = sequoia_tree(nodes, 8, TREE_ACCEPT)
        return expected / verify_seconds(curve, nodes + 1)

    return {"depth": max(range(1, 13), key=chain_rate), "nodes": max(range(1, 33), key=tree_rate)}


def measured_contexts(target) -> list[int]:
    """The contexts above CONTEXT whose curve is cached for this machine and target (`specdecode cost --context N`)."""
    base = curve_path(target)
    found = (re.fullmatch(re.escape(base.stem) + r"-context(\d+)", path.stem)
             for path in base.parent.glob(base.stem + "-context*.json"))
    return sorted(int(match[1]) for match in found if match and int(match[1]) > CONTEXT)


class ContextSizing:
    """Draft size caps by the request's current context length. Every verified row attends over every cached key,
    so the cost curve steepens with the context, and a draft sized on the curve after CONTEXT tokens verifies too
    many rows after 16k. Where curves after longer contexts are cached (`specdecode cost --context N`), a step after
    at least N tokens keeps its draft within the chain depth and tree size that pay most on the longest such curve
    (`sized`); below every measured context nothing is capped."""

    def __init__(self, caps: dict[int, dict[str, int]]):
        self.caps = dict(sorted(caps.items()))  # context -> {"depth": d} and/or {"nodes": n}

    @classmethod
    def for_target(cls, target, roles: set[str]) -> "ContextSizing | None":
        """Caps of these roles ("depth", "nodes") from the target's cached long-context curves; None without any."""
        caps = {}
        for context in measured_contexts(target):
            size = sized(seconds_by_rows(cost_report(target, context=context)))
            caps[context] = {role: size[role] for role in roles}
        return cls(caps) if caps else None

    def at(self, length: int) -> dict[str, int]:
        """The caps for a step after `length` tokens ({} below every measured context)."""
        caps = {}
        for context, sizes in self.caps.items():
            if context <= length:
                caps = sizes
        return caps


def sized_options(drafter_cls, curve: dict[int, float]) -> dict:
    """The drafter's size options (its `sizes`: option -> "depth" or "nodes") set from the curve."""
    size = sized(curve)
    return {option: size[role] for option, role in drafter_cls.sizes.items()}
