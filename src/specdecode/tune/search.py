"""Searches `specdecode tune` runs for drafters whose options are too many to grid: Draft & Verify's skip set, found as
the paper finds it, by Bayesian optimisation of the measured decoding speed. optuna's TPE sampler (a sequential
model-based optimiser; the paper used bayes_opt's Gaussian process) proposes one skip flag per attention and MLP
sublayer; each trial decodes the tuning prompts with that set."""

from __future__ import annotations

from collections.abc import Callable

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
