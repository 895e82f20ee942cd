"""Run one program three ways and compare: eager float32, te_v2 (reference backend, current
scaling), and an eager emulation of te_v2's kernels.

The emulation (``tests.helpers.eager_emulation``) routes each ``F.linear`` as te_v2's claim would: through the
reference FP8 kernels when ``checks.decide`` gives FP8, through plain ``F.linear`` otherwise (te_v2's unquantized symbols and Thunder's fallback
compute the same products). Compared: every output, every input after the call (the program may
write into it) and every gradient; the None-ness of each gradient must match eager's exactly.

- te_v2 against the emulation: bitwise (``torch.equal``) where every linear ran in FP8, nothing
  is bfloat16, no fuser follows te_v2 and no op is one whose gradient Thunder computes from its
  own decomposition (``THUNDER_ROUNDED``): the same kernels, and te_v2's FP8 dgrad adds into a
  gradient of two terms as eager's autograd adds (of three or more, possibly in another order).
  Elsewhere a relative error (Frobenius norm of the difference over the
  emulation's) of at most ``FOLD_RTOL``: te_v2 folds sums and constant scales into its
  unquantized GEMMs (``addmm_`` with alpha, beta = 1), and Thunder's own backward (the fallback
  linears') adds gradients in another order (4.5e-8 seen). With a bfloat16 value,
  ``BF16_RTOL``: a folded bfloat16 sum rounds once where eager rounds three times (2.5e-3 to
  3.3e-3 on a sum of two bfloat16 linears). Measured with ``python -m tests.fuzz --measure`` (the
  default generator without in-place ops) on the working tree of the fixes: the 21 of 113
  programs with FP8 linears only were bitwise equal, the others within 1.8e-7 (171 more, and
  199 on b562c6f: within 2.5e-7). No rounding flip of an FP8 value downstream of a fold was seen
  (it would cost ~1e-3). The bugs this is for are errors of 0.1 to 1.
- te_v2 against eager float32, where an FP8 linear ran: at most ``FP8_RTOL`` (FP8's error over
  a few linears, measured up to 0.12, with delayed scaling too; a misrouted or lost gradient is
  ~1). Without one, eager is the emulation and the check above covers it.
- Where eager's backward raises because a tensor it saved was written in place after the save,
  eager and the emulation run again with every saved tensor copied when saved
  (``_snapshot_saved_tensors``): the gradients of the forward as it computed. te_v2 either
  raises too (``stale_reads``), or its gradients are judged against those, as any program's are.
- Eager raising otherwise is recorded, not failed: te_v2 should raise too, and a te_v2 that
  returns is counted as ``eager_raised_te_v2_silent``.
- ``delayed``: te_v2 with delayed scaling (stateful) for ``DELAYED_STEPS`` steps on one model
  against eager, within ``FP8_RTOL`` (without FP8 linears, the bound against the emulation).
- ``graphs``: te_v2 under ``TEv2CUDAGraphTransform`` for ``DELAYED_STEPS`` delayed-scaling steps,
  its graphs captured and replayed by ``tests.helpers.capture_taped`` (ATen operations taped and
  run again, no Python, as a CUDA graph replays), against te_v2 without graphs: bitwise. The tape
  cannot see Inductor's CPU kernels, so this holds for programs te_v2 runs alone. The transform
  reuses the saved memory (``reuse_saved_memory=True``): its backward graphs' functions carry
  the calls that free the saved tensors after their last readers (which free nothing on the CPU).

A failure that Thunder without te_v2 shows too is Thunder's (``Verdict.status`` "thunder"), and
so is te_v2's refusal (its own error) of a program that Thunder without te_v2 gets wrong silently.
"""

from __future__ import annotations

import collections
import contextlib
import math
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any
from unittest import mock

import torch
from thunder.transforms.cudagraph import CUDAGraphRunner

from te_v2_executor import ClaimPolicy, TEv2CUDAGraphTransform, current_scaling, delayed_scaling, make_te_v2
from te_v2_executor.dynamo import EagerOnRefusal
from te_v2_executor.recipes import RecipeSpec
from tests.fuzz.programs import FUSINGS, Program
from tests.helpers import capture_taped, eager_emulation

FOLD_RTOL = 1e-6
BF16_RTOL = 1e-2
FP8_RTOL = 0.3
# Ops whose gradient Thunder alone (no te_v2) computes from its decomposition, differing from
# ATen's autograd in the last bits (relu's does not); seen where it reaches a bias's gradient
# unquantized: fuzz --seed 1207 program 28 (tanh GELU, 1.2e-7).
THUNDER_ROUNDED = frozenset({"gelu", "gelu_tanh", "silu", "silu_squared", "swiglu"})
# Thunder alone is wrong, or agrees with te_v2, within this: far above rounding, far below bugs.
ATTRIBUTION_RTOL = 1e-3
DELAYED_STEPS = 3
_DELAYED = delayed_scaling(amax_history_len=4)
_TINY = 1e-30
_WRITTEN_AFTER_SAVE = "needed for gradient computation has been modified by an inplace operation"


@dataclass
class Run:
    """What one way of running a program produced: named tensors, or the error it raised."""

    tensors: dict[str, torch.Tensor | None] = field(default_factory=dict)
    error: str | None = None
    error_at: str = ""  # the exception's type and the line that raised it
    routes: list[str] = field(default_factory=list)  # the emulation's route of each linear call
    eager_regions: int = 0  # regions te_v2_executor.thunderfx ran eagerly, te_v2 having refused them


@dataclass
class Verdict:
    """The comparison of one program's runs."""

    status: str  # "ok", "fail", "thunder", "eager_raised_both", "eager_raised_te_v2_silent"
    kind: str = ""  # the failure's category, which shrinking keeps
    problems: list[str] = field(default_factory=list)
    routes: frozenset[str] = frozenset()  # of the linears, in the emulation
    errors: dict[str, float] = field(default_factory=dict)  # te_v2 vs emulation / eager, max over tensors
    eager_error: str = ""
    note: str = ""  # on a failure: what Thunder without te_v2 does

    @property
    def failed(self) -> bool:
        return self.status == "fail"

    @property
    def fp8(self) -> bool:
        """Whether an FP8 linear ran."""
        return "fp8" in self.routes


def _failed(run: Run, stage: str, e: BaseException) -> Run:
    """``run`` recording that ``stage`` raised ``e``."""
    last = traceback.extract_tb(e.__traceback__)[-1] if e.__traceback__ else None
    run.error_at = f"{stage}, {type(e).__name__}" + (
        f" at {last.filename.rsplit('/', 1)[-1]}:{last.lineno}" if last else ""
    )
    first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
    run.error = f"{run.error_at}: {first}"
    return run


def _snapshot(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().clone()


def _one_step(program: Program, model: torch.nn.Module, fn: Callable[..., Any], ns: dict[str, Any]) -> Run:
    """Forward, loss and backward once on fresh inputs; everything named."""
    for p in model.parameters():
        p.grad = None
    inputs = ns["make_inputs"]()
    run = Run()
    try:
        outputs = fn(*inputs)
    except Exception as e:
        return _failed(run, "forward", e)
    try:
        loss = ns["loss_of"](outputs)
        if loss.requires_grad:
            loss.backward()
    except Exception as e:
        return _failed(run, "backward", e)
    run.tensors = {
        f"output {i} ({o})": _snapshot(t)
        for i, (o, t) in enumerate(zip(program.outputs, outputs, strict=True))
    }
    for spec, x in zip(program.inputs, inputs, strict=True):
        run.tensors[f"{spec.name} (after the call)"] = _snapshot(x)
        run.tensors[f"{spec.name}.grad"] = _snapshot(x.grad)
    run.tensors.update({f"{n}.grad": _snapshot(p.grad) for n, p in model.named_parameters()})
    return run


def execute(
    program: Program,
    how: str,
    *,
    recipe: RecipeSpec | None = None,
    steps: int = 1,
    snapshot_saved: bool = False,
) -> list[Run]:
    """Run ``program`` ``steps`` times: "eager", "emulation", "te_v2", "te_v2 graphed" (under
    ``TEv2CUDAGraphTransform``, captured by a tape) or "thunder" (Thunder without te_v2, fused as
    te_v2's run is, to tell a Thunder bug from te_v2's). With ``snapshot_saved``, autograd saves a
    copy of each tensor it saves for the backward, as it is when saved
    (``_snapshot_saved_tensors``)."""
    recipe = recipe or current_scaling()
    claim = ClaimPolicy(min_features=program.min_features)
    ns = program.namespace()
    graphed = how == "te_v2 graphed"
    with (
        warnings.catch_warnings(),
        mock.patch.object(CUDAGraphRunner, "build_cuda_graph", capture_taped),
        _snapshot_saved_tensors() if snapshot_saved else contextlib.nullcontext(),
    ):
        warnings.simplefilter("ignore")
        model = ns["make_model"]()
        fn: Callable[..., Any] = model
        if program.fusing.dynamo:
            torch._dynamo.reset()
        if how.startswith("te_v2"):
            te_v2 = make_te_v2(backend="reference", recipe=recipe, claim=claim)
            fn = program.fusing.jit(
                model, te_v2, [TEv2CUDAGraphTransform(reuse_saved_memory=True)] if graphed else None
            )
        elif how == "thunder":
            fn = program.fusing.jit(model)
        runs = []
        for _ in range(steps):
            if how == "emulation":
                with eager_emulation(recipe, claim=claim) as routes:
                    run = _one_step(program, model, fn, ns)
                run.routes = list(routes)
            else:
                run = _one_step(program, model, fn, ns)
            run.eager_regions = _eager_regions(fn)
            runs.append(run)
            if run.error:
                break
    return runs


def _snapshot_saved_tensors() -> torch.autograd.graph.saved_tensors_hooks:
    """Autograd's saved tensors copied when saved: a backward then reads each as the forward saved
    it, where eager's raises on a tensor written in place after the save. The emulation's FP8
    copies (tensor subclasses), which the program cannot write, are kept as they are."""
    return torch.autograd.graph.saved_tensors_hooks(
        lambda t: t.clone() if type(t) is torch.Tensor else t, lambda t: t
    )


def _eager_regions(fn: Any) -> int:
    """How many of the regions ``fn`` (compiled by ``te_v2_executor.thunderfx``) runs eagerly."""
    infos = getattr(getattr(fn, "_backend", None), "subgraph_infos", ())
    return sum(
        isinstance(m, EagerOnRefusal) and m.refused
        for info in infos
        for m in info.split_graph_module.modules()
    )


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected||, in float64 (0 for equal tensors, inf for NaN)."""
    a, e = actual.double(), expected.double()
    if torch.equal(a, e):
        return 0.0
    if not (torch.isfinite(a).all() and torch.isfinite(e).all()):
        return math.inf
    return float((a - e).norm() / e.norm().clamp(min=_TINY))


def tolerance(program: Program, routes: frozenset[str]) -> float | None:
    """The largest relative error allowed between te_v2 and the emulation (None: bitwise), for
    ``program`` whose linears took ``routes``. With a fusion executor after te_v2, ``FOLD_RTOL``
    even where every linear ran in FP8: the fuser computes the elementwise ops te_v2 hands back
    with code of its own (Inductor's GELU differs from ATen's kernel in the last bit, 1.5e-7 seen:
    fuzz ``--fuser torch.compile --seed 2042`` program 76)."""
    if any(m.dtype == "bfloat16" for m in program.meta.values()):
        return BF16_RTOL
    rounded = any(THUNDER_ROUNDED.intersection(op.kinds) for op in program.ops)
    exact = routes == {"fp8"} and not program.fusing.executors and not rounded
    return None if exact and not _three_gradient_terms(program) else FOLD_RTOL


def _three_gradient_terms(program: Program) -> bool:
    """Whether some value is read three times or more (an output counts as a read): its gradient
    is then a sum of three terms, which te_v2's FP8 dgrad, adding into the sum of the others,
    may add in another order than eager's autograd (4.9e-8 seen: fuzz seed 20261213 program 286,
    ``x1`` read by a linear and an add and returned)."""
    reads = collections.Counter(name for op in program.ops for name in op.reads)
    reads.update(program.outputs)
    return any(n >= 3 for n in reads.values())


def _compare(expected: Run, actual: Run, label: str, tolerance: float | None, problems: list[str]) -> float:
    """Append to ``problems`` what differs between two runs; the largest relative error."""
    worst = 0.0
    for name, e in expected.tensors.items():
        a = actual.tensors.get(name)
        if (a is None) != (e is None):
            zeros = " (all zeros)" if not (a if e is None else e).any() else ""
            problems.append(
                f"{name}: {label}: {'None' if a is None else 'a tensor'}, expected {'None' if e is None else 'a tensor'}{zeros}"
            )
            continue
        if a is None:
            continue
        if a.shape != e.shape or a.dtype != e.dtype:
            problems.append(f"{name}: {label} {a.dtype}{list(a.shape)}, expected {e.dtype}{list(e.shape)}")
            continue
        err = relative_error(a, e)
        worst = max(worst, err)
        if (tolerance is None and err != 0.0) or (tolerance is not None and err > tolerance):
            bound = "bitwise" if tolerance is None else f"tolerance {tolerance:g}"
            problems.append(f"{name}: {label} relative error {err:.3g} ({bound})")
    return worst


def check(program: Program, *, delayed: bool = False, graphs: bool = False) -> Verdict:
    """Run ``program`` eagerly, emulated and through te_v2 (with ``delayed`` and ``graphs``, the
    module docstring's checks too), and judge te_v2; a failure that Thunder shows without te_v2
    too is Thunder's (status "thunder")."""
    (eager,) = execute(program, "eager")
    snapshot = _saved_tensor_written(eager)
    if snapshot:
        raised, (eager,) = eager, execute(program, "eager", snapshot_saved=True)
    if eager.error:
        (te,) = execute(program, "te_v2")
        status = "eager_raised_both" if te.error else "eager_raised_te_v2_silent"
        return Verdict(status, eager_error=eager.error)
    (emu,) = execute(program, "emulation", snapshot_saved=snapshot)
    if emu.error:
        return Verdict("fail", "emulation raised", [f"the emulation raised, eager did not: {emu.error}"])
    none_ness: list[str] = []
    _compare(eager, emu, "emulation", math.inf, none_ness)
    if none_ness:
        return Verdict("fail", "emulation differs from eager", none_ness)
    (te,) = execute(program, "te_v2")
    if snapshot and te.error:
        return Verdict("eager_raised_both", eager_error=raised.error)
    verdict = Verdict("ok", routes=frozenset(emu.routes))
    if snapshot:
        verdict.eager_error = raised.error
    if te.error:
        verdict.status, verdict.kind = "fail", f"te_v2 raised ({te.error_at})"
        verdict.problems.append(f"te_v2 raised, eager did not: {te.error}")
    elif te.eager_regions:  # those regions' linears ran unquantized: te_v2's are judged against eager
        problems = []
        verdict.errors["eager"] = _compare(
            eager, te, "te_v2 (regions run eagerly) vs eager", FP8_RTOL, problems
        )
        if problems:
            verdict.status, verdict.kind, verdict.problems = "fail", _mismatch("eager", problems), problems
    else:
        problems: list[str] = []
        verdict.errors["emulation"] = _compare(
            emu, te, "te_v2 vs emulation", tolerance(program, verdict.routes), problems
        )
        if problems:
            verdict.status, verdict.kind, verdict.problems = (
                "fail",
                _mismatch("the emulation", problems),
                problems,
            )
        if verdict.fp8:
            problems = []
            verdict.errors["eager"] = _compare(eager, te, "te_v2 vs eager", FP8_RTOL, problems)
            if problems and not verdict.failed:
                verdict.status, verdict.kind, verdict.problems = (
                    "fail",
                    _mismatch("eager", problems),
                    problems,
                )
    if verdict.failed:
        _attribute(program, eager, te, verdict)
        return verdict
    if delayed or graphs:
        stateful = execute(program, "te_v2", recipe=_DELAYED, steps=DELAYED_STEPS)
    if delayed or (graphs and stateful[-1].error):  # the graphs check alone reports its raise too
        _check_delayed(program, verdict, stateful, snapshot)
    if graphs and not verdict.failed:
        graphed = execute(program, "te_v2 graphed", recipe=_DELAYED, steps=DELAYED_STEPS)
        _check_steps(verdict, stateful, graphed, "under CUDA graphs", "itself without CUDA graphs", None)
    return verdict


def _saved_tensor_written(eager: Run) -> bool:
    """Whether eager's backward raised because a tensor it saved was written in place after."""
    return eager.error_at.startswith("backward") and _WRITTEN_AFTER_SAVE in (eager.error or "")


def _mismatch(against: str, problems: list[str]) -> str:
    """A failure's kind: against what, and whether a gradient's None-ness differs (where the
    other is all zeros, or not) or only values."""
    none_ness = [p for p in problems if ", expected " in p]
    if not none_ness:
        return f"te_v2 differs from {against}: values"
    zeros = all(p.endswith("(all zeros)") for p in none_ness)
    return f"te_v2 differs from {against}: None-ness of a gradient{' (zeros)' if zeros else ''}"


def _names(problems: list[str]) -> set[str]:
    return {p.split(": ", 1)[0] for p in problems}


def _attribute(program: Program, eager: Run, te: Run, verdict: Verdict) -> None:
    """Make ``verdict`` Thunder's when Thunder alone (no te_v2), fused as te_v2's run is or, after
    a fuser, unfused, raises too or gets the same tensors wrong (and, without FP8, the same values
    as te_v2): Thunder 0.2.6 drops the gradient through an input written in place with a value
    that needs one, unfused, and its torch.compile regions get it wrong another way (fuzz
    ``--fuser torch.compile --seed 2043`` program 80), where te_v2 computes what unfused Thunder does."""
    fusings = [program] + ([replace(program, fusing=FUSINGS["none"])] if program.fusing.executors else [])
    notes = []
    for alone in fusings:
        thunders, note = _thunder_shares(alone, eager, te, verdict)
        notes.append(note)
        if thunders:
            verdict.status = "thunder"
            break
    verdict.note = "; unfused: ".join(notes)


def _thunder_shares(program: Program, eager: Run, te: Run, verdict: Verdict) -> tuple[bool, str]:
    """Whether Thunder alone, as ``program`` fuses, shows ``verdict``'s failure; and what it did."""
    (alone,) = execute(program, "thunder")
    if alone.error:
        return bool(te.error), f"Thunder without te_v2 raises too: {alone.error}"
    if te.error:
        if _refusal_of_thunders(program, te):
            return True, "te_v2 refuses it; Thunder without te_v2 differs from eager silently"
        return False, "Thunder without te_v2 runs it"
    problems: list[str] = []
    _compare(eager, alone, "Thunder alone", ATTRIBUTION_RTOL, problems)
    agree: list[str] = []
    if not verdict.fp8:
        _compare(alone, te, "te_v2 vs Thunder alone", ATTRIBUTION_RTOL, agree)
    thunders = bool(problems) and _names(verdict.problems) <= _names(problems) and not agree
    if problems:
        return thunders, "Thunder without te_v2 differs from eager too: " + "; ".join(problems[:4])
    return thunders, "Thunder without te_v2 matches eager"


def _refusal_of_thunders(program: Program, te: Run) -> bool:
    """Whether ``te``'s error is te_v2's refusal of a program Thunder alone gets wrong, silently,
    with the program's loss or the other one (squares hide a sign: ``v.t().mul_(-1)`` bypassed)."""
    if "te_v2: " not in te.error or "internal error" in te.error:
        return False
    for loss in dict.fromkeys((program.loss, "squares", "cotangent")):
        probe = replace(program, loss=loss)
        (eager,), (alone,) = execute(probe, "eager"), execute(probe, "thunder")
        problems: list[str] = []
        _compare(eager, alone, "Thunder alone", ATTRIBUTION_RTOL, problems)
        if problems and not alone.error:
            return True
    return False


def _check_delayed(program: Program, verdict: Verdict, te: list[Run], snapshot: bool) -> None:
    """Fail ``verdict`` if te_v2 with delayed scaling (``te``, a few steps) strays from eager (its
    saved tensors copied when saved, with ``snapshot``)."""
    eager = execute(program, "eager", steps=DELAYED_STEPS, snapshot_saved=snapshot)
    bound = (
        FP8_RTOL if verdict.fp8 else tolerance(program, verdict.routes)
    )  # without FP8, eager is the emulation
    _check_steps(verdict, eager, te, "delayed scaling", "eager (delayed scaling)", bound)


def _check_steps(
    verdict: Verdict, expected: list[Run], actual: list[Run], how: str, against: str, bound: float | None
) -> None:
    """Fail ``verdict`` if te_v2 run ``how`` (``actual``, a few steps) raised, or strays from
    ``expected`` (``against``, as the failure names it) at a step beyond ``bound`` (None: bitwise);
    the largest error goes into ``verdict.errors`` under ``against``."""
    if actual[-1].error:
        verdict.status, verdict.kind = "fail", f"te_v2 ({how}) raised ({actual[-1].error_at})"
        verdict.problems.append(f"te_v2 ({how}) raised, {against} did not: {actual[-1].error}")
        return
    for step, (e, t) in enumerate(zip(expected, actual, strict=True)):
        problems: list[str] = []
        err = _compare(e, t, f"te_v2 ({how}, step {step})", bound, problems)
        verdict.errors[against] = max(verdict.errors.get(against, 0.0), err)
        if problems:
            verdict.status, verdict.kind = "fail", _mismatch(against, problems)
            verdict.problems += problems
            return
