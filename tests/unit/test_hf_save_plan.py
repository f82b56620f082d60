"""`zero3.checkpoint.hf_save` in one process: the size parsing and the file split that transformers
uses (huggingface_hub's greedy split), and a plain module (no config) saved as safetensors only,
each tied parameter once, loaded back bit-exact; which file `zero3.pretrained.load_state_dict` takes from a
directory, and a state dict in torch's legacy format. The 2-rank tests with Hugging Face models are in
tests/multiproc/test_hf_streaming_save.py."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, strategies as st
from torch import nn

import zero3
from zero3.checkpoint.hf_save import Source, parse_shard_size, split_shards
from zero3.checkpoint.safetensors import read_safetensors_header


def test_shard_sizes_parse_as_transformers_does():
    assert parse_shard_size("5GB") == 5 * 10**9
    assert parse_shard_size(" 1.5mb ") == 1_500_000
    assert parse_shard_size("20KB") == 20_000
    assert parse_shard_size(123) == 123
    with pytest.raises(ValueError, match="TB, GB, MB or KB"):
        parse_shard_size("5GiB")


@given(st.lists(st.integers(1, 40), min_size=1, max_size=30), st.integers(8, 120))
def test_split_matches_huggingface_hub(numels, max_bytes):
    hub = pytest.importorskip("huggingface_hub")
    state = {f"t{i}": torch.zeros(n) for i, n in enumerate(numels)}
    want = hub.split_torch_state_dict_into_shards(state, filename_pattern="model{suffix}.safetensors",
                                                  max_shard_size=max_bytes)
    sources = [Source(k, v, v.dtype, ((k, v.dtype, tuple(v.shape)),)) for k, v in state.items()]
    got = split_shards(sources, max_bytes)
    assert {f: [s[0] for s in specs] for f, specs in got.files.items()} == want.filename_to_tensors
    assert got.total_size == want.metadata["total_size"] and got.sharded == want.is_sharded


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 8)
        self.mid = nn.Linear(8, 8)
        self.head = nn.Linear(8, 50, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.tensor([2.0]))
        self.register_buffer("scratch", torch.zeros(3), persistent=False)


def test_plain_module_saves_weights_only_each_tied_parameter_once(tmp_path):
    torch.manual_seed(0)
    with zero3.Init():
        model = Tied()
    engine = zero3.initialize(model, None, {"param_persistence_threshold": 0})
    out = engine.save_pretrained(tmp_path / "out", max_shard_size=500)
    files = sorted(p.name for p in out.iterdir())
    index = json.loads((out / "model.safetensors.index.json").read_text())
    # The buffer comes first in the state dict; the embedding, larger than a file, gets its own,
    # written while the one holding the buffer is still open.
    first, second = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    assert files == [first, second, "model.safetensors.index.json"]
    assert index["weight_map"] == {"scale": second, "embed.weight": first, "mid.weight": second, "mid.bias": second}
    assert index["metadata"] == {"total_parameters": 50 * 8 + 8 * 8 + 8, "total_size": (50 * 8 + 8 * 8 + 8 + 1) * 4}
    assert list(read_safetensors_header(out / second).entries) == ["scale", "mid.weight", "mid.bias"]
    header = read_safetensors_header(out / first)
    assert header.metadata == {"format": "pt"}
    torch.manual_seed(1)
    with zero3.Init():
        fresh = Tied()
    result = zero3.pretrained.load_state_dict(fresh, out)
    assert result.missing_keys == [] and result.unexpected_keys == []
    for (name, p), q in zip(model.named_parameters(), fresh.parameters()):
        with zero3.GatheredParameters([p]), zero3.GatheredParameters([q]):
            assert torch.equal(p, q), name
    assert fresh.head.weight is fresh.embed.weight
    # A second save with one file removes the shards of the first.
    engine.save_pretrained(out)
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]


def test_a_directory_in_the_way_of_a_save_is_refused_and_the_earlier_save_stays(tmp_path):
    """Probe 36K2: a directory named model.safetensors was moved aside, the new save put in place and the
    earlier shards removed, then its removal raised IsADirectoryError, and every later save failed on the
    moved directory."""
    torch.manual_seed(0)
    with zero3.Init():
        model = Tied()
    engine = zero3.initialize(model, None, {"param_persistence_threshold": 0})
    out = engine.save_pretrained(tmp_path / "out", max_shard_size=500)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    (out / "model.safetensors").mkdir()
    for _ in range(2):  # and again: nothing left behind in the way
        with pytest.raises(zero3.ZeroConfigError, match=r"model\.safetensors is in the way .*not a file"):
            engine.save_pretrained(out)
        assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
        assert sorted(p.name for p in out.iterdir() if not p.is_file()) == ["model.safetensors"]
    (out / "model.safetensors").rmdir()
    engine.save_pretrained(out)
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]


def test_only_safetensors(tmp_path):
    with zero3.Init():
        model = Tied()
    engine = zero3.initialize(model, None, {})
    with pytest.raises(ValueError, match="safetensors only"):
        engine.save_pretrained(tmp_path, safe_serialization=False)


def test_a_conversion_that_combines_tensors_is_refused_before_any_file(tmp_path, monkeypatch):
    transformers = pytest.importorskip("transformers")
    from transformers import core_model_loading

    transformers.logging.set_verbosity_error()
    cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1)
    with zero3.Init():
        model = transformers.LlamaForCausalLM(cfg)
    engine = zero3.initialize(model, None, {})

    def fuse_q_and_k(module, state):  # one name for two tensors: many-to-one
        return {k.replace("k_proj", "q_proj"): v for k, v in state.items()} if len(state) > 1 else state

    monkeypatch.setattr(core_model_loading, "revert_weight_conversion", fuse_q_and_k)
    with pytest.raises(NotImplementedError, match="combines several tensors"):
        engine.save_pretrained(tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_masters_on_nvme_are_read_in_one_parameter_at_a_time(tmp_path):
    """bf16 with parameters and optimizer state (fp32 masters) on NVMe: the fp32 save equals
    ``consolidated_state_dict()`` and the default save is in bf16."""
    cfg = {"bf16": {"enabled": True}, "param_persistence_threshold": 0,
           "offload_param": {"device": "nvme", "nvme_path": str(tmp_path / "p")},
           "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path / "o")}}
    torch.manual_seed(0)
    with zero3.Init(config=cfg):
        model = Tied()
    engine = zero3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), cfg)
    ids = torch.randint(0, 50, (2, 5))
    engine.backward(model.head(model.mid(model.embed(ids))).float().logsumexp(-1).mean())
    engine.step()
    fp32 = engine.save_pretrained(tmp_path / "fp32", state_dict_dtype=torch.float32)
    bf16 = engine.save_pretrained(tmp_path / "bf16")
    want = engine.consolidated_state_dict()
    load_file = pytest.importorskip("safetensors.torch").load_file
    got = load_file(fp32 / "model.safetensors")
    assert sorted(got) == ["embed.weight", "mid.bias", "mid.weight", "scale"]
    assert all(torch.equal(got[k], want[k]) for k in got)
    assert {v.dtype for k, v in load_file(bf16 / "model.safetensors").items() if k != "scale"} == {torch.bfloat16}


def test_a_directory_with_one_file_and_an_index_loads_the_file_as_transformers_does(tmp_path, caplog):
    """Probe 35C: transformers' save_pretrained leaves ``model.safetensors`` when it saves shards over
    it, and its from_pretrained then loads that file; zero3 took the index, so the two loaded other
    weights. Both now take the file, and zero3 says so."""
    torch.manual_seed(0)
    old, new = nn.Linear(4, 4), nn.Linear(4, 4)
    model = nn.Linear(4, 4)
    engine = zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {"param_persistence_threshold": 0})
    with zero3.GatheredParameters(list(model.parameters()), modifier_rank=0):
        model.load_state_dict(new.state_dict())
    engine.save_pretrained(tmp_path, max_shard_size=20)  # shards and an index: the new weights
    from safetensors.torch import save_file
    save_file({k: v.contiguous() for k, v in old.state_dict().items()}, str(tmp_path / "model.safetensors"))
    with caplog.at_level("WARNING", logger="zero3"):
        zero3.pretrained.load_state_dict(engine, tmp_path)
    assert "holds both model.safetensors and model.safetensors.index.json" in caplog.text
    with zero3.GatheredParameters(list(model.parameters())):
        assert torch.equal(model.weight, old.weight) and torch.equal(model.bias, old.bias)


def test_a_state_dict_in_torchs_legacy_format_loads(tmp_path):
    """``torch.save(..., _use_new_zipfile_serialization=False)`` (torch < 1.6's format) cannot be
    memory-mapped; zero3 called such a file corrupt (probe 35C). It is read whole now."""
    torch.manual_seed(0)
    src, model = nn.Linear(3, 2), nn.Linear(3, 2)
    torch.save(src.state_dict(), tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {"param_persistence_threshold": 0})
    zero3.pretrained.load_state_dict(model, tmp_path / "legacy.pt")
    with zero3.GatheredParameters(list(model.parameters())):
        assert torch.equal(model.weight, src.weight) and torch.equal(model.bias, src.bias)


_CUSTOM = '''
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel


class TinyCustomConfig(PretrainedConfig):
    model_type = "zero3_tiny_custom"

    def __init__(self, hidden=8, **kw):
        self.hidden = hidden
        super().__init__(**kw)


class TinyCustomModel(PreTrainedModel):
    config_class = TinyCustomConfig

    def __init__(self, config):
        super().__init__(config)
        self.lin = nn.Linear(config.hidden, config.hidden)
        self.post_init()

    def forward(self, x):
        return self.lin(x)
'''


def test_a_custom_code_model_is_saved_with_its_code_and_loads_with_trust_remote_code(tmp_path, monkeypatch):
    """Reviews 35R2, 35R3: the staged save dropped the custom model's .py file and its auto_map entry
    (transformers' save_pretrained writes both), so the directory no longer loaded."""
    transformers = pytest.importorskip("transformers")
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "zero3_tiny_custom.py").write_text(_CUSTOM)
    monkeypatch.syspath_prepend(str(tmp_path / "code"))
    import zero3_tiny_custom as custom
    custom.TinyCustomConfig.register_for_auto_class()
    custom.TinyCustomModel.register_for_auto_class("AutoModel")
    torch.manual_seed(0)
    model = custom.TinyCustomModel(custom.TinyCustomConfig())
    engine = zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {"param_persistence_threshold": 0})
    engine.save_pretrained(tmp_path / "out")
    assert (tmp_path / "out" / "zero3_tiny_custom.py").is_file()
    loaded = transformers.AutoModel.from_pretrained(tmp_path / "out", trust_remote_code=True)
    with zero3.GatheredParameters(list(model.parameters())):
        assert torch.equal(loaded.lin.weight, model.lin.weight)
