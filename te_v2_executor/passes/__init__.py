"""te_v2's passes over the joint forward+backward trace, before fusion, in order: ``PIPELINE``.

Thunder calls ``TEv2Executor.fusion_pass`` on the joint trace before it splits it: the one place
the whole backward can be seen before any fusion. There ``run`` applies each pass in turn, trace
in, trace out, symbols recognised by identity. Every pass that moves a read of a tensor (a fold)
proves that no in-place write lies between the old and the new position (``_writes.Writes``);
``run`` checks at the end that no pass made a read see a write it did not see before.

Each ``Pass`` says why it sits where it does and what it needs of the trace it gets; the
optional ones are the folds, which only make the step faster: ``TEv2Config.skip_passes`` (and
the tests) switch them off by name.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from thunder.core.trace import TraceCtx, TraceProvenance
from thunder.extend import FusionExecutor

from te_v2_executor.passes import (
    casts,
    consumption,
    dead_writes,
    gelu,
    handback,
    input_recasts,
    narrowings,
    recast_batches,
    recasts,
    recompute_guard,
    scales,
    shared_inputs,
    stale_reads,
    states,
    sums,
    swiglu,
    syncs,
    view_writes,
    widenings,
    write_order,
)
from te_v2_executor.passes._trace import source_name
from te_v2_executor.passes._writes import check_no_new_stale_reads
from te_v2_executor.state import StateRegistry

__all__ = ["OPTIONAL", "PIPELINE", "Context", "Pass", "check_skippable", "run", "source_name"]


@dataclass(frozen=True)
class Context:
    """What the passes know of the compilation besides the trace."""

    registry: StateRegistry  # the compiled function's quantization states
    grad_enabled: bool  # grad mode when the function was traced
    fusers: list[FusionExecutor]  # the fusion executors listed after te_v2
    graphed: bool = False  # a CUDA graph transform captures the traces
    eager_fallback: bool = False  # a refused region runs eagerly (stale_reads.EAGER_FALLBACK_OPTION)
    dynamo_region: bool = False  # the function is a graph Dynamo captured (a thunderfx region)
    # groups of argument positions sharing storage at compile time, as Thunder's cache records them
    aliased_inputs: list[list[int]] = field(default_factory=list)
    # the module's parameters and buffers by their proxies' names (compiled.module_input_names)
    inputs: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Pass:
    """One pass of the pipeline: its name, what it does, why it sits where it does, and what it
    needs of the trace it gets."""

    name: str
    run: Callable[[TraceCtx, Context], TraceCtx]
    does: str
    why_here: str
    precondition: str
    optional: bool = False  # a fold: without it the results hold, the step is slower


PIPELINE: tuple[Pass, ...] = (
    Pass(
        "states",
        lambda trace, context: states.bind_states(trace, context.registry, context.inputs),
        "every te_v2 symbol gets its linear's state from the function's registry",
        "first: every later pass, the report and the state dict see the registry's states",
        "the linears' symbols carry the provisional states their transforms made",
    ),
    Pass(
        "aliased_inputs",
        lambda trace, context: stale_reads.refuse_aliased_inputs(trace, context.aliased_inputs),
        "a function that writes in place and gets inputs sharing storage (the same tensor twice, "
        "views of one) raises: Thunder reads each as the first of its group and gives each the "
        "whole gradient",
        "before input_writes and every pass that reads the inputs, which Thunder already replaced",
        "Thunder's cache recorded the inputs sharing storage when it compiled the function",
    ),
    Pass(
        "input_writes",
        lambda trace, context: stale_reads.refuse_writes_into_inputs_with_gradient(
            trace, dynamo_region=context.dynamo_region
        ),
        "a forward with gradients that writes in place into an input that requires grad (or into "
        "what Thunder renames with one) raises: Thunder differentiates every such write wrong; in a "
        "Dynamo region, so does one that writes a value with gradient into an input without (Dynamo "
        "may return the input itself)",
        "before dead_writes, which drops a write into a cast of an input nothing reads after it, "
        "though Thunder's gradient transform, taking the cast for the input, already lost the "
        "input's gradient to it",
        "writes into existing storage are explicit (copy_, update_aliases), as Writes reads them",
    ),
    Pass(
        "dead_writes",
        lambda trace, context: dead_writes.drop_dead_writes(trace),
        "an in-place write into storage the trace made (no input's) that nothing reads afterwards is "
        "dropped, with the work only it read",
        "before view_writes and stale_reads, which then judge only reads whose results someone "
        "reads (a read by a dead write's work cannot make a gradient wrong); before consumption, "
        "which then sees no reader of a dead GEMM",
        "writes into existing storage are explicit (copy_, update_aliases), as Writes reads them",
    ),
    Pass(
        "view_writes",
        lambda trace, context: view_writes.order_stale_reads(trace),
        "a forward read of a tensor under a name from before a write into its storage (the return's, one through a view Thunder takes for a copy) waits for the write",
        "before stale_reads, which judges the reads of the outputs as returned",
        "the trace is Thunder's own, with its in-place writes functionalized into copies",
    ),
    Pass(
        "stale_reads",
        lambda trace, context: stale_reads.refuse_stale_reads(trace, eager_fallback=context.eager_fallback),
        "a backward that reads a tensor after an in-place write into it, or through a write Thunder "
        "differentiates as if it had not happened, raises",
        "before any pass moves a read: it judges the reads the user's program makes",
        "the trace is Thunder's own, with its in-place writes functionalized into copies",
    ),
    Pass(
        "consumption",
        lambda trace, context: consumption.rewrite_for_consumption(trace),
        "each forward and dy quantization builds only what its readers read",
        "before the syncs and folds, whose decisions read what each forward produces",
        "Thunder's dead-code elimination has removed every unconsumed gradient",
    ),
    Pass(
        "weight_recasts",
        lambda trace, context: recasts.recast_weights(trace, every=context.graphed),
        "dgrads cast their parameter again in the backward, so the forward saves no FP8 copy of it, "
        "where that lowers the step's peak (everywhere under CUDA graphs, whose forward graph holds "
        "what it saves between steps)",
        "after consumption, which decides the copies kept; before the syncs, which give each recast "
        "the scale its forward used",
        "each forward saves exactly the copies its readers read",
        optional=True,
    ),
    Pass(
        "shared_inputs",
        lambda trace, context: shared_inputs.share_input_casts(trace),
        "an input several forwards read (q/k/v, gate/up) is cast to FP8 once, its column-wise copy "
        "saved once",
        "after consumption, which decides which copies each forward saves; before the syncs, which "
        "order the forward flush after every forward's casts",
        "each forward saves exactly the copies its readers read",
        optional=True,
    ),
    Pass(
        "syncs",
        lambda trace, context: syncs.insert_syncs(trace, grad_enabled=context.grad_enabled),
        "the flushes of delayed-scaling state are inserted",
        "after consumption, before the folds, which keep the sync's token and markers in place",
        "every te_v2 forward and dy quantization has its final outputs",
    ),
    Pass(
        "merge_casts",
        lambda trace, context: casts.merge_duplicate_casts_and_views(trace),
        "one of identical casts and views is kept",
        "before round trips and sums: duplicate casts hide sole readers",
        "writes into existing storage are explicit (copy_, update_aliases), as Writes reads them",
        optional=True,
    ),
    Pass(
        "round_trips",
        lambda trace, context: casts.drop_exact_round_trips(trace),
        "exact round trips through a wider dtype are dropped",
        "after merging: one cast back per widening is left to drop",
        "writes into existing storage are explicit, as for merge_casts",
        optional=True,
    ),
    Pass(
        "scales",
        lambda trace, context: scales.fold_scales(trace),
        "constant factors fold into unquantized GEMMs as alpha",
        "before sums: a scaled product then feeds its sum directly",
        "casts merged, so that each product's scaling has one reader chain",
        optional=True,
    ),
    Pass(
        "sums",
        lambda trace, context: sums.accumulate_sums(trace),
        "a sum folds into the GEMM of one summand (beta = 1)",
        "after merging and scales, which change who reads what",
        "each summand's readers are final",
        optional=True,
    ),
    Pass(
        "narrowings",
        lambda trace, context: narrowings.narrow_operands(trace),
        "unquantized GEMMs read the bfloat16 tensor a float32 widening was cast from, where their "
        "other operand is a smaller float32 tensor (peft's float32 adapters)",
        "after scales and sums, which decide the operands each unquantized GEMM reads; before "
        "widenings, which then has no float32 copy of those tensors to recompute",
        "the unquantized GEMMs read their final operands",
        optional=True,
    ),
    Pass(
        "gelus",
        lambda trace, context: gelu.fuse_gelus(trace),
        "exact GELUs fold into the FP8 quantizations next to them",
        "after sums: a GELU's input or gradient may be a sum folded into a GEMM",
        "the te_v2 forwards and dy quantizations read their final operands",
        optional=True,
    ),
    Pass(
        "swiglus",
        lambda trace, context: swiglu.fuse_swiglus(trace),
        "SwiGLUs, silu(gate) * up, fold into the FP8 quantization of the linear that reads them, "
        "their backward into the quantizations of the gate's and up's gradients",
        "after sums, as the GELU folds; before the handback, which would take their SiLUs",
        "the te_v2 forwards and dy quantizations read their final operands",
        optional=True,
    ),
    Pass(
        "activation_handback",
        lambda trace, context: handback.unfolded_activations_as_torch_ops(trace, context.fusers),
        "unfolded GELUs and SiLUs go back to the fusers as torch ops",
        "after the activation folds: only the activations no fold took are left",
        "every activation fold has been made",
        optional=True,
    ),
    Pass(
        "widenings",
        lambda trace, context: widenings.recompute_widenings(trace),
        "the backward recomputes the exact widenings it reads (and their views and log-softmax), "
        "so the narrow tensor is saved",
        "after every fold: it moves the backward reads every other pass leaves",
        "the backward's bound symbols carry Thunder's backward tag, as its grad transform gives them",
        optional=True,
    ),
    Pass(
        "input_recasts",
        lambda trace, context: input_recasts.recast_inputs(trace, context.fusers, every=context.graphed),
        "wgrads cast their input again in the backward where the backward keeps it (or views of it) "
        "anyway, so the forward saves no FP8 copy of it, where that lowers the peak (everywhere "
        "under CUDA graphs, as for weight_recasts)",
        "after every fold and widenings, which decide what the backward reads and what each forward "
        "casts; before write_order, which orders the writes after the recasts' reads",
        "each forward saves exactly the copies its readers read",
        optional=True,
    ),
    Pass(
        "recast_batches",
        lambda trace, context: recast_batches.batch_recasts(trace),
        "weight recasts that follow one another in the backward are one multi-tensor cast",
        "after every pass that adds recasts (weight_recasts) or gives them their scales (syncs, "
        "input_recasts' snapshot); before write_order, which orders writes after the batch's reads",
        "each recast reads its final weight and scale snapshot",
        optional=True,
    ),
    Pass(
        "write_order",
        lambda trace, context: write_order.order_writes(trace),
        "each in-place write waits for every earlier reader of its storage it does not already depend on "
        "(and for a copy from it), and then every later reader waits for it",
        "after every pass that adds or moves a te_v2 read",
        "writes into existing storage are explicit, as Writes reads them",
    ),
    Pass(
        "recompute_guard",
        lambda trace, context: recompute_guard.guard_recomputation(trace),
        "no forward read of a storage written later, and no forward write, is recomputed in the backward",
        "last: it judges the reads of the final trace, which the fusers rematerialize next",
        "writes into existing storage are explicit, as Writes reads them",
    ),
)

OPTIONAL = tuple(p.name for p in PIPELINE if p.optional)


def check_skippable(names: Iterable[str]) -> None:
    """Raise naming any of ``names`` that is not an optional pass."""
    names = frozenset(names)
    if unknown := sorted(names - set(OPTIONAL)):
        required = [p.name for p in PIPELINE if not p.optional]
        raise ValueError(
            f"te_v2: skip_passes={sorted(names)} names {', '.join(map(repr, unknown))}, which is no "
            f"optional pass; the optional ones are {', '.join(OPTIONAL)} "
            f"({', '.join(required)} are needed for correct results)"
        )


def run(trace: TraceCtx, context: Context, *, skip: frozenset[str] = frozenset()) -> TraceCtx:
    """``trace`` through every pass of ``PIPELINE`` not in ``skip``, in order."""
    new_trace = trace
    for p in PIPELINE:
        if p.name not in skip:
            new_trace = p.run(new_trace, context)
    check_no_new_stale_reads(trace, new_trace)
    new_trace.set_provenance(TraceProvenance("te_v2 backward-consumption analysis"))
    return new_trace
