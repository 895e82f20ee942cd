"""The examples of docs/*.md run and show what the docs say (the CPU part).

An example is a fenced ``python`` block whose first line is ``# example: NAME``, or
``# example: NAME (gpu)`` for those tests/gpu/test_docs_examples.py runs. Each runs on its own,
as a script would. An example whose code ends in a ``# SomeError: message`` comment must raise
that error with that message. A ``<!-- output: NAME -->`` text block is all that example or
command NAME prints; ``<!-- excerpt: NAME -->`` blocks are parts of the output of script NAME.
In expected text ``...`` stands for anything within a line, and alone on a line for any lines.

This module also holds the parsing and running helpers the GPU suite uses.
"""

from __future__ import annotations

import contextlib
import copy
import io
import linecache
import re
import subprocess
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import thunder
import torch
from thunder.dynamo import thunderfx

from te_v2_executor import ClaimPolicy, TEv2FallbackWarning, backends, explain, make_te_v2, passes
from te_v2_executor.__main__ import main as explain_cli
from te_v2_executor.symbols import (
    BACKWARD_SYNC,
    FORWARD_SYNC,
    LINEAR_DGRAD,
    LINEAR_FWD,
    LINEAR_WGRAD,
    QUANTIZE_GRAD_OUTPUT,
    is_recast,
)
from tests.helpers import backward_trace, bsyms_of, forward_trace, recast_copies
from tests.models import LoRAStack

# the docs show what users get: only the recasts the peak needs
pytestmark = pytest.mark.peak_policy

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
SEED_SCRIPT = DOCS / "examples" / "trace_seed_case.py"

_EXAMPLE = re.compile(r"```python\n# example: (?P<name>[\w-]+)(?P<gpu> \(gpu\))?\n(?P<code>.*?)```", re.S)
_EXPECTED = re.compile(
    r"<!-- (?P<kind>output|excerpt): (?P<name>[\w-]+) -->\n```text\n(?P<text>.*?)```", re.S
)
_ERROR = re.compile(r"\n# (?P<type>\w+Error): (?P<message>.*(?:\n# .*)*)\n*\Z")


@dataclass(frozen=True)
class Example:
    """One tagged code block of a doc."""

    doc: str
    name: str
    gpu: bool
    code: str

    @property
    def error(self) -> tuple[str, str] | None:
        """The error type and message its closing comment says it raises, if any."""
        found = _ERROR.search(self.code)
        if found is None:
            return None
        return found["type"], " ".join(line.removeprefix("# ") for line in found["message"].split("\n"))


def _doc_texts() -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(DOCS.glob("*.md"))}


def _parse_examples() -> dict[str, Example]:
    examples: dict[str, Example] = {}
    for doc, text in _doc_texts().items():
        for m in _EXAMPLE.finditer(text):
            assert m["name"] not in examples, f"two examples named {m['name']}"
            examples[m["name"]] = Example(doc, m["name"], bool(m["gpu"]), m["code"])
    return examples


def _parse_expected(kind: str) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for text in _doc_texts().values():
        for m in _EXPECTED.finditer(text):
            if m["kind"] == kind:
                found.setdefault(m["name"], []).append(m["text"])
    return found


EXAMPLES = _parse_examples()
OUTPUTS = _parse_expected("output")
EXCERPTS = _parse_expected("excerpt")


def _pattern(expected: str) -> str:
    lines = []
    for line in expected.rstrip("\n").split("\n"):
        if line == "...":
            lines.append(r"(?:[^\n]*\n)*?")
        else:
            lines.append(".*?".join(map(re.escape, line.split("..."))) + r"\n")
    return "".join(lines)


def assert_prints(expected: str, printed: str) -> None:
    """``printed`` is ``expected``, ``...`` standing for what varies."""
    assert re.fullmatch(_pattern(expected), printed.rstrip("\n") + "\n"), (
        f"expected:\n{expected}\nprinted:\n{printed}"
    )


def assert_excerpt(expected: str, printed: str) -> None:
    """``expected`` is a run of whole lines of ``printed``, ``...`` standing for what is left out."""
    assert re.search("(?m)^" + _pattern(expected), printed.rstrip("\n") + "\n"), (
        f"excerpt not in the output:\n{expected}\noutput:\n{printed}"
    )


def run_example(example: Example) -> tuple[dict[str, Any], str]:
    """Execute ``example`` in a namespace of its own; its variables and what it printed.

    An example that says which error it raises must raise that error with that message."""
    filename = f"<{example.doc}: example {example.name}>"
    linecache.cache[filename] = (len(example.code), None, example.code.splitlines(True), filename)
    namespace: dict[str, Any] = {"__name__": f"docs_example_{example.name.replace('-', '_')}"}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        if example.error is None:
            exec(compile(example.code, filename, "exec"), namespace)
        else:
            error_type, message = example.error
            with pytest.raises(Exception) as raised:
                exec(compile(example.code, filename, "exec"), namespace)
            assert type(raised.value).__name__ == error_type
            assert_prints(message, str(raised.value))
    return namespace, printed.getvalue()


def check_example(example: Example, checks: dict[str, Callable[[dict[str, Any]], None]]) -> None:
    """Run ``example``, compare what it prints with its documented output, run its check."""
    namespace, printed = run_example(example)
    for expected in OUTPUTS.get(example.name, []):
        assert_prints(expected, printed)
    if example.name in checks:
        checks[example.name](namespace)


def verified(example: Example, checks: dict[str, Callable]) -> bool:
    """Whether a test asserts more of ``example`` than that it runs."""
    return example.name in checks or example.name in OUTPUTS or example.error is not None


# ---- the CPU examples --------------------------------------------------------------------------


def _check_reference_backend(ns: dict[str, Any]) -> None:
    model = ns["model"]
    assert model[0].weight.grad is None and model[0].bias.grad is None
    assert model[2].weight.grad is not None and model[2].bias.grad is not None
    assert len(bsyms_of(forward_trace(ns["jitted"]), LINEAR_FWD)) == 2


def _check_fallback_warning(ns: dict[str, Any]) -> None:
    assert len(ns["fallbacks"]) == 1
    assert not bsyms_of(forward_trace(ns["jitted"]), LINEAR_FWD)


def _check_eager_region(ns: dict[str, Any]) -> None:
    """The first region runs te_v2, the refused one eagerly: the gradients are eager's."""
    model = ns["model"]
    (first, second) = ns["compiled"]._backend.subgraph_infos
    assert len(first.thunder_compiled_fns) == 1 and not second.thunder_compiled_fns
    twin = copy.deepcopy(model)
    for p in twin.parameters():
        p.grad = None
    with contextlib.redirect_stdout(io.StringIO()):
        twin(ns["x"]).sum().backward()
    for p, expected in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p.grad, expected.grad, rtol=1e-5, atol=1e-5)


CPU_CHECKS: dict[str, Callable[[dict[str, Any]], None]] = {
    "reference-backend": _check_reference_backend,
    "fallback-warning": _check_fallback_warning,
    "eager-region": _check_eager_region,
}
CPU_EXAMPLES = [name for name, example in EXAMPLES.items() if not example.gpu]


def test_every_example_and_output_is_tested():
    from tests.gpu.test_docs_examples import GPU_CHECKS

    assert CPU_EXAMPLES and len(EXAMPLES) > len(CPU_EXAMPLES)
    for example in EXAMPLES.values():
        compile(example.code, f"<{example.doc}: example {example.name}>", "exec")  # GPU ones too
        assert verified(example, GPU_CHECKS if example.gpu else CPU_CHECKS), f"nothing checks {example.name}"
    assert set(OUTPUTS) <= {*EXAMPLES, "explain-cli"}
    assert set(EXCERPTS) == {"trace-seed-case"}


@pytest.mark.parametrize("name", CPU_EXAMPLES)
def test_cpu_example(name):
    example = EXAMPLES[name]
    if name == "missing-te" and backends.te_available():
        pytest.skip("TransformerEngine is installed here: the example shows the error without it")
    check_example(example, CPU_CHECKS)


def test_explain_cli_prints_the_documented_report():
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        explain_cli(["--backend", "reference"])
    (expected,) = OUTPUTS["explain-cli"]
    assert_prints(expected, printed.getvalue())


# ---- docs/architecture.md: the seed case -------------------------------------------------------


def test_trace_script_prints_the_documented_excerpts():
    done = subprocess.run(
        [sys.executable, str(SEED_SCRIPT.relative_to(ROOT))],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert len(EXCERPTS["trace-seed-case"]) == 4
    for excerpt in EXCERPTS["trace-seed-case"]:
        assert_excerpt(excerpt, done.stdout)


def _load_seed_script() -> ModuleType:
    import importlib.util

    spec = importlib.util.spec_from_file_location("trace_seed_case", SEED_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _by_weight(trace, sym) -> dict[int, Any]:
    """``sym``'s bound symbols in ``trace`` by the index of the linear they belong to (the ``i``
    of its state's weight, ``t_linears_{i}_weight``)."""
    return {int(b.kwargs["state"].name.split("_")[-2]): b for b in bsyms_of(trace, sym)}


def test_seed_case_traces_are_the_documented_ones():
    """What docs/architecture.md says of the seed case, on the script's own traces."""
    jitted, te_v2 = _load_seed_script().run()
    before, after, backward = te_v2.received, te_v2.returned, backward_trace(jitted)
    for trace in (before, after, backward):
        assert set(_by_weight(trace, LINEAR_DGRAD)) == {2, 3}
        assert set(_by_weight(trace, LINEAR_WGRAD)) == {1, 3}
        assert set(_by_weight(trace, QUANTIZE_GRAD_OUTPUT)) == {1, 2, 3}

    for b in bsyms_of(before, LINEAR_FWD):
        assert b.kwargs["save_input"] and b.kwargs["save_weight"]
    for b in bsyms_of(before, QUANTIZE_GRAD_OUTPUT):
        assert b.kwargs["rowwise"] and b.kwargs["columnwise"]
    assert not bsyms_of(before, FORWARD_SYNC) and not bsyms_of(before, BACKWARD_SYNC)

    forwards = [b for b in bsyms_of(after, LINEAR_FWD) if not is_recast(b)]
    fwd = {int(b.kwargs["state"].name.split("_")[-2]): b for b in forwards}
    assert [fwd[i].kwargs["save_input"] for i in range(4)] == [False, True, False, True]
    # linear 3's dgrad, the backward's first GEMM, frees its W^T before the peak: it stays saved
    assert [fwd[i].kwargs["save_weight"] for i in range(4)] == [False, False, False, True]
    # the dgrad of linear 2 reads W^T cast in the backward, with the forward's scales
    for trace in (after, backward):
        recasts = {int(name.split("_")[-2]): cast for name, cast in recast_copies(trace).items()}
        assert set(recasts) == {2}
        assert _by_weight(trace, LINEAR_DGRAD)[2].args[1].name == recasts[2][0].name
        assert recasts[2][1] is not None
    quantize = _by_weight(after, QUANTIZE_GRAD_OUTPUT)
    assert {i: (b.kwargs["rowwise"], b.kwargs["columnwise"]) for i, b in quantize.items()} == {
        1: (False, True),
        2: (True, False),
        3: (True, True),
    }
    (forward_sync,) = bsyms_of(after, FORWARD_SYNC)
    (backward_sync,) = bsyms_of(after, BACKWARD_SYNC)
    assert len(forward_sync.kwargs["group"].states) == 4
    assert len(backward_sync.kwargs["group"].states) == 3
    assert bsyms_of(backward, BACKWARD_SYNC)

    # the forward saves for the backward exactly the two FP8 copies of x it reads, linear 3's
    # W^T, and the weight of the recast
    saved = thunder.core.pytree.tree_flatten(forward_trace(jitted).bound_symbols[-1].args[1])[0]
    fp8_saved = {p.name for p in saved if p.dtype is thunder.dtypes.float8_e4m3fn}
    fwd_outputs = _by_weight(forward_trace(jitted), LINEAR_FWD)
    assert fp8_saved == {fwd_outputs[1].output[1].name, *(n.name for n in fwd_outputs[3].output[1:3])}
    assert "t_linears_2_weight" in {p.name for p in saved}


# ---- docs/usage.md, PEFT section: what it says of thunderfx, checked without transformers ---------


def test_thunderfx_regions_run_te_v2_and_the_claim_policy():
    """thunderfx jits regions with te_v2 (``last_*traces`` are lists, one trace per region); a
    frozen base runs no wgrad, the default policy keeps rank-16 adapters out of FP8 silently."""
    dim = max(128, ClaimPolicy().min_features)
    model = LoRAStack([dim, dim, dim], rank=16)
    compiled = thunderfx(model, executors=[make_te_v2(backend="reference"), *thunder.get_default_executors()])
    with warnings.catch_warnings():
        warnings.simplefilter("error", TEv2FallbackWarning)
        compiled(torch.randn(32, dim)).sum().backward()

    assert isinstance(compiled.last_traces, list) and isinstance(compiled.last_backward_traces, list)
    forward_syms = {b.sym for t in compiled.last_traces for b in t.bound_symbols}
    backward_syms = {b.sym for t in compiled.last_backward_traces for b in t.bound_symbols}
    assert {LINEAR_FWD, FORWARD_SYNC} <= forward_syms
    assert {LINEAR_DGRAD, QUANTIZE_GRAD_OUTPUT, BACKWARD_SYNC} <= backward_syms
    assert LINEAR_WGRAD not in backward_syms
    for name, p in model.named_parameters():
        assert (p.grad is not None) is ("lora" in name), name

    rows = explain(compiled).linears
    assert all(r.claimed for r in rows)
    assert {r.name for r in rows if not r.unquantized} == {
        f"l_self_modules_layers_modules_{i}_modules_base_parameters_weight_" for i in range(2)
    }
    assert all(r.unquantized.startswith("claim policy:") for r in rows if "lora" in r.name)


def test_the_documented_pass_order_is_the_pipeline():
    """architecture.md's pass table lists ``passes.PIPELINE``: every pass, in order, with what it
    does, why it sits there and what it needs of the trace it gets."""
    table = (DOCS / "architecture.md").read_text().split("<!-- pipeline -->\n", 1)[1].split("\n\n", 1)[0]
    rows = [tuple(cell.strip() for cell in line.strip("|").split("|")) for line in table.splitlines()[2:]]
    assert rows == [(f"`{p.name}`", p.does, p.why_here, p.precondition) for p in passes.PIPELINE]
