"""Aggregate per-question records into per-method, per-group metrics. Pure functions over dicts."""

from __future__ import annotations

import statistics
from collections import defaultdict

BASELINE = "none"
# Peer rows that run other weights than every other row (llama.cpp: the GGUF file's; OpenVINO: its int4 IR): their
# greedy outputs are compared with their own plain row, not with `none`.
PEER_PLAIN_ROWS = ("llama.cpp", "openvino")


def identity_baseline(method: str) -> str:
    """The row whose outputs `method`'s are compared with: its peer's plain row, or `none`."""
    for plain in PEER_PLAIN_ROWS:
        if method == plain or method.startswith((plain + "-", plain + ":")):
            return plain
    return BASELINE


def key(record: dict) -> tuple:
    return (record["question_id"], record["turn"], record["repeat"])


def aggregate(records: list[dict], methods: list[str], groups: list[str]) -> dict:
    """{method: {group or "overall": metrics}}, speedups relative to the baseline on the same records."""
    by_method: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        by_method[r["method"]].append(r)
    table = {}
    for method in methods:
        rows = by_method.get(method, [])
        baseline_tokens = {key(r): r["token_ids"] for r in by_method.get(identity_baseline(method), [])}
        table[method] = {g: summarize([r for r in rows if r["group"] == g], baseline_tokens) for g in groups}
        table[method]["overall"] = summarize(rows, baseline_tokens)
    for method in methods:
        for group, m in table[method].items():
            base = table.get(BASELINE, {}).get(group)
            m["speedup"] = (
                m["tokens_per_second"] / base["tokens_per_second"] if base and base["tokens_per_second"] else None
            )
    repeats = sorted({r["repeat"] for r in records})
    if len(repeats) > 1:
        add_repeat_spread(table, [aggregate([r for r in records if r["repeat"] == k], methods, groups) for k in repeats])
    return table


def add_repeat_spread(table: dict, per_repeat: list[dict]) -> None:
    """Each speedup's median and range over the repeats, each repeat's speedup computed on its own records (the
    pooled speedup alone hides how much one run of the same configuration differs from the next)."""
    for method, row in table.items():
        for group, m in row.items():
            values = [t[method][group]["speedup"] for t in per_repeat if t[method][group]["speedup"] is not None]
            m["speedup_repeats"] = {
                "values": values,
                "median": statistics.median(values) if values else None,
                "min": min(values, default=None),
                "max": max(values, default=None),
            }


def summarize(rows: list[dict], baseline_tokens: dict) -> dict:
    tokens = sum(r["new_tokens"] for r in rows)
    seconds = sum(r["seconds"] for r in rows)
    draft = sum(r.get("draft_seconds") or 0.0 for r in rows)
    verify = sum(r.get("verify_seconds") or 0.0 for r in rows)
    forwards = [r.get("target_forwards") for r in rows]
    drafted = sum(r.get("drafted_tokens") or 0 for r in rows)
    accepted = sum(r.get("accepted_tokens") or 0 for r in rows)
    first_token = [r.get("prefill_seconds") for r in rows]  # the prefill, which yields the first new token
    decode_seconds = seconds - sum(first_token) if rows and None not in first_token else None
    compared = [r for r in rows if key(r) in baseline_tokens]
    prompts = [r["prompt_tokens"] for r in rows if r.get("prompt_tokens") is not None]
    checked = [r["found_reference"] for r in rows if "found_reference" in r]
    return {
        "records": len(rows),
        "new_tokens": tokens,
        "seconds": seconds,
        "tokens_per_second": tokens / seconds if seconds else 0.0,
        "decode_tokens_per_second": (tokens - len(rows)) / decode_seconds if decode_seconds else None,
        "time_to_first_token": sum(first_token) / len(rows) if rows and None not in first_token else None,
        "prompt_tokens": sum(prompts) / len(prompts) if prompts else None,
        "reference_found": sum(checked) / len(checked) if checked else None,  # the needle's passphrase answered
        "tau": tokens / sum(forwards) if rows and None not in forwards and sum(forwards) else None,
        "acceptance_rate": accepted / drafted if drafted else None,
        "draft_share": draft / seconds if seconds else None,
        "verify_share": verify / seconds if seconds else None,
        "other_share": (seconds - draft - verify) / seconds if seconds else None,
        "identical_share": (
            sum(r["token_ids"] == baseline_tokens[key(r)] for r in compared) / len(compared) if compared else None
        ),
        # approximate rows (prompt compression): what they read and how close their answers stay to the baseline's
        "approximate": any(r.get("approximate") for r in rows),
        "read_prompt_tokens": _mean([r["compressed_prompt_tokens"] for r in rows if "compressed_prompt_tokens" in r]),
        "rouge_l": _mean([rouge_l(r["token_ids"], baseline_tokens[key(r)]) for r in compared if r.get("approximate")]),
    }


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def rouge_l(candidate: list[int], reference: list[int]) -> float:
    """ROUGE-L F1 over tokens: the longest common subsequence against both lengths (1.0 = the same tokens)."""
    if not candidate or not reference:
        return float(candidate == reference)
    previous = [0] * (len(reference) + 1)
    for token in candidate:
        current = [0]
        for j, other in enumerate(reference):
            current.append(previous[j] + 1 if token == other else max(previous[j + 1], current[j]))
        previous = current
    common = previous[-1]
    return 2 * common / (len(candidate) + len(reference))
