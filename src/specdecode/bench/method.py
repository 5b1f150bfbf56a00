"""What every row of a benchmark is: a Method generates from prompt ids and reports its record. Its own module so
that the optional peers (llamacpp.py, openvino.py) and methods.py, which builds them by spec, all import it
without importing each other."""

from __future__ import annotations

from abc import ABC, abstractmethod

from ..sampling import SamplingParams


class Method(ABC):
    label: str
    # Set by the runner to share prompts' KV across the methods of a run (the long suite's prefill once per
    # question); only methods on the engine's target use it.
    prefix_cache = None

    @abstractmethod
    def run(self, prompt_ids: list[int], max_new_tokens: int, params: SamplingParams) -> dict:
        """Generate; return a record with token_ids, new_tokens, seconds and whatever statistics it has."""

    def new_repeat(self) -> None:
        """Forget what earlier generations taught it (a drafter's memory across requests), so that every repeat
        of a run measures the same thing."""
