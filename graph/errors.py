"""One error hierarchy for the whole tool; every package raises these."""

from __future__ import annotations

__all__ = ["RcaError", "CatalogError", "StoreError", "SpoolError", "NotFoundError", "InputError"]


class RcaError(Exception):
    """Base of every error the tool reports to a user (exit status 1, no traceback)."""


class CatalogError(RcaError):
    """The catalog file is broken; ``problems`` lists every issue found."""

    def __init__(self, path: str, problems: list[str]):
        self.path = path
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"catalog {path} has {len(problems)} problem(s):\n{lines}")


class StoreError(RcaError):
    """A DuckDB store could not be opened or queried; the message names file and SQL."""


class SpoolError(RcaError):
    """The spool folder could not be written or read."""


class NotFoundError(RcaError):
    """A trace id, event id or code the user asked for does not exist."""


class InputError(RcaError):
    """A user-supplied argument or file is unusable."""
