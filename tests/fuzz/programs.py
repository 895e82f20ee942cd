"""Seeded random programs: small DAGs of linears and plain ops, as Python source.

A ``Program`` is a list of ``Op``s, each one line (or block) of a generated ``forward``; its
``source()`` is a module that defines the model, its inputs and its loss, exec'd to run it, and
``script()`` the same source with a harness, a standalone reproduction. Everything is drawn from
``random.Random`` seeded by (seed, index), weights and inputs from torch seeds, so a program is
the same on every machine.

The linears' sizes aim at the three routes of te_v2's claim for the program's
``ClaimPolicy(min_features=M)``: FP8 (tokens, in and out features divisible by 16, both features
>= M), unquantized (a feature below M) and fallback (a dimension not divisible by 16).
"""

from __future__ import annotations

import dataclasses
import linecache
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import te_v2_executor.inductor  # noqa: F401

# Feature sizes: multiples of 16 (FP8 or unquantized, by M) and two that fall back.
FEATURES = (16, 32, 48, 64, 24, 40)
FEATURE_WEIGHTS = (2, 3, 2, 3, 1, 1)
LEADING = ((32,), (64,), (48,), (24,), (2, 16), (4, 8), (2, 12))
LEADING_WEIGHTS = (4, 2, 1, 0.5, 2, 1, 0.5)
ROUTES = ("fp8", "unquantized", "fallback")
RANKS = (16, 16, 16, 32, 8)
LORA_SCALINGS = (None, None, None, None, 0.5, 2.0, 0.3)
MIN_FEATURES = (0, 16, 32, 512)
MIN_FEATURES_WEIGHTS = (1, 1, 3, 4)
SCALES = (0.5, 2.0, 0.3, -1.5)
IN_PLACE_FACTORS = (2.0, 0.5, -1.0)
IN_PLACE_KINDS = ("mul_", "add_", "copy_")
# Ops that return their input itself (a write through the result is a write into the input), by
# kind: Thunder decomposes the first two into a ``shallow_copy``; PyTorch runs ``positive``, which
# Thunder registered automatically.
ALIASES = {
    "dropout_p0": "{out} = F.dropout({0}, p=0.0)",
    "contiguous": "{out} = {0}.contiguous()",
    "positive": "{out} = torch.positive({0})",
}
VIEWS = ("reshape", "view", "transpose", "t", *ALIASES)
DTYPE_NAMES = {"float32": "torch.float32", "bfloat16": "torch.bfloat16", "float64": "torch.float64"}


@dataclass(frozen=True)
class Meta:
    """What the generator knows of a value: shape and dtype."""

    shape: tuple[int, ...]
    dtype: str = "float32"


@dataclass(frozen=True)
class Linear:
    """One ``nn.Linear`` of the model."""

    name: str
    in_features: int
    out_features: int
    bias: bool
    frozen: bool


@dataclass(frozen=True)
class Input:
    """One argument of ``forward``: a standard normal tensor."""

    name: str
    shape: tuple[int, ...]
    requires_grad: bool


@dataclass(frozen=True)
class Op:
    """One statement of ``forward``: ``template`` formatted with ``reads`` and ``out``.

    In-place ops have no ``out``; they write ``reads[0]``. A checkpointed region carries the body
    of its method in ``region``; ``linears`` are the modules the op (or its region) calls.
    """

    kind: str
    template: str
    reads: tuple[str, ...]
    out: str | None = None
    linears: tuple[str, ...] = ()
    region: tuple[str, ...] = ()

    @property
    def in_place(self) -> bool:
        return self.out is None

    @property
    def kinds(self) -> tuple[str, ...]:
        """What the op computes: its kind, and "gelu" for each GELU of a checkpointed region."""
        return (self.kind, *("gelu" for line in self.region if "F.gelu(" in line))

    def render(self) -> str:
        return self.template.format(*self.reads, out=self.out)

    def reading(self, old: str, new: str) -> Op:
        """This op with every read of ``old`` turned into a read of ``new``."""
        return dataclasses.replace(self, reads=tuple(new if r == old else r for r in self.reads))


@dataclass(frozen=True)
class Fusing:
    """How the compiled runs fuse: the executors listed after te_v2 (and alone in Thunder's own
    run), by Thunder's names, and ``thunder.jit``'s compile options; none, Thunder's defaults."""

    executors: tuple[str, ...] = ()
    options: tuple[tuple[str, Any], ...] = ()
    dynamo: bool = False  # through te_v2_executor.thunderfx (Thunder's own thunderfx without te_v2)

    def jit(self, model: Any, te_v2: Any = None, transforms: list | None = None) -> Any:
        """``model`` through Thunder, te_v2 first when given, with ``transforms``."""
        import thunder

        executors = [*([te_v2] if te_v2 is not None else []), *map(thunder.get_executor, self.executors)]
        options = {**dict(self.options), **({"transforms": transforms} if transforms else {})}
        if not self.dynamo:
            return thunder.jit(model, executors=executors or None, **options)
        import thunder.dynamo

        import te_v2_executor

        if te_v2 is None:
            return thunder.dynamo.thunderfx(model, dynamic=False, **options)
        return te_v2_executor.thunderfx(model, executors=executors, dynamic=False, **options)

    def source(self, te_v2: str) -> str:
        """The compiling call of :meth:`jit`, with te_v2 as the name ``te_v2``, as source."""
        executors = ", ".join([te_v2, *(f"thunder.get_executor({e!r})" for e in self.executors)])
        options = "".join(f", {k}={v!r}" for k, v in self.options)
        if self.dynamo:
            return f"__import__('te_v2_executor').thunderfx(model, executors=[{executors}], dynamic=False{options})"
        return f"thunder.jit(model, executors=[{executors}]{options})"


# ``--fuser`` choices: te_v2 alone, as ``thunder.jit(model, executors=[te_v2])`` compiles; or
# followed by torch.compile's executor with the dataflow fusion thunderfx selects, which orders
# the trace anew by its data dependencies: Thunder's, or te_v2's ``inductor_ex`` (the one
# ``executors()`` lists), registered under its name by importing ``te_v2_executor.inductor``; or
# te_v2 alone through ``te_v2_executor.thunderfx``, where Dynamo captures the program first and
# a region te_v2 refuses runs eagerly.
FUSINGS = {
    "none": Fusing(),
    "torch.compile": Fusing(("torchcompile",), (("fusion_type", "dataflow"),)),
    "inductor": Fusing(("te_v2_inductor",), (("fusion_type", "dataflow"),)),
    "thunderfx": Fusing(dynamo=True),
}


@dataclass(frozen=True)
class Program:
    """A generated program: a model, its inputs and its loss, for one ``ClaimPolicy``, compiled
    as ``fusing`` says."""

    seed: int
    index: int
    min_features: int
    inputs: tuple[Input, ...]
    linears: tuple[Linear, ...]
    ops: tuple[Op, ...]
    outputs: tuple[str, ...]
    loss: str  # "squares" or "cotangent"
    meta: dict[str, Meta] = field(compare=False, repr=False)
    fusing: Fusing = field(default=FUSINGS["none"], compare=False)

    @property
    def torch_seed(self) -> int:
        return self.seed * 100_003 + self.index

    @property
    def name(self) -> str:
        return f"seed {self.seed} program {self.index}"

    def kinds(self) -> list[str]:
        """The op kinds, in order; an in-place op is named with what it writes: an input, a view
        of one, or an intermediate."""
        inputs = {i.name for i in self.inputs}
        view_of = {op.out: op.reads[0] for op in self.ops if op.kind in VIEWS}

        def written(name: str) -> str:
            root = name
            while root in view_of:
                root = view_of[root]
            if root in inputs:
                return "input" if root == name else "view of input"
            return "intermediate"

        return [f"{op.kind}({written(op.reads[0])})" if op.in_place else op.kind for op in self.ops]

    def source(self) -> str:
        """The model, ``make_model()``, ``make_inputs()`` and ``loss_of(outputs)`` as Python."""
        lines = [
            "import torch",
            "import torch.nn.functional as F",
            "from torch.utils.checkpoint import checkpoint",
            "",
            "",
            "class Program(torch.nn.Module):",
            "    def __init__(self):",
            "        super().__init__()",
        ]
        for lin in self.linears:
            lines.append(
                f"        self.{lin.name} = torch.nn.Linear({lin.in_features}, {lin.out_features}, bias={lin.bias})"
            )
            if lin.frozen:
                lines.append(f"        self.{lin.name}.requires_grad_(False)")
        for op in self.ops:
            if op.region:
                lines += ["", *(f"    {line}" for line in op.region)]
        lines += ["", f"    def forward(self, {', '.join(i.name for i in self.inputs)}):"]
        for op in self.ops:
            lines += [f"        {line}" for line in op.render().splitlines()]
        lines += [f"        return ({''.join(f'{o}, ' for o in self.outputs)})", "", ""]
        lines += [
            "def make_model():",
            f"    torch.manual_seed({self.torch_seed})",
            "    return Program()",
            "",
            "",
            "def make_inputs():",
            f"    g = torch.Generator().manual_seed({self.torch_seed})",
        ]
        for i in self.inputs:
            grad = ".requires_grad_()" if i.requires_grad else ""
            lines.append(f"    {i.name} = torch.randn({', '.join(map(str, i.shape))}, generator=g){grad}")
        lines += [f"    return [{', '.join(i.name for i in self.inputs)}]", "", ""]
        lines += ["def loss_of(outputs):"]
        if self.loss == "squares":
            lines.append("    return sum(o.double().square().sum() for o in outputs)")
        else:
            lines += [
                f"    g = torch.Generator().manual_seed({self.torch_seed + 1})",
                "    return sum((o.double() * torch.randn(o.shape, generator=g, dtype=torch.float64)).sum() for o in outputs)",
            ]
        return "\n".join(lines) + "\n"

    def namespace(self) -> dict[str, Any]:
        """The source exec'd: its ``Program``, ``make_model``, ``make_inputs``, ``loss_of``."""
        src = self.source()
        filename = f"<fuzz {self.name} {hash(src) & 0xFFFFFFFF:08x}>"
        linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)  # for tracebacks
        ns: dict[str, Any] = {"__name__": "fuzz_program"}
        exec(compile(src, filename, "exec"), ns)
        return ns

    def script(self, header: str = "", *, emulation: bool = False) -> str:
        """A standalone reproduction: the source, and a harness that runs it eagerly and through
        te_v2 (and, with ``emulation``, through the eager FP8 emulation) and prints what differs."""
        mode_list = '("eager", "te_v2", "emulation")' if emulation else '("eager", "te_v2")'
        harness = f'''

def run(how):
    """Outputs, inputs after the call and every gradient, named, or the exception raised."""
    import thunder

    from te_v2_executor import ClaimPolicy, current_scaling, make_te_v2

    model, inputs = make_model(), make_inputs()
    fn = model
    if how == "te_v2":
        claim = ClaimPolicy(min_features={self.min_features})
        ex = make_te_v2(backend="reference", recipe=current_scaling(), claim=claim)
        fn = {self.fusing.source("ex")}
    try:
        if how == "emulation":  # the eager FP8 emulation lives in the te_v2 repository's tests
            from tests.helpers import eager_emulation

            with eager_emulation(current_scaling(), claim=ClaimPolicy(min_features={self.min_features})):
                outputs = fn(*inputs)
                loss = loss_of(outputs)
                if loss.requires_grad:
                    loss.backward()
        else:
            outputs = fn(*inputs)
            loss = loss_of(outputs)
            if loss.requires_grad:
                loss.backward()
    except Exception as e:
        return f"{{type(e).__name__}}: {{e}}"
    named = {{f"output {{i}}": o for i, o in enumerate(outputs)}}
    named.update({{f"{{n}} (after)": x for n, x in zip({[i.name for i in self.inputs]!r}, inputs)}})
    named.update({{f"{{n}}.grad": x.grad for n, x in zip({[i.name for i in self.inputs]!r}, inputs)}})
    named.update({{f"{{n}}.grad": p.grad for n, p in model.named_parameters()}})
    return named


if __name__ == "__main__":
    import warnings

    warnings.simplefilter("ignore")
    results = {{how: run(how) for how in {mode_list}}}
    expected = results["eager"]
    for how, got in results.items():
        if isinstance(got, str) or isinstance(expected, str):
            print(how, "raised:" if isinstance(got, str) else "", got if isinstance(got, str) else "")
            continue
        for name, e in expected.items():
            a = got[name]
            if (a is None) != (e is None):
                print(f"{{how}}: {{name}} is {{a is None and 'None' or 'a tensor'}}, eager's is not")
            elif a is not None and not torch.equal(a, e):
                err = float((a.double() - e.double()).norm() / e.double().norm().clamp(min=1e-30))
                print(f"{{how}}: {{name}} differs from eager's, relative error {{err:.3g}}")
'''
        head = (
            f'"""Fuzzer failure, {self.name} (python -m tests.fuzz).\n\n{header}\n"""\n\n' if header else ""
        )
        return head + self.source() + harness

    def without_op(self, i: int) -> Program | None:
        """This program without op ``i``; later reads of its value read an operand of the same
        shape and dtype instead. None when its value is read and no operand can stand in."""
        op = self.ops[i]
        before, after = list(self.ops[:i]), list(self.ops[i + 1 :])
        outputs = list(self.outputs)
        if op.out is not None and (op.out in outputs or any(op.out in o.reads for o in after)):
            stand_ins = [r for r in op.reads if self.meta.get(r) == self.meta[op.out]]
            if not stand_ins:
                return None
            after = [o.reading(op.out, stand_ins[0]) for o in after]
            outputs = [stand_ins[0] if o == op.out else o for o in outputs]
        return dataclasses.replace(self, ops=(*before, *after), outputs=tuple(dict.fromkeys(outputs))).used()

    def without_ops(self, indices: range) -> Program | None:
        """This program without the ops at ``indices`` (see ``without_op``)."""
        program: Program | None = self
        for i in reversed(indices):
            program = program.without_op(i) if program is not None else None
        return program

    def without_dead_ops(self) -> Program:
        """This program without the ops whose value nothing reads (in-place ops stay)."""
        ops = list(self.ops)
        while True:
            read = {r for op in ops for r in op.reads} | set(self.outputs)
            live = [op for op in ops if op.out is None or op.out in read]
            if len(live) == len(ops):
                return dataclasses.replace(self, ops=tuple(ops)).used()
            ops = live

    def used(self) -> Program:
        """This program without the linears and inputs no op reads."""
        names = {n for op in self.ops for n in op.linears}
        reads = {r for op in self.ops for r in op.reads} | set(self.outputs)
        return dataclasses.replace(
            self,
            linears=tuple(lin for lin in self.linears if lin.name in names),
            inputs=tuple(i for i in self.inputs if i.name in reads),
        )


@dataclass(frozen=True)
class Weights:
    """Relative frequencies of the generator's choices (the defaults find both known bugs)."""

    linear: float = 3.0
    reuse_linear: float = 0.5  # the same module called twice
    tied: float = 0.5  # F.linear with another linear's weight (or its transpose)
    sliced: float = 0.5  # F.linear(x, W[:n])
    lora: float = 3.5
    lora_in_place: float = 0.7  # a LoRA with an in-place write into x or h after one read
    lora_on_input: float = 0.5  # a LoRA on an input of the program (else on any value)
    add: float = 1.5
    scale: float = 1.0
    gelu: float = 1.0
    swiglu: float = 1.0  # F.silu(a) * b, or F.silu(a) alone
    relu: float = 0.3
    cast: float = 0.8
    view: float = 1.0
    alias: float = 0.5  # an op that returns its input itself (``ALIASES``)
    checkpoint: float = 0.7
    no_grad: float = 0.4
    # An attention over keys and values repeated as Hugging Face's ``repeat_kv`` repeats them
    # (``grouped_attention``): 0 by default, so that seeds make the programs they made before it.
    grouped_attention: float = 0.0
    # In-place ops per program: 0, 1, 2, 3.
    in_place_counts: tuple[float, ...] = (0.3, 0.4, 0.2, 0.1)
    # The target of an in-place op: weights by its number of reads (0, 1, 2 or more), times
    # ``in_place_input`` for an input; how often it goes between two reads of its target, or
    # right after the only one (else anywhere after the target is made).
    in_place_target_by_reads: tuple[float, ...] = (0.3, 2.0, 3.0)
    in_place_input: float = 2.0
    between_reads: float = 0.7
    frozen: float = 0.3
    frozen_base: float = 0.85  # a LoRA's base linear
    frozen_adapter: float = 0.45  # each of its A and B
    routes: tuple[float, ...] = (0.35, 0.45, 0.2)  # FP8, unquantized, fallback (as far as M allows)
    bias: float = 0.3
    input_requires_grad: float = 0.4


class _Builder:
    """Draws one program, op by op, keeping the metadata of every value."""

    def __init__(self, seed: int, index: int, weights: Weights) -> None:
        self.rng = random.Random(seed * 1_000_003 + index)
        self.seed, self.index, self.w = seed, index, weights
        self.meta: dict[str, Meta] = {}
        self.linears: list[Linear] = []
        self.ops: list[Op] = []
        self.inputs: list[Input] = []
        self.counter = 0
        self.regions = 0
        self.min_features = self._weighted(MIN_FEATURES, MIN_FEATURES_WEIGHTS)
        self.leading = self._weighted(LEADING, LEADING_WEIGHTS)

    def _weighted(self, items: Any, weights: Any) -> Any:
        return self.rng.choices(items, weights=weights)[0]

    def _chance(self, p: float) -> bool:
        return self.rng.random() < p

    def _value(self, meta: Meta) -> str:
        name = f"v{self.counter}"
        self.counter += 1
        self.meta[name] = meta
        return name

    def _route(self, in_f: int, out_f: int) -> str:
        """te_v2's route for a linear of these features (divisible tokens assumed)."""
        if in_f % 16 or out_f % 16:
            return "fallback"
        return "unquantized" if min(in_f, out_f) < self.min_features else "fp8"

    def _out_features(self, in_f: int) -> int:
        """Out-features for a linear from ``in_f`` that take a route drawn by ``Weights.routes``
        (any, where none can), often ``in_f`` itself (a residual sum can follow)."""
        route = self._weighted(ROUTES, self.w.routes)
        options = [
            (f, w) for f, w in zip(FEATURES, FEATURE_WEIGHTS, strict=True) if self._route(in_f, f) == route
        ]
        if not options:
            options = list(zip(FEATURES, FEATURE_WEIGHTS, strict=True))
        if in_f in dict(options) and self._chance(0.35):
            return in_f
        return self._weighted([f for f, _ in options], [w for _, w in options])

    def _new_linear(
        self, in_f: int, out_f: int, *, frozen: bool | None = None, bias: bool | None = None
    ) -> str:
        name = f"l{len(self.linears)}"
        self.linears.append(
            Linear(
                name,
                in_f,
                out_f,
                self._chance(self.w.bias) if bias is None else bias,
                self._chance(self.w.frozen) if frozen is None else frozen,
            )
        )
        return name

    def _linear_by(self, name: str) -> Linear:
        return next(lin for lin in self.linears if lin.name == name)

    def _emit(self, op: Op) -> None:
        self.ops.append(op)

    def _pick(self, pred: Callable[[str, Meta], bool] = lambda n, m: True) -> str | None:
        """A value satisfying ``pred``, recent ones more likely."""
        names = [n for n, m in self.meta.items() if pred(n, m)]
        if not names:
            return None
        return self.rng.choices(names, weights=[i + 1 for i in range(len(names))])[0]

    # One method per op kind; each returns whether it emitted anything.

    def linear(self) -> bool:
        v = self._pick()
        if v is None:
            return False
        m = self.meta[v]
        d = m.shape[-1]
        out_f = self._out_features(d)
        name = self._new_linear(d, out_f)
        out = self._value(Meta((*m.shape[:-1], out_f), m.dtype))
        if m.dtype == "float32":
            template = f"{{out}} = self.{name}({{0}})"
        else:
            cast = DTYPE_NAMES[m.dtype]
            bias = f", self.{name}.bias.to({cast})" if self._linear_by(name).bias else ""
            template = f"{{out}} = F.linear({{0}}, self.{name}.weight.to({cast}){bias})"
        self._emit(
            Op("linear" if m.dtype == "float32" else f"linear_{m.dtype}", template, (v,), out, (name,))
        )
        return True

    def reuse_linear(self) -> bool:
        for lin in self.rng.sample(self.linears, len(self.linears)):
            v = self._pick(lambda n, m, lin=lin: m.dtype == "float32" and m.shape[-1] == lin.in_features)
            if v is not None:
                out = self._value(Meta((*self.meta[v].shape[:-1], lin.out_features)))
                self._emit(Op("reuse_linear", f"{{out}} = self.{lin.name}({{0}})", (v,), out, (lin.name,)))
                return True
        return False

    def tied(self) -> bool:
        for lin in self.rng.sample(self.linears, len(self.linears)):
            transposed = self._chance(0.4)
            d_in, d_out = (
                (lin.out_features, lin.in_features) if transposed else (lin.in_features, lin.out_features)
            )
            v = self._pick(lambda n, m, d_in=d_in: m.dtype == "float32" and m.shape[-1] == d_in)
            if v is not None:
                out = self._value(Meta((*self.meta[v].shape[:-1], d_out)))
                w = f"self.{lin.name}.weight{'.t()' if transposed else ''}"
                self._emit(Op("tied_linear", f"{{out}} = F.linear({{0}}, {w})", (v,), out, (lin.name,)))
                return True
        return False

    def sliced(self) -> bool:
        for lin in self.rng.sample(self.linears, len(self.linears)):
            v = self._pick(lambda n, m, lin=lin: m.dtype == "float32" and m.shape[-1] == lin.in_features)
            if v is None or lin.out_features < 16:
                continue
            rows = self.rng.choice(
                [r for r in (8, 16, 24, 32, 48) if r < lin.out_features] or [lin.out_features // 2]
            )
            bias = f", self.{lin.name}.bias[:{rows}]" if lin.bias and self._chance(0.5) else ""
            out = self._value(Meta((*self.meta[v].shape[:-1], rows)))
            template = f"{{out}} = F.linear({{0}}, self.{lin.name}.weight[:{rows}]{bias})"
            self._emit(Op("sliced_linear", template, (v,), out, (lin.name,)))
            return True
        return False

    def lora(self) -> bool:
        """PEFT's LoRA: base(x) + B(A(dropout(x))) * scaling, as separate ops (base first or not)."""
        inputs = [i.name for i in self.inputs]
        v = (
            self.rng.choice(inputs)
            if self._chance(self.w.lora_on_input)
            else self._pick(lambda n, m: m.dtype == "float32")
        )
        if v is None:
            return False
        m = self.meta[v]
        d = m.shape[-1]
        out_f = self._out_features(d)
        rank = self.rng.choice(RANKS)
        base = self._new_linear(
            d, out_f, frozen=self._chance(self.w.frozen_base), bias=self._chance(self.w.bias / 2)
        )
        a = self._new_linear(d, rank, bias=False, frozen=self._chance(self.w.frozen_adapter))
        b = self._new_linear(rank, out_f, bias=False, frozen=self._chance(self.w.frozen_adapter))
        scaling = self.rng.choice(LORA_SCALINGS)
        lead = m.shape[:-1]
        y_base = self._value(Meta((*lead, out_f)))
        base_op = Op("linear", f"{{out}} = self.{base}({{0}})", (v,), y_base, (base,))
        adapter: list[Op] = []
        x = v
        if self._chance(0.3):
            x = self._value(m)
            adapter.append(Op("dropout0", "{out} = F.dropout({0}, p=0.0)", (v,), x))
        h = self._value(Meta((*lead, rank)))
        adapter.append(Op("linear", f"{{out}} = self.{a}({{0}})", (x,), h, (a,)))
        ya = self._value(Meta((*lead, out_f)))
        adapter.append(Op("linear", f"{{out}} = self.{b}({{0}})", (h,), ya, (b,)))
        if scaling is not None:
            scaled = self._value(Meta((*lead, out_f)))
            adapter.append(Op("scale", f"{{out}} = {{0}} * {scaling}", (ya,), scaled))
            ya = scaled
        # PEFT's order is the base first; an in-place write into x after the base read it, or
        # into h after B read it, is what a GEMM moved to the sum would miss.
        order = [base_op, *adapter] if self._chance(0.7) else [*adapter, base_op]
        b_op = adapter[-1 if scaling is None else -2]
        # Eager rejects a write into what a trainable linear saved (and into a leaf that
        # requires grad): mostly writes after a frozen reader, sometimes one eager rejects.
        after = [op for op, lin in ((b_op, b), (base_op, base)) if self._linear_by(lin).frozen]
        if any(i.name == v and i.requires_grad for i in self.inputs) and base_op in after:
            after.remove(base_op)
        if not after and self._chance(0.25):
            after = [b_op]
        write_after = None
        if after and self._chance(self.w.lora_in_place):
            write_after = order.index(self.rng.choice(after))
        for i, op in enumerate(order):
            self._emit(op)
            if i == write_after:
                self._emit(self._write(op.reads[0], self._defined()))
        out = self._value(Meta((*lead, out_f)))
        reads = (y_base, ya) if self._chance(0.8) else (ya, y_base)
        self._emit(Op("add", "{out} = {0} + {1}", reads, out))
        return True

    def add(self) -> bool:
        a = self._pick()
        if a is None:
            return False
        b = self._pick(lambda n, m: m == self.meta[a] and n != a)
        if b is None:
            return False
        out = self._value(self.meta[a])
        self._emit(Op("add", "{out} = {0} + {1}", (a, b) if self._chance(0.5) else (b, a), out))
        return True

    def scale(self) -> bool:
        v = self._pick()
        if v is None:
            return False
        out = self._value(self.meta[v])
        self._emit(Op("scale", f"{{out}} = {{0}} * {self.rng.choice(SCALES)}", (v,), out))
        return True

    def gelu(self) -> bool:
        v = self._pick()
        if v is None:
            return False
        out = self._value(self.meta[v])
        if self._chance(0.15):
            self._emit(Op("gelu_tanh", '{out} = F.gelu({0}, approximate="tanh")', (v,), out))
        else:
            self._emit(Op("gelu", "{out} = F.gelu({0})", (v,), out))
        return True

    def swiglu(self) -> bool:
        a = self._pick()
        if a is None:
            return False
        b = self._pick(lambda n, m: m == self.meta[a] and n != a) if self._chance(0.8) else None
        out = self._value(self.meta[a])
        if b is None and self._chance(0.2):
            self._emit(Op("silu_squared", "{out} = F.silu({0}) * F.silu({0})", (a,), out))
        elif b is None:
            self._emit(Op("silu", "{out} = F.silu({0})", (a,), out))
        else:
            self._emit(Op("swiglu", "{out} = F.silu({0}) * {1}", (a, b), out))
        return True

    def relu(self) -> bool:
        v = self._pick()
        if v is None:
            return False
        out = self._value(self.meta[v])
        self._emit(Op("relu", "{out} = torch.relu({0})", (v,), out))
        return True

    def cast(self) -> bool:
        v = self._pick()
        if v is None:
            return False
        m = self.meta[v]
        if m.dtype != "float32":
            out = self._value(Meta(m.shape))
            self._emit(Op("cast_float32", "{out} = {0}.float()", (v,), out))
            return True
        dtype = self._weighted(("bfloat16", "float64"), (3, 1))
        out = self._value(Meta(m.shape, dtype))
        self._emit(Op(f"cast_{dtype}", f"{{out}} = {{0}}.to({DTYPE_NAMES[dtype]})", (v,), out))
        return True

    def view(self) -> bool:
        v = self._pick()
        if v is None:
            return False
        m = self.meta[v]
        if len(m.shape) == 3:
            if self._chance(0.5):
                out = self._value(Meta((m.shape[0] * m.shape[1], m.shape[2]), m.dtype))
                self._emit(Op("reshape", f"{{out}} = {{0}}.reshape(-1, {m.shape[2]})", (v,), out))
            else:
                out = self._value(Meta((m.shape[1], m.shape[0], m.shape[2]), m.dtype))
                self._emit(Op("transpose", "{out} = {0}.transpose(0, 1)", (v,), out))
            return True
        rows, cols = m.shape
        if self._chance(0.15):
            out = self._value(Meta((cols, rows), m.dtype))
            self._emit(Op("t", "{out} = {0}.t()", (v,), out))
            return True
        splits = [s for s in (2, 4) if rows % s == 0]
        if not splits:
            return False
        s = self.rng.choice(splits)
        out = self._value(Meta((s, rows // s, cols), m.dtype))
        self._emit(Op("view", f"{{out}} = {{0}}.view({s}, {rows // s}, {cols})", (v,), out))
        return True

    def alias(self) -> bool:
        v = self._pick()
        if v is None:
            return False
        kind = self.rng.choice(sorted(ALIASES))
        out = self._value(self.meta[v])
        self._emit(Op(kind, ALIASES[kind], (v,), out))
        return True

    def checkpoint(self) -> bool:
        """A region of 1 to 3 ops under ``checkpoint(..., use_reentrant=False)``, as a method."""
        v = self._pick(lambda n, m: m.dtype == "float32")
        if v is None:
            return False
        m = self.meta[v]
        method = f"ck{self.regions}"
        self.regions += 1
        body, linears, cur, d = [], [], "t0", m.shape[-1]
        locals_ = 1
        for _ in range(self.rng.randint(1, 3)):
            step = self._weighted(("linear", "gelu", "scale", "residual"), (4, 1, 1, 1))
            new = f"t{locals_}"
            locals_ += 1
            if step == "linear":
                out_f = self._out_features(d)
                lin = self._new_linear(d, out_f)
                linears.append(lin)
                body.append(f"{new} = self.{lin}({cur})")
                d = out_f
            elif step == "gelu":
                body.append(f"{new} = F.gelu({cur})")
            elif step == "scale":
                body.append(f"{new} = {cur} * {self.rng.choice(SCALES)}")
            elif d == m.shape[-1]:
                body.append(f"{new} = {cur} + t0")
            else:
                continue
            cur = new
        region = (f"def {method}(self, t0):", *(f"    {line}" for line in body), f"    return {cur}")
        out = self._value(Meta((*m.shape[:-1], d)))
        template = f"{{out}} = checkpoint(self.{method}, {{0}}, use_reentrant=False)"
        self._emit(Op("checkpoint", template, (v,), out, tuple(linears), region))
        return True

    def grouped_attention(self) -> bool:
        """Heads of ``x`` attending, causally or not, to keys and values cut from ``x`` or another
        value of its shape, fewer heads repeated to every query head as ``repeat_kv`` does."""
        x = self._pick(lambda n, m: m.dtype == "float32" and m.shape[-1] % 8 == 0)
        if x is None:
            return False
        m = self.meta[x]
        kv_source = self._pick(lambda n, m2: m2 == m)
        heads = self.rng.choice([h for h in (2, 4) if m.shape[-1] % h == 0])
        kv_heads = self.rng.choice([k for k in (1, 2) if k < heads])
        tokens, dim = math.prod(m.shape[:-1]), m.shape[-1] // heads

        def heads_of(v: str, n: int) -> str:
            return f"{v}[..., :{n * dim}].reshape(1, {tokens}, {n}, {dim}).transpose(1, 2)"

        def repeated(heads_: str) -> str:
            shape = f"1, {kv_heads}, {heads // kv_heads}, {tokens}, {dim}"
            return f"({heads_})[:, :, None].expand({shape}).reshape(1, {heads}, {tokens}, {dim})"

        # Keys through a nonlinearity, as RoPE turns them by position: a shift shared by every key
        # (a linear's bias) leaves the softmax as it is, so its exact gradient would be 0 and
        # every computed one rounding noise.
        keys = f"torch.tanh({heads_of('{1}', kv_heads)})"
        causal = self._chance(0.5)
        attention = (
            f"F.scaled_dot_product_attention({heads_of('{0}', heads)}, {repeated(keys)}, "
            f"{repeated(heads_of('{0}' if self._chance(0.5) else '{1}', kv_heads))}, is_causal={causal})"
        )
        out = self._value(m)
        template = f"{{out}} = {attention}.transpose(1, 2).reshape({', '.join(map(str, m.shape))})"
        self._emit(Op("grouped_attention", template, (x, kv_source), out))
        return True

    def no_grad(self) -> bool:
        v = self._pick(lambda n, m: m.dtype == "float32")
        if v is None:
            return False
        m = self.meta[v]
        reusable = [lin for lin in self.linears if lin.in_features == m.shape[-1]]
        if reusable and self._chance(0.5):
            lin = self.rng.choice(reusable)
            name, out_f = lin.name, lin.out_features
        else:
            out_f = self._out_features(m.shape[-1])
            name = self._new_linear(m.shape[-1], out_f)
        out = self._value(Meta((*m.shape[:-1], out_f)))
        template = f"with torch.no_grad():\n    {{out}} = self.{name}({{0}})"
        self._emit(Op("no_grad_linear", template, (v,), out, (name,)))
        return True

    def in_place(self) -> None:
        """Insert one in-place op into the drawn ops, on an input or an intermediate."""
        grad_inputs = {i.name for i in self.inputs if i.requires_grad}
        inputs = {i.name for i in self.inputs}
        defined_at = {i.name: 0 for i in self.inputs}
        for pos, op in enumerate(self.ops):
            if op.out is not None:
                defined_at[op.out] = pos + 1
        # Writing into a leaf that requires grad is an error eager reports at once: rarely. A
        # value read more than once is the likeliest target, an input likelier still.
        targets = [n for n in defined_at if n not in grad_inputs or self._chance(0.05)]
        if not targets:
            return
        reads = {n: [pos for pos, op in enumerate(self.ops) if n in op.reads] for n in targets}
        by_reads = self.w.in_place_target_by_reads
        weights = [
            by_reads[min(len(reads[n]), len(by_reads) - 1)] * (self.w.in_place_input if n in inputs else 1)
            for n in targets
        ]
        target = self.rng.choices(targets, weights=weights)[0]
        read_at, start = reads[target], defined_at[target]
        if len(read_at) >= 2 and self._chance(self.w.between_reads):
            i = self.rng.randrange(len(read_at) - 1)
            pos = self.rng.randint(read_at[i] + 1, read_at[i + 1])
        elif read_at and self._chance(self.w.between_reads):
            pos = read_at[0] + 1  # right after its first read
        else:
            pos = self.rng.randint(start, len(self.ops))
        pos = max(pos, start)
        defined = [n for n, at in defined_at.items() if at <= pos]
        self.ops.insert(pos, self._write(target, defined))

    def _write(self, target: str, defined: list[str]) -> Op:
        """An in-place op into ``target``: a multiply by a constant, or an ``add_`` or ``copy_``
        of a value of ``defined`` with its shape and dtype."""
        kind = self.rng.choice(IN_PLACE_KINDS)
        sources = [n for n in defined if n != target and self.meta[n] == self.meta[target]]
        if kind == "mul_" or not sources:
            return Op("mul_", f"{{0}}.mul_({self.rng.choice(IN_PLACE_FACTORS)})", (target,))
        return Op(kind, f"{{0}}.{kind}({{1}})", (target, self.rng.choice(sources)))

    def _defined(self) -> list[str]:
        return [i.name for i in self.inputs] + [op.out for op in self.ops if op.out is not None]

    def build(self) -> Program:
        w = self.w
        n_inputs = self._weighted((1, 2), (3, 1))
        for i in range(n_inputs):
            d = self._weighted(FEATURES[:4], (1, 3, 1, 3)) if i == 0 or self._chance(0.5) else None
            shape = (*self.leading, d) if d is not None else self.meta["x0"].shape
            self.inputs.append(Input(f"x{i}", shape, self._chance(w.input_requires_grad)))
            self.meta[f"x{i}"] = Meta(shape)
        kinds = [
            "linear",
            "reuse_linear",
            "tied",
            "sliced",
            "lora",
            "add",
            "scale",
            "gelu",
            "relu",
            "cast",
            "view",
            "checkpoint",
            "no_grad",
            "swiglu",
            "alias",  # with the weights of the kinds after swiglu 0, seeds make the programs they made before them
            "grouped_attention",
        ]
        weights = [getattr(w, k) for k in kinds]
        target = self.rng.randint(3, 12)
        while len(self.ops) < target:
            getattr(self, self.rng.choices(kinds, weights=weights)[0])()
        for _ in range(self._weighted(range(len(w.in_place_counts)), w.in_place_counts)):
            self.in_place()
        return Program(
            seed=self.seed,
            index=self.index,
            min_features=self.min_features,
            inputs=tuple(self.inputs),
            linears=tuple(self.linears),
            ops=tuple(self.ops),
            outputs=self._outputs(),
            loss=self.rng.choice(("squares", "cotangent")),
            meta=self.meta,
        ).used()

    def _outputs(self) -> tuple[str, ...]:
        """The last value, and sometimes intermediates (those written in place first)."""
        values = [op.out for op in self.ops if op.out is not None]
        outputs = [values[-1]] if values else [self.inputs[0].name]
        written = [op.reads[0] for op in self.ops if op.in_place]
        for _ in range(self._weighted((0, 1, 2), (2, 2, 1))):
            pool = written if written and self._chance(0.6) else values
            pick = self.rng.choice(pool) if pool else None
            if pick is not None and pick not in outputs:
                outputs.append(pick)
        return tuple(outputs)


def generate(seed: int, index: int, weights: Weights | None = None) -> Program:
    """Program number ``index`` of the stream seeded by ``seed``."""
    return _Builder(seed, index, weights or Weights()).build()
