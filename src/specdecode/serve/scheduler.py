"""One worker thread runs every request's decode loop, one speculative step at a time, round-robin.

Each request owns its generator (its own KV caches and drafter state), so requests are independent; interleaving
steps keeps every stream moving, and a cancelled request is dropped at its next turn, freeing its caches.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator

DONE = object()  # sent after a job's last item


class Job:
    def __init__(self, steps: Iterator, deliver: Callable[[object], None]):
        self.steps = steps
        self.deliver = deliver  # called from the worker thread with each item, an exception, or DONE
        self.cancelled = threading.Event()

    def cancel(self) -> None:
        self.cancelled.set()


class Scheduler:
    def __init__(self):
        self._jobs: deque[Job] = deque()
        self._wake = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="specdecode-worker", daemon=True)
        self._thread.start()

    def submit(self, steps: Iterator, deliver: Callable[[object], None]) -> Job:
        job = Job(steps, deliver)
        with self._wake:
            self._jobs.append(job)
            self._wake.notify()
        return job

    @property
    def active(self) -> int:
        return len(self._jobs)

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._jobs:
                    self._wake.wait()
                job = self._jobs.popleft()
            if job.cancelled.is_set():
                job.steps.close()
                continue
            try:
                item = next(job.steps)
            except StopIteration:
                job.deliver(DONE)
                continue
            except Exception as exc:  # delivered to the request, never kills the worker
                job.deliver(exc)
                continue
            job.deliver(item)
            with self._wake:
                self._jobs.append(job)
