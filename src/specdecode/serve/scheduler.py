"""One worker thread runs every request's decode loop and batches their verification forwards.

Each request is an engine generator (engine.decode_steps) with its own drafter state. The worker runs a request until
it asks for a target forward (a ForwardRequest), delivering its tokens on the way; its KV cache then moves into a
slot of one KVPool. Each round takes the next run of up to max_batch waiting requests, in slot order (consecutive
slots, so the model reads their caches in place), runs one target.forward_batch for all of them, and sends each
its logits. Rounds go round-robin over the waiting requests, so every stream keeps moving; max_batch 1 runs one
request's forward at a time.

A cancelled request is dropped before every round and its slot freed (the pool itself is freed when idle). An
exception in one request is delivered to that request only; a failed batch forward is retried one request at a
time, so only the request at fault fails.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import threading
from collections.abc import Callable, Generator

from ..cache import KVPool
from ..models.base import CausalLM, ForwardRequest

DONE = object()  # sent after a job's last item
IDLE_TRIM_SECONDS = 1.0  # the second trim of an idle period


def _malloc_trim():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim
    except (AttributeError, OSError, TypeError):  # not glibc
        return None


_MALLOC_TRIM = _malloc_trim()


def return_free_memory() -> None:
    """Give the allocator's free pages back to the OS. glibc keeps what a burst of long requests freed (KV caches,
    activations) in its heaps, so without this an idle server would hold its peak memory. Called when the worker
    goes idle, so it delays no one."""
    gc.collect()  # reference cycles (an exception's traceback holds its frames' tensors) first
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


class Job:
    def __init__(self, steps: Generator, deliver: Callable[[object], None]):
        self.steps = steps
        self.deliver = deliver  # called from the worker thread with each item, an exception, or DONE
        self.cancelled = threading.Event()
        self.request: ForwardRequest | None = None  # the forward it waits for; its cache is in the pool

    def cancel(self) -> None:
        self.cancelled.set()


class Scheduler:
    def __init__(self, target: CausalLM, max_batch: int = 8):
        self.target = target
        self.max_batch = max_batch
        self.pool = KVPool()
        self.batches = 0  # verification forwards run (forward_batch calls)
        self.batched_requests = 0  # requests verified in them (batched_requests / batches = mean batch size)
        self._jobs: set[Job] = set()  # every live job
        self._new: list[Job] = []  # submitted, not started
        self._waiting: list[Job] = []  # started, each waiting for job.request; in pool slot order
        self._cursor = 0  # where the next round starts in _waiting
        self._wake = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="specdecode-worker", daemon=True)
        self._thread.start()

    def submit(self, steps: Generator, deliver: Callable[[object], None]) -> Job:
        job = Job(steps, deliver)
        with self._wake:
            self._jobs.add(job)
            self._new.append(job)
            self._wake.notify()
        return job

    @property
    def active(self) -> int:
        return len(self._jobs)

    @property
    def slots(self) -> int:
        """KV cache slots held in the pool (0 when no request is running: a leak shows here)."""
        return len(self.pool.caches)

    def _run(self) -> None:
        while True:
            with self._wake:
                if not self._has_work():  # idle: give back what finished requests freed, now and once more a moment
                    return_free_memory()  # later (their handlers and exceptions release tensors after the worker)
                    if not self._wake.wait_for(self._has_work, timeout=IDLE_TRIM_SECONDS):
                        return_free_memory()
                self._wake.wait_for(self._has_work)
                new, self._new = self._new, []
            for job in new:
                self._resume(job, None)
            for job in [job for job in self._waiting if job.cancelled.is_set()]:  # before the round, every time
                self._finish(job)
            self._round(self._next_batch())

    def _has_work(self) -> bool:
        return bool(self._new or self._waiting)

    def _next_batch(self) -> list[Job]:
        if self._cursor >= len(self._waiting):
            self._cursor = 0
        batch = self._waiting[self._cursor : self._cursor + self.max_batch]
        self._cursor += len(batch)
        return batch

    def _round(self, batch: list[Job]) -> None:
        if not batch:
            return
        requests = [job.request for job in batch]
        try:
            results = self.target.forward_batch(requests)
        except Exception:
            results = [self._forward_alone(request) for request in requests]
        self.batches += 1
        self.batched_requests += len(batch)
        for job, result in zip(batch, results):
            if isinstance(result, Exception):
                self._fail(job, result)
            else:
                self._resume(job, result)

    def _forward_alone(self, request: ForwardRequest):
        request.cache.discard()  # entries a failed batch may have written
        try:
            return request.run(self.target)
        except Exception as exc:
            return exc

    def _resume(self, job: Job, target_logits) -> None:
        """Run the job until it asks for its next forward, delivering its tokens; finish it when it ends."""
        if job.cancelled.is_set():
            self._finish(job)
            return
        try:
            item = job.steps.send(target_logits)
            while not isinstance(item, ForwardRequest):
                job.deliver(item)
                item = next(job.steps)
        except StopIteration:
            self._finish(job)
            job.deliver(DONE)
            return
        except Exception as exc:  # delivered to the request, never kills the worker
            self._fail(job, exc)
            return
        if job.request is None:  # its first forward: its cache joins the pool
            self.pool.adopt(item.cache)
            self._waiting.append(job)
        job.request = item

    def _fail(self, job: Job, exc: Exception) -> None:
        self._finish(job)
        job.deliver(exc)

    def _finish(self, job: Job) -> None:
        """Close the job's generator and free its slot (before its last item is delivered: a client that has its
        answer finds the server without it)."""
        job.steps.close()
        if job.request is not None:
            self.pool.release(job.request.cache)
            self._waiting.remove(job)
            self._waiting.sort(key=lambda waiting: self.pool.slot(waiting.request.cache))
            job.request = None
        with self._wake:
            self._jobs.discard(job)
