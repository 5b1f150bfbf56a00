"""Tuned profiles: the options `specdecode tune` picked per drafter, saved per target, dtype, weight format and model class.

A profile is one JSON file under <cache>/profiles/. The API, CLI, bench and server build drafters with
tuned_drafter, which applies a drafter's tuned options when the caller gave none; any explicit option wins (the
tuned set is then not used at all, so tuned options never mix with given ones), and the option profile=none turns
the lookup off (to compare tuned against hand-picked defaults). Without a tuned set, the size options the caller did
not give come from this machine's cost curve (`-o vocab=N` keeps the sized tree). drafters.build_drafter itself
never reads a profile.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from ..drafters.building import build_drafter, check_drafter_name
from ..errors import SpecDecodeError
from ..files import cache_root, write_text_atomic

PROFILE_CHOICES = ("auto", "none")


def profile_path(target) -> Path:
    """<cache>/profiles/<target name>-<dtype>-<weights>-<model class>.json (the class tells backends apart)."""
    dtype = str(target.dtype).removeprefix("torch.")
    key = f"{target.name}-{dtype}-{target.quant}-{type(target).__name__}"
    return cache_root() / "profiles" / (re.sub(r"[^A-Za-z0-9._-]+", "_", key) + ".json")


def load_profile(target) -> dict | None:
    path = profile_path(target)
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise SpecDecodeError(
            f"cannot read the tuned profile {path}: {exc}.", "Delete it or run `specdecode tune` again."
        ) from None


def save_profile(target, profile: dict) -> Path:
    """Write the profile; drafters tuned earlier and not in this run keep their saved entries."""
    path = profile_path(target)
    earlier = (load_profile(target) or {}).get("drafters", {})
    merged = dict(profile, drafters={**earlier, **profile["drafters"]})
    write_text_atomic(path, json.dumps(merged, indent=1))
    return path


def check_profile(profile: str) -> None:
    if profile not in PROFILE_CHOICES:
        raise SpecDecodeError(f"unknown profile '{profile}'.", "Use -o profile=auto (the default) or -o profile=none.")


def tuned_drafter(name: str, target, draft_model=None, profile: str = "auto", **options):
    """build_drafter, with the options saved for this drafter, target and draft model when none are given; with
    none saved either, the size options not given set from this machine's forward-cost curve (measured once and
    cached)."""
    check_drafter_name(name)
    check_profile(profile)
    tuned = None if options else tuned_options(name, target, draft_model, profile)  # {}: tune chose the defaults
    sized = {} if tuned is not None or profile == "none" else machine_sized_options(name, target, given=options)
    drafter = build_drafter(name, target, draft_model, **(tuned if tuned is not None else {**sized, **options}))
    drafter.tuned = tuned is not None
    drafter.sized = tuple(sized)
    if sized:  # sized on the short-context curve: capped on longer contexts' curves where they are measured
        from .machine import ContextSizing

        drafter.context_sizing = ContextSizing.for_target(target, {drafter.sizes[option] for option in sized})
    return drafter


def machine_sized_options(name: str, target, given: dict | None = None) -> dict:
    """The drafter's size options not in `given` from the cost curve of this machine and target (tune.machine); the
    curve is measured only if one is wanted."""
    from ..drafters import DRAFTERS
    from .machine import cost_report, seconds_by_rows, sized_options

    cls, given = DRAFTERS[name], given or {}
    if all(option in given for option in cls.sizes):
        return {}
    sized = sized_options(cls, seconds_by_rows(cost_report(target)))
    return {option: value for option, value in sized.items() if option not in given}


def tuned_options(name: str, target, draft_model, profile: str) -> dict | None:
    """The options saved for drafter `name` on this target (and draft model; {} when tune chose the defaults), or
    None when nothing was saved."""
    check_profile(profile)
    saved = load_profile(target) if profile == "auto" else None
    entry = (saved or {}).get("drafters", {}).get(name)
    if not entry or entry.get("draft_model") != getattr(draft_model, "name", None):
        return None
    return dict(entry["options"])
