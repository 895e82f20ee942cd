"""Which executors to list after te_v2, and whether an executor list fuses elementwise ops.

te_v2 fuses nothing itself: the norms, activations, rotary embeddings and residual adds between
its GEMMs are fused by the executor listed after it. Without nvFuser, Thunder's default executors
(cuDNN, SDPA and a torch.compile executor for cross-entropy alone) fuse none of them, and each
runs as a kernel of its own: on a Llama block that made te_v2 1.4 to 1.6x slower than with
Thunder's general torch.compile executor after it. That executor is the one measured fastest
after te_v2, and runs everywhere Thunder does; nvFuser, where installed, failed on a Hugging Face
Llama through thunderfx (docs/performance.md, "Real models"), so it is listed only on request.
Attention goes to Thunder's SDPA executor (PyTorch's fused attention kernels): no fuser claims
it, and Thunder would otherwise decompose it into two matrix products and a softmax.
"""

from __future__ import annotations

from typing import Any

from thunder.core import prims
from thunder.extend import Executor, FusionExecutor


def fuses_elementwise(ex: Any) -> bool:
    """Whether ``ex`` fuses elementwise ops wherever they stand: a fusion executor that claims
    additions and makes a region of any run of ops it can run (Thunder's torch.compile executors
    for concatenation or cross-entropy only make regions around those ops)."""
    return (
        isinstance(ex, FusionExecutor)
        and prims.PrimIDs.ADD in ex.implmap
        and getattr(ex, "required_ops", None) is None
    )


def fast_after_te_v2() -> list[Executor]:
    """Thunder's SDPA executor for attention, then Thunder's torch.compile executor for the rest.

    Not cuDNN's attention executor, which Thunder lists first among its defaults: Thunder 0.2.6's
    raises while checking an attention with the cuDNN frontend of the GPU machine's torch 2.11
    image (``'pygraph' object has no attribute 'scaled_dot_product_flash_attention'``), failing
    the compilation."""
    from thunder.executors.sdpaex import sdpa_ex
    from thunder.executors.torch_compile import torch_compile_ex

    return [sdpa_ex, torch_compile_ex]


def after(listed: list[Any], te_v2: Any) -> list[Any]:
    """The executors ``listed`` after ``te_v2`` (none when it is not listed)."""
    return listed[listed.index(te_v2) + 1 :] if te_v2 in listed else []


def missing_fuser(listed: list[Any], te_v2: Any) -> str:
    """The warning for an executor list in which nothing after ``te_v2`` fuses elementwise ops,
    or "" when one does."""
    later = after(listed, te_v2)
    if any(fuses_elementwise(ex) for ex in later):
        return ""
    names = ", ".join(getattr(ex, "name", repr(ex)) for ex in later) or "none"
    return (
        f"te_v2: no executor listed after {te_v2.name!r} fuses elementwise ops (after it: {names}), so "
        "the norms, activations and residual adds between te_v2's GEMMs run one kernel each, as in "
        "eager mode; use executors=te_v2_executor.executors(), which lists te_v2, Thunder's SDPA "
        "executor, then Thunder's torch.compile executor"
    )
