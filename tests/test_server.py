"""The real server on loopback, driven by the official openai client (and raw HTTP for malformed requests)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from specdecode.cli import main

pytestmark = pytest.mark.real_model
MODEL = "smollm2-135m-instruct"
KEY = "test-key"
QUESTION = "Name three primary colors."


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(*extra: str):
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "specdecode.cli", "serve", "--model", MODEL, "--drafter", "pld", "--port", str(port),
         "--api-key", KEY, *extra],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"),  # the test process shares the CPU: no thread waits at a barrier
    )
    base = f"http://127.0.0.1:{port}"
    for _ in range(240):
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.5)
        if proc.poll() is not None:
            raise RuntimeError(proc.stderr.read())
    else:
        proc.kill()
        raise RuntimeError(f"the server at {base} never answered /health in 120 s: {proc.stderr.read()[-2000:]}")
    yield base
    proc.terminate()
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def server(smollm2):  # smollm2: pulled before the server starts
    yield from start_server()


@pytest.fixture(scope="module")
def hf_server(smollm2):  # the transformers backend, whose forward_batch runs a batch as one padded forward
    yield from start_server("--backend", "hf", "--dtype", "float32")


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=120)


def cli_answer(capsys, *extra: str) -> dict:
    """`specdecode generate` in the default configuration (the server's: no --dtype, no --quant)."""
    assert main(["generate", "--model", MODEL, "--chat", "--prompt", QUESTION, "--max-new-tokens", "40", "--json",
                 *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_models(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_greedy_chat_matches_generate_streamed_and_not(client, capsys):
    expected = cli_answer(capsys)
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], temperature=0, max_tokens=40
    )
    assert reply.choices[0].message.content == expected["text"]
    assert reply.usage.completion_tokens == expected["new_tokens"]
    speculative = reply.model_extra["speculative"]
    # every target forward yields one token (the prefill's first, each step's bonus), accepted drafts the rest
    # (less any accepted past an end-of-sequence token)
    assert speculative["target_forwards"] <= expected["new_tokens"]
    assert expected["new_tokens"] <= speculative["target_forwards"] + speculative["accepted_tokens"]
    assert speculative["tau"] == pytest.approx(expected["new_tokens"] / speculative["target_forwards"])
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], temperature=0, max_tokens=40, stream=True
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected["text"]
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert chunks[-1].usage.completion_tokens == expected["new_tokens"]


def test_completions_and_stop_strings(client):
    reply = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", temperature=0, max_tokens=30, stop=[" 7"])
    assert " 7" not in reply.choices[0].text and reply.choices[0].finish_reason == "stop"


def test_sampling_through_the_server_is_the_engines_sampling(client, capsys):
    """A seeded sampled request gets exactly what `generate` samples with the same drafter, seed and warping."""
    def sampled(seed: int) -> str:
        return client.completions.create(model=MODEL, prompt="Once upon a time", temperature=0.8, top_p=0.9,
                                         seed=seed, max_tokens=12).choices[0].text

    assert main(["generate", "--model", MODEL, "--drafter", "pld", "--prompt", "Once upon a time", "--temperature",
                 "0.8", "--top-p", "0.9", "--seed", "3", "--max-new-tokens", "12", "--json"]) == 0
    assert sampled(3) == json.loads(capsys.readouterr().out)["text"]
    assert len({sampled(seed) for seed in (3, 4, 5, 6)}) > 1  # the seed is used: sampling, not greedy


@pytest.mark.parametrize(
    "change,status",
    [
        ({"temperature": 3}, 400),
        ({"top_p": 0}, 400),
        ({"n": 2}, 400),
        ({"max_tokens": 0}, 400),
        ({"messages": []}, 400),
        ({"model": "gpt-4"}, 404),
        ({"messages": [{"role": "user", "content": "hello " * 9000}]}, 400),
    ],
)
def test_bad_requests_get_openai_style_errors(server, change, status):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **change}
    r = httpx.post(server + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == status, r.text
    assert set(r.json()["error"]) >= {"message", "type"}


def test_malformed_json_and_missing_key(server):
    r = httpx.post(server + "/v1/chat/completions", content=b"{not json", timeout=30,
                   headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server + "/v1", api_key="wrong", max_retries=0).models.list()


def test_disconnect_mid_stream_cancels_and_others_keep_being_served(server, client):
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Write a very long story."}],
            "max_tokens": 4000, "temperature": 0, "stream": True}
    with httpx.stream("POST", server + "/v1/chat/completions", json=body, headers=headers, timeout=60) as r:
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
    deadline = time.time() + 30
    while httpx.get(server + "/health").json()["active_requests"] and time.time() < deadline:
        time.sleep(0.2)
    assert httpx.get(server + "/health").json()["active_requests"] == 0
    assert client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=5, temperature=0).choices[0].message.content


def test_an_abandoned_request_is_cancelled(server):
    """A client that gives up on a (non-streamed) request: the server stops decoding it and frees its slot."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Write a very long story."}],
            "max_tokens": 100, "temperature": 0}
    headers = {"Authorization": f"Bearer {KEY}"}
    start = time.time()
    answer = httpx.post(server + "/v1/chat/completions", json=body, headers=headers, timeout=120).json()
    per_token = (time.time() - start) / answer["usage"]["completion_tokens"]  # this machine's pace, however busy
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server + "/v1/chat/completions", json={**body, "max_tokens": 4000}, headers=headers, timeout=2)
    deadline = time.time() + 1000 * per_token  # a quarter of what its 4000 tokens would take
    while httpx.get(server + "/health").json()["active_requests"] and time.time() < deadline:
        time.sleep(0.1)
    assert httpx.get(server + "/health").json()["active_requests"] == 0


def test_identical_concurrent_requests_answer_as_one_request_and_plain_decoding(server, client, capsys):
    """The default configuration (no --dtype, no --quant: int8 weights on the row-exact kernels) is batch-invariant:
    four identical greedy requests at once, batched with each other's drafts, each get the answer of one request
    alone and of plain decoding (`generate --drafter none`)."""
    plain = cli_answer(capsys, "--drafter", "none")["text"]
    ask = lambda: client.chat.completions.create(  # noqa: E731
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], temperature=0, max_tokens=40
    ).choices[0].message.content
    alone = ask()
    before = httpx.get(server + "/health").json()
    answers: list[str] = []
    threads = [threading.Thread(target=lambda: answers.append(ask())) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    after = httpx.get(server + "/health").json()
    assert answers == [plain] * 4 and alone == plain
    assert after["batched_requests"] - before["batched_requests"] > after["batches"] - before["batches"]


@pytest.mark.parametrize("backend_server", ["server", "hf_server"])
def test_concurrent_requests_are_batched_and_each_gets_its_answer_alone(request, backend_server):
    server = request.getfixturevalue(backend_server)
    client = openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=120)
    prompts = ["Count from 1 to 10.", "What is 2+2?", "Name a fruit.", "Say hello in French."]
    expected = {p: client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": p}],
                                                  temperature=0, max_tokens=24).choices[0].message.content
                for p in prompts}
    before = httpx.get(server + "/health").json()
    results: dict[str, str] = {}

    def ask(p):
        results[p] = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": p}],
                                                    temperature=0, max_tokens=24).choices[0].message.content

    threads = [threading.Thread(target=ask, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert results == expected
    after = httpx.get(server + "/health").json()
    batches = after["batches"] - before["batches"]
    assert after["batched_requests"] - before["batched_requests"] > batches  # some forwards verified several
