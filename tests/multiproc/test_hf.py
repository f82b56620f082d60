"""Hugging Face models under zero3 on 2 gloo ranks, against the plain model built from the same seed.

For each architecture (tiny configs, dropout off so both sides compute the same function):
- built under `zero3.Init`, every parameter gathers to exactly the plain build's values;
- ``model.dtype`` / ``model.device`` (HF properties that read parameter metadata) answer while every
  parameter is partitioned;
- 5 AdamW steps, each rank on its half of the global batch, follow a single process trained on the
  whole batch (the global mean loss every step to 1e-5 relative, the final gathered parameters to
  1e-5 absolute), with every parameter partitioned (``param_persistence_threshold: 0``) and with
  the default config;
- greedy ``generate()`` (many root forwards under no_grad, a DynamicCache, left padding) gives the
  plain model's tokens; for BERT the masked-LM logits are compared instead.
Then: HF activation checkpointing (both torch modes) trains like the plain model; ranks generating
from different prompts stop at different lengths with ``synced_gpus=True``; a ``save_pretrained``
directory loaded with `zero3.pretrained.load_state_dict`, fine-tuned, and saved from the consolidated
state dict (or a sharded checkpoint consolidated by ``python -m zero3.consolidate``) is what
``AutoModelForCausalLM.from_pretrained`` reads back; ``from_pretrained`` itself under ``zero3.Init``
loads the same values on every rank; and bf16 shards give bf16 ``model.dtype``, masks and logits.

transformers is an optional extra (``pip install -e '.[hf]'``; the ``test`` extra includes it): this
module is skipped without it.
"""

from __future__ import annotations

import os

import pytest

# Before transformers is imported (huggingface_hub reads it then), in every process importing this
# module, the ranks included: nothing is ever downloaded.
os.environ["HF_HUB_OFFLINE"] = "1"
transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import zero3  # noqa: E402
from zero3.checkpoint.consolidate import main as consolidate_main  # noqa: E402

pytestmark = pytest.mark.multiproc

VOCAB = 96
PER_RANK, SEQ, STEPS = 2, 16, 5
TOL = 1e-5
LR = 1e-3
MASK_ID = 3  # BERT's [MASK] in the synthetic vocabulary
DECODER_ONLY = ["gpt2", "llama", "mistral", "qwen2", "opt", "gpt_neox", "mixtral"]
ARCHS = DECODER_ONLY + ["t5", "bert"]
CONFIGS = {"every parameter partitioned": {"param_persistence_threshold": 0}, "default config": {}}


def _arch(name: str) -> tuple[type, object]:
    """(model class, tiny config): hidden 32, 2 layers, dropout off."""
    t = transformers
    decoder = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=4, max_position_embeddings=64)
    if name == "gpt2":
        return t.GPT2LMHeadModel, t.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                                               resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1,
                                               eos_token_id=2)
    if name == "llama":
        return t.LlamaForCausalLM, t.LlamaConfig(num_key_value_heads=2, **decoder)
    if name == "mistral":
        return t.MistralForCausalLM, t.MistralConfig(num_key_value_heads=2, **decoder)
    if name == "qwen2":  # biases on q/k/v
        return t.Qwen2ForCausalLM, t.Qwen2Config(num_key_value_heads=2, **decoder)
    if name == "opt":  # learned positions with an offset, tied embeddings
        return t.OPTForCausalLM, t.OPTConfig(vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                                             num_attention_heads=4, max_position_embeddings=64,
                                             word_embed_proj_dim=32, dropout=0.0, attention_dropout=0.0)
    if name == "gpt_neox":  # partial rotary, parallel residual
        return t.GPTNeoXForCausalLM, t.GPTNeoXConfig(**decoder)
    if name == "mixtral":  # mixture of experts: top-2 of 4 experts per token, experts fused in 3-D parameters
        return t.MixtralForCausalLM, t.MixtralConfig(num_key_value_heads=2, num_local_experts=4,
                                                     num_experts_per_tok=2, **decoder)
    if name == "t5":  # encoder-decoder, relative position bias; its feed-forward reads wo.weight.dtype
        return t.T5ForConditionalGeneration, t.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                                        num_heads=4, dropout_rate=0.0, decoder_start_token_id=0,
                                                        pad_token_id=0, eos_token_id=1)
    if name == "bert":  # padding_idx row zeroed in post_init, decoder tied to the word embeddings
        return t.BertForMaskedLM, t.BertConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                               num_hidden_layers=2, num_attention_heads=4,
                                               max_position_embeddings=64, hidden_dropout_prob=0.0,
                                               attention_probs_dropout_prob=0.0)
    raise ValueError(f"unknown architecture {name!r}")


def _quiet() -> None:
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def _build(name: str, seed: int = 0) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(plain model, the same built under zero3.Init), from the same seed."""
    cls, cfg = _arch(name)
    torch.manual_seed(seed)
    plain = cls(cfg)
    torch.manual_seed(seed)
    with zero3.Init():
        model = cls(cfg)
    return plain, model


def _batch(step: int, masked_lm: bool) -> dict[str, torch.Tensor]:
    """The global batch of a step. Masked LM: every 4th position masked, the same count in every row,
    so the mean of the ranks' mean losses is the global mean loss."""
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(4, VOCAB, (PER_RANK * dist.get_world_size(), SEQ), generator=g)
    if not masked_lm:
        return {"input_ids": ids, "labels": ids}
    picked = torch.zeros_like(ids, dtype=torch.bool)
    picked[:, 1::4] = True
    return {"input_ids": ids.masked_fill(picked, MASK_ID), "labels": ids.masked_fill(~picked, -100)}


def _full(p: torch.nn.Parameter) -> torch.Tensor:
    with zero3.GatheredParameters([p]):
        return p.detach().clone()


def _relative_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _gathered_diffs(model: torch.nn.Module, plain: torch.nn.Module) -> dict[str, float]:
    """Max |zero3 - plain| of every parameter, gathered one at a time.

    Absolute, as in test_gpt_parity.py, not relative to each tensor: a key projection's bias has a
    zero gradient in exact arithmetic (softmax ignores a constant added to every score), so AdamW
    moves it by rounding noise alone, differently for two reduction orders, and that noise is large
    relative to the bias itself. The weights here are of order 0.01 to 1."""
    plain_params = dict(plain.named_parameters())
    out = {}
    for name, p in model.named_parameters():
        with zero3.GatheredParameters([p]):
            out[name] = (p.detach() - plain_params[name].detach()).abs().max().item()
    return out


def _train(name: str, zero_cfg: dict, checkpointing: dict | None = None) -> dict:
    """5 AdamW steps of zero3 (half the batch per rank) and of the plain model (the whole batch);
    ``checkpointing``: ``activation_checkpointing_enable`` kwargs for both models."""
    rank = dist.get_rank()
    plain, model = _build(name)
    if checkpointing is not None:
        for m in (plain, model):
            m.activation_checkpointing_enable(activation_checkpointing_kwargs=checkpointing)
    engine = zero3.initialize(model, torch.optim.AdamW(model.parameters(), lr=LR, eps=1e-6), zero_cfg)
    ref_opt = torch.optim.AdamW(plain.parameters(), lr=LR, eps=1e-6)
    mlp_calls = [0]  # forwards of the decoder layers' MLPs (a recompute runs them again; hooks fire there)
    if checkpointing is not None:
        for layer in model.model.layers:
            layer.mlp.register_forward_pre_hook(lambda *_: mlp_calls.__setitem__(0, mlp_calls[0] + 1))
    loss_diffs = []
    for step in range(STEPS):
        batch = _batch(step, masked_lm=name == "bert")
        mine = {k: v[rank * PER_RANK:(rank + 1) * PER_RANK] for k, v in batch.items()}
        loss = engine(**mine).loss  # keyword-only forward
        engine.backward(loss)
        engine.step()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        global_loss /= dist.get_world_size()
        ref_loss = plain(**batch).loss
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        loss_diffs.append(abs(global_loss.item() - ref_loss.item()) / abs(ref_loss.item()))
    engine.coordinator.check_valid()
    out = {"loss": loss_diffs, "params": _gathered_diffs(model, plain), "mlp_calls": mlp_calls[0],
           "left_gathered": len(engine.coordinator.live_params), "persistent": len(engine.coordinator.persistent)}
    prompt = torch.randint(4, VOCAB, (2, 6), generator=torch.Generator().manual_seed(100))
    mask = torch.ones_like(prompt)
    mask[0, :2] = 0  # left padding in the first row
    with torch.no_grad():
        if name == "bert":
            out["logits"] = _relative_diff(model(input_ids=prompt, attention_mask=mask).logits,
                                           plain(input_ids=prompt, attention_mask=mask).logits)
        else:
            kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
            out["generated"] = model.generate(prompt, **kw).tolist()
            out["plain_generated"] = plain.generate(prompt, **kw).tolist()
    return out


def check_architecture(name: str) -> dict:
    _quiet()
    plain, model = _build(name)
    built = [n for (n, p), q in zip(model.named_parameters(), plain.parameters())
             if not torch.equal(_full(p), q.detach())]
    report: dict = {"built_differently": built,
                    "same_names": [n for n, _ in model.named_parameters()] == [n for n, _ in plain.named_parameters()],
                    "all_partitioned": all(p.ds_status is zero3.ParamStatus.NOT_AVAILABLE for p in model.parameters()),
                    "dtype": model.dtype, "device": model.device}
    if name in DECODER_ONLY:
        prompt = torch.randint(4, VOCAB, (1, 5), generator=torch.Generator().manual_seed(7))
        engine = zero3.initialize(model, None, {"param_persistence_threshold": 0})
        with torch.no_grad():
            out = engine(input_ids=prompt, use_cache=True)
            report["cache"] = type(out.past_key_values).__name__
            report["logits_equal"] = torch.equal(out.logits, plain(input_ids=prompt, use_cache=True).logits)
    for label, zero_cfg in CONFIGS.items():
        report[label] = _train(name, zero_cfg)
    return report


@pytest.mark.parametrize("name", ARCHS)
def test_hf_model_builds_trains_and_generates_like_the_plain_model(pools, name):
    for rank, report in enumerate(pools.get(2).run(check_architecture, name, timeout=120)):
        assert report["same_names"] and report["all_partitioned"], rank
        assert report["built_differently"] == [], f"rank {rank}: Init built other values than the plain build"
        assert report["dtype"] == torch.float32 and report["device"] == torch.device("cpu"), rank
        if name in DECODER_ONLY:
            assert report["cache"] == "DynamicCache" and report["logits_equal"], rank
        assert report["every parameter partitioned"]["persistent"] == 0
        for label in CONFIGS:
            r = report[label]
            assert max(r["loss"]) < TOL, (rank, label, r["loss"])
            worst = max(r["params"], key=r["params"].get)
            assert r["params"][worst] < TOL, (rank, label, worst, r["params"][worst])
            assert r["left_gathered"] == 0, (rank, label)
            if name == "bert":
                assert r["logits"] < TOL, (rank, label, r["logits"])
            else:
                assert r["generated"] == r["plain_generated"], (rank, label)


def train_with_activation_checkpointing(use_reentrant: bool) -> dict:
    _quiet()
    return _train("llama", {"param_persistence_threshold": 0}, {"use_reentrant": use_reentrant})


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_hf_activation_checkpointing_trains_like_the_plain_model(pools, use_reentrant):
    for r in pools.get(2).run(train_with_activation_checkpointing, use_reentrant, timeout=120):
        assert max(r["loss"]) < TOL and max(r["params"].values()) < TOL, r
        assert r["mlp_calls"] == 2 * 2 * STEPS, r["mlp_calls"]  # 2 layers, each run again in the backward
        assert r["generated"] == r["plain_generated"]


def generate_a_prompt_per_rank() -> dict:
    """Each rank its own prompt; the end-of-sequence token is chosen so rank 0 stops after 3 new tokens
    and rank 1 runs longer. Every forward is a collective, so ``synced_gpus=True`` keeps a finished
    rank running forwards until every rank is done (HF turns it on by itself only for DeepSpeed/FSDP)."""
    _quiet()
    plain, model = _build("llama")
    zero3.initialize(model, None, {"param_persistence_threshold": 0})
    prompts = [torch.randint(4, VOCAB, (1, 5), generator=torch.Generator().manual_seed(s)) for s in (11, 12)]
    with torch.no_grad():
        eos = plain.generate(prompts[0], max_new_tokens=3, do_sample=False, pad_token_id=0)[0, -1].item()
        kw = dict(max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=eos)
        mine = model.generate(prompts[dist.get_rank()], synced_gpus=True, **kw).tolist()
        return {"generated": mine, "plain_generated": plain.generate(prompts[dist.get_rank()], **kw).tolist()}


def test_ranks_generating_from_different_prompts_with_synced_gpus(pools):
    reports = pools.get(2).run(generate_a_prompt_per_rank, timeout=120)
    for r in reports:
        assert r["generated"] == r["plain_generated"]
    assert len(reports[0]["generated"][0]) < len(reports[1]["generated"][0]), "both ranks stopped together"


# -- pretrained weights in, fine-tuned weights out --------------------------------------------------
def pretrained_round_trip(name: str, workdir: str) -> dict:
    """``save_pretrained`` (a plain model, rank 0) -> load into a zero3 model -> 2 steps -> consolidate ->
    ``save_pretrained(state_dict=...)`` on rank 0 -> ``AutoModelForCausalLM.from_pretrained``."""
    _quiet()
    rank = dist.get_rank()
    cls, cfg = _arch(name)
    src, dst = os.path.join(workdir, f"{name}-pretrained"), os.path.join(workdir, f"{name}-finetuned")
    if rank == 0:
        torch.manual_seed(1)
        cls(cfg).save_pretrained(src)
    dist.barrier()
    torch.manual_seed(0)  # another seed than the checkpoint's: loading must overwrite every value
    with zero3.Init():
        model = cls(cfg)
    loaded = zero3.pretrained.load_state_dict(model, src)
    pretrained = transformers.AutoModelForCausalLM.from_pretrained(src)
    report: dict = {"loaded": loaded, "load_diffs": _gathered_diffs(model, pretrained)}
    engine = zero3.initialize(model, torch.optim.AdamW(model.parameters(), lr=LR, eps=1e-6),
                              {"param_persistence_threshold": 0})
    for step in range(2):
        batch = _batch(step, masked_lm=False)
        loss = engine(**{k: v[rank * PER_RANK:(rank + 1) * PER_RANK] for k, v in batch.items()}).loss
        engine.backward(loss)
        engine.step()
    state = engine.consolidated_state_dict()  # a collective; {} off rank 0
    engine.save_checkpoint(os.path.join(workdir, f"{name}-ckpt"))  # for the streaming consolidation below
    prompt = torch.randint(4, VOCAB, (1, 5), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        report["generated"] = model.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0).tolist()
    if rank == 0:
        model.save_pretrained(dst, state_dict=state)
        back = transformers.AutoModelForCausalLM.from_pretrained(dst)
        report["files"] = sorted(os.listdir(dst))
        report["reloaded_type"] = type(back).__name__
        back_state = back.state_dict()
        report["reload_equal"] = sorted(k for k, v in state.items() if torch.equal(back_state[k], v))
        report["keys"] = sorted(state)
        report["diffs"] = _gathered_diffs(model, back)
        with torch.no_grad():
            report["reloaded_generated"] = back.generate(prompt, max_new_tokens=8, do_sample=False,
                                                         pad_token_id=0).tolist()
        # Models too large for rank 0's memory: consolidate the sharded checkpoint one tensor at a time.
        streamed = os.path.join(workdir, f"{name}-streamed")
        consolidate_main([os.path.join(workdir, f"{name}-ckpt"), os.path.join(streamed, "model.safetensors")])
        model.config.save_pretrained(streamed)
        streamed_state = transformers.AutoModelForCausalLM.from_pretrained(streamed).state_dict()
        report["streamed_equal"] = sorted(k for k, v in state.items() if torch.equal(streamed_state[k], v))
    else:
        report["diffs"] = _gathered_diffs(model, pretrained)  # the collective gathers, paired with rank 0's
    dist.barrier()
    return report


@pytest.mark.parametrize("name", ["gpt2", "llama"])  # tied and untied embeddings
def test_save_pretrained_directory_loads_finetunes_and_saves_back(pools, tmp_path, name):
    reports = pools.get(2).run(pretrained_round_trip, name, str(tmp_path), timeout=120)
    for r in reports:
        assert r["loaded"].missing_keys == [] and r["loaded"].unexpected_keys == []
        assert max(r["load_diffs"].values()) == 0.0, r["load_diffs"]
    r = reports[0]
    assert "model.safetensors" in r["files"] and "config.json" in r["files"]
    assert r["reloaded_type"] == _arch(name)[0].__name__
    assert r["reload_equal"] == r["keys"] == r["streamed_equal"]
    assert max(r["diffs"].values()) == 0.0, r["diffs"]
    assert r["reloaded_generated"] == r["generated"] == reports[1]["generated"]


def from_pretrained_under_init(name: str, workdir: str) -> dict:
    """``AutoModelForCausalLM.from_pretrained`` inside ``zero3.Init``: HF builds the model, then registers
    every loaded weight as a new parameter, which Init partitions when it exits."""
    _quiet()
    cls, cfg = _arch(name)
    src = os.path.join(workdir, f"{name}-pretrained")
    if dist.get_rank() == 0:
        torch.manual_seed(1)
        cls(cfg).save_pretrained(src)
    dist.barrier()
    with zero3.Init():
        model = transformers.AutoModelForCausalLM.from_pretrained(src)
    plain = transformers.AutoModelForCausalLM.from_pretrained(src)
    report = {"partitioned": all(p.ds_status is zero3.ParamStatus.NOT_AVAILABLE for p in model.parameters()),
              "diffs": _gathered_diffs(model, plain), "ids": [p.ds_id for p in model.parameters()]}
    engine = zero3.initialize(model, None, {"param_persistence_threshold": 0})
    prompt = torch.randint(4, VOCAB, (1, 5), generator=torch.Generator().manual_seed(3))
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        expected = plain.generate(prompt, **kw).tolist()
        before = engine.metrics.allgather_numel
        report["generated_equal"] = model.generate(prompt, **kw).tolist() == expected
        per_token = engine.metrics.allgather_numel - before
        # The workaround docs/huggingface.md gives for generation: gather the whole model once around it.
        with zero3.GatheredParameters(list(model.parameters())):
            before = engine.metrics.allgather_numel
            report["gathered_once_equal"] = model.generate(prompt, **kw).tolist() == expected
            report["gathered_inside"] = engine.metrics.allgather_numel - before
        # Generation mode: weights gathered by the first forward stay gathered for the following ones.
        with engine.generation():
            before = engine.metrics.allgather_numel
            report["generation_mode_equal"] = model.generate(prompt, **kw).tolist() == expected
            report["gathered_in_generation_mode"] = engine.metrics.allgather_numel - before
        report["left_gathered"] = sum(p.ds_status is not zero3.ParamStatus.NOT_AVAILABLE for p in model.parameters())
    report["gathered_per_generate"] = per_token
    report["numel"] = sum(p.ds_numel for p in model.parameters())
    return report


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_from_pretrained_under_init_partitions_the_loaded_weights_alike_on_every_rank(pools, tmp_path, name):
    reports = pools.get(2).run(from_pretrained_under_init, name, str(tmp_path), timeout=120)
    assert reports[0]["ids"] == reports[1]["ids"], "ranks numbered the parameters differently"
    for r in reports:
        assert r["partitioned"] and r["generated_equal"] and r["gathered_once_equal"]
        assert max(r["diffs"].values()) == 0.0, r["diffs"]
        # Every one of the 8 forwards gathers every weight (a tied one twice in the first, unplanned, one).
        assert r["gathered_per_generate"] >= 8 * r["numel"], (r["gathered_per_generate"], r["numel"])
        assert r["gathered_inside"] == 0, "inside GatheredParameters nothing is gathered again"
        assert r["generation_mode_equal"] and r["left_gathered"] == 0
        # engine.generation() under the default budget (the whole model fits): each weight once.
        assert r["gathered_in_generation_mode"] <= r["numel"], (r["gathered_in_generation_mode"], r["numel"])


# -- bf16 shards ------------------------------------------------------------------------------------
def bf16_llama() -> dict:
    """bf16 shards: HF's ``model.dtype`` (and the attention masks it builds from it) say bf16, and the
    logits equal a plain model whose parameters (not buffers: the rotary ``inv_freq`` stays fp32, as
    with ``from_pretrained(dtype=torch.bfloat16)``) were cast to bf16."""
    _quiet()
    zero_cfg = {"bf16": {"enabled": True}, "param_persistence_threshold": 0}
    cls, cfg = _arch("llama")
    torch.manual_seed(0)
    plain = cls(cfg)
    with torch.no_grad():
        for p in plain.parameters():
            p.data = p.data.to(torch.bfloat16)
    torch.manual_seed(0)
    with zero3.Init(config=zero_cfg):
        model = cls(cfg)
    engine = zero3.initialize(model, None, zero_cfg)
    prompt = torch.randint(4, VOCAB, (2, 6), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(prompt)
    mask[0, :3] = 0
    with torch.no_grad():
        logits = engine(input_ids=prompt, attention_mask=mask).logits
        kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
        return {"dtype": model.dtype, "logits_dtype": logits.dtype,
                "logits_equal": torch.equal(logits, plain(input_ids=prompt, attention_mask=mask).logits),
                "generated_equal": model.generate(prompt, **kw).tolist() == plain.generate(prompt, **kw).tolist()}


def test_bf16_shards_give_bf16_dtype_masks_and_logits(pools):
    for r in pools.get(2).run(bf16_llama, timeout=120):
        assert r == {"dtype": torch.bfloat16, "logits_dtype": torch.bfloat16, "logits_equal": True,
                     "generated_equal": True}
