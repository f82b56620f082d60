"""zero3.pretrained.load_state_dict does not run the model's own load_state_dict hooks
(checkpoint/load_hooks.py), and names one that is not torch's in a WARNING. Probe 29D: a pre-hook
renaming a legacy checkpoint's keys was skipped without a word (strict=False loaded nothing). Review
29Z1: running them as zero3 first did differed from torch five ways and refused files that load."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import zero3
import zero3.config.sections as sections


class _Legacy(nn.Sequential):
    """Saved with an attribute ``fc1``; a pre-hook renames ``fc1.*`` to ``0.*`` (torch runs it)."""

    def __init__(self) -> None:
        super().__init__(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))
        self.register_load_state_dict_pre_hook(self._rename)

    @staticmethod
    def _rename(module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        for key in [k for k in state_dict if k.startswith(prefix + "fc1.")]:
            state_dict[prefix + "0." + key[len(prefix + "fc1."):]] = state_dict.pop(key)


def _legacy_state_dict() -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    sd = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2)).state_dict()
    return {("fc1." + k[2:] if k.startswith("0.") else k): v for k, v in sd.items()}


def test_a_users_hook_is_not_run_and_is_named_once(caplog):
    sections._WARNED.clear()
    model = _Legacy()
    zero3.initialize(model, None, {"param_persistence_threshold": 0})
    with caplog.at_level(logging.WARNING, logger="zero3"):
        result = zero3.pretrained.load_state_dict(model, _legacy_state_dict(), strict=False)
        zero3.pretrained.load_state_dict(model, _legacy_state_dict(), strict=False)
    assert result.missing_keys == ["0.weight", "0.bias"] and result.unexpected_keys == ["fc1.weight", "fc1.bias"]
    said = [r.getMessage() for r in caplog.records if "does not run load_state_dict hooks" in r.getMessage()]
    assert len(said) == 1 and "the pre-hook _Legacy._rename on the model (_Legacy) is skipped" in said[0], said


class _NoRepr:
    """A hook object whose repr raises: naming it must not fail the load (review 29Z2)."""

    def __call__(self, *args):
        pass

    def __repr__(self):
        raise RuntimeError("repr not available")


def test_torchs_checkpoint_wrapper_hook_and_an_odd_hook_object_are_named_and_loads_go_on(caplog):
    """checkpoint_wrapper's pre-hook adds its prefix back to the keys torch's state_dict strips: not
    run, so its keys are missing and unexpected; it was skipped without a word (review 29Z2)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    sections._WARNED.clear()
    torch.manual_seed(0)
    model = nn.Sequential(checkpoint_wrapper(nn.Linear(4, 6)), nn.ReLU(), nn.Linear(6, 2))
    sd = {k: v.clone() for k, v in model.state_dict().items()}  # the wrapper's prefix stripped
    model.register_load_state_dict_post_hook(_NoRepr())
    zero3.initialize(model, None, {"param_persistence_threshold": 0})
    with caplog.at_level(logging.WARNING, logger="zero3"):
        result = zero3.pretrained.load_state_dict(model, sd, strict=False)
    assert result.unexpected_keys == ["0.weight", "0.bias"]
    said = " | ".join(r.getMessage() for r in caplog.records)
    assert "the pre-hook " in said and "on 0 (CheckpointWrapper) is skipped" in said, said
    assert "the post-hook _NoRepr on the model (Sequential) is skipped" in said, said


def test_torchs_own_compatibility_hooks_load_a_file_without_a_word(tmp_path, caplog):
    """weight_norm's parametrization carries torch's hook for old weight_g/weight_v keys: the model's
    own checkpoint loads from a file, read slice by slice, as before (review 29Z1: it was refused)."""
    sections._WARNED.clear()
    torch.manual_seed(0)
    ref = nn.Sequential(nn.utils.parametrizations.weight_norm(nn.Conv1d(2, 4, 3)), nn.Linear(2, 2))
    path = tmp_path / "model.pt"
    torch.save(ref.state_dict(), path)
    torch.manual_seed(1)
    model = nn.Sequential(nn.utils.parametrizations.weight_norm(nn.Conv1d(2, 4, 3)), nn.Linear(2, 2))
    zero3.initialize(model, None, {"param_persistence_threshold": 0})
    with caplog.at_level(logging.WARNING, logger="zero3"):
        assert zero3.pretrained.load_state_dict(model, str(path)) == ([], [])
    assert not [r for r in caplog.records if "load_state_dict hooks" in r.getMessage()]
    for name, p in ref.named_parameters():
        assert torch.equal(zero3.safe_get_full_fp32_param(model.get_parameter(name)), p.detach())


@pytest.mark.parametrize("strict", [True, False])
def test_renamed_first_the_legacy_checkpoint_loads_as_torch_loads_it(strict):
    sd = _legacy_state_dict()
    ref = _Legacy()
    ref.load_state_dict(sd, strict=strict)
    model = _Legacy()
    zero3.initialize(model, None, {"param_persistence_threshold": 0})
    renamed = {("0." + k[4:] if k.startswith("fc1.") else k): v for k, v in sd.items()}
    assert zero3.pretrained.load_state_dict(model, renamed, strict=strict) == ([], [])
    for name, p in ref.named_parameters():
        assert torch.equal(zero3.safe_get_full_fp32_param(model.get_parameter(name)), p.detach())
