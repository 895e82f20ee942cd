"""The seed case through te_v2, on the plain-torch reference backend (CPU is enough).

Four bias-free linears of 64 features with ReLU between them, the even ones (index 0 and 2)
frozen, 32 tokens whose input needs no gradient. Prints the te_v2 bound symbols, cotangent reads
and return of three traces: the joint forward+backward trace as te_v2's fusion pass receives it
(before the backward-consumption analysis), the one it returns (after), and the backward trace
Thunder splits off and runs; then the explain report. docs/architecture.md quotes this output.

    python docs/examples/trace_seed_case.py

Printed lines are Thunder's own, except that each quantization state (``state=``, each of
``states=``) or sync group argument, an opaque object in Thunder's printout, is shown as the
weight it belongs to or its repr.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import thunder
import torch
from thunder.core import prims
from thunder.core.trace import TraceCtx
from torch import nn

from te_v2_executor import Backend, ClaimPolicy, TEv2Config, TEv2Executor, explain
from te_v2_executor.symbols import ops as te_v2_symbols

TOKENS, FEATURES, LINEARS = 32, 64, 4


class SeedStack(nn.Module):
    """Linears with ReLU between them; the even ones (0-based) do not train."""

    def __init__(self) -> None:
        super().__init__()
        self.linears = nn.ModuleList(nn.Linear(FEATURES, FEATURES, bias=False) for _ in range(LINEARS))
        for i in range(0, LINEARS, 2):
            self.linears[i].requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, linear in enumerate(self.linears):
            x = linear(x)
            if i < LINEARS - 1:
                x = torch.relu(x)
        return x


class RecordingTEv2(TEv2Executor):
    """te_v2 that keeps the joint trace its fusion pass receives and the one it returns."""

    def fusion_pass(self, trace: TraceCtx) -> TraceCtx:
        self.received = trace
        self.returned = super().fusion_pass(trace)
        return self.returned


_OPAQUE = re.compile(r"\(object of type te_v2_executor_state_\w+\)")


def shown_lines(trace: TraceCtx) -> list[str]:
    """The te_v2 bound symbols of ``trace``, its gradient reads and its return, one line each."""
    lines = []
    for bsym in trace.bound_symbols:
        if bsym.sym.executor is not te_v2_symbols and bsym.sym not in (prims.get_grad, prims.python_return):
            continue
        (line,) = bsym.python(indent=0, print_depth=1)
        line = line.split("  # ")[0]  # drop the result type comment
        for state in bsym.kwargs.get("states", ()):
            line = _OPAQUE.sub(f"<{state.name}>", line, count=1)
        label = bsym.kwargs.get("state", bsym.kwargs.get("group"))
        if label is not None:
            shown = f"<{label.name}>" if "state" in bsym.kwargs else repr(label)
            line = _OPAQUE.sub(shown, line)
        lines.append(line)
    return lines


def run() -> tuple[Callable, RecordingTEv2]:
    """Compile the seed case and run one training step; the jitted model and its te_v2."""
    torch.manual_seed(0)
    # claim all four linears whatever the default claim policy
    config = TEv2Config(backend=Backend.REFERENCE, claim=ClaimPolicy(min_features=0))
    te_v2 = RecordingTEv2(config, name="te_v2_seed_case")
    jitted = thunder.jit(SeedStack(), executors=[te_v2])
    jitted(torch.randn(TOKENS, FEATURES)).sum().backward()
    return jitted, te_v2


def report(jitted: Callable, te_v2: RecordingTEv2) -> str:
    """The before/after traces and the explain report, as the script prints them."""
    sections = {
        "BEFORE: the joint trace te_v2's fusion pass receives": te_v2.received,
        "AFTER: the joint trace te_v2's fusion pass returns": te_v2.returned,
        "AFTER, split: the backward trace Thunder runs (thunder.last_backward_traces)": (
            thunder.last_backward_traces(jitted)[-1]
        ),
    }
    parts = [f"== {title} ==\n" + "\n".join(shown_lines(trace)) + "\n" for title, trace in sections.items()]
    parts.append(f"== explain(jitted) ==\n{explain(jitted)}")
    return "\n".join(parts)


def main() -> None:
    print(report(*run()))


if __name__ == "__main__":
    main()
