"""torch's flight recorder is off by default where zero3 decides (issue 19, item 10).

Its ring of recorded collectives fragments glibc's heap under zero3's many collectives per step
(process_group.py [Note: the flight recorder and resident memory]; bench_soak.py measures the RSS).
Each case runs in a fresh interpreter, since the variable only matters before the first group.
"""

from __future__ import annotations

import os
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(code: str, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE",
                                                               "RANK", "WORLD_SIZE")}
    out = subprocess.run([sys.executable, "-c", code], env={**clean, **env, "PYTHONPATH": ROOT},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()


READ = "import os; import zero3; print(os.environ.get('TORCH_FR_BUFFER_SIZE'))"


def test_importing_zero3_in_a_cpu_build_turns_the_recorder_off():
    expected = "0" if torch.version.cuda is None and getattr(torch.version, "hip", None) is None else "None"
    assert _run(READ) == expected


def test_a_users_setting_wins_under_either_name():
    assert _run(READ, TORCH_FR_BUFFER_SIZE="2000") == "2000"
    assert _run(READ, TORCH_NCCL_TRACE_BUFFER_SIZE="500") == "None"


def test_a_group_made_before_importing_zero3_is_left_alone_and_warned_about():
    code = ("import os, logging, torch.distributed as dist\n"
            "dist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=1)\n"
            "logging.basicConfig(level=logging.WARNING)\n"
            "import zero3, torch\n"
            "print(os.environ.get('TORCH_FR_BUFFER_SIZE'))\n"
            "zero3.initialize(torch.nn.Linear(4, 4), None, {})\n"
            "dist.destroy_process_group()\n")
    clean = {k: v for k, v in os.environ.items() if k not in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")}
    out = subprocess.run([sys.executable, "-c", code], env={**clean, "PYTHONPATH": ROOT}, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "None"
    assert "flight recorder may be on" in out.stderr


def test_init_distributed_turns_it_off_for_the_gloo_group_it_makes():
    code = ("import os, torch.distributed as dist\n"
            "from zero3.comm import process_group as pg\n"
            "os.environ.pop('TORCH_FR_BUFFER_SIZE', None)\n"
            "pg.init_distributed(backend='gloo', verbose=False)\n"
            "print(os.environ.get('TORCH_FR_BUFFER_SIZE'), pg.flight_recorder_may_be_on())\n"
            "dist.destroy_process_group()\n")
    assert _run(code) == "0 False"
