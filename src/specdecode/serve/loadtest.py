"""A bounded load test against a running server on loopback: N concurrent clients for a fixed time, every answer
checked against the server's own answer to the same request served alone (greedy, so it must be identical)."""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass, field

PROMPTS = [
    "Write a Python function that reverses a linked list.",
    "Explain what a hash table is in two sentences.",
    "List five prime numbers and explain why they are prime.",
    "Translate 'good morning, how are you?' into Spanish and French.",
]


@dataclass
class LoadResult:
    clients: int
    seconds: float
    latencies: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    wrong: int = 0
    failed: int = 0
    mean_batch: float = float("nan")  # requests verified per target forward on the server (its /health counters)

    @property
    def requests(self) -> int:
        return len(self.latencies)

    def percentile(self, q: float) -> float:
        if not self.latencies:
            return float("nan")
        return statistics.quantiles(self.latencies, n=100, method="inclusive")[int(q) - 1] if len(self.latencies) > 1 else self.latencies[0]

    def line(self) -> str:
        return (
            f"clients {self.clients}: {self.requests} requests in {self.seconds:.1f} s, "
            f"{self.requests / self.seconds:.3f} req/s, {self.completion_tokens / self.seconds:.1f} tokens/s, "
            f"latency p50 {self.percentile(50):.2f} s p90 {self.percentile(90):.2f} s p99 {self.percentile(99):.2f} s, "
            f"mean batch {self.mean_batch:.2f}, wrong {self.wrong}, failed {self.failed}"
        )


def run_load(url: str, api_key: str | None, clients: int, duration: float, max_tokens: int, expected: dict) -> LoadResult:
    from openai import OpenAI

    client = OpenAI(base_url=url, api_key=api_key or "none", max_retries=0, timeout=600)
    model = client.models.list().data[0].id
    result = LoadResult(clients, 0.0)
    lock = threading.Lock()
    stop_at = time.time() + duration

    def worker(index: int):
        i = index
        while time.time() < stop_at:
            prompt = PROMPTS[i % len(PROMPTS)]
            i += 1
            start = time.perf_counter()
            try:
                reply = client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=max_tokens
                )
            except Exception:
                with lock:
                    result.failed += 1
                continue
            with lock:
                result.latencies.append(time.perf_counter() - start)
                result.completion_tokens += reply.usage.completion_tokens
                result.wrong += reply.choices[0].message.content != expected[prompt]

    before = batch_counters(url)
    begin = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    result.seconds = time.perf_counter() - begin
    after = batch_counters(url)
    if before and after and after[0] > before[0]:
        result.mean_batch = (after[1] - before[1]) / (after[0] - before[0])
    return result


def batch_counters(url: str) -> tuple[int, int] | None:
    """(verification batches, requests verified in them) from a specdecode server's /health; None elsewhere."""
    import httpx

    try:
        health = httpx.get(url.removesuffix("/").removesuffix("/v1") + "/health", timeout=10).json()
        return health["batches"], health["batched_requests"]
    except (httpx.HTTPError, ValueError, KeyError):
        return None


def expected_answers(url: str, api_key: str | None, max_tokens: int) -> dict:
    from openai import OpenAI

    client = OpenAI(base_url=url, api_key=api_key or "none", max_retries=0, timeout=600)
    model = client.models.list().data[0].id
    return {
        p: client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": p}], temperature=0, max_tokens=max_tokens
        ).choices[0].message.content
        for p in PROMPTS
    }
