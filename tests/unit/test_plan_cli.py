"""``python -m zero3.plan``: the commands its help shows run, and an all-persistent model is a plan."""

from __future__ import annotations

import io
import os
import re
from contextlib import redirect_stdout

import pytest
import torch
from gpt import GPT, GPTConfig
from torch import nn

import zero3
from zero3.errors import ZeroConfigError
from zero3.plan import main, predict, record_trace

GPT_FILE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "gpt.py")


def _run(*argv: str) -> dict[str, str]:
    out = io.StringIO()
    with redirect_stdout(out):
        assert main(list(argv)) == 0
    rows = {}
    for line in out.getvalue().splitlines():
        key, _, value = line.rpartition("  ")
        rows[key.strip()] = value.strip()
    return rows


def test_an_all_persistent_model_predicts_no_gathers_and_every_element_resident() -> None:
    rows = _run("--model", f"{GPT_FILE}:GPT", "--model-arg", "GPTConfig(n_layer=12)", "--input-shape", "8,64",
                "--config", '{"max_live_parameters": 2e7}', "--world-size", "8")
    numel = sum(p.numel() for p in GPT(GPTConfig(n_layer=12)).parameters())
    assert rows["all-gathers per step"] == "0"
    assert rows["persistent elements (always gathered)"] == f"{numel:,}"


def test_the_help_example_with_threshold_zero_predicts_gathers_under_the_cap() -> None:
    rows = _run("--model", f"{GPT_FILE}:GPT", "--model-arg", "GPTConfig(n_layer=12)", "--input-shape", "8,64",
                "--config", '{"param_persistence_threshold": 0, "max_live_parameters": 2e4}', "--world-size", "8")
    assert int(rows["all-gathers per step"].replace(",", "")) > 0
    assert 0 < int(rows["peak gathered parameter elements"].replace(",", "")) <= 20_000
    assert rows["persistent elements (always gathered)"] == "0"


def test_a_config_given_as_text_is_read_as_a_config_file_is() -> None:
    """``--config '<JSON>'`` took json.loads: a comment raised json's traceback and a key given twice was
    taken silently (review 32RB); it reads as a file does now."""
    args = ("--model", f"{GPT_FILE}:GPT", "--model-arg", "GPTConfig(n_layer=2)", "--input-shape", "2,16")
    rows = _run(*args, "--config", '{"param_persistence_threshold": 0, /* all gathered */ "max_live_parameters": 2e4,}')
    assert rows["persistent elements (always gathered)"] == "0"
    with pytest.raises(ZeroConfigError, match="--config: the key 'dtype' is given twice"):
        main([*args, "--config", '{"dtype": "bf16", "dtype": "fp16"}'])


def test_a_config_text_longer_than_a_file_name_is_read() -> None:
    """Review 32RE: ``Path.exists`` raised ENAMETOOLONG on a 335-character config text (Python 3.11)."""
    args = ("--model", f"{GPT_FILE}:GPT", "--model-arg", "GPTConfig(n_layer=2)", "--input-shape", "2,16")
    text = '{"param_persistence_threshold": 0, "max_live_parameters": 2e4, ' + '"reduce_bucket_size": 5e8, ' * 12 + \
        '"prefetch_bucket_size": 5e7}'
    assert len(text) > 300
    with pytest.raises(ZeroConfigError, match="given twice"):  # read as JSON: its repeated key is named
        main([*args, "--config", text])


class _PredFirst(nn.Module):
    """Returns (predictions, logits): the first output needs no gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.e, self.a, self.b = nn.Embedding(100, 64), nn.Linear(64, 64), nn.Linear(64, 100)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.b(self.a(self.e(x)))
        return logits.argmax(-1), logits


def _measured(config: dict, steps: int = 3) -> dict:
    """What a real run at world size 1 measures per step once its first step is planned."""
    torch.manual_seed(0)
    model = _PredFirst()
    engine = zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), config)
    for _ in range(steps):
        engine.backward(nn.functional.cross_entropy(engine(torch.zeros(2, 8, dtype=torch.long))[1].flatten(0, 1),
                                                    torch.zeros(16, dtype=torch.long)))
        engine.step()
    m = engine.last_step_metrics
    engine.remove_hooks()
    return {"gathers": m.allgather_calls, "numel": m.allgather_numel}


@pytest.mark.parametrize("config", [
    {"param_persistence_threshold": 100, "max_live_parameters": 10_000},
    {"memory_budget": 60_000},
    {"memory_budget": 100_000},
])
def test_a_prediction_equals_what_a_training_step_measures(config) -> None:
    """Probe 35E: the default loss took the model's first output, an argmax, and predicted the forward
    alone (3 gathers of 16,896 elements against a step's 5 of 27,392), silently; and ``memory_budget``
    was ignored, the default budgets planned (a predicted peak above the budget itself)."""
    with torch.device("meta"):
        model = _PredFirst()
    s = predict(record_trace(model, lambda: (torch.zeros(2, 8, dtype=torch.long, device="meta"),), config),
                config).schedule.stats
    assert {"gathers": s.num_allgathers, "numel": s.allgather_numel} == _measured(config)
    if "memory_budget" in config:
        assert s.peak_live_bytes <= config["memory_budget"]


class _FrozenTable(nn.Module):
    """The largest parameter, a table, frozen: the reduce bucket is sized by the largest trainable one."""

    def __init__(self) -> None:
        super().__init__()
        self.e, self.a, self.b = nn.Embedding(1000, 64), nn.Linear(64, 64), nn.Linear(64, 8)
        self.e.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(self.e(x)))


def test_a_prediction_under_memory_budget_counts_trainable_parameters_only() -> None:
    """Review 35R2: the largest parameter was counted as a gradient piece although frozen, and budgets a
    run trains with were refused (a reduce bucket of 256,000 bytes against the run's 31,250 elements)."""
    config = {"memory_budget": 400_000}
    with torch.device("meta"):
        model = _FrozenTable()
    s = predict(record_trace(model, lambda: (torch.zeros(2, 8, dtype=torch.long, device="meta"),), config),
                config).schedule.stats
    torch.manual_seed(0)
    real = _FrozenTable()
    engine = zero3.initialize(real, torch.optim.SGD([p for p in real.parameters() if p.requires_grad], lr=0.1), config)
    for _ in range(3):
        engine.backward(engine(torch.zeros(2, 8, dtype=torch.long)).sum())
        engine.step()
    m = engine.last_step_metrics
    engine.remove_hooks()
    assert (s.num_allgathers, s.allgather_numel) == (m.allgather_calls, m.allgather_numel)


def test_a_launchers_environment_is_not_read_by_the_dry_run(monkeypatch) -> None:
    """Probe 36K: run where a launcher's RANK/WORLD_SIZE were inherited (a subprocess of a torchrun job),
    the dry run's initialize made a default group from them and waited for ranks that never came."""
    import zero3.comm.process_group as process_group

    def would_wait(*args, **kwargs):
        raise AssertionError("the dry run made a process group from the environment (it would wait for rank 1)")

    monkeypatch.setattr(process_group, "init_distributed", would_wait)
    for key, value in {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(key, value)
    rows = _run("--model", f"{GPT_FILE}:GPT", "--model-arg", "GPTConfig(n_layer=2)", "--input-shape", "2,16",
                "--config", '{"param_persistence_threshold": 0}', "--world-size", "2")
    assert int(rows["all-gathers per step"].replace(",", "")) > 0
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"]) == ("0", "2")  # given back


def test_a_prediction_under_memory_budget_follows_the_backend_and_world_size() -> None:
    """The budget counts a reduce bucket as what it holds on the transport "auto" resolves to: p2p on
    gloo (1.5x its gradients on 2 ranks), reduce-scatter on NCCL (2.5x); nothing at world size 1
    (review 39R1: a prediction for an NCCL run planned gloo's room)."""
    with torch.device("meta"):
        model = _FrozenTable()
    trace = record_trace(model, lambda: (torch.zeros(2, 8, dtype=torch.long, device="meta"),), {})
    bucket = {}
    for world, backend in [(1, "gloo"), (2, "gloo"), (2, "nccl")]:
        with pytest.raises(ZeroConfigError, match="give at least") as refused:
            predict(trace, {"memory_budget": 1000}, world, backend)
        bucket[(world, backend)] = int(re.search(r"reduce bucket \(([\d,]+)\)", str(refused.value))[1].replace(",", ""))
    assert bucket[(1, "gloo")] == 0
    assert 1.5 * 4 * 64 * 64 <= bucket[(2, "gloo")] < 2.5 * 4 * 64 * 64 <= bucket[(2, "nccl")], bucket


def test_an_unknown_backend_is_refused_by_name() -> None:
    """Review 39R2: a typo planned NCCL's larger account silently."""
    with torch.device("meta"):
        model = _FrozenTable()
    trace = record_trace(model, lambda: (torch.zeros(2, 8, dtype=torch.long, device="meta"),), {})
    with pytest.raises(ValueError, match="predict\\(backend='glooo'\\): one of gloo, nccl"):
        predict(trace, {"memory_budget": 10**6}, 2, "glooo")
    with pytest.raises(SystemExit):
        main(["--trace", "x.json", "--backend", "Gloo"])
