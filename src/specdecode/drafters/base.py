"""The Drafter interface and its registry.

A drafter proposes a token tree below the last committed token; the engine verifies it with the target and
tells the drafter what was accepted. A new method is one file with a class decorated by @register("name").

The contract, per request (a drafter object serves one request at a time; the server builds one per request):
- use_target_cache(cache) with the target's KV cache of this request, then start(prompt_ids, capacity) once; then,
  if hidden_layers is set, receive_hidden with the prompt's states. The cache may already hold the prompt's first
  entries, committed, restored from the prefix cache (cache/prefix.py; never for a drafter with hidden_layers, whose
  prompt is always prefilled in full); start still gets every prompt token.
- A self-speculative drafter (needs_sublayers) may run a part of the target over that cache during propose
  (CausalLM.forward_sublayers): its entries stay uncommitted after the committed ones, which it never touches. The
  engine drops them before verification, unless the draft carries their states (Draft.exit_states): then the
  verification resumes from the drafter's exit layer over those slots, and the accepted path's entries are kept.
- propose(context) returns a Draft of at most max_nodes nodes (the engine asserts it: max_nodes sizes the caches),
  parents before children, draft_probs None (deterministic: the point-mass rule) or the distribution each node
  was drawn from. It must not use the target's scores of this draft: only earlier verdicts and logits.
- The engine may trim the draft (a depth limit near max_new_tokens, or the governor's cap); the trimmed draft is
  what the target scores and what reaches receive_hidden / commit, so commit must accept a draft smaller than the
  proposal. Before each propose the engine sets depth_limit to the depth it will keep (None: no limit): a drafter
  whose drafting costs per level may stop there.
- receive_hidden(states of the root and accepted path), then commit(verdict, draft, target_logits), after every
  verification; the next propose's context ends with the bonus token.
- Options are the constructor's keyword parameters (building.build_drafter checks names and kinds against its
  signature); a value the drafter cannot take raises errors.OptionError naming what it needs.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import ClassVar

import torch

from ..errors import SpecDecodeError
from ..sampling import SamplingParams
from ..tree import Draft
from ..verify import Verdict

DRAFTERS: dict[str, type["Drafter"]] = {}


def register(name: str):
    def decorate(cls: type[Drafter]) -> type[Drafter]:
        cls.name = name
        DRAFTERS[name] = cls
        return cls

    return decorate


class Drafter(ABC):
    name: ClassVar[str]
    needs_draft_model: ClassVar[bool] = False  # True: the constructor takes draft_model=<CausalLM>
    foreign_vocabulary: ClassVar[bool] = False  # True: that draft model may use another tokenizer than the target
    # True: draft_model (optional) is a folder the drafter loads itself (a trained head), not a CausalLM
    takes_draft_folder: ClassVar[bool] = False
    supports_sampling: ClassVar[bool] = True  # False: the engine refuses temperature > 0
    # True: it runs a part of the target itself (CausalLM.forward_sublayers), so it needs a target that can
    # (runs_sublayers: the native backend)
    needs_sublayers: ClassVar[bool] = False
    # True: after plain steps (the governor resting it) its next proposal first processes the tokens decoded
    # meanwhile (a draft model's prefill of them, a head's rows for them), so that step is slow for a reason other
    # than speculating; the governor does not judge it. False (retrieval, layer skipping): nothing to catch up on.
    catches_up: ClassVar[bool] = False
    max_nodes: int = 0  # most draft tokens one proposal can hold (sizes the target's cache)
    depth_limit: int | None = None  # set by the engine before each propose: the draft depth it keeps (None: all)
    options: dict = {}  # the options it was built with (given, or from the tuned profile); {} = defaults
    tuned: bool = False  # True when those options came from the tuned profile (set by tune.profile.tuned_drafter)
    sized: tuple[str, ...] = ()  # the size options that came from this machine's cost curve (idem)
    # caps on those sizes by context length (tune.machine.ContextSizing; None: none measured), which the engine applies
    context_sizing = None
    # Option sets worth checking (chain and tree shapes, say): the lossless test matrix runs each of them.
    variants: ClassVar[tuple[dict, ...]] = ({},)
    # Option sets `specdecode tune` measures on this hardware (sizes, shapes), besides the defaults.
    tune_grid: ClassVar[tuple[dict, ...]] = ()
    # The options that size a draft, by role: "depth" (longest chain) or "nodes" (tree size). Untuned, they are set
    # from this machine's forward-cost curve (tune.machine.sized_options), not from the numbers in the signature.
    sizes: ClassVar[dict[str, str]] = {}
    # The target's hidden states this drafter reads (models.base.HiddenStates numbering: layer i's input, 0 = the
    # embeddings, target.n_layers = the last layer's output before the final norm; EAGLE-3: 2, L//2, L-3). Empty:
    # the target computes and keeps nothing extra.
    hidden_layers: tuple[int, ...] = ()

    @classmethod
    def search(cls, target, score: Callable[[dict], float], trials: int) -> list[dict]:
        """Option sets found by searching this target (`specdecode tune`), beyond tune_grid, best first; score(options)
        is the estimated tokens per second of one option set on the tuning prompts, `trials` the evaluations the
        search may spend. Most drafters have nothing to search: []."""
        return []

    def use_target_cache(self, cache) -> None:
        """The target's KVCache of the request about to start (self-speculative drafters draft over it)."""

    def start(self, prompt_ids: list[int], capacity: int) -> None:
        """A new request: reset per-request state. capacity = longest context this request can reach."""

    @abstractmethod
    def propose(self, context: list[int], params: SamplingParams, generator: torch.Generator) -> Draft:
        """A draft tree below context[-1] (the last committed token, not yet in the target's cache)."""

    def commit(self, verdict: Verdict, draft: Draft, target_logits: torch.Tensor) -> None:
        """The target scored `draft` (target_logits [N+1, V]: root, then each node), accepted verdict.accepted
        and appended verdict.bonus; roll own state forward or back, or learn from the logits."""

    def receive_hidden(self, hidden: torch.Tensor) -> None:
        """Called only when hidden_layers is non-empty: hidden [K, n, H] (K = len(hidden_layers), in that order,
        the target's dtype) holds the states of the n tokens that just entered the target's KV cache, in order.
        After the prefill (before the first propose): the prompt's tokens. After each verification (just before
        commit): the root (context[-1] of the last propose) and the accepted path's tokens. So the rows received
        so far are those of context[:-1]; the bonus token's come with the next verification."""


def parse_options(pairs: list[str]) -> dict:
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SpecDecodeError(f"drafter option '{pair}' is not KEY=VALUE.", "Write it as -o depth=5.")
        options[key.replace("-", "_")] = _literal(value)
    return options


def _literal(value: str):
    for cast in (int, float):
        try:
            return cast(value)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(value.lower(), value)
