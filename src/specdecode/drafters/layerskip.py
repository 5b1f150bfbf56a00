"""Draft & Verify (Zhang et al., ACL 2024, arXiv 2309.08168): self-speculative decoding by layer skipping. The draft
is the target itself with a set of attention and MLP sublayers skipped (the residual stream passes them unchanged),
over the target's own KV cache; no training, no extra weights. It drafts a chain and stops once a token's draft
probability falls below a threshold that adapts online to the acceptance rate (draft_length `adaptive`, the
paper's `auto_th_stop_draft`).

`vocab` (default 0: the whole vocabulary, as the paper) scores only the target's `vocab` most frequent tokens
(vocabulary.py): the draft then skips most of the LM head too, a large part of a small model with a large vocabulary
(Gemma 3 270M's 262k-token head).

The skip set is `skip_attn` and `skip_mlp` (comma-separated layer indices; `auto` = a generic set, see default_skip).
`specdecode tune --drafters layerskip` searches it as the paper does, by Bayesian optimisation of the decoding speed
(optuna's TPE sampler; the paper used a Gaussian process) over the shipped tuning prompts, and saves the best set in
the target's tuned profile, where this drafter finds it.
"""

from __future__ import annotations

from collections.abc import Callable

from ..errors import OptionError
from ..models.base import Sublayers
from .base import register
from .self_draft import SelfDrafter
from .vocabulary import VocabularyHead, frequent_tokens

Layers = frozenset[int]


def search_skip_set(
    n_layers: int, score: Callable[[Layers, Layers], float], trials: int, seed_sets: list[tuple[Layers, Layers]] = (),
    seed: int = 0,
) -> tuple[Layers, Layers]:
    """The (skipped attention layers, skipped MLP layers) with the highest score(attention, mlp) found in `trials`
    evaluations, the seed sets tried first (as the paper probes known good sets). A set is measured once."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    names = [f"attention{i}" for i in range(n_layers)] + [f"mlp{i}" for i in range(n_layers)]
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.TPESampler(seed=seed, multivariate=True))
    for attention, mlp in seed_sets:
        study.enqueue_trial({f"attention{i}": i in attention for i in range(n_layers)}
                            | {f"mlp{i}": i in mlp for i in range(n_layers)})
    scores: dict[tuple[Layers, Layers], float] = {}

    def objective(trial) -> float:
        flags = {name: trial.suggest_categorical(name, [False, True]) for name in names}
        chosen = (_layers(flags, "attention", n_layers), _layers(flags, "mlp", n_layers))
        if chosen not in scores:
            scores[chosen] = score(*chosen)
        return scores[chosen]

    study.optimize(objective, n_trials=trials)
    best = study.best_params
    return _layers(best, "attention", n_layers), _layers(best, "mlp", n_layers)


def _layers(flags: dict, kind: str, n_layers: int) -> Layers:
    return frozenset(i for i in range(n_layers) if flags[f"{kind}{i}"])


def default_skip(n_layers: int) -> tuple[frozenset[int], frozenset[int]]:
    """A generic skip set where none was searched: the attention of every odd layer and the MLP of every fourth
    (layers 3, 7, ...), keeping the first and last layers whole; roughly the shares the paper's search found for
    LLaMA-2-13B (24 of 40 attention sublayers, 10 of 40 MLPs)."""
    inner = range(1, n_layers - 1)
    return frozenset(i for i in inner if i % 2 == 1), frozenset(i for i in inner if i % 4 == 3)


def skip_option(value, default: frozenset[int], n_layers: int, name: str) -> frozenset[int]:
    """An option's layer set: `auto` (the default set), `none` or empty, or comma-separated layer indices."""
    text = str(value).strip().lower()
    if text == "auto":
        return default
    if text in ("", "none"):
        return frozenset()
    try:
        layers = frozenset(int(part) for part in text.split(","))
    except ValueError:
        layers = frozenset([-1])
    if not all(0 <= layer < n_layers for layer in layers):
        raise OptionError(f"{name}={value}: need auto, none or comma-separated layers in 0..{n_layers - 1}")
    return layers


def skip_text(layers) -> str:
    return ",".join(str(layer) for layer in sorted(layers)) or "none"


@register("layerskip")
class LayerSkipDrafter(SelfDrafter):
    variants = ({}, {"skip_attn": "0", "skip_mlp": "none", "depth": 3, "length": "fixed", "vocab": 40})
    tune_grid = ({"threshold": 0.6}, {"depth": 4}, {"depth": 12, "threshold": 0.6}, {"vocab": 32768})

    def __init__(self, target, skip_attn: str = "auto", skip_mlp: str = "auto", depth: int = 8,
                 threshold: float = 0.8, length: str = "adaptive", vocab: int = 0):
        super().__init__(target, depth, length, threshold)
        self.head = None  # the target's whole LM head
        if vocab:
            self.head = VocabularyHead.of(target.lm_head, frequent_tokens(target, vocab), target.vocab_size)
        attention, mlp = default_skip(target.n_layers)
        self.sublayers = Sublayers(
            target.n_layers, skip_option(skip_attn, attention, target.n_layers, "skip_attn"),
            skip_option(skip_mlp, mlp, target.n_layers, "skip_mlp"),
        )

    def next_logits(self, token, position):
        hidden = self.run_target(token, position, self.sublayers)  # [1, d]: the last layer's output
        normed = self.target.final_norm(hidden)
        return (self.target.lm_head_logits(normed) if self.head is None else self.head(normed))[0]

    @classmethod
    def search(cls, target, score: Callable[[dict], float], trials: int) -> list[dict]:
        """The paper's skip-set search: Bayesian optimisation of score(options) (estimated tokens per second on the
        tuning prompts) over one skip flag per attention and MLP sublayer, seeded with the default set; the best
        set, then with the tune grid's thresholds and depths."""
        attention, mlp = default_skip(target.n_layers)
        best = search_skip_set(
            target.n_layers, lambda a, m: score({"skip_attn": skip_text(a), "skip_mlp": skip_text(m)}), trials,
            seed_sets=[(attention, mlp)],
        )
        found = {"skip_attn": skip_text(best[0]), "skip_mlp": skip_text(best[1])}
        return [found] + [dict(found, **options) for options in cls.tune_grid]
