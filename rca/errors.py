"""Re-export of the tool's one error hierarchy (defined in :mod:`graph.errors`)."""

from graph.errors import (
    CatalogError,
    InputError,
    NotFoundError,
    RcaError,
    SpoolError,
    StoreError,
)

__all__ = ["RcaError", "CatalogError", "StoreError", "SpoolError", "NotFoundError", "InputError"]
