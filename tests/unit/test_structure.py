"""The shape of the package, read from its source: no import cycle among zero3's modules, and no
``torch.distributed`` collective called anywhere but the communicator (``zero3/comm*``).

Every import counts, lazy ones inside functions and ``TYPE_CHECKING`` blocks included, so a cycle
cannot hide behind a local import. The checks run on synthetic sources too, so they can fail.
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

PKG = Path(__file__).resolve().parents[2] / "zero3"
COLLECTIVES = {
    "all_gather", "all_gather_into_tensor", "all_gather_object", "all_gather_single", "all_reduce",
    "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "broadcast", "broadcast_object_list",
    "gather", "gather_object", "scatter", "scatter_object_list", "reduce", "barrier", "monitored_barrier",
    "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv", "batch_isend_irecv",
}


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def analyse(sources: dict[str, str], package: str = "zero3") -> tuple[nx.DiGraph, list[str]]:
    """(import graph between the package's modules, collective calls outside comm*) of ``sources``,
    a mapping of module name to source text."""
    graph = nx.DiGraph()
    graph.add_nodes_from(sources)
    stray: list[str] = []
    for mod, text in sources.items():
        is_pkg = mod == package
        tree = ast.parse(text)
        dist_names = {"dist"}
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base_parts = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                    base = ".".join(base_parts + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                targets = [f"{base}.{a.name}" for a in node.names] + [base]
                if base == "torch":
                    dist_names |= {a.asname or a.name for a in node.names if a.name == "distributed"}
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
                dist_names |= {a.asname for a in node.names if a.name == "torch.distributed" and a.asname}
            for t in targets:
                if t in sources and t != mod and t != package:
                    graph.add_edge(mod, t)
                    break
            in_comm = any(part.startswith("comm") for part in mod.split(".")[1:])
            if in_comm:
                continue
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in COLLECTIVES:
                chain, v = [], node.func.value
                while isinstance(v, ast.Attribute):
                    chain.append(v.attr)
                    v = v.value
                if isinstance(v, ast.Name):
                    chain.append(v.id)
                chain.reverse()
                if chain and (chain[0] in dist_names or chain[:2] == ["torch", "distributed"]):
                    stray.append(f"{mod}:{node.lineno} {'.'.join(chain)}.{node.func.attr}")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr" \
                    and len(node.args) >= 2 and isinstance(node.args[0], ast.Name) and node.args[0].id in dist_names \
                    and isinstance(node.args[1], ast.Constant) and node.args[1].value in COLLECTIVES:
                stray.append(f"{mod}:{node.lineno} getattr(dist, {node.args[1].value!r})")
    return graph, stray


def _package_sources() -> dict[str, str]:
    return {_module_name(p, PKG): p.read_text() for p in sorted(PKG.rglob("*.py"))}


def test_zero3_has_no_import_cycle() -> None:
    graph, _ = analyse(_package_sources())
    assert graph.number_of_nodes() > 10
    cycles = [sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1]
    assert cycles == [], f"import cycles: {cycles}"


def test_only_the_communicator_calls_collectives() -> None:
    _, stray = analyse(_package_sources())
    assert stray == [], "collectives outside zero3/comm*: " + "; ".join(stray)


def test_the_checks_see_cycles_lazy_imports_and_stray_collectives() -> None:
    sources = {
        "zero3": "",
        "zero3.a": "from .b import x\n",
        "zero3.b": "def f():\n    from . import a\n",  # a lazy import still closes the cycle
        "zero3.c": "import torch.distributed as td\ntd.all_reduce(t)\n",
        "zero3.d": "import torch\ntorch.distributed.broadcast(t, 0)\n",
        "zero3.e": "from torch import distributed\nf = getattr(distributed, 'all_gather_single')\n",
        "zero3.comm.communicator": "import torch.distributed as dist\ndist.all_reduce(t)\n",
    }
    graph, stray = analyse(sources)
    assert [sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1] == [["zero3.a", "zero3.b"]]
    assert sorted(s.split(":")[0] for s in stray) == ["zero3.c", "zero3.d", "zero3.e"]
