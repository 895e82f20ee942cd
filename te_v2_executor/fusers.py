"""Which executors to list after te_v2, and whether an executor list fuses elementwise ops.

te_v2 fuses nothing itself: the norms, activations, rotary embeddings and residual adds between
its GEMMs are fused by the executor listed after it. Without nvFuser, Thunder's default executors
(cuDNN, SDPA and a torch.compile executor for cross-entropy alone) fuse none of them, and each
runs as a kernel of its own: on a Llama block that made te_v2 1.4 to 1.6x slower than with
Thunder's general torch.compile executor after it. That executor is the one measured fastest
after te_v2, and runs everywhere Thunder does; nvFuser, where installed, failed on a Hugging Face
Llama through thunderfx (docs/performance.md, "Real models"), so it is listed only on request.
Attention goes to te_v2's cuDNN attention executor, or else Thunder's SDPA executor (PyTorch's
fused attention kernels): no fuser claims it, and Thunder would otherwise decompose it into two
matrix products and a softmax. thunderfx's splitter checks each node with Thunder's *default*
executors, not the ones it is given, so a cuDNN attention executor among them that cannot run
sends every attention out of Thunder (``broken_default_attention``).
"""

from __future__ import annotations

from typing import Any

import thunder.extend
from thunder.core import prims
from thunder.extend import Executor, FusionExecutor

# The cuDNN frontend graph method Thunder 0.2.6's cuDNN attention executor builds its graphs with.
_CUDNN_SDPA_METHOD = "scaled_dot_product_flash_attention"


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
    """te_v2's attention executor (cuDNN's fused kernels, ``attention.py``), Thunder's SDPA executor
    for the attentions it does not claim, then Thunder's torch.compile executor for the rest, its
    regions called without Dynamo (``inductor.py``).

    Not Thunder's cuDNN attention executor, which Thunder lists first among its defaults: Thunder
    0.2.6's raises while checking an attention with the cuDNN frontend of the GPU machine's torch
    2.11 image (``broken_default_attention``)."""
    from thunder.executors.sdpaex import sdpa_ex

    from te_v2_executor.attention import attention_ex
    from te_v2_executor.inductor import inductor_ex

    return [attention_ex, sdpa_ex, inductor_ex]


def broken_default_attention() -> str:
    """Remove Thunder's cuDNN attention executor from Thunder's default executors when it cannot
    run with the installed cuDNN frontend, and say why; "" when there is nothing to remove.

    Thunder 0.2.6's executor calls the frontend's ``pygraph.scaled_dot_product_flash_attention``,
    which current frontends no longer have: its checker then raises on every attention. thunderfx
    checks each node with the default executors whatever ``executors=`` it is given, takes that
    error for an unsupported op and hands each attention to TorchInductor, so a forward crosses
    between Thunder and Inductor regions at every layer (and ``thunder.jit`` with the defaults
    fails on any attention)."""
    cudnn_ex = thunder.extend.get_executor("cudnn")
    if cudnn_ex is None or cudnn_ex not in thunder.extend.get_default_executors():
        return ""
    import cudnn

    if hasattr(cudnn.pygraph, _CUDNN_SDPA_METHOD):
        return ""
    thunder.extend.remove_default_executor(cudnn_ex)
    version = getattr(cudnn, "__version__", "of unknown version")
    return (
        f"te_v2: removed Thunder's 'cudnn' executor from its default executors: Thunder's cuDNN "
        f"attention calls pygraph.{_CUDNN_SDPA_METHOD}, which the installed cuDNN frontend "
        f"({version}) does not have, so it raised on every attention and thunderfx's splitter, which "
        "checks nodes with the default executors, sent each attention to TorchInductor; attention "
        "now stays in Thunder, on te_v2's attention executor. To keep the 'cudnn' executor, install "
        "a cuDNN frontend that has that method (nvidia-cudnn-frontend) and a Thunder that matches it"
    )


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
        "eager mode; use executors=te_v2_executor.executors(), which lists te_v2, attention "
        "executors, then Thunder's torch.compile executor"
    )
