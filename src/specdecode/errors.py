"""User-facing errors: one line naming the problem, one naming the fix."""

from __future__ import annotations


class SpecDecodeError(Exception):
    """An error caused by the user's input. The CLI prints it without a traceback and exits with 2."""

    def __init__(self, problem: str, fix: str = ""):
        super().__init__(problem)
        self.problem = problem
        self.fix = fix

    def __str__(self) -> str:
        return f"{self.problem} {self.fix}".strip()


class OptionError(SpecDecodeError):
    """A drafter option whose value the drafter cannot take (raised by constructors; build_drafter adds the
    drafter's name)."""

    def __init__(self, need: str, fix: str = "Fix the value given with -o KEY=VALUE."):
        super().__init__(f"bad option value: {need}.", fix)
        self.need = need
