"""The shape of the package, read from its source: no import cycle among zero3's modules, every import
between its layers allowed by `LAYERS`, ``torch.distributed`` imported only where `DISTRIBUTED` says,
and no ``torch.distributed`` collective called anywhere but the communicator (``zero3/comm*``).

Every import counts, lazy ones inside functions and ``TYPE_CHECKING`` blocks included, so a cycle
or a layer breach cannot hide behind a local import. Importing ``zero3.a.b`` runs the package
``zero3.a``'s ``__init__`` first, so the cycle check follows that edge too. The checks run on
synthetic sources too, so they can fail.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import networkx as nx

PKG = Path(__file__).resolve().parents[2] / "zero3"
COLLECTIVES = {
    "all_gather", "all_gather_into_tensor", "all_gather_object", "all_gather_single", "all_reduce",
    "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "broadcast", "broadcast_object_list",
    "gather", "gather_object", "scatter", "scatter_object_list", "reduce", "barrier", "monitored_barrier",
    "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv", "batch_isend_irecv",
}


@dataclass(frozen=True)
class Layer:
    """What the modules under one prefix may import from zero3: anything under a prefix in
    ``may_import`` (and under their own prefix) except what falls under a longer prefix in ``except_``."""

    may_import: frozenset[str]
    except_: frozenset[str] = frozenset()


def _layer(*may_import: str, except_: tuple[str, ...] = ()) -> Layer:
    return Layer(frozenset(f"zero3.{m}" for m in may_import), frozenset(f"zero3.{m}" for m in except_))


_BASE = ("errors", "metrics")
_BELOW_RUNTIME = (*_BASE, "config", "partition", "planning", "comm", "offload", "optim")
ENTRY = ("zero3", "zero3.engine", "zero3.accessors", "zero3.memory", "zero3.plan", "zero3.consolidate",
         "zero3.deepspeed")
"""Entry modules: the public API and the CLIs, above every layer; they may import anything."""

LAYERS: dict[str, Layer] = {
    "zero3.errors": _layer(),
    "zero3.metrics": _layer(),
    "zero3.partition": _layer(*_BASE),
    "zero3.planning": _layer("errors"),
    "zero3.config": _layer("errors"),  # DeepSpeed's key translation included (config/deepspeed.py)
    "zero3.comm": _layer(*_BASE, "config", "partition"),
    "zero3.offload": _layer(*_BASE, "config", "partition", "planning"),
    "zero3.optim": _layer(*_BASE, "config", "partition", "comm", "offload"),
    "zero3.runtime": _layer(*_BELOW_RUNTIME),
    # the RNG tracker is what checkpoint may take from activation, so it stays free of the hooks.
    "zero3.activation.rng": _layer(*_BASE, "config", "comm"),
    "zero3.activation": _layer(*_BELOW_RUNTIME, "runtime"),
    "zero3.checkpoint": _layer(*_BELOW_RUNTIME, "runtime", "activation.rng", except_=("runtime.hooks",)),
}
DISTRIBUTED = ("zero3.comm", *ENTRY)
"""The only modules that may import ``torch.distributed`` (or reach it as ``torch.distributed``)."""


@dataclass(frozen=True)
class Import:
    module: str
    line: int
    target: str  # a module of the package, or "torch.distributed"


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _is_package(mod: str, sources: dict[str, str], package: str) -> bool:
    return mod == package or any(_under(other, mod) and other != mod for other in sources)


def imports(sources: dict[str, str], package: str = "zero3") -> list[Import]:
    """Every import in ``sources`` (module name -> source text) of one of the package's modules or of
    ``torch.distributed``, lazy and ``TYPE_CHECKING`` ones included."""
    found: list[Import] = []
    for mod, text in sources.items():
        is_pkg = _is_package(mod, sources, package)
        torch_names: set[str] = set()
        for node in ast.walk(ast.parse(text)):
            names: list[str] = []
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base_parts = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                    base = ".".join(base_parts + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    names.append(sub if sub in sources or sub == "torch.distributed" else base)
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
                torch_names |= {a.asname or "torch" for a in node.names if a.name == "torch"}
            elif isinstance(node, ast.Attribute) and node.attr == "distributed" \
                    and isinstance(node.value, ast.Name) and node.value.id in torch_names | {"torch"}:
                found.append(Import(mod, node.lineno, "torch.distributed"))
            for name in names:
                if _under(name, "torch.distributed"):
                    found.append(Import(mod, node.lineno, "torch.distributed"))
                    continue
                while name and name not in sources:  # `import zero3.a.b.X` names the module zero3.a.b
                    name = name.rpartition(".")[0]
                if name and name != mod:
                    found.append(Import(mod, node.lineno, name))
    return sorted(set(found), key=lambda i: (i.module, i.line, i.target))


def _parents(name: str, package: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(2, len(parts))] if name.startswith(package + ".") else []


def analyse(sources: dict[str, str], package: str = "zero3") -> tuple[nx.DiGraph, list[str]]:
    """(import graph between the package's modules, collective calls outside comm*) of ``sources``,
    a mapping of module name to source text."""
    graph = nx.DiGraph()
    graph.add_nodes_from(sources)
    for imp in imports(sources, package):
        if imp.target in sources and imp.target != package:
            for target in (*_parents(imp.target, package), imp.target):
                if target != imp.module and not _under(imp.module, target):
                    graph.add_edge(imp.module, target)
    stray: list[str] = []
    for mod, text in sources.items():
        tree = ast.parse(text)
        dist_names = {"dist"}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "torch":
                dist_names |= {a.asname or a.name for a in node.names if a.name == "distributed"}
            elif isinstance(node, ast.Import):
                dist_names |= {a.asname for a in node.names if a.name == "torch.distributed" and a.asname}
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


def _longest(name: str, prefixes: set[str] | frozenset[str] | tuple[str, ...]) -> str | None:
    """The longest of ``prefixes`` that ``name`` is under; the root package (no dot) only names itself."""
    return max((p for p in prefixes if _under(name, p) and ("." in p or p == name)), key=len, default=None)


def layer_violations(sources: dict[str, str], layers: dict[str, Layer] = LAYERS,
                     entry: tuple[str, ...] = ENTRY, distributed: tuple[str, ...] = DISTRIBUTED,
                     package: str = "zero3") -> list[tuple[Import, str]]:
    """(import, the rule it breaks) for every import in ``sources`` that ``layers`` and ``distributed``
    do not allow; a module under no layer and no entry prefix is itself reported."""
    found: list[tuple[Import, str]] = []
    for mod in sources:
        if mod not in entry and _longest(mod, layers) is None and _longest(mod, entry) is None:
            found.append((Import(mod, 0, ""), f"{mod} is in no layer of LAYERS and not in ENTRY"))
    for imp in imports(sources, package):
        if imp.target == "torch.distributed":
            if _longest(imp.module, distributed) is None:
                found.append((imp, f"only {', '.join(sorted(distributed))} may import torch.distributed"))
            continue
        own = _longest(imp.module, layers)
        if own is None or len(_longest(imp.module, entry) or "") > len(own):
            continue  # an entry module, or a layer's module that the entry list singles out
        rule = layers[own]
        allowed = rule.may_import | {own}
        if _longest(imp.target, allowed) is None or \
                len(_longest(imp.target, rule.except_) or "") > len(_longest(imp.target, allowed) or ""):
            found.append((imp, f"{own} may import {', '.join(sorted(allowed))}"
                          + (f" except {', '.join(sorted(rule.except_))}" if rule.except_ else "")))
    return found


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


def test_every_import_keeps_to_the_layers() -> None:
    found = layer_violations(_package_sources())
    breaches = [f"{imp.module}:{imp.line} imports {imp.target}: {rule}" for imp, rule in found]
    assert breaches == [], "imports across layers that LAYERS does not allow:\n" + "\n".join(breaches)


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


def test_the_cycle_check_follows_a_package_init() -> None:
    sources = {
        "zero3": "",
        "zero3.config": "from zero3.deepspeed.config import translate\n",
        "zero3.deepspeed": "from ..engine import Engine\n",
        "zero3.deepspeed.config": "from ..errors import ZeroConfigError\n",
        "zero3.engine": "from .config import ZeroConfig\n",
        "zero3.errors": "",
    }
    graph, _ = analyse(sources)
    cycles = [sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1]
    assert cycles == [["zero3.config", "zero3.deepspeed", "zero3.engine"]]


def test_the_layer_check_sees_planted_breaches() -> None:
    sources = {
        "zero3": "from .engine import initialize\n",
        "zero3.engine": "import torch.distributed as dist\nfrom .runtime.hooks import ModuleHooks\n",
        "zero3.errors": "",
        "zero3.planning": "",
        "zero3.planning.trace": "def f():\n    import torch\n    return torch.distributed.get_rank()\n",
        "zero3.planning.schedule": "from __future__ import annotations\nfrom typing import TYPE_CHECKING\n"
                                   "if TYPE_CHECKING:\n    from torch import distributed\n",
        "zero3.comm": "",
        "zero3.comm.communicator": "import torch.distributed as dist\nfrom ..errors import ZeroStateError\n"
                                   "def f():\n    from zero3.runtime import context\n",
        "zero3.runtime": "",
        "zero3.runtime.context": "from ..comm.communicator import Communicator\n",
        "zero3.runtime.hooks": "from .context import RuntimeContext\n",
        "zero3.activation": "",
        "zero3.activation.rng": "",
        "zero3.activation.checkpointing": "from ..runtime.hooks import checkpoint_forward\n",
        "zero3.checkpoint": "",
        "zero3.checkpoint.checkpoint": "from ..runtime.context import RuntimeContext\n"
                                       "from ..activation.rng import get_cuda_rng_tracker\n"
                                       "from ..activation import checkpointing\n"
                                       "from zero3.runtime import hooks\n",
        "zero3.stray": "",
    }
    found = {(imp.module, imp.line, imp.target): rule for imp, rule in layer_violations(sources)}
    assert sorted(found) == [
        ("zero3.checkpoint.checkpoint", 3, "zero3.activation.checkpointing"),
        ("zero3.checkpoint.checkpoint", 4, "zero3.runtime.hooks"),
        ("zero3.comm.communicator", 4, "zero3.runtime.context"),
        ("zero3.planning.schedule", 4, "torch.distributed"),
        ("zero3.planning.trace", 3, "torch.distributed"),
        ("zero3.stray", 0, ""),
    ]
    assert "zero3.comm may import" in found[("zero3.comm.communicator", 4, "zero3.runtime.context")]
    assert "except zero3.runtime.hooks" in found[("zero3.checkpoint.checkpoint", 4, "zero3.runtime.hooks")]
    assert "may import torch.distributed" in found[("zero3.planning.trace", 3, "torch.distributed")]
