"""examples/deepspeed_script.py, a script written for DeepSpeed with only its import changed, under
``torchrun --nproc-per-node 2``: it trains, checkpoints, saves the 16-bit model, and a second launch
resumed from the checkpoint gives the same losses and the same final model (issue 20)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.multiproc

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "deepspeed_script.py"
CONFIG = ROOT / "examples" / "deepspeed_config.json"
LAUNCH_TIMEOUT_S = 300


def torchrun(args: list[str], log: Path) -> None:
    """``python -m torch.distributed.run --standalone --nproc-per-node 2 SCRIPT ARGS`` (a free port of its own);
    fails with the log's tail."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                                 "--standalone", str(SCRIPT), *args], cwd=ROOT, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=LAUNCH_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the agent's session: the agent and its ranks
            raise
    if proc.returncode != 0:
        raise AssertionError(f"torchrun exited with {proc.returncode}:\n{log.read_text()[-4000:]}")


def test_the_script_differs_from_a_deepspeed_script_only_in_its_import():
    source = SCRIPT.read_text()
    assert "import zero3.deepspeed as deepspeed  # was: import deepspeed" in source
    assert len(re.findall(r"zero3", source)) == 2  # the docstring's "run on zero3" and the import


def test_deepspeed_script_trains_checkpoints_and_resumes_exactly_under_torchrun(tmp_path):
    save = tmp_path / "run"
    common = ["--deepspeed", "--deepspeed_config", str(CONFIG), "--save_dir", str(save), "--steps", "6",
              "--save_at", "3"]
    torchrun([*common, "--loss_file", str(tmp_path / "first.json")], tmp_path / "first.log")
    first = json.loads((tmp_path / "first.json").read_text())
    first_model = torch.load(save / "pytorch_model.bin")
    assert (save / "latest").read_text().strip() == "step3" and len(first) == 6
    log = (tmp_path / "first.log").read_text()
    assert "step 0 loss" in log and "lr 1.00e-04" in log  # the warm-up's first value at the first step

    torchrun([*common, "--resume", "--loss_file", str(tmp_path / "resumed.json")], tmp_path / "resumed.log")
    resumed = json.loads((tmp_path / "resumed.json").read_text())
    assert resumed == {k: v for k, v in first.items() if int(k) >= 3}
    resumed_model = torch.load(save / "pytorch_model.bin")
    assert list(resumed_model) == list(first_model) == ["body.0.weight", "body.0.bias", "body.2.weight",
                                                         "body.2.bias", "body.4.weight", "body.4.bias"]
    for key, value in first_model.items():
        assert value.dtype == torch.float32 and torch.equal(value, resumed_model[key]), key
