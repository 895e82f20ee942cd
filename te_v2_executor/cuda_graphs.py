"""CUDA graphs for traces te_v2 runs in: Thunder's ``CUDAGraphTransform``, flushes left out.

A small step is bound by the host: Python issues its kernels more slowly than the GPU runs them
(docs/performance.md). Replaying the forward and the backward as CUDA graphs removes that cost.
Everything is captured except te_v2's quantization-state flushes, which run eagerly between the
graphs: what they do is decided in Python on every call (an open ``quantization_update_scope``
holds the update back; the ``te.autocast`` amax group picks the all-reduce), and a capture would
freeze the decision of the first step. The flush symbols refuse to be captured, so Thunder's
plain ``CUDAGraphTransform`` fails with an error naming this transform instead of updating the
state wrongly. Forwards the backward recomputes with the scales the forward sync snapshot
(activation checkpointing under delayed scaling) run eagerly too: replayed from a capture, their
copies came out wrong from the second step on. The ``weight_recasts`` pass is off under CUDA
graphs, where each of its casts would run between graphs: the forward keeps the FP8 weight
copies.

    jitted = thunder.jit(model, executors=[te_v2, torch_compile_ex], transforms=[TEv2CUDAGraphTransform()])
"""

from __future__ import annotations

from thunder.core.symbol import BoundSymbol
from thunder.transforms.cudagraph import CUDAGraphTransform

from te_v2_executor.symbols import LINEAR_FWD, SYNC_SYMBOLS, arg


class TEv2CUDAGraphTransform(CUDAGraphTransform):
    """Thunder's CUDA graph transform, keeping te_v2's state flushes and replayed forwards out of
    the graphs.

    As with Thunder's transform, outputs (the forward's result, saved activations, gradients
    before autograd copies them into ``.grad``) live in the graphs' static buffers and are
    overwritten by the next replay, and those buffers stay allocated between steps.
    """

    def can_fuse(self, bsym: BoundSymbol) -> bool:
        if bsym.sym in SYNC_SYMBOLS or (bsym.sym is LINEAR_FWD and arg(bsym, "replay") is not None):
            return False
        return super().can_fuse(bsym)
