"""Batched verification across requests: a KVPool's slots as views, forward_batch == per-request forwards, and the
scheduler's batched decoding == each request decoded alone."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from specdecode.cache import KVCache, KVPool
from specdecode.drafters import build_drafter
from specdecode.engine import decode_steps, generate
from specdecode.models.base import CausalLM, prefill, tree_request
from specdecode.sampling import SamplingParams
from specdecode.serve.scheduler import DONE, Scheduler
from specdecode.tree import Draft

from conftest import TARGETS, native_twin, perturbed_copy, tiny_model, tiny_pair

GREEDY = SamplingParams()
PROMPTS = [[3, 9, 4, 17, 3], [11, 5, 60, 2, 33, 48, 7, 1, 19, 50, 41], [8, 8, 21, 30, 12, 5, 9, 40]]
DRAFTS = [
    Draft.chain([4, 17, 3, 9]),
    Draft(torch.tensor([7, 12, 1, 30, 2, 9]), torch.tensor([-1, -1, 0, 1, 0, 2])),  # a tree
    Draft.empty(),  # the root alone
]


@pytest.fixture(scope="module", params=TARGETS)
def target(request):
    return tiny_pair(request.param, seed=3)[0]


def prefilled(target: CausalLM, prompt: list[int]) -> KVCache:
    cache = target.new_cache(len(prompt) + 12)
    prefill(target, cache, prompt)
    return cache


def test_forward_batch_equals_each_request_alone(target, monkeypatch):
    alone = [prefilled(target, p) for p in PROMPTS]
    pooled = [prefilled(target, p) for p in PROMPTS]
    pool = KVPool()
    for cache in pooled:
        pool.adopt(cache)
    forward, calls = target.forward, []
    monkeypatch.setattr(target, "forward", lambda *args, **kw: calls.append(args) or forward(*args, **kw))
    for step, drafts in enumerate([DRAFTS, DRAFTS[::-1]]):  # two steps: the second reads the first's commits
        roots = [p[-1] + step for p in PROMPTS]
        expected = [tree_request(c, r, d).run(target) for c, r, d in zip(alone, roots, drafts)]
        batched = target.forward_batch([tree_request(c, r, d) for c, r, d in zip(pooled, roots, drafts)])
        for want, got, draft in zip(expected, batched, drafts):
            assert got.shape == (len(draft) + 1, target.vocab_size)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        for cache_alone, cache_pooled in zip(alone, pooled):
            assert cache_pooled.end == cache_alone.end
            cache_alone.keep([0, 1] if cache_alone.pending > 1 else [0])
            cache_pooled.keep([0, 1] if cache_pooled.pending > 1 else [0])
    assert len(calls) == 2 * len(PROMPTS)  # only the requests scored alone: the batch ran as one forward


def test_pool_keeps_slots_packed_and_frees_memory_when_idle():
    caches = []
    for n in range(3):
        cache = KVCache(n_layers=2, n_kv_heads=1, head_dim=1, capacity=8 + n, dtype=torch.float32)
        cache.reserve(torch.arange(n + 1))
        for layer in range(2):
            cache.update(layer, torch.full((1, 1, n + 1, 1), float(n)), torch.full((1, 1, n + 1, 1), -float(n)))
        cache.advance(n + 1)
        caches.append(cache)
    pool = KVPool()
    for cache in caches:
        pool.adopt(cache)
    assert pool.keys.shape[1] >= 3 and pool.keys.shape[3] == 10  # grew to the longest capacity
    assert caches[2].keys.data_ptr() == pool.keys[:, 2:3].data_ptr()  # a view of its slot
    pool.release(caches[0])  # the last cache moves into slot 0 with its (uncommitted) entries
    assert pool.caches == [caches[2], caches[1]]
    assert caches[2].keys[1, 0, 0, :3, 0].tolist() == [2.0, 2.0, 2.0] and caches[2].end == 3
    assert caches[2].keys.data_ptr() == pool.keys[:, 0:1].data_ptr()
    assert pool.batch([caches[1], caches[2]], q=1) is None  # not in slot order
    assert pool.batch([caches[2], caches[1]], q=1).key_count == 3 + 1  # the longest row, plus q
    pool.release(caches[1])
    pool.release(caches[2])
    assert pool.keys is None


class Raising:
    """A drafter wrapper that fails at its third proposal."""

    def __init__(self, drafter):
        self.inner, self.calls = drafter, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def propose(self, *args):
        self.calls += 1
        if self.calls == 3:
            raise ValueError("drafter failed")
        return self.inner.propose(*args)


def run_jobs(scheduler: Scheduler, jobs: list) -> list:
    """Submit (steps) generators; wait for all; each result is its token list or the exception it ended with."""
    results: list = [[] for _ in jobs]
    done = threading.Semaphore(0)

    def deliver(index, item):
        if item is DONE or isinstance(item, Exception):
            results[index] = item if isinstance(item, Exception) else results[index]
            done.release()
        else:
            results[index] = results[index] + item

    for index, steps in enumerate(jobs):
        scheduler.submit(steps, lambda item, index=index: deliver(index, item))
    for _ in jobs:
        assert done.acquire(timeout=120)
    return results


@pytest.mark.parametrize("max_batch", [1, 3])
@pytest.mark.parametrize("backend", ["hf", "native"])
def test_scheduler_batches_requests_and_each_gets_its_answer_alone(backend, max_batch):
    target = tiny_model("qwen2", seed=1)
    draft_model = perturbed_copy(target, scale=0.1, seed=2)
    if backend == "native":
        target, draft_model = native_twin(target), native_twin(draft_model)
    prompts = PROMPTS + [[3, 9, 4, 17, 3, 9, 4, 22, 3, 9, 4, 17, 3, 9], [60, 61, 2]]
    drafters = [("pld", {}), ("draft", {"draft_model": draft_model}), ("none", {}),
                ("draft", {"draft_model": draft_model, "depth": 3, "topk": 3, "budget": 7}), ("pld", {})]
    lengths = [30, 12, 25, 40, 7]  # requests finish at different times: the pool compacts under the others
    expected = [generate(target, build_drafter(n, target, **o), p, k, GREEDY)[0]
                for (n, o), p, k in zip(drafters, prompts, lengths)]
    forward, calls = target.forward, []
    target.forward = lambda *args, **kwargs: calls.append(args) or forward(*args, **kwargs)
    scheduler = Scheduler(target, max_batch)
    failing = Raising(build_drafter("pld", target))
    jobs = [decode_steps(target, build_drafter(n, target, **o), p, k, GREEDY)
            for (n, o), p, k in zip(drafters, prompts, lengths)]
    jobs.append(decode_steps(target, failing, prompts[0], 30, GREEDY))
    results = run_jobs(scheduler, jobs)
    assert results[:-1] == expected
    assert isinstance(results[-1], ValueError)  # the failing request fails alone
    assert scheduler.active == 0 and scheduler.pool.keys is None
    assert scheduler.batched_requests > scheduler.batches if max_batch > 1 else scheduler.batched_requests == scheduler.batches
    assert len(calls) == len(jobs)  # the prefills: every verification ran in place on the pool (forward_batch)


def test_a_cancelled_request_is_dropped_and_its_slot_freed():
    target = tiny_model("llama", seed=1)
    scheduler = Scheduler(target, max_batch=4)
    started, items = threading.Event(), []
    job = scheduler.submit(decode_steps(target, build_drafter("pld", target), PROMPTS[1], 200, GREEDY),
                           lambda item: items.append(item) or started.set())
    assert started.wait(timeout=60)
    job.cancel()
    deadline = time.time() + 30
    while scheduler.active and time.time() < deadline:
        time.sleep(0.05)
    assert scheduler.active == 0 and scheduler.pool.keys is None
    assert DONE not in items and sum(len(step) for step in items) < 200  # stopped early, not run to the end


def test_a_request_cancelled_while_others_run_gets_no_further_forward():
    """A request cancelled during another request's round is dropped before the next round, even when no new
    request arrives in between (the sweep once ran only while starting new requests)."""
    target = tiny_model("llama", seed=1)
    scheduler = Scheduler(target, max_batch=1)  # one request per round: the two alternate
    forward_batch, late = target.forward_batch, []
    jobs: list = []
    cancelled_cache: list = []

    def forward_batch_cancelling_the_other(requests):
        first = jobs[0]
        if first.cancelled.is_set():
            late.extend(request for request in requests if request.cache is cancelled_cache[0])
        elif first.request is not None and all(request is not first.request for request in requests):
            cancelled_cache.append(first.request.cache)
            first.cancel()  # while the worker runs the other request's round
        return forward_batch(requests)

    target.forward_batch = forward_batch_cancelling_the_other
    done = threading.Semaphore(0)
    for prompt in PROMPTS[:2]:
        steps = decode_steps(target, build_drafter("none", target), prompt, 30, GREEDY)
        jobs.append(scheduler.submit(steps, lambda item: item is DONE and done.release()))
    assert done.acquire(timeout=60)  # the second request runs to its end
    deadline = time.time() + 30
    while scheduler.active and time.time() < deadline:
        time.sleep(0.05)
    assert cancelled_cache, "the first request was never cancelled: the test did not exercise the sweep"
    assert scheduler.active == 0 and not late
