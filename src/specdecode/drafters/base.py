"""The Drafter interface and its registry.

A drafter proposes a token tree below the last committed token; the engine verifies it with the target and
tells the drafter what was accepted. A new method is one file with a class decorated by @register("name").
"""

from __future__ import annotations

from abc import ABC, abstractmethod
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
    # True: draft_model (optional) is a folder the drafter loads itself (a trained head), not a CausalLM
    takes_draft_folder: ClassVar[bool] = False
    supports_sampling: ClassVar[bool] = True  # False: the engine refuses temperature > 0
    max_nodes: int = 0  # most draft tokens one proposal can hold (sizes the target's cache)
    options: dict = {}  # the options build_drafter passed (given, or from the tuned profile); {} = defaults
    tuned: bool = False  # True when those options came from the tuned profile
    # Option sets worth checking (chain and tree shapes, say): the lossless test matrix runs each of them.
    variants: ClassVar[tuple[dict, ...]] = ({},)
    # Option sets `specdecode tune` measures on this hardware (sizes, shapes), besides the defaults.
    tune_grid: ClassVar[tuple[dict, ...]] = ()
    # The target's hidden states this drafter reads (models.base.HiddenStates numbering: layer i's input, 0 = the
    # embeddings, target.n_layers = the last layer's output before the final norm; EAGLE-3: 2, L//2, L-3). Empty:
    # the target computes and keeps nothing extra.
    hidden_layers: tuple[int, ...] = ()

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


def check_drafter_name(name: str) -> None:
    if name not in DRAFTERS:
        raise SpecDecodeError(f"unknown drafter '{name}'.", f"Choose one of: {', '.join(sorted(DRAFTERS))}.")


def build_drafter(name: str, target, **options) -> Drafter:
    """A drafter for `target`. Without options, the options `specdecode tune` saved for it (if any) apply;
    profile=none skips them."""
    from ..tune.profile import tuned_options

    check_drafter_name(name)
    cls = DRAFTERS[name]
    profile = options.pop("profile", "auto")
    tuned = {}
    if not any(key != "draft_model" for key in options):
        tuned = tuned_options(name, target, options.get("draft_model"), profile)
        options.update(tuned)
    if cls.needs_draft_model and options.get("draft_model") is None:
        raise SpecDecodeError(
            f"drafter '{name}' needs a draft model.", "Pass --draft-model NAME (a smaller model with the same tokenizer)."
        )
    if not cls.needs_draft_model and not (cls.takes_draft_folder and options.get("draft_model") is not None):
        options.pop("draft_model", None)
    try:
        drafter = cls(target, **options)
    except TypeError as exc:  # unknown or malformed option
        raise SpecDecodeError(f"bad option for drafter '{name}': {exc}.", "Check the drafter's options.") from None
    drafter.options = {key: value for key, value in options.items() if key != "draft_model"}
    drafter.tuned = bool(tuned)
    return drafter


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
