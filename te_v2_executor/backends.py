"""Which numerics run the te_v2 symbols, and lazy access to TransformerEngine.

TransformerEngine's PyTorch extension needs CUDA to import, so nothing here imports it at module
load: CPU machines (and CI) use the package with the reference backend only.
"""

from __future__ import annotations

import enum
import functools
import importlib
from types import ModuleType
from typing import Any


class Backend(enum.Enum):
    """Where the te_v2 symbols get their numerics."""

    TE = "te"  # TransformerEngine FP8 kernels (CUDA, Hopper or newer)
    REFERENCE = "reference"  # plain torch emulation through torch's float8 dtypes (any device)


TE_MISSING_HINT = (
    'install it with `pip install "te-v2-executor[te]"` (from a checkout: `pip install -e ".[te]"`) '
    "on a CUDA machine, or build the executor with `te_v2_executor.make_te_v2(backend='reference')` "
    "to run the plain-torch reference"
)


@functools.cache
def te_import_error() -> str:
    """Empty when ``transformer_engine.pytorch`` imports; otherwise why it does not."""
    try:
        importlib.import_module("transformer_engine.pytorch")
    except Exception as e:  # ImportError, or OSError/RuntimeError from its CUDA libraries
        return f"{type(e).__name__}: {e}"
    return ""


def te_available() -> bool:
    return not te_import_error()


@functools.cache
def kernels(backend: Backend) -> ModuleType:
    """The module implementing ``backend``'s kernels (see ``kernels.py`` / ``reference.py``)."""
    if backend is Backend.REFERENCE:
        return importlib.import_module("te_v2_executor.reference")
    if not te_available():
        raise ImportError(f"te_v2 needs TransformerEngine ({te_import_error()}); {TE_MISSING_HINT}")
    return importlib.import_module("te_v2_executor.kernels")


def autocast_recipe() -> Any:
    """The recipe object of the enclosing ``te.autocast`` if FP8 is enabled there, else None."""
    if not te_available():
        return None
    return kernels(Backend.TE).autocast_recipe()
