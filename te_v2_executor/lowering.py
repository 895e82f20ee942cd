"""How te_v2 claims a linear: the lookaside, the checker, the execution and grad transforms; and
the claim of exact GELUs and of SiLUs, as single symbols a pass can fold into the linears' FP8
quantization (``passes/gelu.py``, ``passes/swiglu.py``).

The grad transform emits the full backward (dy quantized once, dgrad, wgrad, bias grad) and a
forward that saves every FP8 copy; Thunder's dead-code elimination then drops the gradients
nobody consumes, and the passes (``passes/``) trim the forward to what survives. A linear the
claim policy keeps out of FP8 gets the same three symbols, unquantized
(``backends/unquantized.py``). Whether a linear runs in FP8 is ``checks.decide``'s decision.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import thunder.torch as ltorch
import torch
from thunder.core import dtypes
from thunder.core.compile_data import get_compile_data
from thunder.core.jit_ext import get_jit_ctx
from thunder.core.prims import get_grad, put_grad
from thunder.core.proxies import TensorProxy
from thunder.extend import Executor

from te_v2_executor import backends, checks
from te_v2_executor.autocast import RecipeGuard, active_recipe
from te_v2_executor.config import TEv2Config
from te_v2_executor.state import LinearQuantState
from te_v2_executor.symbols import (
    ACTIVATION_BACKWARD,
    CHECK_RECIPE,
    GELU,
    LINEAR_DGRAD,
    LINEAR_FWD,
    LINEAR_IDS,
    LINEAR_WGRAD,
    QUANTIZE_GRAD_OUTPUT,
    SILU,
    UNQUANTIZED_DGRAD,
    UNQUANTIZED_FWD,
    UNQUANTIZED_WGRAD,
)


def _torch_dtype(t: TensorProxy) -> torch.dtype:
    return dtypes.to_torch_dtype(t.dtype)


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


class LinearLowering:
    """The checker, transforms and lookaside of one te_v2 executor."""

    def __init__(self, executor: Executor, config: TEv2Config) -> None:
        self.executor = executor
        self.config = config
        self.guard = RecipeGuard()

    def decide(self, x: TensorProxy, w: TensorProxy, bias: TensorProxy | None = None) -> checks.Decision:
        """How this executor runs the linear ``x @ w.T + bias`` traced now (``checks.decide``)."""
        op = checks.operands(x, w, bias)
        return checks.decide(op, active_recipe(self.config.recipe), self.config.backend, self.config.claim)

    def _unquantized(self, x: TensorProxy, w: TensorProxy, bias: TensorProxy | None) -> bool:
        """Whether the claim policy, not a capability rule, keeps this claimed linear out of FP8."""
        return self.decide(x, w, bias).by_policy

    def checker(self, x: TensorProxy, w: TensorProxy, bias: TensorProxy | None = None) -> bool:
        decision = self.decide(x, w, bias)
        return decision.fp8 or (decision.by_policy and self.config.claim.unquantized)

    def _state(self, w: TensorProxy) -> LinearQuantState:
        """A provisional state; the ``states`` pass swaps it for the registry's once the whole
        trace is known."""
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
                    "e.g. executors=te_v2_executor.executors(), which puts te_v2 first and a fuser after it"
                )

    def lookaside(self, x, w, bias=None):
        """Runs when Thunder traces ``F.linear``: checks the setup and guards the recipe."""
        self._check_executor_order()
        backends.load(self.config.backend)  # a missing TransformerEngine fails here, by name
        if self.config.recipe is None and backends.te_available():
            get_jit_ctx().add_constraint((CHECK_RECIPE, self.guard, self.guard.current_signature()))
        return ltorch.linear(x, w, bias)

    def gelu_checker(self, a: TensorProxy, approximate: str = "none") -> bool:
        """Exact GELUs only: TE has no kernel for them, and the tanh approximation is not one."""
        return self.config.claim.gelu and approximate == "none"

    def silu_checker(self, a: TensorProxy, inplace: bool = False) -> bool:
        """Out-of-place SiLUs: an in-place one writes its input, which a fold would read."""
        return self.config.claim.silu and not inplace

    @staticmethod
    def _activation_transforms(sym: Any) -> tuple[Callable, Callable]:
        """The execution and grad transforms that run an activation as te_v2's symbol ``sym``,
        its gradient as that symbol's backward."""

        def execution_transform(a: TensorProxy, *args: Any, **kwargs: Any) -> TensorProxy:
            return sym(a)

        def grad_transform(a: TensorProxy, *args: Any, **kwargs: Any) -> TensorProxy:
            h = sym(a)
            put_grad(a, ACTIVATION_BACKWARD[sym](get_grad(h), a))
            return h

        return execution_transform, grad_transform

    def register(self) -> None:
        for sym_id, checker, sym in (
            (ltorch.gelu.id, self.gelu_checker, GELU),
            (ltorch.silu.id, self.silu_checker, SILU),
        ):
            execution_transform, grad_transform = self._activation_transforms(sym)
            self.executor.register_supported(
                sym_id, checker, execution_transform=execution_transform, grad_transform=grad_transform
            )
        for sym_id in LINEAR_IDS:
            self.executor.register_supported(
                sym_id,
                self.checker,
                execution_transform=self.execution_transform,
                grad_transform=self.grad_transform,
            )
        self.executor._lookasides[torch.nn.functional.linear] = self.lookaside
