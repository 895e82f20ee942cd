"""The te_v2 trace symbols: meta, implementation and registration, side by side; then the
symbol groups and argument accessors the passes and the report read them by.

They live on a private operator executor that is never listed in ``executors=``; Thunder runs any
symbol whose executor is set, so they execute wherever the te_v2 transforms put them. Metas say
what the runtime values are: the saved FP8 copies are float8 tensors of the flattened operand's
shape. Implementations only forward to the numerics of the call site's backend
(``state.numerics``, a ``KernelBackend``).

Every symbol takes ``state``, the ``LinearQuantState`` of its call site, which is how the passes
know which forward, quantization and GEMMs belong to one linear.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import thunder.torch as ltorch
import torch
from thunder.core import devices, dtypes, prims, utils
from thunder.core.proxies import AnyProxy, TensorProxy
from thunder.core.symbol import BoundSymbol, BoundSymbolTag, Symbol
from thunder.executors import torchex
from thunder.extend import OperatorExecutor

from te_v2_executor import gathered_weights
from te_v2_executor.backends import unquantized
from te_v2_executor.state import LinearQuantState, SyncGroup

ops = OperatorExecutor("te_v2_ops")


def _fp8_proxy(
    like: TensorProxy, shape: tuple[int, ...], state: LinearQuantState, *, forward: bool
) -> TensorProxy:
    return TensorProxy(like=like, shape=shape, dtype=dtypes.to_dtype(state.recipe.fp8_dtype(forward=forward)))


def _flat_shape(t: TensorProxy) -> tuple[int, int]:
    return (math.prod(t.shape[:-1]), t.shape[-1])


# ---- forward: y = x W^T + b, plus the FP8 copies the backward reads -------------------------
# The last output, ``amax_ready``, carries no data: it marks that this forward has recorded its
# amaxes, so the forward sync can be ordered after every forward without holding their outputs.
# A recomputed forward (activation checkpointing) gets ``replay``: the forward scales snapshot
# the forward sync took before updating them, and the row of this linear in it; it quantizes
# exactly as the original forward did and records no amax.
# ``gelu``: x is the input of an exact GELU whose output the linear reads (``passes/gelu.py``).
# ``up``: x is the gate of a SwiGLU, silu(x) * up, whose output the linear reads
# (``passes/swiglu.py``).
# A forward that only saves the weight's copy takes no x (a recast, ``passes/recasts.py``); one
# that only saves the input's copy takes no w (``passes/input_recasts.py``).
# ``x_q``: x as ``te_v2_quantize_input`` cast it once for every forward that reads it
# (``passes/shared_inputs.py``); the forward reads that copy and casts only W.
# A weight FSDP2 gathered in FP8 (``fsdp.py``) is not cast again: the implementation finds the
# gathered bytes by the weight (``gathered_weights``) and the backend reads them.
# ``times``: the input is x * times, a product of two tensors of x's shape and dtype, computed as
# PyTorch's ``*`` computes it (``passes/input_recasts.py``, so that the backward can compute it
# again bitwise).
# ``after``: a tensor the symbol waits for without reading it. A recast waits for the gradient
# its dgrad reads: with no input made in the backward, a fuser's reordering (Thunder's dataflow
# fusion, which thunderfx selects) would hoist it to the start of the backward, its copy alive
# through all of it.


def _linear_fwd_meta(
    x,
    w,
    bias,
    x_q=None,
    *,
    state,
    compute_output,
    save_input,
    save_weight,
    gelu=False,
    up=None,
    replay=None,
    replay_row=0,
    after=None,
    times=None,
):
    y = TensorProxy(like=x, shape=(*x.shape[:-1], w.shape[0])) if compute_output else None
    x_saved = _fp8_proxy(x, _flat_shape(x), state, forward=True) if save_input else None
    w_saved = _fp8_proxy(w, tuple(w.shape), state, forward=True) if save_weight else None
    return y, x_saved, w_saved, AnyProxy(None, prefix="amax_ready")


def _linear_fwd_impl(
    x,
    w,
    bias,
    x_q=None,
    *,
    state,
    compute_output,
    save_input,
    save_weight,
    gelu=False,
    up=None,
    replay=None,
    replay_row=0,
    after=None,
    times=None,
):
    if replay is None:
        scaling = state.forward_scaling((w if w is not None else x).device)
    else:
        scaling = state.replay_scaling(replay[replay_row])
    y, x_saved, w_saved = state.numerics.linear_fwd(
        x if times is None else x * times,
        w,
        bias,
        scaling,
        compute_output=compute_output,
        save_input=save_input,
        save_weight=save_weight,
        gelu=gelu,
        up=up,
        x_q=x_q,
        w_gathered=None if w is None else gathered_weights.find(w, state.recipe),
    )
    return y, x_saved, w_saved, None


LINEAR_FWD = ops.register_operator("te_v2_linear_fwd", meta=_linear_fwd_meta, fn=_linear_fwd_impl)


# ---- one cast of an input several forwards read, with the first one's state ----------------
# ``x_q`` (row-wise) is read by the forwards' GEMMs, ``x_saved`` (column-wise, when a wgrad reads
# it) by their wgrads; two tensors, so that the row-wise copy dies after the last forward.
# ``sharers``: the states of the other forwards, into whose input amax the cast's is recorded too.
# ``times`` and ``after``: as for ``te_v2_linear_fwd``.


def _quantize_input_meta(x, *, state, sharers, columnwise, times=None, after=None):
    x_q = _fp8_proxy(x, _flat_shape(x), state, forward=True)
    return x_q, _fp8_proxy(x, _flat_shape(x), state, forward=True) if columnwise else None


def _quantize_input_impl(x, *, state, sharers, columnwise, times=None, after=None):
    scalings = [s.forward_scaling(x.device) for s in sharers]
    x = x if times is None else x * times
    return state.numerics.quantize_input(x, state.forward_scaling(x.device), scalings, columnwise=columnwise)


QUANTIZE_INPUT = ops.register_operator(
    "te_v2_quantize_input", meta=_quantize_input_meta, fn=_quantize_input_impl
)


# ---- the weight recasts of several dgrads, as one cast (``passes/recast_batches.py``) --------
# ``ws``: parameters the backward casts again (``passes/recasts.py``), one per state of ``states``;
# ``rows``: each state's row in ``replay``, the forward sync's snapshot of the scales its forward
# quantized with. ``after``: as for a recast, the gradient the first of their dgrads reads.


def _recast_weights_meta(replay, after, *ws, states, rows):
    return tuple(_fp8_proxy(w, tuple(w.shape), s, forward=True) for w, s in zip(ws, states, strict=True))


def _recast_weights_impl(replay, after, *ws, states, rows):
    scales = replay.unbind(0)
    scalings = [s.replay_scaling(scales[row]) for s, row in zip(states, rows, strict=True)]
    return states[0].numerics.recast_weights(ws, scalings)


RECAST_WEIGHTS = ops.register_operator(
    "te_v2_recast_weights", meta=_recast_weights_meta, fn=_recast_weights_impl
)


# ---- backward: dy quantized once, shared by dgrad and wgrad; bias grad alongside ------------
# ``gelu_input``: dy is the gradient of an exact GELU's output, and the GELU's input is given; the
# gradient of that input is what gets quantized (``passes/gelu.py``). ``swiglu_gate``: dy is the
# gradient of a SwiGLU's output, silu(gate) * up, and the gradient of up is quantized; with
# ``swiglu_up`` also given, the gradient of the gate (``passes/swiglu.py``).


def _quantize_grad_output_meta(
    dy, gelu_input=None, swiglu_gate=None, swiglu_up=None, *, state, rowwise, columnwise, bgrad
):
    dy_q = _fp8_proxy(dy, _flat_shape(dy), state, forward=False) if (rowwise or columnwise) else None
    dbias = TensorProxy(like=dy, shape=(dy.shape[-1],)) if bgrad else None
    return dy_q, dbias


def _quantize_grad_output_impl(
    dy, gelu_input=None, swiglu_gate=None, swiglu_up=None, *, state, rowwise, columnwise, bgrad
):
    return state.numerics.quantize_grad_output(
        dy,
        state.backward_scaling(dy.device),
        rowwise=rowwise,
        columnwise=columnwise,
        bgrad=bgrad,
        gelu_input=gelu_input,
        swiglu_gate=swiglu_gate,
        swiglu_up=swiglu_up,
    )


QUANTIZE_GRAD_OUTPUT = ops.register_operator(
    "te_v2_quantize_grad_output", meta=_quantize_grad_output_meta, fn=_quantize_grad_output_impl
)


# ``accumulate_into``: a gradient of the same input that nothing else reads; the GEMM adds dx into
# its buffer and returns it (``passes/sums.py``).


def _linear_dgrad_meta(dy_q, w_saved, accumulate_into=None, *, state, input_shape, dtype):
    return TensorProxy(like=dy_q, shape=tuple(input_shape), dtype=dtypes.to_dtype(dtype))


def _linear_dgrad_impl(dy_q, w_saved, accumulate_into=None, *, state, input_shape, dtype):
    return state.numerics.linear_dgrad(
        dy_q, w_saved, state.recipe, input_shape=input_shape, dtype=dtype, accumulate_into=accumulate_into
    )


LINEAR_DGRAD = ops.register_operator("te_v2_linear_dgrad", meta=_linear_dgrad_meta, fn=_linear_dgrad_impl)


def _linear_wgrad_meta(dy_q, x_saved, *, state, dtype):
    return TensorProxy(like=dy_q, shape=(dy_q.shape[-1], x_saved.shape[-1]), dtype=dtypes.to_dtype(dtype))


def _linear_wgrad_impl(dy_q, x_saved, *, state, dtype):
    return state.numerics.linear_wgrad(dy_q, x_saved, state.recipe, dtype=dtype)


LINEAR_WGRAD = ops.register_operator("te_v2_linear_wgrad", meta=_linear_wgrad_meta, fn=_linear_wgrad_impl)


# ---- linears the claim policy keeps out of FP8, run unquantized (``backends/unquantized.py``) -
# ``site`` names the call site, as ``state`` does for an FP8 linear: it ties the three symbols
# of one linear together for ``explain``. ``accumulate_into`` as for ``te_v2_linear_dgrad``
# (``passes/sums.py``); ``scale`` multiplies the product (``passes/scales.py``). One operand may
# be bfloat16 where the other is float32 (``passes/narrowings.py``): the product is then float32.


def _product_dtype(a: TensorProxy, b: TensorProxy) -> dtypes.dtype:
    """The dtype of the product of ``a`` and ``b``: theirs, or float32 for bfloat16 and float32."""
    if a.dtype == b.dtype:
        return a.dtype
    utils.check(
        {dtypes.to_torch_dtype(a.dtype), dtypes.to_torch_dtype(b.dtype)} == {torch.bfloat16, torch.float32},
        lambda: (
            f"te_v2: an unquantized GEMM multiplies {a.dtype} by {b.dtype}; only bfloat16 by "
            "float32 mixes dtypes"
        ),
    )
    return dtypes.float32


def _unquantized_fwd_meta(x, w, bias, accumulate_into=None, *, site, scale=1.0):
    utils.check(
        bias is None or (accumulate_into is None and scale == 1 and x.dtype == w.dtype),
        lambda: "te_v2: an accumulating, scaled or mixed-dtype linear takes no bias",
    )
    return TensorProxy(like=x, shape=(*x.shape[:-1], w.shape[0]), dtype=_product_dtype(x, w))


def _unquantized_fwd_impl(x, w, bias, accumulate_into=None, *, site, scale=1.0):
    return unquantized.linear_fwd(x, w, bias, accumulate_into, scale=scale)


UNQUANTIZED_FWD = ops.register_operator(
    "te_v2_unquantized_fwd", meta=_unquantized_fwd_meta, fn=_unquantized_fwd_impl
)


def _unquantized_dgrad_meta(dy, w, accumulate_into=None, *, site, input_shape, scale=1.0):
    return TensorProxy(like=dy, shape=tuple(input_shape), dtype=_product_dtype(dy, w))


def _unquantized_dgrad_impl(dy, w, accumulate_into=None, *, site, input_shape, scale=1.0):
    return unquantized.linear_dgrad(dy, w, accumulate_into, input_shape=input_shape, scale=scale)


UNQUANTIZED_DGRAD = ops.register_operator(
    "te_v2_unquantized_dgrad", meta=_unquantized_dgrad_meta, fn=_unquantized_dgrad_impl
)


def _unquantized_wgrad_meta(dy, x, *, site, scale=1.0):
    return TensorProxy(like=dy, shape=(dy.shape[-1], x.shape[-1]), dtype=_product_dtype(dy, x))


def _unquantized_wgrad_impl(dy, x, *, site, scale=1.0):
    return unquantized.linear_wgrad(dy, x, scale=scale)


UNQUANTIZED_WGRAD = ops.register_operator(
    "te_v2_unquantized_wgrad", meta=_unquantized_wgrad_meta, fn=_unquantized_wgrad_impl
)


# ---- exact GELU and SiLU, claimed so a pass can fold them into the quantizations next to them --
# Unfolded, PyTorch's own kernels run them (fp32 math, one rounding), as in eager mode.


def _activation_meta(a):
    return TensorProxy(like=a)


def _activation_backward_meta(grad, a):
    return TensorProxy(like=a)


def _gelu_backward_impl(grad: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten.gelu_backward(grad, a)


def _silu_backward_impl(grad: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten.silu_backward(grad, a)


GELU = ops.register_operator("te_v2_gelu", meta=_activation_meta, fn=torch.nn.functional.gelu)
GELU_BACKWARD = ops.register_operator(
    "te_v2_gelu_backward", meta=_activation_backward_meta, fn=_gelu_backward_impl
)
SILU = ops.register_operator("te_v2_silu", meta=_activation_meta, fn=torch.nn.functional.silu)
SILU_BACKWARD = ops.register_operator(
    "te_v2_silu_backward", meta=_activation_backward_meta, fn=_silu_backward_impl
)
# activation -> its backward, (grad, input) -> the input's gradient
ACTIVATION_BACKWARD = {GELU: GELU_BACKWARD, SILU: SILU_BACKWARD}


# ---- an exact widening the backward recomputes for te_v2 readers (``passes/widenings.py``) ---
# ``after``: a tensor of the backward the cast waits for without reading it, as for a recast: its
# input saved by the forward, a fuser's reordering would otherwise hoist it to the start of the
# backward, its wide copy alive through all of it. Fusible readers get Thunder's own cast instead,
# which the fuser folds into their region.


def _widen_meta(a, after, *, dtype):
    return TensorProxy(like=a, dtype=dtypes.to_dtype(dtype))


def _widen_impl(a: torch.Tensor, after, *, dtype: torch.dtype) -> torch.Tensor:
    return a.to(dtype)


WIDEN = ops.register_operator("te_v2_widen", meta=_widen_meta, fn=_widen_impl)


# ---- copies of trace inputs the backward computes from (``passes/input_recasts.py``) --------
# The forward takes them where it reads the inputs, so that a write the trace cannot see (through
# ``.data``, between forward and backward) does not reach what the backward computes. The forward
# that reads the inputs takes the first copy as ``after``: Thunder's split keeps in the forward
# only what a forward symbol reads.


def _snapshot_meta(*tensors):
    return tuple(TensorProxy(like=t) for t in tensors)


def _snapshot_impl(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(t.clone() for t in tensors)


SNAPSHOT = ops.register_operator("te_v2_snapshot", meta=_snapshot_meta, fn=_snapshot_impl)


# ---- a write into a tensor, ordered after te_v2's reads of it (``passes/write_order.py``) ---
# Returns ``a`` itself; the in-place op writes through it. ``after``: outputs of the te_v2 symbols
# that read ``a``'s storage before the write, which a fuser could otherwise order after it.


def _ordered_meta(a, *after):
    return TensorProxy(like=a)


def _ordered_impl(a: torch.Tensor, *after) -> torch.Tensor:
    return a


ORDERED = ops.register_operator("te_v2_ordered", meta=_ordered_meta, fn=_ordered_impl)


# ---- once-per-pass flushes of delayed-scaling state -----------------------------------------


def _forward_sync_meta(token, *after, group):
    replay = None
    if group.replayed:
        replay = TensorProxy(like=token, shape=(len(group.replayed), 2), dtype=dtypes.float32)
    return TensorProxy(like=token), replay


def _forward_sync_impl(
    token: torch.Tensor, *after, group: SyncGroup
) -> tuple[torch.Tensor, torch.Tensor | None]:
    replay = group.snapshot_replayed_scales()
    group.flush()
    return token, replay


# Returns ``token`` (a forward output) so Thunder's forward/backward split keeps it in the
# forward, and the pre-update scales of the linears the backward recomputes.
FORWARD_SYNC = ops.register_operator(
    "te_v2_forward_sync", meta=_forward_sync_meta, fn=_forward_sync_impl, tags=(prims.OpTags.DONT_DCE,)
)


def _backward_sync_meta(*after, group):
    return None


def _backward_sync_impl(*after, group: SyncGroup) -> None:
    group.flush()


BACKWARD_SYNC = ops.register_operator(
    "te_v2_backward_sync", meta=_backward_sync_meta, fn=_backward_sync_impl, tags=(prims.OpTags.DONT_DCE,)
)


# ---- a backward that reads a tensor after an in-place write into it: refused when it runs ----
# (``passes/stale_reads.py``), as eager autograd refuses it; the forward runs as usual. ``when``:
# flags the forward computed, one per message; none: refused unconditionally, with the first.


def _refuse_backward_meta(grads, when, *, messages):
    return None


def _refuse_backward_impl(grads, when, *, messages: tuple[str, ...]) -> None:
    if not when:
        raise RuntimeError(messages[0])
    for flag, message in zip(when, messages, strict=True):
        if bool(flag):
            raise RuntimeError(message)


REFUSE_BACKWARD = ops.register_operator(
    "te_v2_refuse_backward",
    meta=_refuse_backward_meta,
    fn=_refuse_backward_impl,
    tags=(prims.OpTags.DONT_DCE,),
)


# ---- whether two names of a storage share it at run time (``passes/view_writes.py``) --------
# Thunder's view ops may copy (``reshape`` of a transposed tensor does); a read through another name
# than a write's is refused only where the two do share storage. A CPU flag for the refusal, which
# Thunder's split runs in the backward, the two tensors saved for it (in such programs only).


def _shares_storage_meta(a, b):
    return TensorProxy(like=a, shape=(), device=devices.cpu, dtype=dtypes.bool8)


def _shares_storage_impl(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.tensor(a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr())


SHARES_STORAGE = ops.register_operator(
    "te_v2_shares_storage", meta=_shares_storage_meta, fn=_shares_storage_impl
)


# ---- inputs over one storage read as one: each call checks they are one view -----------------
# (``passes/stale_reads.py``, ``refuse_aliased_inputs``): Thunder replaced each with the first.


def _same_views_meta(*tensors, message):
    return None


def _same_views_impl(*tensors: torch.Tensor, message: str) -> None:
    first = tensors[0]
    for t in tensors[1:]:
        if (t.data_ptr(), t.shape, t.stride()) != (first.data_ptr(), first.shape, first.stride()):
            raise RuntimeError(message)


SAME_VIEWS = ops.register_operator(
    "te_v2_same_views", meta=_same_views_meta, fn=_same_views_impl, tags=(prims.OpTags.DONT_DCE,)
)


# ---- prologue guard: retrace when the te.autocast recipe changes ----------------------------


def _check_recipe_meta(guard, signature):
    return None


def _check_recipe_impl(guard, signature: str) -> None:
    if guard.current_signature() != signature:
        raise RuntimeError("te_v2: the FP8 recipe changed since this trace was compiled")


CHECK_RECIPE = ops.register_operator(
    "te_v2_check_recipe", meta=_check_recipe_meta, fn=_check_recipe_impl, tags=(prims.OpTags.DONT_DCE,)
)


# ---- symbol groups --------------------------------------------------------------------------

# The symbols of one FP8 linear, each carrying its ``state``, and of one unquantized linear, each
# carrying its ``site``.
LINEAR_SYMBOLS = (LINEAR_FWD, QUANTIZE_GRAD_OUTPUT, LINEAR_DGRAD, LINEAR_WGRAD)
UNQUANTIZED_SYMBOLS = (UNQUANTIZED_FWD, UNQUANTIZED_DGRAD, UNQUANTIZED_WGRAD)
SYNC_SYMBOLS = (FORWARD_SYNC, BACKWARD_SYNC)

# Thunder reaches a linear as ltorch.linear (nn.Linear, F.linear) or prims.linear (after
# autocast and other decompositions); claiming only one lets the other bypass te_v2.
LINEAR_IDS = (ltorch.linear.id, prims.linear.id)


def is_thunder_linear(bsym: BoundSymbol) -> bool:
    """A linear te_v2 did not claim: Thunder's own, or the torch executor's that runs it."""
    return bsym.sym.id in LINEAR_IDS or bsym.sym is torchex.linear


def is_te_v2(bsym: BoundSymbol) -> bool:
    """Whether ``bsym`` is one of te_v2's own symbols, which no fuser fuses."""
    return bsym.sym.executor is ops


def in_backward(bsym: BoundSymbol) -> bool:
    """Whether ``bsym`` belongs to the backward of a joint trace, as Thunder's grad transform tags
    it (a checkpoint's recomputed forward included)."""
    return BoundSymbolTag.BACKWARD in bsym.tags


def is_recompute(bsym: BoundSymbol) -> bool:
    """A forward copy Thunder placed in the backward to recompute a checkpointed region."""
    return bsym.sym is LINEAR_FWD and in_backward(bsym)


def is_recast(bsym: BoundSymbol) -> bool:
    """The backward's cast of a forward's weight alone, for its dgrads (``passes/recasts.py``)."""
    return is_recompute(bsym) and arg(bsym, "x") is None


def is_input_recast(bsym: BoundSymbol) -> bool:
    """The backward's cast of a forward's input alone, for its wgrads (``passes/input_recasts.py``)."""
    return is_recompute(bsym) and arg(bsym, "w") is None


def is_forward_linear(bsym: BoundSymbol) -> bool:
    """A linear's forward, in FP8, unquantized or left to Thunder, other than a checkpoint
    recompute (which Thunder tags as backward)."""
    linear = bsym.sym in (LINEAR_FWD, UNQUANTIZED_FWD) or is_thunder_linear(bsym)
    return linear and not in_backward(bsym)


# ---- argument accessors: a te_v2 bound symbol's arguments by their meta's parameter names -----

_SIGNATURES: dict[Symbol, inspect.Signature] = {
    sym: inspect.signature(sym.meta) for sym in (*LINEAR_SYMBOLS, *UNQUANTIZED_SYMBOLS)
}


def _positional(sym: Symbol) -> list[str]:
    return [p.name for p in _SIGNATURES[sym].parameters.values() if p.kind is p.POSITIONAL_OR_KEYWORD]


def arg(bsym: BoundSymbol, name: str) -> Any:
    """The argument ``name`` of a te_v2 linear symbol's bound symbol, given by position or by
    keyword; its default when not given (``accumulate_into`` is None, ``scale`` 1.0)."""
    positional = _positional(bsym.sym)
    if name in positional and (at := positional.index(name)) < len(bsym.args):
        return bsym.args[at]
    if name in bsym.kwargs:
        return bsym.kwargs[name]
    return _SIGNATURES[bsym.sym].parameters[name].default


def with_args(bsym: BoundSymbol, /, **changes: Any) -> BoundSymbol:
    """``bsym`` with the named arguments changed, each where the symbol takes it: a positional
    one in its place (the optional ones before it given as None), the others as keywords.
    ``output=`` gives the bound symbol a new output."""
    extra = {"output": changes.pop("output")} if "output" in changes else {}
    positional = _positional(bsym.sym)
    args, kwargs = list(bsym.args), dict(bsym.kwargs)
    for name, value in changes.items():
        if name in positional:
            at = positional.index(name)
            args += [None] * (at + 1 - len(args))
            args[at] = value
        else:
            kwargs[name] = value
    return bsym.from_bsym(args=tuple(args), kwargs=kwargs, **extra)


# The te_v2 GEMMs that can add their product into an existing tensor (``accumulate_into``, the
# tensor they write into), and that argument's position.
ACCUMULATE_ARG = {
    sym: _positional(sym).index("accumulate_into")
    for sym in (*LINEAR_SYMBOLS, *UNQUANTIZED_SYMBOLS)
    if "accumulate_into" in _positional(sym)
}
