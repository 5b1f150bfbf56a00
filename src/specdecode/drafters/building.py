"""Building a drafter by name: its options checked against its constructor's signature (plus the suffix hybrid's,
which wraps any drafter), one clear error for a bad name, option or value. Kept out of base.py, which every drafter
imports, so that the hybrid (built on the suffix drafter) can be imported here without a circle."""

from __future__ import annotations

import inspect

from ..errors import OptionError, SpecDecodeError
from .base import DRAFTERS, Drafter
from .hybrid import HYBRID_OPTIONS, LookupHybrid


def check_drafter_name(name: str) -> None:
    if name not in DRAFTERS:
        raise SpecDecodeError(f"unknown drafter '{name}'.", f"Choose one of: {', '.join(sorted(DRAFTERS))}.")


def build_drafter(name: str, target, draft_model=None, **options) -> Drafter:
    """Drafter `name` for `target` with these options (none: its defaults). Every drafter also takes `lookup` and
    `lookup_nodes` (the suffix hybrid, hybrid.py). Tuned profiles are resolved by the caller (the API, CLI, bench
    and server: tune.profile.tuned_drafter), never here."""
    check_drafter_name(name)
    cls = DRAFTERS[name]
    check_options(name, options)
    if cls.needs_draft_model and draft_model is None:
        kind = ("any smaller model, whatever its tokenizer" if cls.foreign_vocabulary
                else "a smaller model with the same tokenizer")
        raise SpecDecodeError(f"drafter '{name}' needs a draft model.", f"Pass --draft-model NAME ({kind}).")
    own = {key: value for key, value in options.items() if key not in HYBRID_OPTIONS}
    hybrid = {key: value for key, value in options.items() if key in HYBRID_OPTIONS}
    try:
        takes_model = cls.needs_draft_model or (cls.takes_draft_folder and draft_model is not None)
        drafter = cls(target, draft_model=draft_model, **own) if takes_model else cls(target, **own)
        if hybrid.get("lookup", 0):
            drafter = LookupHybrid(drafter, target, **hybrid)
    except OptionError as exc:
        raise SpecDecodeError(f"bad option value for drafter '{name}': {exc.need}.", exc.fix) from None
    drafter.options = dict(options)
    return drafter


def option_defaults(name: str) -> dict:
    """Drafter `name`'s options and their defaults: its constructor's keyword parameters, then the hybrid's."""
    parameters = inspect.signature(DRAFTERS[name].__init__).parameters.values()
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    skip = ("self", "target", "draft_model")
    own = {p.name: p.default for p in parameters if p.kind in kinds and p.name not in skip}
    return {**own, **HYBRID_OPTIONS}


def check_options(name: str, options: dict) -> None:
    """Every option is one of the drafter's, and a number where the default is one; else one clear error."""
    defaults = option_defaults(name)
    valid = ", ".join(f"{key}={default}" for key, default in defaults.items())
    for key, value in options.items():
        if key not in defaults:
            raise SpecDecodeError(f"bad option '{key}' for drafter '{name}'.", f"Its options (defaults): {valid}.")
        if not _fits(value, defaults[key]):
            kind = {bool: "true or false", int: "an integer", float: "a number"}[type(defaults[key])]
            raise SpecDecodeError(
                f"drafter '{name}' option {key}={value!r}: need {kind}.", f"Like its default: -o {key}={defaults[key]}."
            )


def _fits(value, default) -> bool:
    """Can `value` stand for an option whose default is `default`? Booleans for booleans, numbers for numbers (an
    int for a float); anything for text or None defaults (the constructor checks those)."""
    if isinstance(default, bool):
        return isinstance(value, bool)
    if isinstance(default, (int, float)):
        return isinstance(value, int if isinstance(default, int) else (int, float)) and not isinstance(value, bool)
    return True
