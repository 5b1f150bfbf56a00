"""Identical answers under load in the default configuration: `specdecode serve` with a drafter answers N identical
concurrent greedy chat requests (official `openai` client) as it answers one request alone, and as
`specdecode generate --drafter none` answers the same question (plain decoding, one request).

    python benchmarks/concurrent_identity.py --model smollm2-135m-instruct --drafter pld
    python benchmarks/concurrent_identity.py --model qwen2.5-coder-1.5b-instruct --drafter draft \
        --serve-args "--draft-model qwen2.5-coder-0.5b-instruct"

Prints one JSON line: the answers' agreement and the server's batching counters.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import threading

import httpx
import openai

from specdecode.serve.soak import server_process

QUESTIONS = ["Write a Python function that checks whether a string is a palindrome.", "Name three primary colors."]


def plain_answer(model: str, question: str, tokens: int) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "specdecode.cli", "generate", "--model", model, "--drafter", "none", "--chat",
         "--prompt", question, "--max-new-tokens", str(tokens), "--json"], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)["text"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--drafter", required=True)
    parser.add_argument("--serve-args", default="", help="more `specdecode serve` options (quoted)")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    serve = ["-m", "specdecode.cli", "serve", "--model", args.model, "--drafter", args.drafter,
             *shlex.split(args.serve_args)]
    with server_process(serve, start_timeout=600) as (base, _):
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=600)
        for question in QUESTIONS:
            def ask() -> str:
                return client.chat.completions.create(
                    model=args.model, messages=[{"role": "user", "content": question}], temperature=0,
                    max_tokens=args.max_tokens).choices[0].message.content

            alone = ask()
            before = httpx.get(base + "/health").json()
            answers: list[str] = []
            threads = [threading.Thread(target=lambda: answers.append(ask())) for _ in range(args.clients)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            after = httpx.get(base + "/health").json()
            plain = plain_answer(args.model, question, args.max_tokens)
            print(json.dumps({
                "model": args.model, "drafter": args.drafter, "serve_args": args.serve_args, "question": question,
                "concurrent_identical_to_alone": sum(a == alone for a in answers), "clients": args.clients,
                "alone_identical_to_plain_generate": alone == plain,
                "batches": after["batches"] - before["batches"],
                "batched_requests": after["batched_requests"] - before["batched_requests"],
                "answer": alone[:120]}), flush=True)


if __name__ == "__main__":
    main()
