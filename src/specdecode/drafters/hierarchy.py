"""Hierarchy Drafting (Cho et al., 2025): n-gram databases searched in order of temporal locality.

W: the current context (prompt and tokens generated so far); S: this model's own earlier generations (kept for
the drafter's lifetime, across requests); L: a static corpus (option `corpus`, a text or .jsonl file tokenized once).
Candidates are collected from W, then S, then L, until `guess` continuations are found; they form one
deterministic tree (draft_probs None). The paper collects 7; on a 2-core CPU, where every drafted token costs
verification time, 2 measured faster (own prompts, Qwen2.5-Coder 1.5B, bf16): 1.08x against 0.83x with 7.
"""

from __future__ import annotations

from ..errors import OptionError
from ..tree import Draft, from_sequences
from .base import Drafter, register
from .ngram_table import NgramTable, read_corpus


@register("hierarchy")
class HierarchyDrafter(Drafter):
    variants = ({}, {"guess": 7, "length": 2})
    tune_grid = ({"guess": 1}, {"guess": 1, "length": 6}, {"guess": 4}, {"guess": 7})

    def __init__(self, target, guess: int = 2, length: int = 4, corpus: str | None = None):
        if guess < 1 or length < 1:
            raise OptionError("need guess >= 1 and length >= 1")
        self.guess, self.length = guess, length
        self.max_nodes = guess * length
        self.history = NgramTable(length=length, per_key=16)  # S
        self.corpus = NgramTable(length=length, per_key=16)  # L
        for document in read_corpus(corpus, target.tokenizer) if corpus else []:
            self.corpus.add_sequence(document)
        self.context = NgramTable(length=length)  # W
        self.prompt_len = 0
        self.last_context: list[int] = []

    def start(self, prompt_ids, capacity):
        if len(self.last_context) > self.prompt_len:  # the previous request's answer joins S
            self.history.add_sequence(self.last_context[self.prompt_len :])
        self.context = NgramTable(length=self.length)
        self.prompt_len = len(prompt_ids)
        self.last_context = []

    def propose(self, context, params, generator) -> Draft:
        self.last_context = context
        self.context.extend(context)
        found: list[list[int]] = []
        for table in (self.context, self.history, self.corpus):
            for continuation in table.lookup(context, self.guess - len(found)):
                if continuation not in found:
                    found.append(continuation)
            if len(found) >= self.guess:
                break
        return from_sequences(found)
