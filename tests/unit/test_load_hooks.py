"""The model's own load_state_dict hooks run under zero3.pretrained.load_state_dict as torch runs them
(checkpoint/load_hooks.py). Probe 29D: a pre-hook renaming a legacy checkpoint's keys (the usual shim)
was skipped, so strict=False loaded nothing and only reported every key missing or unexpected, and no
post-hook ran; torch's own load_state_dict, which zero3 names as the way, refuses partitioned weights."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zero3
from zero3.errors import ZeroStateError


class _Legacy(nn.Sequential):
    """Was saved with an attribute ``fc1``; a pre-hook renames ``fc1.*`` to ``0.*``."""

    def __init__(self) -> None:
        super().__init__(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))
        self.seen: list[tuple[list[str], list[str]]] = []
        self.register_load_state_dict_pre_hook(self._rename)
        self.register_load_state_dict_post_hook(self._after)

    @staticmethod
    def _rename(module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        for key in [k for k in state_dict if k.startswith(prefix + "fc1.")]:
            state_dict[prefix + "0." + key[len(prefix + "fc1."):]] = state_dict.pop(key)

    @staticmethod
    def _after(module, keys):
        module.seen.append((list(keys.missing_keys), list(keys.unexpected_keys)))


def _legacy_state_dict() -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    sd = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2)).state_dict()
    return {("fc1." + k[2:] if k.startswith("0.") else k): v for k, v in sd.items()}


@pytest.mark.parametrize("strict", [True, False])
def test_a_renaming_pre_hook_and_a_post_hook_run_as_in_torch(strict):
    sd = _legacy_state_dict()
    torch.manual_seed(0)
    ref = _Legacy()
    ref.load_state_dict(sd, strict=strict)
    torch.manual_seed(0)
    model = _Legacy()
    zero3.initialize(model, None, {"param_persistence_threshold": 0})
    result = zero3.pretrained.load_state_dict(model, sd, strict=strict)
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert "fc1.weight" in sd  # the caller's dict is left as it was
    for name, p in ref.named_parameters():
        torch.testing.assert_close(zero3.safe_get_full_fp32_param(model.get_parameter(name)), p.detach(),
                                   rtol=0, atol=0)
    assert model.seen == ref.seen == [([], [])]


def test_a_file_is_refused_when_the_model_has_a_pre_hook(tmp_path):
    path = tmp_path / "legacy.pt"
    torch.save(_legacy_state_dict(), path)
    model = _Legacy()
    zero3.initialize(model, None, {"param_persistence_threshold": 0})
    before = zero3.safe_get_full_fp32_param(model[0].weight)
    with pytest.raises(ZeroStateError, match=r"load_state_dict pre-hooks.*Load the file into a dict"):
        zero3.pretrained.load_state_dict(model, str(path))
    assert torch.equal(zero3.safe_get_full_fp32_param(model[0].weight), before)
    assert model.seen == []
