"""Process-group life cycles run in fresh processes (tests/multiproc/_lifecycle_script.py): a
default group destroyed and made again between two engines, and a peer that dies mid-training."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import pytest

from test_clean_exit import ROOT, _free_port

pytestmark = pytest.mark.multiproc

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_lifecycle_script.py")


def _launch(case: str, world: int = 2, timeout: float = 120) -> list[dict | None]:
    """Each rank's JSON (None if it wrote none), after all exited."""
    with tempfile.TemporaryDirectory(prefix="zero3-lifecycle-") as out_dir:
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": str(world),
               "LIFECYCLE_PORT2": str(_free_port()),
               "LIFECYCLE": case, "LIFECYCLE_DIR": out_dir, "OMP_NUM_THREADS": "1",
               "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
        procs = [subprocess.Popen([sys.executable, SCRIPT], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for r in range(world)]
        errs = []
        for p in procs:
            try:
                errs.append(p.communicate(timeout=timeout)[1])
            except subprocess.TimeoutExpired:
                p.kill()
                errs.append(p.communicate()[1])
        out = []
        for r in range(world):
            path = os.path.join(out_dir, f"rank{r}.json")
            out.append(json.load(open(path)) if os.path.exists(path) else None)
        assert any(o is not None for o in out), "no rank wrote a result:\n" + "\n".join(e[-600:] for e in errs)
        return out


def test_an_engine_after_the_default_group_was_destroyed_and_made_again_trains_like_one_process():
    for r in _launch("reinit"):
        assert r is not None
        assert r["first"] == pytest.approx(r["reference"], rel=1e-6), r
        assert r["second"] == pytest.approx(r["reference"], rel=1e-6), r
        assert r["again"] == pytest.approx(r["continued"], rel=1e-6), r
        assert r["refused"] is not None and "process group (world size 2) was destroyed" in r["refused"], r


def test_a_peer_that_died_is_reported_as_a_closed_connection_not_a_timeout():
    rank0, rank1 = _launch("dead_peer")
    assert rank1 is None  # it exited before writing
    assert rank0 is not None and rank0["error"] is not None, rank0
    assert "a peer closed its connection (its process exited or died)" in rank0["error"], rank0["error"]
    assert "within collective_timeout" not in rank0["error"]
