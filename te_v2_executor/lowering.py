"""How te_v2 claims a linear: the checker, the execution and grad transforms, the lookaside,
and ``bind_states``, which gives each linear of a whole trace its quantization state. Exact GELUs
are claimed too, as single symbols the analysis can fold into the linears' FP8 quantization
(``analysis.fuse_gelus``).

The grad transform emits the full backward (dy quantized once, dgrad, wgrad, bias grad) and a
forward that saves every FP8 copy; Thunder's dead-code elimination then drops the gradients
nobody consumes, and the analysis (``analysis.py``) trims the forward to what survives. A linear
the claim policy keeps out of FP8 gets the same three symbols, unquantized (``unquantized.py``).
"""

from __future__ import annotations

import collections

import thunder.torch as ltorch
import torch
from thunder.core import dtypes, prims, utils
from thunder.core.compile_data import get_compile_data
from thunder.core.jit_ext import get_jit_ctx
from thunder.core.prims import get_grad, put_grad
from thunder.core.proxies import TensorProxy, variableify
from thunder.core.symbol import BoundSymbol, BoundSymbolTag
from thunder.core.trace import TraceCtx, from_trace, tracectx
from thunder.executors import torchex
from thunder.extend import Executor

from te_v2_executor import analysis, backends, checks
from te_v2_executor.config import TEv2Config
from te_v2_executor.recipes import active_recipe
from te_v2_executor.state import LinearQuantState, StateKey, StateRegistry
from te_v2_executor.symbols import (
    CHECK_RECIPE,
    GELU,
    GELU_BACKWARD,
    LINEAR_DGRAD,
    LINEAR_FWD,
    LINEAR_WGRAD,
    QUANTIZE_GRAD_OUTPUT,
    UNQUANTIZED_DGRAD,
    UNQUANTIZED_FWD,
    UNQUANTIZED_WGRAD,
)

# Thunder reaches a linear as ltorch.linear (nn.Linear, F.linear) or prims.linear (after
# autocast and other decompositions); claiming only one lets the other bypass te_v2.
LINEAR_IDS = (ltorch.linear.id, prims.linear.id)


def _torch_dtype(t: TensorProxy) -> torch.dtype:
    return dtypes.to_torch_dtype(t.dtype)


def operands(x: TensorProxy, w: TensorProxy, bias: TensorProxy | None) -> checks.LinearOperands:
    """The facts of a traced linear the checks need."""
    device = x.device.devicetype.name.lower()
    capability = None
    if device == "cuda" and torch.cuda.is_available():
        capability = torch.cuda.get_device_capability(x.device.index or 0)
    return checks.LinearOperands(
        x_shape=tuple(x.shape),
        w_shape=tuple(w.shape),
        bias_shape=None if bias is None else tuple(bias.shape),
        dtypes=tuple(_torch_dtype(t) for t in (x, w, bias) if t is not None),
        device_type=device,
        compute_capability=capability,
    )


def _site(x: TensorProxy, w: TensorProxy) -> str:
    """The call-site name the symbols of one unquantized linear share."""
    return f"{w.name}({x.name})"


def _unquantized_grad_transform(x: TensorProxy, w: TensorProxy, bias: TensorProxy | None) -> TensorProxy:
    """A linear the claim policy keeps out of FP8: its forward and every gradient, unquantized."""
    site = _site(x, w)
    y = UNQUANTIZED_FWD(x, w, bias, site=site)
    dy = get_grad(y)
    put_grad(x, UNQUANTIZED_DGRAD(dy, w, site=site, input_shape=tuple(x.shape)))
    put_grad(w, UNQUANTIZED_WGRAD(dy, x, site=site))
    if bias is not None:
        put_grad(bias, ltorch.sum(dy, tuple(range(dy.ndim - 1))))
    return y


class RecipeGuard:
    """Tells, in a compiled function's prologue, whether ``te.autocast``'s recipe is still the
    one its trace was made with; a mismatch makes Thunder retrace instead of reusing it."""

    def current_signature(self) -> str:
        return repr(backends.autocast_recipe())


class LinearLowering:
    """The checker, transforms and lookaside of one te_v2 executor."""

    def __init__(self, executor: Executor, config: TEv2Config) -> None:
        self.executor = executor
        self.config = config
        self.guard = RecipeGuard()

    def rule_broken(
        self, x: TensorProxy, w: TensorProxy, bias: TensorProxy | None = None
    ) -> tuple[str, bool]:
        """The rule that keeps this linear out of FP8 ("" when te_v2 runs it in FP8), and whether
        it is the claim policy's choice rather than something te_v2 cannot run."""
        op = operands(x, w, bias)
        rule = checks.capability_rule_broken(op, active_recipe(self.config.recipe), self.config.backend)
        if rule:
            return rule, False
        rule = checks.policy_rule_broken(op, self.config.claim)
        return rule, bool(rule)

    def _unquantized(self, x: TensorProxy, w: TensorProxy, bias: TensorProxy | None) -> bool:
        """Whether the claim policy, not a capability rule, keeps this claimed linear out of FP8."""
        return self.rule_broken(x, w, bias)[1]

    def checker(self, x: TensorProxy, w: TensorProxy, bias: TensorProxy | None = None) -> bool:
        rule, by_policy = self.rule_broken(x, w, bias)
        return not rule or (by_policy and self.config.claim.unquantized)

    def _state(self, w: TensorProxy) -> LinearQuantState:
        """A provisional state; ``bind_states`` swaps it for the registry's once the whole trace
        is known."""
        return LinearQuantState(w.name, active_recipe(self.config.recipe), self.config.backend)

    def execution_transform(
        self, x: TensorProxy, w: TensorProxy, bias: TensorProxy | None = None
    ) -> TensorProxy:
        """Inference: the forward GEMM alone, no FP8 copies kept."""
        if self._unquantized(x, w, bias):
            return UNQUANTIZED_FWD(x, w, bias, site=_site(x, w))
        y, *_ = LINEAR_FWD(
            x, w, bias, state=self._state(w), compute_output=True, save_input=False, save_weight=False
        )
        return y

    def grad_transform(self, x: TensorProxy, w: TensorProxy, bias: TensorProxy | None = None) -> TensorProxy:
        """Training: forward, then every gradient; unconsumed ones are removed downstream."""
        if self._unquantized(x, w, bias):
            return _unquantized_grad_transform(x, w, bias)
        state = self._state(w)
        y, x_saved, w_saved, _ = LINEAR_FWD(
            x, w, bias, state=state, compute_output=True, save_input=True, save_weight=True
        )
        dy_q, dbias = QUANTIZE_GRAD_OUTPUT(
            get_grad(y), state=state, rowwise=True, columnwise=True, bgrad=bias is not None
        )
        put_grad(
            x, LINEAR_DGRAD(dy_q, w_saved, state=state, input_shape=tuple(x.shape), dtype=_torch_dtype(x))
        )
        put_grad(w, LINEAR_WGRAD(dy_q, x_saved, state=state, dtype=_torch_dtype(w)))
        if bias is not None:
            put_grad(bias, dbias)
        return y

    def _check_executor_order(self) -> None:
        compile_data = get_compile_data()
        if compile_data is None:
            return
        te_v2s = [
            ex.name
            for ex in compile_data.executors_list
            if isinstance(getattr(ex, "lowering", None), LinearLowering)
        ]
        if len(te_v2s) > 1:
            raise ValueError(
                f"te_v2: executors=[...] lists {len(te_v2s)} te_v2 executors "
                f"({', '.join(map(repr, te_v2s))}), but only one may be listed: each would claim the "
                "same linears and run its analysis on the same trace; keep the one with the backend, "
                "recipe and claim policy you want"
            )
        for ex in compile_data.executors_list:
            if ex == self.executor:
                return
            if any(i in ex.implmap for i in LINEAR_IDS):
                raise ValueError(
                    f"te_v2: executor {ex.name!r} comes before {self.executor.name!r} in executors=[...] "
                    f"and claims linear first, so te_v2 would never run; list {self.executor.name!r} first, "
                    f"e.g. executors=[te_v2, *thunder.get_default_executors()]"
                )

    def lookaside(self, x, w, bias=None):
        """Runs when Thunder traces ``F.linear``: checks the setup and guards the recipe."""
        self._check_executor_order()
        backends.kernels(self.config.backend)  # a missing TransformerEngine fails here, by name
        if self.config.recipe is None and backends.te_available():
            get_jit_ctx().add_constraint((CHECK_RECIPE, self.guard, self.guard.current_signature()))
        return ltorch.linear(x, w, bias)

    def gelu_checker(self, a: TensorProxy, approximate: str = "none") -> bool:
        """Exact GELUs only: TE has no kernel for them, and the tanh approximation is not one."""
        return self.config.claim.gelu and approximate == "none"

    def gelu_execution_transform(self, a: TensorProxy, approximate: str = "none") -> TensorProxy:
        return GELU(a)

    def gelu_grad_transform(self, a: TensorProxy, approximate: str = "none") -> TensorProxy:
        h = GELU(a)
        put_grad(a, GELU_BACKWARD(get_grad(h), a))
        return h

    def register(self) -> None:
        self.executor.register_supported(
            ltorch.gelu.id,
            self.gelu_checker,
            execution_transform=self.gelu_execution_transform,
            grad_transform=self.gelu_grad_transform,
        )
        for sym_id in LINEAR_IDS:
            self.executor.register_supported(
                sym_id,
                self.checker,
                execution_transform=self.execution_transform,
                grad_transform=self.grad_transform,
            )
        self.executor._lookasides[torch.nn.functional.linear] = self.lookaside


def source_input(producers: dict, p: TensorProxy) -> TensorProxy:
    """The trace input ``p`` derives from through single-input ops (casts, views, slices): what
    names a weight, for its state and in the report."""
    while p in producers and len(inputs := producers[p].flat_proxy_args) == 1:
        p = inputs[0]
    return p


def _is_forward_linear(bsym: BoundSymbol) -> bool:
    """A linear's forward, in FP8, unquantized or left to Thunder, other than a checkpoint
    recompute (which Thunder tags as backward)."""
    linear = (
        bsym.sym in (LINEAR_FWD, UNQUANTIZED_FWD) or bsym.sym.id in LINEAR_IDS or bsym.sym is torchex.linear
    )
    return linear and BoundSymbolTag.BACKWARD not in bsym.tags


def bind_states(trace: TraceCtx, registry: StateRegistry) -> TraceCtx:
    """Give every te_v2 symbol of a joint or inference trace its linear's state from
    ``registry``, by ``StateKey``, in place of the provisional one the transforms gave it; then
    load what was loaded before the first trace (``load_quantization_state_dict``).

    The symbols of one linear (its forward, a checkpoint recompute, the dy quantization and the
    GEMMs) share the provisional state, so they get one state. A linear's ordinal counts the
    forwards before it whose weight has the same source, whoever runs them, so that a trace where
    another use of the weight falls back (a batch shape TE cannot run) numbers the same.
    """
    producers = utils.producers(trace)
    ordinals: collections.Counter[str] = collections.Counter()
    bound: dict[int, LinearQuantState] = {}
    for bsym in filter(_is_forward_linear, trace.bound_symbols):
        name = source_input(producers, bsym.args[1]).name
        source = name.removeprefix("t_")  # as explain names it
        ordinal, ordinals[source] = ordinals[source], ordinals[source] + 1
        if bsym.sym is LINEAR_FWD:
            state = bsym.kwargs["state"]
            key = StateKey(source, ordinal, state.recipe, state.backend)
            bound[id(state)] = registry.state(key, name)
    registry.take_held()
    if not bound:
        return trace
    return analysis.with_bound_symbols(trace, [_rebound(b, bound) for b in trace.bound_symbols])


def _rebound(bsym: BoundSymbol, bound: dict[int, LinearQuantState]) -> BoundSymbol:
    """``bsym`` with its bound state, if it is a te_v2 symbol of a linear."""
    state = bsym.kwargs.get("state")
    if not isinstance(state, LinearQuantState):
        return bsym
    return bsym.from_bsym(kwargs={**bsym.kwargs, "state": bound[id(state)]})


_SQRT1_2 = 0.7071067811865476
_INV_SQRT_2PI = 0.3989422804014327


def _gelu_backward_ops(grad: TensorProxy, a: TensorProxy) -> TensorProxy:
    """PyTorch's exact GELU backward, computed as PyTorch does in the wider of float32 and
    ``a``'s dtype (float32 for the 16-bit dtypes, float64 for float64), rounded once to ``a``'s
    dtype."""
    compute = torch.promote_types(torch.float32, _torch_dtype(a))
    x = ltorch.to(a, compute)
    cdf = ltorch.mul(0.5, ltorch.add(1.0, ltorch.erf(ltorch.mul(x, _SQRT1_2))))
    pdf = ltorch.mul(ltorch.exp(ltorch.mul(ltorch.mul(-0.5, x), x)), _INV_SQRT_2PI)
    dx = ltorch.mul(ltorch.to(grad, compute), ltorch.add(cdf, ltorch.mul(x, pdf)))
    return ltorch.to(dx, _torch_dtype(a))


def gelu_as_torch_ops(bsym: BoundSymbol, trace: TraceCtx) -> list[BoundSymbol]:
    """A ``te_v2_gelu`` or ``te_v2_gelu_backward`` bound symbol as Thunder torch-level ops with the
    same output proxy, for a fusion executor to fuse with its neighbours."""
    scratch = from_trace(trace)
    with tracectx(scratch):
        out = ltorch.gelu(*bsym.args) if bsym.sym is GELU else _gelu_backward_ops(*bsym.args)
    swap = {variableify(out): bsym.output}
    return [b.from_bsym_swap_proxies(swap) for b in scratch.bound_symbols]
