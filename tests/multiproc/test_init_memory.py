"""Building under zero3.Init never holds the whole model: peak memory is one module plus shards."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

pytestmark = pytest.mark.multiproc

SCRIPT = os.path.join(os.path.dirname(__file__), "_init_memory_script.py")
MIB = 1 << 20


def _peak_growth(mode: str, tmp_path) -> list[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(tmp_path / mode)
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")
    subprocess.run([sys.executable, SCRIPT, mode, str(port), out], check=True, env=env, timeout=240)
    return [int(open(f"{out}.{r}").read()) for r in range(2)]


def test_init_peak_is_one_module_plus_shards(tmp_path):
    layer = 2048 * 2048 * 4  # 16 MiB
    model = 8 * layer
    plain = _peak_growth("plain", tmp_path)
    zero = _peak_growth("zero3", tmp_path)
    for p in plain:
        assert p >= 0.9 * model, (p / MIB, "the plain build should hold the whole model")
    for z in zero:
        # shards (half the model) + one full module being built + a little slack
        assert z <= model / 2 + layer + 12 * MIB, (z / MIB, "MiB: Init held more than one module plus shards")
