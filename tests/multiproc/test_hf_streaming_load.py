"""`zero3.from_pretrained` on 2 gloo ranks against transformers' own ``from_pretrained`` of the same directory.

- Llama-shaped (untied embeddings) and GPT-2-shaped (tied) tiny models, written by ``save_pretrained`` in
  several files (``max_shard_size``), bf16 on disk, loaded into fp32 and into bf16 (and ``"auto"``):
  every gathered parameter and every buffer equals transformers' load bit for bit, dtype included,
  and a forward through `zero3.initialize` gives its logits bit for bit.
- Each rank's bytes read from the files, counted by wrapping the byte-range reader, are at most its
  own slices (in the file's dtype) plus the largest tensor.
- Missing, unexpected and (with ``ignore_mismatched_sizes``) mismatched keys: the same loading info
  and the same warning (transformers' load report) as transformers, those weights initialised to
  transformers' values (same RNG draws), and ``strict=True`` raises on every rank before anything
  is read.
- A base model's checkpoint loads into the LM-head model (prefix renamed); weights transformers fuses
  on load (Mixtral's experts) are refused; both names of a tied pair in the file load tied when equal
  and are refused when they differ.
"""

from __future__ import annotations

import json
import logging
import os

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: nothing is downloaded
transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import zero3  # noqa: E402
from zero3.checkpoint import pretrained  # noqa: E402

pytestmark = pytest.mark.multiproc

VOCAB = 96


def _config(arch: str, tied: bool):
    t = transformers
    if arch == "gpt2":
        return t.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                            embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=tied)
    return t.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=tied)


def _write(arch: str, tied: bool, disk_dtype: torch.dtype, out: str, drop=(), extra=None) -> None:
    """Rank 0 writes a ``save_pretrained`` directory in several files; every rank waits for it."""
    if dist.get_rank() == 0:
        torch.manual_seed(1)
        model = transformers.AutoModelForCausalLM.from_config(_config(arch, tied)).to(disk_dtype)
        state = None
        if drop or extra:
            state = {k: v for k, v in model.state_dict().items() if k not in drop}
            state.update(extra or {})
        model.save_pretrained(out, max_shard_size="40KB", state_dict=state)
    dist.barrier()


class _CountingReader:
    """Wraps the byte-range reader: bytes each rank asks the files for, per tensor name."""

    def __init__(self) -> None:
        self.inner = pretrained.read_tensor_range
        self.bytes = 0

    def __call__(self, fh, header, name, elem_offset, dest) -> None:
        self.bytes += dest.numel() * header.entries[name].dtype.itemsize
        self.inner(fh, header, name, elem_offset, dest)

    def __enter__(self) -> "_CountingReader":
        pretrained.read_tensor_range = self
        return self

    def __exit__(self, *exc) -> None:
        pretrained.read_tensor_range = self.inner


def _tensor_bytes(path: str) -> dict[str, int]:
    from zero3.checkpoint.safetensors import read_safetensors_header

    out = {}
    for f in os.listdir(path):
        if f.endswith(".safetensors"):
            for name, e in read_safetensors_header(os.path.join(path, f)).entries.items():
                out[name] = e.end - e.begin
    return out


def _compare(model: torch.nn.Module, ref: torch.nn.Module) -> list[str]:
    """Names whose gathered value or dtype differs from transformers' load (parameters and buffers)."""
    bad = []
    for name, p in model.named_parameters():
        r = ref.get_parameter(name)
        with zero3.GatheredParameters([p]):
            if p.dtype != r.dtype or not torch.equal(p.detach(), r.detach()):
                bad.append(name)
    buffers = dict(ref.named_buffers())
    for name, b in model.named_buffers():
        if b.dtype != buffers[name].dtype or not torch.equal(b, buffers[name]):
            bad.append(name)
    return bad


def load_and_compare(arch: str, tied: bool, dtype, workdir: str) -> dict:
    transformers.logging.set_verbosity_error()
    src = os.path.join(workdir, f"{arch}-{tied}")
    _write(arch, tied, torch.bfloat16, src)
    warnings = _Records()  # zero3's: the build's uninitialised memory differs between ranks, and is loaded over
    logging.getLogger("zero3").addHandler(warnings)
    try:
        with _CountingReader() as counter:
            model = zero3.from_pretrained(transformers.AutoModelForCausalLM, src, dtype=dtype,
                                          zero_config={"param_persistence_threshold": 0})
    finally:
        logging.getLogger("zero3").removeHandler(warnings)
    ref = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=dtype)
    bad = _compare(model, ref)
    engine = zero3.initialize(model, None, {"param_persistence_threshold": 0})
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits_equal = torch.equal(engine(input_ids=ids).logits, ref(input_ids=ids).logits)
    sizes = _tensor_bytes(src)
    owned = 0  # this rank's slices, in the file's dtype (2 bytes: bf16)
    for p in {id(p): p for p in model.parameters()}.values():
        start, end = p._zero.shard_range()
        owned += max(min(end, p._zero.numel) - start, 0) * 2
    return {"files": sorted(f for f in os.listdir(src) if f.endswith(".safetensors")), "type": type(model).__name__,
            "dtype": model.dtype, "ref_dtype": ref.dtype, "bad": bad, "training": model.training,
            "logits_equal": logits_equal, "warnings": warnings.messages,
            "tied": model.lm_head.weight is model.get_input_embeddings().weight,
            "ref_tied": ref.lm_head.weight is ref.get_input_embeddings().weight,
            "read": counter.bytes, "owned": owned, "largest": max(sizes.values()), "total": sum(sizes.values()),
            "partitioned": all(isinstance(p, zero3.ZeroParameter) for p in model.parameters())}


CASES = [("llama", False, torch.float32), ("llama", False, torch.bfloat16), ("gpt2", True, torch.float32),
         ("gpt2", True, "auto"), ("llama", True, torch.bfloat16)]


@pytest.mark.parametrize("arch,tied,dtype", CASES, ids=[f"{a}-{'tied' if t else 'untied'}-{d}" for a, t, d in CASES])
def test_streamed_load_equals_transformers_and_reads_only_own_slices(pools, tmp_path, arch, tied, dtype):
    reports = pools.get(2).run(load_and_compare, arch, tied, dtype, str(tmp_path), timeout=120)
    for r in reports:
        assert len(r["files"]) > 1, r["files"]
        assert r["partitioned"] and not r["training"]
        assert r["bad"] == [], r["bad"]
        assert r["logits_equal"], "the loaded model computes other logits than transformers' load"
        assert not [m for m in r["warnings"] if "differed between ranks" in m], r["warnings"]
        assert r["dtype"] == r["ref_dtype"] == (torch.bfloat16 if dtype == "auto" else dtype)
        assert r["tied"] == r["ref_tied"] == tied
        assert r["read"] <= r["owned"] + r["largest"], r
    assert sum(r["read"] for r in reports) == reports[0]["total"], "together the ranks read every tensor once"


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def missing_and_unexpected(workdir: str) -> dict:
    """A checkpoint without ``lm_head.weight`` and one MLP weight, with a key the model lacks."""
    transformers.logging.set_verbosity_warning()
    src = os.path.join(workdir, "llama-partial")
    dropped = ("lm_head.weight", "model.layers.1.mlp.up_proj.weight")
    _write("llama", False, torch.float32, src, drop=dropped, extra={"model.extra.weight": torch.ones(3)})
    records = _Records()
    hf_logger = logging.getLogger("transformers")
    hf_logger.addHandler(records)
    try:
        torch.manual_seed(7)
        model, info = zero3.from_pretrained(transformers.AutoModelForCausalLM, src, output_loading_info=True)
        ours = list(records.messages)
        records.messages.clear()
        torch.manual_seed(7)
        ref, ref_info = transformers.AutoModelForCausalLM.from_pretrained(src, output_loading_info=True)
        theirs = list(records.messages)
    finally:
        hf_logger.removeHandler(records)
        transformers.logging.set_verbosity_error()
    try:
        zero3.from_pretrained(transformers.AutoModelForCausalLM, src, strict=True)
        strict_error = None
    except zero3.CheckpointMismatchError as exc:
        strict_error = str(exc)
    return {"info": info, "ref_info": ref_info, "ours": ours, "theirs": theirs, "bad": _compare(model, ref),
            "strict_error": strict_error}


def test_missing_and_unexpected_keys_warn_and_initialise_like_transformers(pools, tmp_path):
    for r in pools.get(2).run(missing_and_unexpected, str(tmp_path), timeout=120):
        assert r["info"] == r["ref_info"]
        assert r["info"]["missing_keys"] == {"lm_head.weight", "model.layers.1.mlp.up_proj.weight"}
        assert r["info"]["unexpected_keys"] == {"model.extra.weight"}
        assert r["ours"] == r["theirs"] and any("LOAD REPORT" in m for m in r["ours"]), r["ours"]
        assert r["bad"] == [], "missing weights got other values than transformers' _init_weights"
        assert r["strict_error"] is not None and "lm_head.weight" in r["strict_error"]


def base_model_and_fused_experts(workdir: str) -> dict:
    """A ``GPT2Model`` checkpoint (no ``transformer.`` prefix) into ``GPT2LMHeadModel``: renamed as transformers
    renames it; Mixtral's per-expert tensors, which transformers fuses on load: refused, naming them."""
    transformers.logging.set_verbosity_error()
    t = transformers
    base, mix = os.path.join(workdir, "gpt2-base"), os.path.join(workdir, "mixtral")
    if dist.get_rank() == 0:
        torch.manual_seed(1)
        t.GPT2Model(_config("gpt2", True)).save_pretrained(base)
        mixtral = t.MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=4, num_key_value_heads=2, num_local_experts=2,
                                  num_experts_per_tok=1)
        t.MixtralForCausalLM(mixtral).save_pretrained(mix)
    dist.barrier()
    torch.manual_seed(2)
    model, info = zero3.from_pretrained(t.GPT2LMHeadModel, base, output_loading_info=True)
    torch.manual_seed(2)
    ref, ref_info = t.GPT2LMHeadModel.from_pretrained(base, output_loading_info=True)
    try:
        zero3.from_pretrained(t.AutoModelForCausalLM, mix)
        refused = None
    except zero3.ZeroConfigError as exc:
        refused = str(exc)
    return {"info": info, "ref_info": ref_info, "bad": _compare(model, ref), "refused": refused}


def test_base_model_prefix_is_renamed_and_fused_experts_are_refused(pools, tmp_path):
    for r in pools.get(2).run(base_model_and_fused_experts, str(tmp_path), timeout=120):
        assert r["info"] == r["ref_info"] and r["bad"] == []
        assert r["refused"] is not None and "experts.0" in r["refused"], r["refused"]


def tied_pair_in_the_checkpoint(workdir: str, equal: bool) -> dict:
    """A tied GPT-2 whose file holds ``lm_head.weight`` too (``save_pretrained`` leaves it out; other
    writers do not): equal to ``wte`` it loads tied, as in transformers; different, transformers unties
    the two and zero3 refuses on every rank."""
    from safetensors.torch import load_file, save_file

    transformers.logging.set_verbosity_error()
    src = os.path.join(workdir, f"gpt2-both-{equal}")
    _write("gpt2", True, torch.float32, src)
    if dist.get_rank() == 0:
        files = [f for f in os.listdir(src) if f.endswith(".safetensors")]
        holder = next(f for f in files if "transformer.wte.weight" in load_file(os.path.join(src, f)))
        state = load_file(os.path.join(src, holder))
        wte = state["transformer.wte.weight"]
        state["lm_head.weight"] = wte.clone() if equal else wte + 1
        save_file(state, os.path.join(src, holder), metadata={"format": "pt"})
        index = os.path.join(src, "model.safetensors.index.json")
        with open(index) as fh:
            raw = json.load(fh)
        raw["weight_map"]["lm_head.weight"] = holder
        with open(index, "w") as fh:
            json.dump(raw, fh)
    dist.barrier()
    try:
        model = zero3.from_pretrained(transformers.AutoModelForCausalLM, src)
    except zero3.ZeroConfigError as exc:
        return {"refused": str(exc)}
    ref = transformers.AutoModelForCausalLM.from_pretrained(src)
    return {"refused": None, "bad": _compare(model, ref), "tied": model.lm_head.weight is model.transformer.wte.weight,
            "ref_tied": ref.lm_head.weight is ref.transformer.wte.weight}


@pytest.mark.parametrize("equal", [True, False], ids=["equal", "different"])
def test_both_names_of_a_tied_pair_in_the_checkpoint(pools, tmp_path, equal):
    for r in pools.get(2).run(tied_pair_in_the_checkpoint, str(tmp_path), equal, timeout=120):
        if equal:
            assert r["refused"] is None and r["bad"] == [] and r["tied"] and r["ref_tied"]
        else:
            assert r["refused"] is not None and "tie_word_embeddings=False" in r["refused"], r


def mismatched_sizes(workdir: str) -> dict:
    """A config with a larger vocabulary than the checkpoint's: with ``ignore_mismatched_sizes`` the
    embeddings are reported as mismatched and initialised as transformers initialises them; without it
    both raise."""
    transformers.logging.set_verbosity_error()
    src = os.path.join(workdir, "llama-vocab")
    _write("llama", False, torch.float32, src)
    config = transformers.AutoConfig.from_pretrained(src)
    config.vocab_size = VOCAB + 4
    auto = transformers.AutoModelForCausalLM
    torch.manual_seed(4)
    model, info = zero3.from_pretrained(auto, src, config=config, ignore_mismatched_sizes=True,
                                        output_loading_info=True)
    torch.manual_seed(4)
    ref, ref_info = auto.from_pretrained(src, config=config, ignore_mismatched_sizes=True, output_loading_info=True)
    try:
        zero3.from_pretrained(auto, src, config=config)
        raised = None
    except zero3.CheckpointMismatchError as exc:
        raised = str(exc)
    return {"info": info, "ref_info": ref_info, "bad": _compare(model, ref), "raised": raised}


def test_ignore_mismatched_sizes_reinitialises_like_transformers(pools, tmp_path):
    for r in pools.get(2).run(mismatched_sizes, str(tmp_path), timeout=120):
        assert r["info"] == r["ref_info"] and r["bad"] == []
        assert {k for k, _, _ in r["info"]["mismatched_keys"]} == {"lm_head.weight", "model.embed_tokens.weight"}
        assert r["raised"] is not None and "shape mismatch" in r["raised"]
