"""examples/hf_causal_lm.py end to end on 2 gloo ranks (issue 22): it loads with `zero3.from_pretrained`,
fine-tunes, generates, saves with `engine.save_pretrained` into sharded files, and transformers'
``from_pretrained`` of that directory generates the same text (the script itself raises otherwise)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

pytestmark = pytest.mark.multiproc

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "hf_causal_lm.py"
DOC = ROOT / "docs" / "huggingface.md"
TIMEOUT_S = 300


def test_the_example_uses_the_streaming_load_and_save():
    source = SCRIPT.read_text()
    assert "zero3.from_pretrained(AutoModelForCausalLM" in source and "engine.save_pretrained(" in source
    assert "consolidated_state_dict" not in source and "load_state_dict" not in source


def test_the_walk_through_quotes_the_script():
    """Every line of the python excerpts in docs/huggingface.md's walk-through is a line of the script."""
    doc = DOC.read_text()
    walk = doc[doc.index("## Walk-through"):doc.index("### What memory each step needs")]
    script = {line.strip() for line in SCRIPT.read_text().splitlines()}
    quoted = [line.strip() for block in re.findall(r"```python\n(.*?)```", walk, re.S) for line in block.splitlines()]
    assert len(quoted) > 10
    assert [q for q in quoted if q not in script and q != "..."] == []


def test_the_example_runs_end_to_end_and_the_saved_directory_generates_the_same_text(tmp_path):
    out = tmp_path / "finetuned"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "--steps", "10", "--pretrained", str(tmp_path / "pre"),
                             "--out", str(out)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the script's session: it and the ranks it spawned
        raise
    assert proc.returncode == 0, log[-4000:]
    assert "generates the same text: True" in log, log[-4000:]
    for rank in (0, 1):
        assert f"2. rank {rank}: loaded LlamaForCausalLM (106,816 parameters; missing [], unexpected []); " \
               "holds 213,632 bytes of parameter shards + 0 of persistent parameters (whole on every rank) of " \
               "427,264 parameter bytes" in log
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and all((out / f).is_file() for f in files)  # split by the small --max-shard-size
    assert not (out / "model.safetensors").exists()
