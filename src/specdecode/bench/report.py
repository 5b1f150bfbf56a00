"""Markdown report in the Spec-Bench leaderboard layout, a JSON file with every record, and two plots."""

from __future__ import annotations

import json
from pathlib import Path

from ..models.loading import AUTO_QUANT
from . import long_suite
from .metrics import BASELINE, aggregate
from .questions import GROUP_TITLES as SPEC_BENCH_TITLES

GROUP_TITLES = {**SPEC_BENCH_TITLES, **long_suite.GROUP_TITLES}


def write_report(config, records: list[dict], out_dir: Path, machine: dict, when: str) -> dict:
    groups = [g for g in config.groups if any(r["group"] == g for r in records)] or config.groups
    table = aggregate(records, config.methods, groups)
    by_length = metrics_by_length(records, config.methods, groups)
    results = {"config": config.__dict__, "machine": machine, "date": when, "metrics": table, "records": records}
    if by_length:
        results["metrics_by_length"] = by_length
    (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    (out_dir / "report.md").write_text(markdown(config, table, groups, machine, when, records, by_length))
    plot(table, config.methods, groups, out_dir)
    return table


def metrics_by_length(records: list[dict], methods: list[str], groups: list[str]) -> dict:
    """{length label: aggregate(...)} over the long suite's records (those with a `length`), in LENGTHS order."""
    present = {r["length"] for r in records if r.get("length")}
    labels = [label for label in long_suite.LENGTHS if label in present] + sorted(present - set(long_suite.LENGTHS))
    return {label: aggregate([r for r in records if r.get("length") == label], methods, groups) for label in labels}


def weights_label(quant: str) -> str:
    return f"auto ({AUTO_QUANT} on the native backend)" if quant == "auto" else quant


def _fmt(value, spec: str, suffix: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{suffix}"


def markdown(config, table: dict, groups: list[str], machine: dict, when: str, records: list[dict] = (),
             by_length: dict | None = None) -> str:
    """report.md; by_length: metrics_by_length's tables (the long suite), when there are any."""
    sampling = "greedy" if config.temperature == 0 else f"temperature {config.temperature}"
    llama_cpp = any(m.startswith("llama.cpp") for m in config.methods)
    lines = [
        f"# specdecode bench: {config.model}, {config.dtype}, backend {config.backend}, "
        f"weights {weights_label(config.quant)}"
        + (f" (draft models {config.draft_quant})" if config.draft_quant else "") + f", {sampling}",
        "",
        f"- Date: {when}",
        f"- Machine: {machine['cpu']}, {machine['threads']} threads"
        + (f", flags `{' '.join(machine['cpu_flags'])}`, kernels {machine.get('kernels')}"
           if "cpu_flags" in machine else "")
        + f"; {machine['platform']}; "
        f"torch {machine['torch']}, transformers {machine['transformers']}"
        + (f", llama-cpp-python {machine.get('llama_cpp')}" if llama_cpp else "")
        + "".join(f", {engine}" for engine in sorted({r["engine"] for r in records if r.get("engine")})),
        f"- Command: `{config.command}`",
        _questions_line(config, groups, machine),
        f"- {config.max_new_tokens} new tokens at most, {config.repeats} repeat(s); warm-up excluded; "
        "all methods interleaved question by question in one process.",
        "",
        "## Speedup over plain decoding (`none`), same run",
        "",
        "| Method | " + " | ".join(GROUP_TITLES.get(g, g) for g in groups) + " | #Mean accepted tokens | Overall |",
        "|---|" + "---:|" * (len(groups) + 2),
    ]
    for method, row in table.items():
        cells = [_fmt(row[g]["speedup"], ".2f", "x") for g in groups]
        lines.append(f"| {method} | " + " | ".join(cells) + f" | {_fmt(row['overall']['tau'], '.2f')} | "
                     f"{_fmt(row['overall']['speedup'], '.2f', 'x')} |")
    lines += _repeats_section(table, groups, config.repeats)
    lines += [
        "",
        "## Details (all groups)",
        "",
        "| Method | tokens/s | time to first token | decode tok/s | tau | acceptance | draft time | verify time "
        "| other time | identical to plain |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for method, row in table.items():
        m = row["overall"]
        lines.append(
            f"| {method} | {m['tokens_per_second']:.2f} | {_fmt(m['time_to_first_token'], '.2f', ' s')} | "
            f"{_fmt(m['decode_tokens_per_second'], '.2f')} | "
            f"{_fmt(m['tau'], '.2f')} | {_fmt(m['acceptance_rate'], '.1%')} | "
            f"{_fmt(m['draft_share'], '.0%')} | {_fmt(m['verify_share'], '.0%')} | {_fmt(m['other_share'], '.0%')} | "
            f"{_fmt(m['identical_share'] if config.temperature == 0 else None, '.0%')} |"
        )
    weights = {}
    for record in records:  # peer rows that name the weights they ran (openvino: its int4 IR)
        if record.get("weights"):
            weights.setdefault(record["method"], record["weights"])
    if weights:
        lines += ["", "Weights of the peer rows: " + "; ".join(f"`{m}` {w}" for m, w in weights.items()) + "."]
    lines += _approximate_section(table)
    lines += _long_section(by_length or {}, config.methods, groups)
    lines += _options_section(records)
    lines += [
        "",
        "tokens/s is end to end (new tokens / generation time, prefill included); time to first token is the "
        "prefill's time (mean per generation); decode tok/s leaves out the time to the first token and that token. "
        "tau = new tokens / target forward passes (the prefill and the bonus token count). Time shares: drafting, "
        "target verification forwards + acceptance, and the rest (prefill, bookkeeping). Peer rows (hf-*) run "
        "transformers' generate() on the model's transformers weights in the run's dtype (the same weights, except "
        "in an int4/int8 run: transformers has no path for those, so its greedy outputs can differ) and report no "
        "tau; llama.cpp rows run "
        "llama-cpp-python on the model's GGUF file (its quantized weights, so greedy outputs can differ) with the "
        "same prompt token ids and thread count; openvino rows run OpenVINO GenAI on the model exported to "
        "OpenVINO IR with int4 weights (NNCF, group 32, sym), fed the same prompt token ids, with the same thread "
        "count, their time to first token from OpenVINO GenAI's own metrics. "
        f"Identity compares each generation with `{BASELINE}` on the same question and turn (greedy only), a "
        "llama.cpp or openvino row with that peer's own plain row (`llama.cpp`, `openvino`: other weights); in "
        "bfloat16 a near-tie can flip (see `specdecode audit`).",
        "",
        "![speedup per group](speedup.png) ![tau vs tokens/s](tau_vs_tokens_per_second.png)",
        "",
    ]
    return "\n".join(lines)


def _approximate_section(table: dict) -> list[str]:
    """Rows that answer a compressed prompt (SpecPC): not lossless; how much of the prompt the target read, and
    how close the answers stay to plain decoding's of the full prompt."""
    rows = {method: row["overall"] for method, row in table.items() if row["overall"].get("approximate")}
    if not rows:
        return []
    lines = ["", "## Approximate rows (not lossless: the target reads a compressed prompt)", "",
             "| Method | prompt tokens | read by the target | time to first token | ROUGE-L vs plain | identical "
             "| needle found |", "|---|---:|---:|---:|---:|---:|---:|"]
    for method, m in rows.items():
        lines.append(f"| {method} | {_fmt(m['prompt_tokens'], '.0f')} | {_fmt(m['read_prompt_tokens'], '.0f')} | "
                     f"{_fmt(m['time_to_first_token'], '.2f', ' s')} | {_fmt(m['rouge_l'], '.2f')} | "
                     f"{_fmt(m['identical_share'], '.0%')} | {_fmt(m['reference_found'], '.0%')} |")
    lines += ["", "Their time to first token includes the draft model's reading of the whole prompt and the ranking."]
    return lines


def _questions_line(config, groups: list[str], machine: dict) -> str:
    if getattr(config, "suite", "spec-bench") == "long":
        return (f"- Questions: long-input suite built on this machine from Python {machine.get('python', '')}'s "
                f"standard-library sources, {len(config.question_ids)} questions ({', '.join(groups)}) at "
                f"{', '.join(config.long_lengths)} tokens (measured with the target's tokenizer, within 15%), "
                f"ids {config.question_ids}; chat template applied; follow-up second turns answer the method's own "
                "first answer. Each prompt is prefilled once per question for all specdecode methods (the first "
                "to run it; the others restore its KV, bit-exact, and are charged its prefill time in time to first "
                "token and end to end); a follow-up turn reuses the first turn's KV, as the API's prefix cache does. "
                "Peers prefill every prompt themselves.")
    return (f"- Questions: Spec-Bench, {len(config.question_ids)} questions ({', '.join(groups)}), "
            f"ids {config.question_ids}; evenly spaced within each group; chat template applied; "
            f"MT-bench second turns answer the method's own first answer.")


def _long_section(by_length: dict, methods: list[str], groups: list[str]) -> list[str]:
    """Per length and group (metrics_by_length): prompt size, end-to-end tokens/s, time to first token, decode
    tokens/s, speedup; and how often each method's answer held the needle's passphrase."""
    if not by_length:
        return []
    lines = ["", "## Long inputs: per length and group", ""]
    for label, table in by_length.items():
        lines += [f"### {label} tokens", "",
                  "| Group | Method | prompt tokens | tokens/s | time to first token | decode tok/s | speedup |",
                  "|---|---|---:|---:|---:|---:|---:|"]
        for group in [*groups, "overall"]:
            for method in methods:
                m = table[method][group]
                if not m["records"]:
                    continue
                lines.append(
                    f"| {GROUP_TITLES.get(group, 'All groups' if group == 'overall' else group)} | {method} | "
                    f"{_fmt(m['prompt_tokens'], '.0f')} | {m['tokens_per_second']:.2f} | "
                    f"{_fmt(m['time_to_first_token'], '.2f', ' s')} | {_fmt(m['decode_tokens_per_second'], '.2f')} | "
                    f"{_fmt(m['speedup'], '.2f', 'x')} |")
        found = [f"{method} {table[method]['overall']['reference_found']:.0%}" for method in methods
                 if table[method]["overall"]["reference_found"] is not None]
        if found:
            lines += ["", f"Needle passphrase in the answer: {', '.join(found)}."]
        lines.append("")
    return lines


def plot(table: dict, methods: list[str], groups: list[str], out_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(groups) + 2), 4))
    width = 0.8 / max(1, len(methods))
    for i, method in enumerate(methods):
        values = [table[method][g]["speedup"] or 0 for g in groups]
        ax.bar([x + i * width for x in range(len(groups))], values, width, label=method)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(groups))], [GROUP_TITLES.get(g, g) for g in groups],
                  rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("speedup over none")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / "speedup.png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(5, 4))
    for method in methods:
        m = table[method]["overall"]
        if m["tau"] is not None:
            ax.scatter(m["tau"], m["tokens_per_second"])
            ax.annotate(method, (m["tau"], m["tokens_per_second"]), fontsize=7)
    ax.set_xlabel("tau (tokens per target forward)")
    ax.set_ylabel("tokens/s")
    fig.tight_layout()
    fig.savefig(out_dir / "tau_vs_tokens_per_second.png", dpi=120)
    plt.close(fig)


def _repeats_section(table: dict, groups: list[str], repeats: int) -> list[str]:
    """Median (min-max) of each speedup over the repeats, each repeat's speedup from its own records."""
    if "speedup_repeats" not in table[next(iter(table))]["overall"]:
        return []

    def cell(m: dict) -> str:
        spread = m["speedup_repeats"]
        if spread["median"] is None:
            return "n/a"
        return f"{spread['median']:.2f}x ({spread['min']:.2f}-{spread['max']:.2f})"

    return [
        "",
        f"### Across the {repeats} repeats: median (min-max) of each repeat's own speedup",
        "",
        "| Method | " + " | ".join(GROUP_TITLES.get(g, g) for g in groups) + " | Overall |",
        "|---|" + "---:|" * (len(groups) + 1),
        *(f"| {method} | " + " | ".join(cell(row[g]) for g in [*groups, "overall"]) + " |"
          for method, row in table.items()),
    ]


def _options_section(records) -> list[str]:
    """Each engine method's drafter options in effect: given in its spec, or picked by `specdecode tune`."""
    seen: dict[str, dict] = {}
    for record in records:
        if "options" in record:
            seen.setdefault(record["method"], record["options"])
    if not seen:
        return []
    lines = ["", "Drafter options in effect (tuned: the `specdecode tune` profile of this target; sized: set from this "
             "machine's forward-cost curve, `specdecode cost`; governor: plain steps where speculation did not pay):",
             "", "| Method | options | source | governor |", "|---|---|---|---|"]
    for method, options in seen.items():
        chosen = {key: value for key, value in options.items() if key not in ("tuned", "sized", "governor")}
        shown = " ".join(f"{key}={value}" for key, value in chosen.items()) or "(defaults)"
        source = option_source(options, chosen)
        lines.append(f"| {method} | {shown} | {source} | {'on' if options.get('governor') else 'off'} |")
    return lines


def option_source(options: dict, chosen: dict) -> str:
    """Where a row's options came from: the tuned profile, the cost curve (`sized`: the names it set; true in
    records written before it named them), given, or the drafter's defaults."""
    if options.get("tuned"):
        return "tuned profile"
    sized = options.get("sized") or ()
    sized = list(chosen) if sized is True else list(sized)
    given = [key for key in chosen if key not in sized]
    if sized and given:
        return f"given; {', '.join(sized)} sized from the cost curve"
    return "sized from the cost curve" if sized else "given" if given else "defaults"
