"""A longer soak of the server under faults than the test suite's 30 s, written up as a report.

    python benchmarks/soak.py --model smollm2-135m-instruct --clients 4 --minutes 10 \
        --out benchmarks/results/DATE_MACHINE_smollm2-135m_serve-soak

writes report.json (specdecode.serve.soak.SoakReport) and report.md (the command, the machine, what was sent, what
came back, slots and memory before and after). Exit status 1 if the soak found a problem.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

from specdecode.tune.machine import capability
from specdecode.serve.soak import run_soak, soak_server


def markdown(report: dict, command: str, cpu: dict) -> str:
    ok = not report["problems"]
    rss = ", ".join(f"{mb:.0f}" for mb in report["rss_mb_every_10s"])
    lines = [
        f"# Server soak under faults: {report['model']}, {report['drafter']}, {report['clients']} clients",
        "",
        f"- Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        f"- Machine: {cpu['model']}, {cpu['threads']} threads, flags {' '.join(cpu['flags'])}; "
        f"{platform.platform()}",
        f"- Command: `{command}`",
        f"- Result: **{'passed' if ok else 'FAILED'}**",
        "",
        "| | |",
        "|---|---|",
        f"| duration | {report['seconds']:.0f} s, {report['clients']} concurrent clients |",
        f"| sent | {', '.join(f'{k} {v}' for k, v in sorted(report['actions'].items()))} |",
        f"| faults injected | {report['faults']} |",
        f"| good requests completed | {report['completed']} |",
        f"| identical to the request served alone | {report['identical']} |",
        f"| faults refused as expected | {report['rejected_as_expected']} |",
        f"| problems | {len(report['problems'])} |",
        f"| mean batch (requests per verification forward) | {report['mean_batch']:.2f} |",
        f"| requests / cache slots before | {report['health_before']['active_requests']} / "
        f"{report['health_before']['cache_slots']} |",
        f"| requests / cache slots after | {report['health_after']['active_requests']} / "
        f"{report['health_after']['cache_slots']} (settled in {report['settle_seconds']:.2f} s) |",
        f"| resident memory before / after | {report['rss_before_mb']:.0f} MB / {report['rss_after_mb']:.0f} MB |",
        f"| resident memory every 10 s during the soak | {rss} MB |",
        f"| answers correctly afterwards | {report['answers_after']} |",
        "",
        "Good requests are greedy or seeded-sampling chat and completion requests, streamed and not; every completed "
        "answer is compared with the same request served alone before the soak (float32). Faults: streams dropped "
        "mid-answer (disconnect), requests abandoned mid-answer (cancel), malformed JSON, invalid UTF-8, an oversized "
        "body, a prompt longer than the context, and a drafter that raises mid-answer (specdecode.serve.soak).",
    ]
    lines += [f"- problem: {p}" for p in report["problems"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--drafter", default="pld")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--minutes", type=float, default=10)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    command = "python benchmarks/soak.py " + " ".join(sys.argv[1:] if argv is None else argv)
    with soak_server(args.model, args.drafter) as (url, server):
        report = run_soak(url, server.pid, clients=args.clients, duration=60 * args.minutes).as_dict()
    report.update(model=args.model, drafter=args.drafter)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / "report.md").write_text(markdown(report, command, capability()))
    print((args.out / "report.md").read_text())
    return 1 if report["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
