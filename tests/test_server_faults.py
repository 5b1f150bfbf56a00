"""The server under faults: a drafter that raises, bodies it cannot read, and a bounded soak of concurrent clients
mixing good requests with every fault (specdecode.serve.soak; benchmarks/soak.py runs it longer, as a report)."""

from __future__ import annotations

import json

import pytest
from starlette.testclient import TestClient

from specdecode.api import SpecDecoder
from specdecode.serve import create_app
from specdecode.serve.soak import FAULT_REQUEST, FAULTS, REQUESTS, FaultyDrafter, run_soak, soak_server

pytestmark = pytest.mark.real_model
MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def app(smollm2):
    """The app in this process (no socket), with the soak's planted drafter fault and a 4 kB body limit."""
    decoder = SpecDecoder(smollm2, "pld", dtype="float32")
    trigger = [decoder.encode(FAULT_REQUEST["messages"], chat=True)]
    new_drafter = decoder.new_drafter
    decoder.new_drafter = lambda: FaultyDrafter(new_drafter(), trigger)
    with TestClient(create_app(decoder, MODEL, max_body_bytes=4096)) as client:
        yield client


def post(app, request: dict, **extra):
    body = dict(request, **extra)
    return app.post("/v1/" + body.pop("path"), json=body)


def idle(app) -> bool:
    health = app.get("/health").json()
    return health["active_requests"] == 0 and health["cache_slots"] == 0


def test_a_drafter_that_raises_gets_a_500_and_frees_its_slot(app):
    expected = post(app, REQUESTS[1]).json()["choices"][0]["message"]["content"]
    response = post(app, FAULT_REQUEST)
    assert response.status_code == 500
    assert response.json()["error"]["type"] == "server_error"
    assert "planted drafter fault" in response.json()["error"]["message"]
    assert idle(app)
    with app.stream("POST", "/v1/chat/completions", json=dict(FAULT_REQUEST, stream=True)) as streamed:
        events = [json.loads(line.removeprefix("data: ")) for line in streamed.iter_lines() if line.startswith("data")]
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"  # the stream had begun
    assert events[-1]["error"]["type"] == "server_error"  # and ends with the error, without [DONE]
    assert idle(app)
    assert post(app, REQUESTS[1]).json()["choices"][0]["message"]["content"] == expected  # still serving


def chunks(data: bytes, size: int = 1024):
    for i in range(0, len(data), size):
        yield data[i : i + size]


@pytest.mark.parametrize(
    "send,status",
    [
        (dict(content=b'{"messages": [{"role": "user", "content": "hi"}'), 400),  # malformed JSON
        (dict(content=b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}'), 400),  # not UTF-8
        (dict(content=b'{"messages": [{"role": "user", "content": "' + b"x" * 5000 + b'"}]}'), 413),  # declared
        (dict(content=chunks(b'{"messages": [{"role": "user", "content": "' + b"x" * 5000 + b'"}]}')), 413),  # chunked
        (dict(json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": "many"}), 400),
    ],
    ids=["malformed-json", "invalid-utf8", "oversized", "oversized-chunked", "wrong-type"],
)
def test_bodies_the_server_cannot_read_get_openai_errors(app, send, status):
    response = app.post("/v1/chat/completions", headers={"Content-Type": "application/json"}, **send)
    assert response.status_code == status, response.text
    assert response.json()["error"]["type"] == "invalid_request_error" and response.json()["error"]["message"]


def test_unknown_paths_get_openai_errors(app):
    response = app.get("/v1/engines")
    assert response.status_code == 404 and response.json()["error"]["type"] == "not_found_error"


def test_soak_under_faults(smollm2):  # smollm2: pulled first, and skipped with SPECDECODE_SKIP_REAL=1
    """30 s of 4 clients (every fault kind injected): every completed answer is the one served alone, every fault
    is refused cleanly, and afterwards nothing is left on the server, its memory is flat and it still answers."""
    with soak_server(MODEL) as (url, server):
        report = run_soak(url, server.pid, clients=4, duration=30)
    assert report.problems == []
    assert set(FAULTS) <= set(report.actions)
    assert report.completed > 0 and report.identical == report.completed
    assert report.health_after["active_requests"] == 0 and report.health_after["cache_slots"] == 0
    assert report.settle_seconds < 10  # abandoned requests were cancelled, not run to their 4000 tokens
    assert report.mean_batch > 1  # requests arrived while batches ran
    assert report.answers_after
    assert report.rss_after_mb < 1.2 * report.rss_before_mb
