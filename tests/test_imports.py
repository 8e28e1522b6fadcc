"""The import graph of jequi, pallas_kernels and ffi, read from the sources (ast, nothing
imported): no cycle between files, the kernel packages below the API, and every import order
of the three packages working in a fresh process."""

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("jequi", "pallas_kernels", "ffi")
# What the kernel packages may import from jequi: its core (nothing of a backend, the API or the
# models), docs/design.md's first layer.
# What both kernel packages share sits there too: how a Pallas kernel is launched and the
# row-part fix-up of the convs.
CORE = {"jequi.irreps", "jequi.descriptor", "jequi.sums", "jequi.graph", "jequi.so2", "jequi.symmetric_basis",
        "jequi.dtypes", "jequi.pallas_launch", "jequi.row_fixup"}


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = _modules()


def _imports(name: str, path: pathlib.Path) -> set[str]:
    """The repo modules `name` imports, at any depth of its code (function-level imports too):
    ``import a.b`` and ``from a import b`` name ``a.b`` where that is a module, else ``a``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _cycles(graph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_graph_is_read():
    """The reader sees the edges it should (so that an empty graph cannot pass the tests below)."""
    assert "jequi.sums" in GRAPH["pallas_kernels.ops"] and "jequi.descriptor" in GRAPH["ffi.schedule"]
    assert "jequi.eaas_reference" in GRAPH["jequi.eaas"] and "jequi.models.data" in GRAPH["jequi.models.calculator"]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycle_between_files():
    assert _cycles(GRAPH) == []


def test_kernel_packages_import_only_the_core_of_jequi():
    for name, targets in GRAPH.items():
        if name.split(".")[0] == "jequi":
            continue
        for target in targets:
            if target.split(".")[0] == "jequi":
                assert target in CORE, f"{name} imports {target}, which is not jequi's core"
            else:
                assert target.split(".")[0] == name.split(".")[0], f"{name} imports {target}: the kernel packages import each other"


def test_the_core_imports_nothing_above_it():
    for name in CORE:
        assert GRAPH[name] <= CORE, f"{name} imports {GRAPH[name] - CORE}"


@pytest.mark.parametrize("first", ["ffi", "pallas_kernels.ops", "ffi.ops", "jequi.sums", "jequi.models"])
def test_any_import_order_in_a_fresh_process(first):
    code = f"import {first}; import jequi, ffi, pallas_kernels; assert {{'xla', 'pallas', 'cuda'}} <= set(jequi.backends.BACKENDS)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]


# jequi.models in layers, each importing only its own layer and those below: data (structures,
# neighbour lists, padding, the device mesh, the architecture interface, the precision policies) <-
# architectures <- training (the loss, single-device and data-parallel training) <- pretrained weights <-
# calculator and MD <- distribution (the sharded calculator and MD over a decomposition).
MODEL_LAYERS = [
    "data mesh architecture named precision",
    "nequip mace nequix e2former",
    "loss train data_parallel",
    "pretrained",
    "calculator md",
    "decomposition distributed",
]


def test_models_import_only_their_layer_and_below():
    rank = {f"jequi.models.{m}": r for r, layer in enumerate(MODEL_LAYERS) for m in layer.split()}
    modules = {name for name in GRAPH if name.startswith("jequi.models.")}
    assert modules == set(rank), f"modules without a layer: {sorted(modules - set(rank))}"
    for name in modules:
        for target in GRAPH[name] & modules:
            assert rank[target] <= rank[name], f"{name} imports {target}, a layer above it"
