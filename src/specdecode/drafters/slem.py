"""SLEM, String-Level Exact Match (Timor et al., 2025, arXiv 2502.05202, Algorithm 2; transformers' universal
assisted generation at temperature 0): the draft model continues the committed text in its own tokens, the
continuation's text is re-tokenized by the target's tokenizer, and the target tokens go out as a chain.

The chain is deterministic (draft_probs None): greedy verification accepts it up to the first token the target
would not pick; under sampling the draft model samples its continuation and the rejection verifier's point-mass
rule keeps the output distributed as plain sampling.

The boundary: a tokenizer is not injective on concatenations, so the text after the committed tokens may tokenize
differently once glued to them (committed " the", draft "re" -> " there"). The continuation is re-tokenized together
with the last `lookbehind` committed tokens' text, and only the tokens after an exact match of those committed
tokens are sent; when the merge crosses the boundary, the continuation is tokenized on its own instead. Either way
the committed tokens stay the target's own.
"""

from __future__ import annotations

import torch

from ..errors import OptionError
from ..sampling import SamplingParams, probs_from_logits
from ..tree import Draft
from .base import register
from .foreign import ForeignDrafter


@register("slem")
class SLEMDrafter(ForeignDrafter):
    variants = ({}, {"depth": 8, "length": "confidence", "threshold": 0.3, "lookbehind": 1})
    tune_grid = ({"depth": 4}, {"depth": 8, "length": "confidence", "threshold": 0.4})

    def __init__(self, target, draft_model, depth: int = 6, length: str = "fixed", threshold: float = 0.4,
                 lookbehind: int = 8):
        super().__init__(target, draft_model, depth, length, threshold)
        if lookbehind < 1:
            raise OptionError("need lookbehind >= 1")
        self.lookbehind = lookbehind

    def propose(self, context, params: SamplingParams, generator) -> Draft:
        logits = self.view.sync(context, self.depth)  # [Vd]
        if logits is None:
            return Draft.empty()
        continuation = self.continue_text(logits, params, generator)
        self.view.drop_tree()
        tokens = self.retokenize(context, continuation)[: self.depth]
        known = next((i for i, t in enumerate(tokens) if t >= self.target.vocab_size), len(tokens))
        return Draft.chain(tokens[:known])  # (a tokenizer may know ids the model has no row for)

    def continue_text(self, logits: torch.Tensor, params: SamplingParams, generator) -> str:
        """The draft model's continuation (greedy, or sampled as the request samples), as text."""
        tokens, parent, confidence = [], -1, 1.0
        levels = self.length.depth_within(self.depth_limit)
        for level in range(levels):
            probs = probs_from_logits(logits, params)  # [Vd]; one-hot when greedy
            token = int(torch.multinomial(probs, 1, generator=generator)) if not params.greedy else int(probs.argmax())
            tokens.append(token)
            confidence *= float(torch.softmax(logits.float(), -1)[token])
            if level + 1 == levels or not self.length.grow(confidence):
                break
            logits = self.view.grow([token], [parent])[0]
            parent += 1
        return self.view.model.tokenizer.decode(tokens, skip_special_tokens=False).rstrip("\ufffd")

    def retokenize(self, context: list[int], continuation: str) -> list[int]:
        """The target tokens of `continuation` as they follow the committed `context`."""
        tokenizer = self.target.tokenizer
        window = context[-self.lookbehind :]
        joined = tokenizer.encode(tokenizer.decode(window, skip_special_tokens=False) + continuation,
                                  add_special_tokens=False)
        if joined[: len(window)] == window:
            return list(joined[len(window) :])
        return list(tokenizer.encode(continuation, add_special_tokens=False))
