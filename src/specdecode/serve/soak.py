"""A bounded soak test of the server under faults, on loopback.

Concurrent clients send, for a fixed time, good requests (greedy and seeded sampling, chat and completions, streamed
and not) mixed with faults: streams dropped at a random point, requests abandoned mid-answer (concurrent
cancellation), malformed JSON, invalid UTF-8, an oversized body, a prompt longer than the model's context, and a
request whose drafter raises mid-answer. Requests keep arriving while batches run. Afterwards every completed answer
must equal the same request served alone before the soak (float32, so batching cannot flip a tie), no request or
cache slot may be left on the server (/health), its resident memory must be flat, and it must still answer.

The server side (`python -m specdecode.serve.soak --model M --port P`) is `specdecode serve` with one planted fault:
the drafter of FAULT_REQUEST's prompt raises on its second proposal, after its cache has joined the batch pool.
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import httpx

# Good requests (bodies without "model"; every one is also sent streamed). Greedy and seeded sampling: each has one
# right answer, the one it gets when served alone.
REQUESTS = [
    {"path": "chat/completions", "messages": [{"role": "user", "content": "Write a Python function that reverses a "
                                               "linked list."}], "temperature": 0, "max_tokens": 40},
    {"path": "chat/completions", "messages": [{"role": "user", "content": "Name three primary colors."}],
     "temperature": 0, "max_tokens": 24},
    {"path": "completions", "prompt": "1, 2, 3, 4,", "temperature": 0, "max_tokens": 32, "stop": [" 12"]},
    {"path": "chat/completions", "messages": [{"role": "user", "content": "Tell me a short story about a cat."}],
     "temperature": 0.8, "top_p": 0.9, "seed": 7, "max_tokens": 32},
    {"path": "completions", "prompt": "Once upon a time", "temperature": 1.0, "top_k": 20, "seed": 3,
     "max_tokens": 24},
]
# Requests abandoned mid-answer: long enough that the server must cancel them (they would run for minutes).
LONG_REQUEST = {"path": "chat/completions", "messages": [{"role": "user", "content": "Write a very long story about "
                                                          "a dragon."}], "temperature": 0, "max_tokens": 4000}
FAULT_REQUEST = {"path": "chat/completions", "messages": [{"role": "user", "content": "Please fail mid-answer."}],
                 "temperature": 0, "max_tokens": 40}
MAX_BODY_BYTES = 1 << 20  # the soak server's body limit (the oversized fault sends more)

# What each client does next, with its weight; every client starts with its share of the faults, so that each kind
# is injected early even in a short soak.
ACTIONS = {"complete": 4, "stream": 4, "disconnect": 3, "cancel": 2, "malformed_json": 1, "invalid_utf8": 1,
           "oversized": 1, "overlong": 1, "drafter_raises": 1}
FAULTS = [action for action in ACTIONS if action not in ("complete", "stream")]


class PlantedFault(RuntimeError):
    """What the soak server's faulty drafter raises."""


class FaultyDrafter:
    """A drafter that raises on its second proposal when its request's prompt is one of `trigger` (token id lists);
    otherwise the wrapped drafter, unchanged."""

    def __init__(self, inner, trigger: list[list[int]]):
        self.inner, self.trigger = inner, trigger
        self.armed, self.proposals = False, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def start(self, prompt_ids, capacity):
        self.armed, self.proposals = list(prompt_ids) in self.trigger, 0
        self.inner.start(prompt_ids, capacity)

    def propose(self, context, params, generator):
        self.proposals += 1
        if self.armed and self.proposals == 2:
            raise PlantedFault("planted drafter fault (soak test)")
        return self.inner.propose(context, params, generator)


@dataclass
class SoakReport:
    clients: int
    seconds: float = 0.0
    actions: Counter = field(default_factory=Counter)  # action: times sent
    completed: int = 0  # good requests answered in full (streamed or not)
    identical: int = 0  # of those, answers equal to the request served alone
    rejected_as_expected: int = 0  # faults answered with the right status and an OpenAI error body
    problems: list[str] = field(default_factory=list)  # anything else: wrong answers, statuses, bodies, hangs
    health_before: dict = field(default_factory=dict)
    health_after: dict = field(default_factory=dict)
    rss_before_mb: float = float("nan")
    rss_after_mb: float = float("nan")
    rss_mb_every_10s: list[float] = field(default_factory=list)  # during the soak
    settle_seconds: float = float("nan")  # from the clients' end to no request left on the server
    answers_after: bool = False  # the server answered correctly after the soak
    mean_batch: float = float("nan")

    @property
    def faults(self) -> int:
        return sum(n for action, n in self.actions.items() if action not in ("complete", "stream"))

    def as_dict(self) -> dict:
        out = {k: v for k, v in self.__dict__.items()}
        out.update(actions=dict(self.actions), faults=self.faults)
        return out


class Client:
    """One soak client on its own connection pool; every outcome goes to the shared report."""

    def __init__(self, url: str, model: str, expected: dict[int, str], report: SoakReport, lock, seed: int):
        self.url, self.model, self.expected = url.rstrip("/"), model, expected
        self.report, self.lock = report, lock
        self.rng = random.Random(seed)
        self.http = httpx.Client(timeout=120)

    def run(self, stop_at: float, first: list[str]) -> None:
        """`first`, then actions drawn at random, until stop_at."""
        names, weights = list(ACTIONS), list(ACTIONS.values())
        while time.time() < stop_at:
            action = first.pop(0) if first else self.rng.choices(names, weights)[0]
            with self.lock:
                self.report.actions[action] += 1
            try:
                getattr(self, action)()
            except Exception as exc:  # a hang, a dropped connection the client did not ask for
                self.problem(f"{action}: {type(exc).__name__}: {exc}")
        self.http.close()

    def problem(self, text: str) -> None:
        with self.lock:
            self.report.problems.append(text)

    def answered(self, index: int, text: str) -> None:
        with self.lock:
            self.report.completed += 1
            if text == self.expected[index]:
                self.report.identical += 1
            else:
                self.report.problems.append(f"request {index}: {text!r} != alone {self.expected[index]!r}")

    def rejected(self, action: str, response: httpx.Response, status: int, kind: str | None = None) -> None:
        """A fault's answer: the status and an OpenAI error body ({"error": {"message", "type", ...}})."""
        try:
            body = response.json()["error"]
            ok = response.status_code == status and body["message"] and (kind is None or body["type"] == kind)
        except (ValueError, KeyError, TypeError):
            ok = False
        if ok:
            with self.lock:
                self.report.rejected_as_expected += 1
        else:
            self.problem(f"{action}: expected {status}, got {response.status_code} {response.text[:200]!r}")

    def post(self, body: dict, **kwargs) -> httpx.Response:
        body = dict(body, model=self.model)
        return self.http.post(f"{self.url}/v1/{body.pop('path')}", json=body, **kwargs)

    def raw(self, content: bytes) -> httpx.Response:
        return self.http.post(f"{self.url}/v1/chat/completions", content=content,
                              headers={"Content-Type": "application/json"})

    # ---- good requests ----

    def complete(self) -> None:
        index = self.rng.randrange(len(REQUESTS))
        response = self.post(REQUESTS[index])
        if response.status_code != 200:
            return self.problem(f"request {index}: status {response.status_code} {response.text[:200]!r}")
        self.answered(index, answer_text(response.json()))

    def stream(self, drop_after: int | None = None, request: dict | None = None) -> None:
        """A streamed request, read to the end (or dropped after `drop_after` events)."""
        index = self.rng.randrange(len(REQUESTS))
        body = dict(request or REQUESTS[index], model=self.model, stream=True)
        with self.http.stream("POST", f"{self.url}/v1/{body.pop('path')}", json=body) as response:
            if response.status_code != 200:
                return self.problem(f"stream {index}: status {response.status_code}")
            pieces, done = [], False
            for count, line in enumerate(response.iter_lines()):
                if drop_after is not None and count >= drop_after:
                    return  # closing the response drops the connection mid-stream
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                event = json.loads(line.removeprefix("data: "))
                if "error" in event:
                    return self.problem(f"stream {index}: {event['error']}")
                pieces.append(chunk_text(event))
        if not done:
            return self.problem(f"stream {index}: ended without [DONE]")
        self.answered(index, "".join(pieces))

    # ---- faults ----

    def disconnect(self) -> None:
        """A stream dropped at a random point: a short request's (it may have finished) or a long one's."""
        self.stream(self.rng.randrange(1, 12), LONG_REQUEST if self.rng.random() < 0.5 else None)

    def cancel(self) -> None:
        """A long request abandoned after a random wait, before its answer."""
        try:
            response = self.post(LONG_REQUEST, timeout=self.rng.uniform(0.05, 3.0))
        except httpx.TimeoutException:
            return
        self.problem(f"cancel: the long request was answered at once ({response.status_code})")

    def malformed_json(self) -> None:
        self.rejected("malformed_json", self.raw(b'{"messages": [{"role": "user", "content": "hi"}'), 400)

    def invalid_utf8(self) -> None:
        self.rejected("invalid_utf8", self.raw(b'{"messages": [{"role": "user", "content": "\xff\xfe\xc3("}]}'), 400)

    def oversized(self) -> None:
        content = "x" * (MAX_BODY_BYTES + self.rng.randrange(1, 1 << 20))
        self.rejected("oversized", self.post(dict(REQUESTS[1], messages=[{"role": "user", "content": content}])), 413)

    def overlong(self) -> None:
        """A prompt longer than any context the shipped models take, under the body limit."""
        self.rejected("overlong", self.post(dict(REQUESTS[2], prompt="hello " * 40000)), 400)

    def drafter_raises(self) -> None:
        if self.rng.random() < 0.5:
            return self.rejected("drafter_raises", self.post(FAULT_REQUEST), 500, "server_error")
        body = dict(FAULT_REQUEST, model=self.model, stream=True)
        with self.http.stream("POST", f"{self.url}/v1/{body.pop('path')}", json=body) as response:
            events = [json.loads(line.removeprefix("data: ")) for line in response.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
        if not (events and events[-1].get("error", {}).get("type") == "server_error"):
            return self.problem(f"drafter_raises (streamed): last event {events[-1:]}")
        with self.lock:
            self.report.rejected_as_expected += 1


def answer_text(reply: dict) -> str:
    choice = reply["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def chunk_text(event: dict) -> str:
    choice = event["choices"][0] if event.get("choices") else {}
    return choice.get("delta", {}).get("content") or choice.get("text") or ""


def alone(url: str, model: str) -> dict[int, str]:
    """Each good request's answer, served alone (one at a time, nothing else on the server)."""
    client = Client(url, model, {}, SoakReport(0), threading.Lock(), 0)
    answers = {}
    for index, request in enumerate(REQUESTS):
        response = client.post(request)
        response.raise_for_status()
        answers[index] = answer_text(response.json())
    client.http.close()
    return answers


def health(url: str) -> dict:
    return httpx.get(url.rstrip("/") + "/health", timeout=30).json()


def rss_mb(pid: int) -> float:
    """Resident memory of a process on this machine (Linux)."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def settled_rss_mb(pid: int, seconds: float = 10) -> float:
    """Resident memory once it has stopped falling for 2 s (an idle server gives freed memory back at once and again
    a second later: scheduler.IDLE_TRIM_SECONDS), or after `seconds`."""
    readings, deadline = [rss_mb(pid)], time.time() + seconds
    while time.time() < deadline:
        time.sleep(1.0)
        readings.append(rss_mb(pid))
        if len(readings) >= 3 and max(readings[-3:]) - min(readings[-3:]) < 1:
            break
    return readings[-1]


def settle(url: str, seconds: float = 30) -> tuple[dict, float]:
    """(/health, seconds waited) once no request is left on the server (abandoned requests end at their next step),
    or after `seconds` (abandoned long requests that were not cancelled would still be running)."""
    begin = time.perf_counter()
    while True:
        state = health(url)
        waited = time.perf_counter() - begin
        if (state["active_requests"] == 0 and state["cache_slots"] == 0) or waited > seconds:
            return state, waited
        time.sleep(0.1)


def run_soak(url: str, server_pid: int, clients: int, duration: float, seed: int = 0) -> SoakReport:
    """Soak the server at `url` (process `server_pid`, on this machine) with `clients` clients for `duration` s."""
    model = httpx.get(url.rstrip("/") + "/v1/models", timeout=30).json()["data"][0]["id"]
    expected = alone(url, model)  # also warms the server up before its memory is read
    report = SoakReport(clients)
    report.health_before, report.rss_before_mb = settle(url)[0], rss_mb(server_pid)
    lock = threading.Lock()
    begin = time.perf_counter()
    stop_at = time.time() + duration
    threads = [threading.Thread(target=Client(url, model, expected, report, lock, seed * 1000 + k).run,
                                args=(stop_at, FAULTS[k::clients])) for k in range(clients)]
    for thread in threads:
        thread.start()
    while any(thread.is_alive() for thread in threads):
        sample_at = time.time() + 10
        for thread in threads:
            thread.join(max(0.0, sample_at - time.time()))
        report.rss_mb_every_10s.append(rss_mb(server_pid))
    report.seconds = time.perf_counter() - begin
    (report.health_after, report.settle_seconds), report.rss_after_mb = settle(url), settled_rss_mb(server_pid)
    batches = report.health_after["batches"] - report.health_before["batches"]
    if batches:
        report.mean_batch = (report.health_after["batched_requests"] - report.health_before["batched_requests"]) / batches
    report.answers_after = alone(url, model) == expected
    return report


@contextmanager
def soak_server(model: str, drafter: str = "pld", max_batch: int = 8, start_timeout: float = 300) -> Iterator[tuple]:
    """(url, process) of a soak server (the planted drafter fault, serve() below) on a free loopback port, stopped
    on exit."""
    with server_process(["-m", "specdecode.serve.soak", "--model", model, "--drafter", drafter,
                         "--max-batch", str(max_batch)], start_timeout) as running:
        yield running


@contextmanager
def server_process(arguments: list[str], start_timeout: float = 300) -> Iterator[tuple]:
    """(url, process) of `python ARGUMENTS --port P` on a free loopback port P, once it answers /health; stopped on
    exit. Its stderr (tracebacks, planted or not) goes to a file, not a pipe that could fill and stall it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryFile("w+") as stderr:
        proc = subprocess.Popen([sys.executable, *arguments, "--port", str(port)], stdout=subprocess.DEVNULL,
                                stderr=stderr)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.time() + start_timeout
            while True:
                try:
                    if httpx.get(url + "/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(0.3)
                if proc.poll() is not None or time.time() > deadline:
                    stderr.seek(0)
                    raise RuntimeError(f"the server did not start: {stderr.read()[-2000:]}")
            yield url, proc
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:  # uvicorn waits for open requests: a failed run may leave some
                proc.kill()
                proc.wait(timeout=30)


def serve(argv: list[str] | None = None) -> None:
    """`specdecode serve` (loopback, float32) with the planted drafter fault for FAULT_REQUEST."""
    import uvicorn

    from ..arguments import add_model_args, decoder_from_args
    from . import create_app

    parser = argparse.ArgumentParser(prog="python -m specdecode.serve.soak")
    add_model_args(parser)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--max-batch", type=int, default=8)
    args = parser.parse_args(["--dtype", "float32", *(argv or [])])
    decoder = decoder_from_args(args)
    fault_prompt = FAULT_REQUEST["messages"]
    trigger = [decoder.encode(fault_prompt, chat=True)]
    new_drafter = decoder.new_drafter
    decoder.new_drafter = lambda: FaultyDrafter(new_drafter(), trigger)
    app = create_app(decoder, args.model, None, 64, args.max_batch, max_body_bytes=MAX_BODY_BYTES)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="error")


if __name__ == "__main__":
    serve(sys.argv[1:])
