"""Which numerics run the te_v2 symbols, and lazy access to TransformerEngine.

Two modules implement the ``KernelBackend`` interface (``common.py``): ``te.py`` on
TransformerEngine's kernels and ``reference.py`` in plain torch. TransformerEngine's PyTorch
extension needs CUDA to import, so nothing here imports it at module load: CPU machines (and CI)
use the package with the reference backend only. ``unquantized.py`` holds the GEMMs of the linears
te_v2 runs without FP8, the same on every backend.
"""

from __future__ import annotations

import enum
import functools
import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from te_v2_executor.backends.common import KernelBackend


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
def load(backend: Backend) -> KernelBackend:
    """The module implementing ``backend``'s numerics (``te.py`` or ``reference.py``); a missing
    TransformerEngine fails here, by name, with how to get it."""
    if backend is Backend.REFERENCE:
        return importlib.import_module("te_v2_executor.backends.reference")
    if not te_available():
        raise ImportError(f"te_v2 needs TransformerEngine ({te_import_error()}); {TE_MISSING_HINT}")
    return importlib.import_module("te_v2_executor.backends.te")
