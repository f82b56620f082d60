"""``engine.save_pretrained`` of a PEFT model: the adapter as PEFT writes it (its own
``save_pretrained``, given the trained adapter weights), or after ``merge_and_unload()`` the merged
base model as transformers writes it. Before, it wrote the wrapper's keys under the wrapper's class
name: a directory that loaded with every weight freshly initialised. PEFT is not a test dependency:
a stand-in with PEFT's API runs everywhere, the real library where it is installed."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

import zero3


class _Lora(nn.Module):
    """A tuner layer as PEFT's: the frozen ``base_layer`` plus a trainable low-rank update."""

    active_adapters = ["default"]

    def __init__(self, base: nn.Linear) -> None:
        super().__init__()
        self.base_layer = base
        self.lora_A = nn.Linear(base.in_features, 2, bias=False)
        self.lora_B = nn.Linear(2, base.out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x) + self.lora_B(self.lora_A(x))


class _PeftStandIn(nn.Module):
    """``peft.PeftModel``'s API as zero3 meets it: ``peft_config``, ``get_base_model`` and a
    ``save_pretrained(dir, state_dict=...)`` that keeps the adapter's entries."""

    def __init__(self, base: nn.Sequential) -> None:
        super().__init__()
        self.base_model = base
        base.requires_grad_(False)
        base[0] = _Lora(base[0])
        self.peft_config = {"default": object()}

    def get_base_model(self) -> nn.Module:
        return self.base_model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_model(x)

    def save_pretrained(self, directory: str, state_dict: dict, safe_serialization: bool = True) -> None:
        import os
        os.makedirs(directory, exist_ok=True)
        torch.save({k: v for k, v in state_dict.items() if "lora_" in k}, os.path.join(directory, "adapter.pt"))


def _base() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _train(model: nn.Module, engine: zero3.Engine | None, steps: int = 3) -> None:
    opt = None if engine is not None else torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                                           lr=1e-2, eps=1e-6)
    for i in range(steps):
        loss = model(torch.randn(4, 6, generator=torch.Generator().manual_seed(i))).pow(2).mean()
        if engine is not None:
            engine.backward(loss)
            engine.step()
        else:
            loss.backward()
            opt.step()
            opt.zero_grad()


def _pair() -> tuple[nn.Module, nn.Module, zero3.Engine]:
    torch.manual_seed(1)
    ref = _PeftStandIn(_base())
    torch.manual_seed(1)
    with zero3.Init():
        model = _PeftStandIn(_base())
    engine = zero3.initialize(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2,
                                                       eps=1e-6), {"param_persistence_threshold": 0})
    return ref, model, engine


def test_a_peft_model_saves_its_trained_adapter_through_peft(tmp_path):
    ref, model, engine = _pair()
    _train(ref, None)
    _train(model, engine)
    engine.save_pretrained(tmp_path)
    saved = torch.load(tmp_path / "adapter.pt")
    want = {n: p for n, p in ref.named_parameters() if "lora_" in n}
    assert sorted(saved) == sorted(want)
    for name, p in want.items():
        torch.testing.assert_close(saved[name], p.detach(), rtol=1e-5, atol=1e-6, msg=name)
    assert not (tmp_path / "model.safetensors").exists()
    assert all(zero3.is_partitioned(p) and p.ds_status.name == "NOT_AVAILABLE" for p in model.parameters())


def test_a_merged_peft_model_saves_the_base_model_under_its_own_keys(tmp_path):
    ref, model, engine = _pair()
    _train(ref, None)
    _train(model, engine)
    for m in (ref, model):  # merge_and_unload: the update goes into the base weight, the tuner layer goes
        layer = m.base_model[0]
        with zero3.GatheredParameters(list(layer.parameters()), modifier_rank=0):
            with torch.no_grad():
                layer.base_layer.weight += layer.lora_B.weight @ layer.lora_A.weight
        m.base_model[0] = layer.base_layer
    engine.save_pretrained(tmp_path)
    from safetensors.torch import load_file
    saved = load_file(tmp_path / "model.safetensors")
    want = ref.get_base_model().state_dict()
    assert sorted(saved) == sorted(want)  # "0.weight", not "base_model.0.base_layer.weight"
    for name, t in want.items():
        torch.testing.assert_close(saved[name], t, rtol=1e-5, atol=1e-6, msg=name)


def test_the_real_peft_library_reloads_the_adapter_zero3_saved(tmp_path):
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=64, tie_word_embeddings=False)
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False,
                           modules_to_save=["lm_head"])
    torch.manual_seed(0)
    with zero3.Init():
        model = peft.get_peft_model(transformers.LlamaForCausalLM(cfg), copy.deepcopy(lora))
    engine = zero3.initialize(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2),
                              {"param_persistence_threshold": 0})
    x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        engine.backward(engine(input_ids=x, labels=x).loss)
        engine.step()
    engine.eval()
    with torch.no_grad():
        want = engine(input_ids=x).logits
    engine.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "adapter_config.json").read_text())["r"] == 4
    torch.manual_seed(0)
    loaded = peft.PeftModel.from_pretrained(transformers.LlamaForCausalLM(cfg), str(tmp_path)).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=x).logits, want, rtol=1e-5, atol=1e-6)
