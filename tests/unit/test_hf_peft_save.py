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
    """A tuner layer as PEFT's: the frozen ``base_layer`` plus, per adapter, a low-rank update keyed by
    the adapter's name (``lora_A.<name>``); only the active adapter runs."""

    active_adapters = ["default"]

    def __init__(self, base: nn.Linear, adapters: tuple[str, ...]) -> None:
        super().__init__()
        self.base_layer = base
        self.lora_A = nn.ModuleDict({a: nn.Linear(base.in_features, 2, bias=False) for a in adapters})
        self.lora_B = nn.ModuleDict({a: nn.Linear(2, base.out_features, bias=False) for a in adapters})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x) + self.lora_B["default"](self.lora_A["default"](x))


class _PeftStandIn(nn.Module):
    """``peft.PeftModel``'s API as zero3 meets it: ``peft_config`` (adapter name -> config),
    ``get_base_model`` and a ``save_pretrained(dir, state_dict=...)`` that keeps, for each adapter, the
    entries named by it, as PEFT's does. The active adapter's ``lora_B`` trains; ``lora_A`` is frozen
    (LoRA-FA), and a second adapter is frozen whole (a reference adapter)."""

    def __init__(self, base: nn.Sequential, adapters: tuple[str, ...] = ("default",)) -> None:
        super().__init__()
        self.base_model = base
        base.requires_grad_(False)
        base[0] = _Lora(base[0], adapters)
        base[0].lora_B["default"].weight.requires_grad_(True)
        self.peft_config = {a: object() for a in adapters}

    def get_base_model(self) -> nn.Module:
        return self.base_model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_model(x)

    def save_pretrained(self, directory: str, state_dict: dict, safe_serialization: bool = True) -> None:
        import os
        os.makedirs(directory, exist_ok=True)
        for a in self.peft_config:
            torch.save({k: v for k, v in state_dict.items() if a in k.split(".")}, os.path.join(directory, f"{a}.pt"))


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


def _pair(adapters: tuple[str, ...] = ("default",), **cfg) -> tuple[nn.Module, nn.Module, zero3.Engine]:
    torch.manual_seed(1)
    ref = _PeftStandIn(_base(), adapters)
    torch.manual_seed(1)
    with zero3.Init(config_dict_or_path=cfg or None):
        model = _PeftStandIn(_base(), adapters)
    engine = zero3.initialize(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2,
                                                       eps=1e-6), {"param_persistence_threshold": 0, **cfg})
    return ref, model, engine


def test_a_peft_model_saves_every_adapter_frozen_or_trained_through_peft(tmp_path):
    """Each adapter's weights, the frozen ``lora_A`` and the frozen second adapter included (before,
    only trainable parameters reached PEFT, which then saved a second adapter empty or misnamed)."""
    ref, model, engine = _pair(("default", "second"))
    _train(ref, None)
    _train(model, engine)
    with pytest.raises(zero3.ZeroConfigError, match="PEFT writes an adapter as one file"):
        engine.save_pretrained(tmp_path, max_shard_size="1GB")
    engine.save_pretrained(tmp_path)
    for adapter in ("default", "second"):
        saved = torch.load(tmp_path / f"{adapter}.pt")
        want = {n: p for n, p in ref.named_parameters() if adapter in n.split(".")}
        assert sorted(saved) == sorted(want) and len(want) == 2, adapter
        for name, p in want.items():
            torch.testing.assert_close(saved[name], p.detach(), rtol=1e-5, atol=1e-6, msg=name)
    assert not (tmp_path / "model.safetensors").exists()
    assert all(zero3.is_partitioned(p) and p.ds_status.name == "NOT_AVAILABLE" for p in model.parameters())


def test_a_bf16_adapter_saves_the_fp32_masters_when_asked_for_fp32(tmp_path):
    _, model, engine = _pair(bf16={"enabled": True})
    for i in range(3):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)
        engine.backward(engine(x).float().pow(2).mean())
        engine.step()
    engine.save_pretrained(tmp_path, state_dict_dtype=torch.float32)
    saved = torch.load(tmp_path / "default.pt")
    trained = model.base_model[0].lora_B["default"].weight
    key = "base_model.0.lora_B.default.weight"
    assert saved[key].dtype == torch.float32
    with zero3.GatheredParameters([trained]):
        assert trained.dtype == torch.bfloat16
        assert not torch.equal(saved[key], trained.float())  # not the bf16 working copy, cast back
    assert torch.equal(saved[key], zero3.safe_get_full_fp32_param(trained))


def test_a_model_with_a_peft_like_attribute_is_saved_whole(tmp_path):
    class Lookalike(nn.Module):
        peft_config = None

        def __init__(self) -> None:
            super().__init__()
            self.backbone, self.head = nn.Linear(4, 4), nn.Linear(4, 2)

        def get_base_model(self) -> nn.Module:
            return self.backbone

    model = Lookalike()
    engine = zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {"param_persistence_threshold": 0})
    engine.save_pretrained(tmp_path)
    from safetensors.torch import load_file
    assert sorted(load_file(tmp_path / "model.safetensors")) == sorted(n for n, _ in model.named_parameters())


def test_a_merged_peft_model_saves_the_base_model_under_its_own_keys(tmp_path):
    ref, model, engine = _pair()
    _train(ref, None)
    _train(model, engine)
    for m in (ref, model):  # merge_and_unload: the update goes into the base weight, the tuner layer goes
        layer = m.base_model[0]
        with zero3.GatheredParameters(list(layer.parameters()), modifier_rank=0):
            with torch.no_grad():
                layer.base_layer.weight += layer.lora_B["default"].weight @ layer.lora_A["default"].weight
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
