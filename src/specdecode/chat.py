"""specdecode chat: a terminal conversation, streamed, with a local model or an OpenAI-compatible server."""

from __future__ import annotations

import sys

from .engine import Stats

PROMPT = "you> "


def _turns():
    while True:
        try:
            line = input(PROMPT)
        except EOFError:
            return
        if line.strip() in ("/exit", "/quit"):
            return
        if line.strip():
            yield line


def chat_local(decoder, max_new_tokens: int, sampling: dict) -> int:
    """Each turn sends the whole conversation; the decoder's prefix cache holds the previous turn's prompt KV, so a
    turn prefills only the last answer and its new message."""
    messages: list[dict] = []
    for line in _turns():
        messages.append({"role": "user", "content": line})
        stats, pieces = Stats(), []
        for chunk in decoder.stream(messages, max_new_tokens, chat=True, stats=stats, **sampling):
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
            pieces.append(chunk.text)
        reused = f", {stats.reused_prompt_tokens} prompt tokens reused" if stats.reused_prompt_tokens else ""
        print(f"\n[{stats.tokens_per_second:.1f} tokens/s, tau {stats.tau:.2f}{reused}]", file=sys.stderr)
        messages.append({"role": "assistant", "content": "".join(pieces)})
    return 0


def chat_remote(url: str, api_key: str | None, max_new_tokens: int, sampling: dict) -> int:
    from openai import OpenAI

    client = OpenAI(base_url=url, api_key=api_key or "none")
    model = client.models.list().data[0].id
    messages: list[dict] = []
    for line in _turns():
        messages.append({"role": "user", "content": line})
        stream = client.chat.completions.create(
            model=model, messages=messages, stream=True, max_tokens=max_new_tokens,
            temperature=sampling["temperature"], top_p=sampling["top_p"], seed=sampling["seed"],
        )
        pieces = []
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                sys.stdout.write(chunk.choices[0].delta.content)
                sys.stdout.flush()
                pieces.append(chunk.choices[0].delta.content)
        print()
        messages.append({"role": "assistant", "content": "".join(pieces)})
    return 0
