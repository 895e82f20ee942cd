"""Both numerics modules, ``backends/te.py`` and ``backends/reference.py``, provide what
``KernelBackend`` says, with the same signatures: read from their source, since TransformerEngine
does not import without CUDA."""

from __future__ import annotations

import ast
import inspect
import pathlib

import pytest

from te_v2_executor import backends
from te_v2_executor.backends.common import KernelBackend, ScalingState

BACKENDS = pathlib.Path(backends.__file__).parent
_KINDS = {
    "posonlyargs": inspect.Parameter.POSITIONAL_ONLY,
    "args": inspect.Parameter.POSITIONAL_OR_KEYWORD,
    "kwonlyargs": inspect.Parameter.KEYWORD_ONLY,
}


def _params_of_source(fn: ast.FunctionDef) -> list[tuple[str, inspect._ParameterKind, bool]]:
    """(name, kind, has a default) of each parameter of a function definition."""
    a = fn.args
    positional = [*a.posonlyargs, *a.args]
    defaulted = {p.arg for p in positional[len(positional) - len(a.defaults) :]}
    defaulted |= {p.arg for p, d in zip(a.kwonlyargs, a.kw_defaults, strict=True) if d is not None}
    return [(p.arg, _KINDS[field], p.arg in defaulted) for field in _KINDS for p in getattr(a, field)]


def _params_of(fn) -> list[tuple[str, inspect._ParameterKind, bool]]:
    return [(p.name, p.kind, p.default is not p.empty) for p in inspect.signature(fn).parameters.values()]


def _definitions(body: list[ast.stmt]) -> dict[str, ast.AST]:
    return {node.name: node for node in body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}


def _expected() -> dict[str, list]:
    """What ``KernelBackend`` asks of a module: its functions' parameters (without ``self``), and
    those of ``ScalingState.__init__`` and ``ScalingState.replaying`` (without ``self``/``cls``)."""
    functions = {
        name: _params_of(getattr(KernelBackend, name))[1:]
        for name, member in vars(KernelBackend).items()
        if inspect.isfunction(member) and not name.startswith("_")
    }
    functions["ScalingState.__init__"] = _params_of(ScalingState.__init__)[1:]
    functions["ScalingState.replaying"] = _params_of(ScalingState.replaying.__func__)[1:]
    return functions


@pytest.mark.parametrize("module", ["te", "reference"])
def test_each_numerics_module_provides_the_kernel_backend(module):
    tree = ast.parse((BACKENDS / f"{module}.py").read_text())
    found = _definitions(tree.body)
    assert isinstance(found.get("ScalingState"), ast.ClassDef), f"{module}.py has no ScalingState class"
    methods = _definitions(found["ScalingState"].body)
    expected = _expected()
    assert set(expected) >= {"linear_fwd", "quantize_grad_output", "linear_dgrad", "linear_wgrad"}
    for name, params in expected.items():
        owner, _, method = name.rpartition(".")
        node = methods.get(method) if owner else found.get(name)
        assert isinstance(node, ast.FunctionDef), f"{module}.py lacks {name}"
        got = _params_of_source(node)[1:] if owner else _params_of_source(node)
        assert got == params, f"{module}.{name}: {got} differs from KernelBackend's {params}"


def test_the_reference_module_is_the_reference_backend():
    """The reference backend loads on any machine, and is the module the check above reads."""
    loaded = backends.load(backends.Backend.REFERENCE)
    assert pathlib.Path(loaded.__file__) == BACKENDS / "reference.py"
    assert all(callable(getattr(loaded, name)) for name in _expected() if "." not in name)
