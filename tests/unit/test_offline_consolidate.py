"""``python -m zero3.consolidate`` is offline: what it imports of zero3, read from the source, holds no
runtime, communicator or activation checkpointing (hooks), and the command runs.

The closure follows every zero3 import (lazy and ``TYPE_CHECKING`` ones included, as in
test_structure.py) and the parent packages an import runs, except zero3's own ``__init__``, which
imports the public API.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import networkx as nx
from test_structure import PKG, _module_name, _package_sources, analyse

ROOT = Path(__file__).resolve().parents[2]
OFFLINE = ("zero3.consolidate", "zero3.checkpoint.consolidate")


def _forbidden(module: str) -> bool:
    return module.split(".")[:2] in (["zero3", "runtime"], ["zero3", "comm"]) \
        or module == "zero3.activation.checkpointing"


def import_graph(sources: dict[str, str], packages: set[str], package: str = "zero3") -> nx.DiGraph:
    """`analyse`'s import graph, with the relative imports of sub-package ``__init__`` files (named in
    ``packages``) resolved inside their package: `analyse` resolves them as a module's, one level up."""
    graph, _ = analyse(sources, package)
    inits = {f"{m}.__init__": text for m, text in sources.items() if m in packages and m != package}
    as_modules, _ = analyse({**sources, **inits}, package)
    for init in inits:
        pkg = init[: -len(".__init__")]
        graph.remove_edges_from(list(graph.out_edges(pkg)))
        graph.add_edges_from((pkg, t) for t in as_modules.successors(init) if t != pkg)
    return graph


def import_closure(graph: nx.DiGraph, starts: tuple[str, ...], package: str = "zero3") -> set[str]:
    """Every module of ``graph`` that importing ``starts`` runs (their parent packages too, but not
    ``package`` itself)."""
    seen: set[str] = set()
    todo = list(starts)
    while todo:
        module = todo.pop()
        if module in seen or module == package:
            continue
        seen.add(module)
        todo += graph.successors(module)
        parts = module.split(".")
        todo += [p for p in (".".join(parts[:i]) for i in range(2, len(parts))) if p in graph]
    return seen


def test_the_offline_consolidation_imports_no_runtime_comm_or_activation_checkpointing() -> None:
    packages = {_module_name(p, PKG) for p in PKG.rglob("__init__.py")}
    closure = import_closure(import_graph(_package_sources(), packages), OFFLINE)
    assert {"zero3.checkpoint.reader", "zero3.checkpoint.format"} <= closure  # the closure is followed
    assert sorted(m for m in closure if _forbidden(m)) == []


def test_the_closure_follows_imports_and_parent_packages() -> None:
    sources = {
        "zero3": "from .runtime import hooks\n",  # the package's own __init__ is not followed
        "zero3.runtime": "",
        "zero3.runtime.hooks": "",
        "zero3.checkpoint": "from .format import X\n",
        "zero3.checkpoint.format": "",
        "zero3.checkpoint.consolidate": "def f():\n    from .reader import R\n",
        "zero3.checkpoint.reader": "from ..comm.communicator import Tag\n",
        "zero3.comm": "",
        "zero3.comm.communicator": "",
    }
    graph = import_graph(sources, {"zero3", "zero3.runtime", "zero3.checkpoint", "zero3.comm"})
    closure = import_closure(graph, ("zero3.checkpoint.consolidate",))
    assert closure == {"zero3.checkpoint.consolidate", "zero3.checkpoint", "zero3.checkpoint.format",
                       "zero3.checkpoint.reader", "zero3.comm", "zero3.comm.communicator"}
    assert sorted(m for m in closure if _forbidden(m)) == ["zero3.comm", "zero3.comm.communicator"]


def test_python_m_zero3_consolidate_help_runs() -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-m", "zero3.consolidate", "--help"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "usage: python -m zero3.consolidate" in done.stdout and "--include-optimizer" in done.stdout


def test_python_m_zero3_consolidate_prints_a_bad_checkpoint_as_one_line(tmp_path) -> None:
    """A checkpoint error was a traceback; now one line on stderr and exit status 1."""
    (tmp_path / "latest").write_text("\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-m", "zero3.consolidate", str(tmp_path), str(tmp_path / "o.pt")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith("python -m zero3.consolidate: error: ") and "latest: names no checkpoint" in done.stderr
    assert "--tag on the command line" in done.stderr
