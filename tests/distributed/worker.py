"""One rank of the distributed suite, launched by torchrun from ``test_distributed.py``.

    torchrun --nproc_per_node=2 -m tests.distributed.worker --out DIR [--device cpu] SCENARIO...

A scenario is ``<wrapper>-<model>``: wrapper ``thunder_ddp``, ``fsdp_zero2``, ``fsdp_zero3``,
``fsdp_nvfuser`` (``fsdp_zero3`` with nvFuser after te_v2, where it is installed), ``torch_ddp``
(torch's DistributedDataParallel around the ``thunder.jit`` module), ``fsdp2`` (torch's
``fully_shard`` on every layer and the model, compiled by ``thunderfx``, each step inside
``quantization_update_scope``: with two layers, one Thunder region each; a third layer would
reuse the second's region, and its delayed-scaling state, docs/usage.md), ``fsdp2_current``
(``fsdp2`` under current scaling), ``fsdp2_fp8`` (``fsdp2_current`` with te_v2's FP8 all-gather) or
``builtin_ddp`` (Thunder's built-in TE executor under ``thunder_ddp``, for contrast); model
``full`` (every linear trained), ``lora`` (frozen base, trainable rank-16 adapters), or a
Hugging Face Llama of two decoder layers mapping token ids to logits, ``llama`` (every linear
trained) or ``llamafrozen`` (attention projections frozen), whose layers FSDP2 shards one by one
and whose one Thunder region Dynamo calls for both. Each
rank trains STEPS SGD steps on its slice of one global batch, after a single-process run of the
same model on the whole batch, and writes what the tests compare to ``DIR/<scenario>.rank<r>.pt``.
Scenario ``fsdp2_checkpoint-<model>`` saves a torch.distributed.checkpoint of the sharded model and
te_v2's quantization state after CHECKPOINT_STEPS steps and trains on; ``restored-<model>``, run
on another number of ranks, loads it and trains on from there. Scenario ``fail`` makes rank 1
raise in its forward while rank 0 waits in a collective.

On CUDA it runs te_v2 on TransformerEngine under ``te.autocast`` with a custom amax reduction
group; with ``--device cpu`` on gloo and the reference backend (no autocast: the default group).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import sys
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import thunder
import thunder.distributed as tdist
import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from benchmarks.measure import gemms, kernel_names
from benchmarks.scaling import counted_collectives
from te_v2_executor import (
    current_scaling,
    delayed_scaling,
    explain,
    load_quantization_state_dict,
    make_te_v2,
    quantization_state_dict,
    quantization_state_template,
    quantization_update_scope,
)
from te_v2_executor.compiled import compiled_functions
from te_v2_executor.fsdp import FP8GatheredWeight, fp8_all_gather
from tests.gpu.common import executors_run
from tests.helpers import CLAIM_ALL, counted_weight_reads, fusers_named
from tests.models import LoRAStack, Stack, tiny_llama

DIM, TOKENS_PER_RANK, STEPS, LR = 256, 128, 5, 1e-3
# a Llama batch's row is a sequence of token ids; its loss sums the squares of 2 x 128 x 8 x 128
# logits, which take a smaller step to go down
LLAMA_HIDDEN, LLAMA_SEQUENCE, LLAMA_LR = 64, 8, 1e-5


class LlamaLogits(torch.nn.Module):
    """A Hugging Face ``LlamaForCausalLM`` as a map from token ids to logits, its decoder layers
    as ``layers``; ``frozen`` freezes the attention projections."""

    def __init__(self, *, frozen: bool) -> None:
        super().__init__()
        self.llama = tiny_llama(LLAMA_HIDDEN, torch.float32)
        for name, p in self.llama.named_parameters():
            p.requires_grad_(not (frozen and "self_attn" in name))

    @property
    def layers(self) -> torch.nn.ModuleList:
        return self.llama.model.layers

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.llama(input_ids=ids, use_cache=False).logits


# Hugging Face models read batches of token ids, take LLAMA_LR and go through thunderfx
MODELS: dict[str, Callable[[], torch.nn.Module]] = {
    "full": lambda: Stack([DIM] * 4),
    "lora": lambda: LoRAStack([DIM] * 3, rank=16),
    "llama": lambda: LlamaLogits(frozen=False),
    "llamafrozen": lambda: LlamaLogits(frozen=True),
}
HUGGING_FACE = {"llama", "llamafrozen"}

CHECKPOINT_STEPS = 2  # of STEPS, before ``checkpointed`` saves
CURRENT = {"fsdp2_current", "fsdp2_fp8"}  # the wrappers that run te_v2 under current scaling
NVFUSER = {"fsdp_nvfuser"}  # the wrappers that list nvFuser after te_v2


class Run:
    """What one rank needs to build and step its models."""

    def __init__(self, device: str) -> None:
        self.cuda = device == "cuda"
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = (
            torch.device("cuda", int(os.environ["LOCAL_RANK"])) if self.cuda else torch.device("cpu")
        )
        # a group of its own, so the amax all-reduces are told apart from the gradients'
        self.amax_group = dist.new_group(ranks=list(range(self.world)))
        self.amax_calls: Counter = Counter()

    def model(self, kind: str) -> torch.nn.Module:
        """The same weights on every rank."""
        torch.manual_seed(0)
        dtype = torch.bfloat16 if self.cuda else torch.float32
        return MODELS[kind]().to(self.device, dtype)

    @property
    def mine(self) -> slice:
        """This rank's rows of a global batch."""
        return slice(self.rank * TOKENS_PER_RANK, (self.rank + 1) * TOKENS_PER_RANK)

    def global_batch(self, kind: str, world: int | None = None) -> list[torch.Tensor]:
        """STEPS global batches for the model ``kind``, the same on every rank, of a run on
        ``world`` ranks (this one's when None)."""
        gen = torch.Generator().manual_seed(1)
        rows = TOKENS_PER_RANK * (world or self.world)
        if kind in HUGGING_FACE:
            vocab = 2 * LLAMA_HIDDEN
            return [
                torch.randint(0, vocab, (rows, LLAMA_SEQUENCE), generator=gen).to(self.device)
                for _ in range(STEPS)
            ]
        dtype = torch.bfloat16 if self.cuda else torch.float32
        return [torch.randn(rows, DIM, generator=gen).to(self.device, dtype) for _ in range(STEPS)]

    def executors(
        self, builtin: bool = False, *, distributed: bool, current: bool = False, nvfuser: bool = False
    ) -> dict[str, Any]:
        """``thunder.jit`` arguments; the single-process reference reduces no amax. ``current``:
        te_v2 pinned to current scaling; ``nvfuser``: nvFuser listed after te_v2."""
        if builtin:
            from thunder.executors.transformer_engineex import (
                TransformerEngineTransform,
                transformer_engine_ex,
            )

            return {"executors": [transformer_engine_ex], "transforms": [TransformerEngineTransform()]}
        recipe = None if self.cuda else delayed_scaling(amax_history_len=4, reduce_amax=distributed)
        recipe = current_scaling() if current else recipe
        te_v2 = make_te_v2(backend="te" if self.cuda else "reference", claim=CLAIM_ALL, recipe=recipe)
        return {"executors": [te_v2, *fusers_named("nvfuser" if nvfuser else "none")]}

    @contextlib.contextmanager
    def fp8(self, *, distributed: bool) -> Iterator[None]:
        if not self.cuda:
            yield
            return
        import transformer_engine.pytorch as te
        from transformer_engine.common.recipe import DelayedScaling

        recipe = DelayedScaling(amax_history_len=4, reduce_amax=distributed)
        with te.autocast(
            enabled=True, recipe=recipe, amax_reduction_group=self.amax_group if distributed else None
        ):
            yield

    @contextlib.contextmanager
    def counting_amax_all_reduces(self) -> Iterator[None]:
        """Counts all_reduce(MAX) calls on the amax group (te_v2 and TE both reduce amaxes so)."""
        original = dist.all_reduce

        def counting(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
            if op == dist.ReduceOp.MAX:
                self.amax_calls["amax group" if group is self.amax_group else "other group"] += 1
            return original(tensor, op=op, group=group, async_op=async_op)

        dist.all_reduce = counting
        try:
            yield
        finally:
            dist.all_reduce = original


def train(
    fn: Callable,
    params: Callable[[], list[torch.nn.Parameter]],
    batches,
    run: Run,
    *,
    distributed: bool,
    scoped: bool = False,
    data_parallel: int | None = None,
    lr: float = LR,
):
    """A step of SGD on ``fn`` per batch; the loss of each, and the amax all-reduces of each. With
    ``scoped``, each step's forward and backward run inside one ``quantization_update_scope``;
    ``data_parallel``: the ranks the batches were split over, where it is not ``run.world``;
    ``lr``: the data-parallel run's learning rate.

    The loss sums over tokens, so dy is the same on a rank's slice as in the single-process run
    (a mean would scale it by the world size and quantize it differently); the single-process
    step divides by the world size as the data-parallel gradient averaging does."""
    lr = lr if distributed else lr / (data_parallel or run.world)
    losses, calls = [], []
    for x in batches:
        run.amax_calls.clear()
        with quantization_update_scope() if scoped else contextlib.nullcontext():
            with run.fp8(distributed=distributed):
                loss = fn(x).float().square().sum()
            loss.backward()
        with torch.no_grad():
            for p in params():
                if p.grad is not None:
                    p -= lr * p.grad
                    p.grad = None
        losses.append(loss.detach().cpu())
        calls.append(dict(run.amax_calls))
    return losses, calls


def wrap(wrapper: str, model: torch.nn.Module, run: Run) -> tuple[Callable, Any, Callable]:
    """(callable to step, the ThunderModule whose traces explain reads, its parameters)."""
    if wrapper.startswith("fsdp2"):
        return fully_sharded(model, run, current=wrapper in CURRENT, fp8_gather=wrapper == "fsdp2_fp8")
    builtin = wrapper == "builtin_ddp"
    jitted = thunder.jit(model, **run.executors(builtin, distributed=True, nvfuser=wrapper in NVFUSER))
    if wrapper in ("thunder_ddp", "builtin_ddp"):
        module = tdist.ddp(jitted)
        return module, module, lambda: list(module.parameters())
    if wrapper.startswith("fsdp"):
        strategy = tdist.FSDPType.ZERO2 if wrapper == "fsdp_zero2" else tdist.FSDPType.ZERO3
        module = tdist.fsdp(jitted, device=run.device, sharding_strategy=strategy)
        return module, module, lambda: list(module.parameters())
    assert wrapper == "torch_ddp", wrapper
    ddp = torch.nn.parallel.DistributedDataParallel(
        jitted, device_ids=[run.device.index] if run.cuda else None, broadcast_buffers=False
    )
    return ddp, jitted, lambda: list(jitted.parameters())


def fully_sharded(
    model: torch.nn.Module,
    run: Run,
    *,
    per_layer: bool = True,
    current: bool = False,
    fp8_gather: bool = False,
) -> tuple[Callable, Any, Callable]:
    """``model`` with ``fully_shard`` on each layer of a LoRA stack or a Llama (``per_layer``) and
    on itself, compiled by ``thunderfx``, te_v2 under current scaling where ``current``, gathering
    its weights in FP8 where ``fp8_gather``. A ``Stack``'s layers are bare linears, which Dynamo
    runs outside its graphs once they are sharded on their own, so only the whole model is."""
    from thunder.dynamo import thunderfx
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch._dynamo.reset()  # regions Dynamo compiled for an earlier scenario's model are not reused
    executors = run.executors(distributed=True, current=current)
    if fp8_gather:
        fp8_all_gather(model, executors["executors"][0], world_size=run.world)
    mesh = init_device_mesh(run.device.type, (run.world,))
    for layer in [] if isinstance(model, Stack) or not per_layer else model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    compiled = thunderfx(model, **executors)
    return compiled, compiled, lambda: list(model.parameters())


def local(p: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``p``: an FSDP2 parameter's shard (unwrapped where it is gathered in
    FP8), or ``p``."""
    shard = p.to_local() if hasattr(p, "to_local") else p
    return shard.unwrap() if isinstance(shard, FP8GatheredWeight) else shard


def local_weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's part of each parameter of ``module``, on the CPU."""
    return {n: local(p).detach().cpu() for n, p in module.named_parameters()}


def summed_over_ranks(losses: list[torch.Tensor], run: Run) -> list[torch.Tensor]:
    """Each step's loss summed over the ranks, as the single-process run's over the global batch."""
    gathered = [None] * run.world
    dist.all_gather_object(gathered, losses)
    return [torch.stack(per_rank).sum(0) for per_rank in zip(*gathered, strict=True)]


def linear_reports(module: Any) -> list[tuple[str, Any]]:
    """(name, report row) of every te_v2 linear of ``module``'s Thunder functions, each name
    prefixed with its function's position (the regions of a ``thunderfx`` object name their
    weights alike)."""
    return [
        (f"{i}.{r.name}", r) for i, fn in enumerate(compiled_functions(module)) for r in explain(fn).linears
    ]


def distributed_step_gemms(fn: Callable, x: torch.Tensor, run: Run) -> list[str]:
    """The GEMM kernels one distributed forward+backward step launches on this rank."""

    def step() -> None:
        with run.fp8(distributed=True):
            loss = fn(x).float().square().mean()
        loss.backward()

    return gemms(kernel_names(step))


def quant_state(module: Any) -> dict[str, Any]:
    """Every te_v2 linear's amax histories and scales, both directions (none under current
    scaling, which keeps no history)."""
    found = {}
    for name, r in linear_reports(module):
        if not r.claimed:
            continue
        for direction, forward in (("fwd", True), ("bwd", False)):
            scaling = r.state.scaling(forward=forward)
            if scaling is not None and scaling.amax_history is not None:
                found[f"{name}.{direction}.amax_history"] = scaling.amax_history.detach().cpu().clone()
                found[f"{name}.{direction}.scale"] = scaling.scale.detach().cpu().clone()
    return found


def scenario(name: str, run: Run, out: Path) -> None:
    wrapper, kind = name.split("-")
    if wrapper in ("fsdp2_checkpoint", "restored"):
        found = (checkpointed if wrapper == "fsdp2_checkpoint" else restored)(kind, run, out)
        torch.save({"rank": run.rank, "world": run.world, **found}, out / f"{name}.rank{run.rank}.pt")
        return
    batches, mine = run.global_batch(kind), run.mine
    lr = LLAMA_LR if kind in HUGGING_FACE else LR
    result: dict[str, Any] = {"rank": run.rank, "world": run.world}

    if wrapper != "builtin_ddp":
        reference = run.model(kind)
        result["initial_weights"] = {
            n: p.detach().cpu().clone() for n, p in reference.named_parameters() if p.requires_grad
        }
        executors = run.executors(distributed=False, current=wrapper in CURRENT, nvfuser=wrapper in NVFUSER)
        if kind in HUGGING_FACE:
            from thunder.dynamo import thunderfx

            torch._dynamo.reset()
            ref_fn = thunderfx(reference, **executors)
        else:
            ref_fn = thunder.jit(reference, **executors)
        result["reference_losses"], _ = train(
            ref_fn, lambda: list(reference.parameters()), batches, run, distributed=False, lr=lr
        )
        result["reference_weights"] = {n: p.detach().cpu() for n, p in reference.named_parameters()}

    model = run.model(kind)
    fn, module, params = wrap(wrapper, model, run)
    sharded = wrapper.startswith("fsdp2")
    with (
        run.counting_amax_all_reduces(),
        counted_collectives() as collectives,
        counted_weight_reads() as reads,
    ):
        losses, calls = train(
            fn, params, [x[mine] for x in batches], run, distributed=True, scoped=sharded, lr=lr
        )
    result["losses"] = summed_over_ranks(losses, run)
    result["weight_reads"] = {how: n / STEPS for how, n in reads.items()}
    result["amax_all_reduces"] = calls
    result["all_gather_bytes"] = collectives["all_gather_into_tensor"]["bytes"] / STEPS
    result["fp8_gathered"] = {
        n: p.numel()
        for n, p in model.named_parameters()
        if isinstance(getattr(p, "_local_tensor", None), FP8GatheredWeight)
    }
    result["weights"] = local_weights(model if sharded else module)
    if wrapper != "builtin_ddp":
        result["quant_state"] = quant_state(module)
        result["report"] = [(name, r.claimed, r.dgrad, r.wgrad) for name, r in linear_reports(module)]
        result["report_text"] = str(explain(module))
    if not sharded:
        traces = [thunder.last_traces(module)[-1], thunder.last_backward_traces(module)[-1]]
        result["executors_run"] = executors_run(traces)
    if run.cuda:
        result["gemm_kernels"] = distributed_step_gemms(fn, batches[0][mine], run)
    torch.save(result, out / f"{name}.rank{run.rank}.pt")


def checkpointed(kind: str, run: Run, out: Path) -> dict[str, Any]:
    """The fsdp2 scenario, saving a distributed checkpoint (the sharded model and te_v2's
    quantization state) after CHECKPOINT_STEPS steps, then training on: what a restore on another
    number of ranks must continue exactly as. The model is sharded and compiled whole: layers
    sharded one by one compile to regions whose states have the same names, which one state dict
    cannot tell apart (docs/quantization-state.md)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    model = run.model(kind)
    fn, module, params = fully_sharded(model, run, per_layer=False)
    batches = [x[run.mine] for x in run.global_batch(kind)]
    train(fn, params, batches[:CHECKPOINT_STEPS], run, distributed=True, scoped=True)
    state = {"model": get_model_state_dict(model), "quantization": quantization_state_dict(fn)}
    dcp.save(state, checkpoint_id=out / f"checkpoint-{kind}")
    losses, _ = train(fn, params, batches[CHECKPOINT_STEPS:], run, distributed=True, scoped=True)
    return {
        "losses": summed_over_ranks(losses, run),
        "weights": local_weights(model),
        "quant_state": quant_state(module),
    }


def restored(kind: str, run: Run, out: Path) -> dict[str, Any]:
    """The checkpoint ``checkpointed`` saved, loaded into a model sharded over this run's ranks
    (another number of them), which trains on from there on the same global batches."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    saved = torch.load(out / f"fsdp2_checkpoint-{kind}.rank0.pt", weights_only=False)
    path = out / f"checkpoint-{kind}"
    model = run.model(kind)
    with torch.no_grad():  # so that only the checkpoint can give the saved weights back
        for p in model.parameters():
            p.add_(1.0)
    fn, module, params = fully_sharded(model, run, per_layer=False)
    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    batches = run.global_batch(kind, saved["world"])[CHECKPOINT_STEPS:]
    with run.fp8(distributed=False):
        fn(batches[0])  # a first call makes the regions, and their states, to load into
    quantization = quantization_state_template(path)
    dcp.load({"quantization": quantization}, checkpoint_id=path)
    load_quantization_state_dict(fn, quantization)
    losses, _ = train(fn, params, batches, run, distributed=False, scoped=True, data_parallel=saved["world"])
    return {
        "losses": losses,
        "weights": local_weights(model),
        "quant_state": quant_state(module),
    }


def fail(run: Run) -> None:
    """Rank 1 feeds a batch of the wrong width; rank 0 goes on into the step's collectives."""
    fn, _, _ = wrap("thunder_ddp", run.model("full"), run)
    width = DIM + 16 if run.rank == 1 else DIM
    x = torch.randn(TOKENS_PER_RANK, width, device=run.device, dtype=next(fn.parameters()).dtype)
    with run.fp8(distributed=True):
        loss = fn(x).float().square().mean()
    loss.backward()
    dist.barrier()


@record  # a failing rank's exception becomes torchrun's reported root cause
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scenarios", nargs="+")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--timeout-s", type=float, default=120.0)
    args = parser.parse_args(argv)
    timeout = datetime.timedelta(seconds=args.timeout_s)
    if args.device == "cuda":
        local = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", timeout=timeout, device_id=torch.device("cuda", local))
    else:
        dist.init_process_group("gloo", timeout=timeout)
    run = Run(args.device)
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.scenarios:
        if name == "fail":
            fail(run)  # raises on rank 1, which exits at once; torchrun then stops rank 0
            continue
        try:
            scenario(name, run, args.out)
        except Exception:  # recorded for its tests; the next scenario still runs
            traceback.print_exc()
            torch.save({"error": traceback.format_exc()}, args.out / f"{name}.rank{run.rank}.pt")
        dist.barrier()
        print(f"[rank {run.rank}] {name}: done", file=sys.stderr, flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
