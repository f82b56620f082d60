"""Generation mode: a greedy decode under ``engine.generation()`` gives the plain model's tokens,
gathers each weight once when the model fits the live budget, and only what does not fit otherwise."""

from __future__ import annotations

import pytest
import torch

import zero3
from gpt import GPT, GPTConfig

pytestmark = pytest.mark.multiproc

CFG = GPTConfig(block_size=32, n_layer=4, n_embd=64, n_head=4)
TOKENS = 12


def decode(model, n: int = TOKENS) -> torch.Tensor:
    x = torch.zeros(1, 1, dtype=torch.long)
    with torch.no_grad():
        for _ in range(n):
            logits = model(x[:, -CFG.block_size:])
            x = torch.cat([x, logits[:, -1].argmax(-1, keepdim=True)], 1)
    return x


def generation_run(budget_fraction: float | None) -> dict:
    torch.manual_seed(0)
    ref = GPT(CFG).eval()
    want = decode(ref)
    torch.manual_seed(0)
    with zero3.Init():
        model = GPT(CFG)
    model.eval()
    numel = sum(p.numel() for p in ref.parameters())
    cfg = {"param_persistence_threshold": 0, "max_reuse_distance": 0, "prefetch_bucket_size": 0}
    if budget_fraction is not None:
        cfg["max_live_parameters"] = int(numel * budget_fraction)
    engine = zero3.initialize(model, None, cfg)
    before = engine.metrics.allgather_numel
    plain = decode(engine)
    plain_numel = engine.metrics.allgather_numel - before
    before = engine.metrics.allgather_numel
    with engine.generation():
        kept = decode(engine)
        peak = engine.metrics.peak_live_numel
    kept_numel = engine.metrics.allgather_numel - before
    return {"plain_ok": torch.equal(plain, want), "kept_ok": torch.equal(kept, want), "numel": numel,
            "plain_numel": plain_numel, "kept_numel": kept_numel, "peak": peak,
            "left": len(engine.coordinator.live_params)}


def test_generation_mode_gathers_each_weight_once_when_the_model_fits(pools):
    for r in pools.get(2).run(generation_run, None, timeout=120):
        assert r["plain_ok"] and r["kept_ok"], r
        assert r["plain_numel"] >= TOKENS * r["numel"]  # plain forwards gather every weight every token
        assert r["kept_numel"] == r["numel"], r  # every weight gathered exactly once
        assert r["left"] == 0  # released on exit


def test_generation_mode_under_half_the_model_regathers_only_what_does_not_fit(pools):
    for r in pools.get(2).run(generation_run, 0.5, timeout=120):
        assert r["kept_ok"], r
        assert r["peak"] <= 0.5 * r["numel"] + 1, r  # the cap holds
        per_token = (r["kept_numel"] - r["numel"]) / (TOKENS - 1)
        assert per_token <= 0.62 * r["numel"], r  # about the half that does not fit, not the whole model
        assert r["kept_numel"] < 0.7 * r["plain_numel"], r


def reference_and_partitioned() -> tuple[torch.Tensor, GPT]:
    """The plain model's tokens, and the same model (same seed) built under ``zero3.Init``, in eval mode."""
    torch.manual_seed(0)
    want = decode(GPT(CFG).eval())
    torch.manual_seed(0)
    with zero3.Init():
        model = GPT(CFG)
    return want, model.eval()


def planned_run(budget_fraction: float | None, in_bytes: bool = False, gather: str = "auto") -> dict:
    """The default ``prefetch_bucket_size``: generation mode plans the decode cycle
    (planning/generation.py [Note: decode plans])."""
    want, model = reference_and_partitioned()
    numel = sum(p.numel() for p in model.parameters())
    nbytes = sum(p._zero.nbytes for p in model.parameters())
    cfg: dict = {"param_persistence_threshold": 0, "max_reuse_distance": 0, "allgather_impl": gather}
    if budget_fraction is not None:
        if in_bytes:
            cfg["max_live_bytes"] = int(nbytes * budget_fraction)
        else:
            cfg["max_live_parameters"] = int(numel * budget_fraction)
    engine = zero3.initialize(model, None, cfg)
    plain = decode(engine)
    calls = engine.metrics.allgather_calls
    gathered = engine.metrics.allgather_numel
    with engine.generation():
        engine.metrics.peak_live_numel = engine.metrics.live_numel
        engine.metrics.peak_live_bytes = engine.metrics.live_bytes
        kept = decode(engine)
        plan = engine.coordinator._generation.plan
        peak = (engine.metrics.peak_live_numel, engine.metrics.peak_live_bytes)
    return {"plain_ok": torch.equal(plain, want), "kept_ok": torch.equal(kept, want), "numel": numel,
            "nbytes": nbytes, "peak": peak, "calls": engine.metrics.allgather_calls - calls,
            "gathered": engine.metrics.allgather_numel - gathered,
            "buckets": None if plan is None else len(plan.buckets), "left": len(engine.coordinator.live_params)}


@pytest.mark.parametrize("fraction,gather", [(None, "auto"), (None, "p2p"), (0.5, "auto")])
def test_planned_generation_decodes_the_plain_tokens_within_the_budget(pools, fraction, gather):
    for r in pools.get(2).run(planned_run, fraction, False, gather, timeout=120):
        assert r["plain_ok"] and r["kept_ok"], r  # the same tokens as without generation mode
        assert r["left"] == 0, r
        if fraction is None:
            assert r["buckets"] is None, r  # the model fits: nothing to plan
            # the whole model in one gather at the first module, each weight once, then none
            assert r["calls"] == 1 and r["gathered"] == r["numel"], r
            continue
        assert r["peak"][0] <= fraction * r["numel"], r  # the cap holds, in flight included
        assert r["buckets"] is not None and r["buckets"] >= 1, r
        # learning forward, planning forward, then one collective per streamed bucket per token
        assert r["calls"] <= 2 * 40 + (TOKENS - 2) * r["buckets"], r


def test_planned_generation_under_a_byte_budget_holds_it(pools):
    for r in pools.get(2).run(planned_run, 0.5, True, timeout=120):
        assert r["kept_ok"], r
        assert r["buckets"] is not None and r["peak"][1] <= 0.5 * r["nbytes"], r


def resident_run() -> dict:
    """Generation mode with the whole model inside the live cap: after the first forward every decode
    forward skips zero3 (hooks.py [Note: resident decode forwards]); a training step inside the mode
    takes the full path, and the weights kept gathered afterwards are the stepped ones."""
    from gpt import synthetic_batch

    want, model = reference_and_partitioned()
    mlp = model.h[1].mlp.c_fc
    seen: list[bool] = []  # a user's pre-hook: is the weight gathered when it runs (zero3's pre-hook goes first)?
    mlp.register_forward_pre_hook(lambda m, args: seen.append(m.weight.ds_status is zero3.ParamStatus.AVAILABLE))
    engine = zero3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6),
                              {"param_persistence_threshold": 0, "max_reuse_distance": 0})
    hooks_before = len(mlp._forward_pre_hooks), len(mlp._forward_hooks)
    events = [0]
    event = engine.coordinator.event

    def counted(*args, **kwargs):
        events[0] += 1
        return event(*args, **kwargs)

    engine.coordinator.event = counted
    out: dict = {}
    with engine.generation():
        first = decode(engine, 1)
        out["resident"] = engine.coordinator.generation_resident
        e0, c0 = events[0], engine.metrics.allgather_calls
        tokens = decode(engine)
        out["tokens_ok"] = torch.equal(first, want[:, :2]) and torch.equal(tokens, want)
        out["resident_events"], out["resident_gathers"] = events[0] - e0, engine.metrics.allgather_calls - c0
        out["hooks_resident"] = len(mlp._forward_pre_hooks), len(mlp._forward_hooks)  # only the user's
        before_step = [p.detach().clone() for p in model.parameters()]  # gathered: the resident weights
        model.train()
        e0 = events[0]
        x, y = synthetic_batch(0, 2, CFG)
        engine.backward(engine(x, y))
        engine.step()
        out["train_events"] = events[0] - e0
        out["resident_after_step"] = engine.coordinator.generation_resident
        model.eval()
        decode(engine, 1)
        out["resident_again"] = engine.coordinator.generation_resident
        kept = [p.detach().clone() for p in model.parameters()]
        decode(engine, 1)
    out["hooks_before_after"] = hooks_before, (len(mlp._forward_pre_hooks), len(mlp._forward_hooks))
    out["user_hook_calls"], out["user_hook_saw_gathered"] = len(seen), all(seen)
    e0 = events[0]
    decode(engine, 1)
    out["events_after"] = events[0] - e0
    with zero3.GatheredParameters(list(model.parameters())):
        stepped = [p.detach().clone() for p in model.parameters()]
    out["kept_is_stepped"] = all(torch.equal(a, b) for a, b in zip(kept, stepped))
    out["step_moved"] = sum(not torch.equal(a, b) for a, b in zip(before_step, stepped)) == len(stepped)
    return out


def test_a_resident_decode_forward_skips_zero3_and_a_step_inside_the_mode_regathers_the_new_weights(pools):
    for r in pools.get(2).run(resident_run, timeout=120):
        assert r["resident"] and r["tokens_ok"], r
        assert r["resident_events"] == 0 and r["resident_gathers"] == 0, r  # no hook work, no collective
        assert r["train_events"] > 0, r  # a forward with grad on takes the full path
        assert r["kept_is_stepped"] and r["step_moved"], r  # not the weights from before the step
        assert not r["resident_after_step"] and r["resident_again"], r  # the step released them; regathered
        assert r["hooks_resident"] == (1, 0), r  # zero3's forward hooks were off the submodules
        before, after = r["hooks_before_after"]
        assert before == after == (2, 1), r  # and back on when the mode ended
        assert r["events_after"] > 0 and r["user_hook_calls"] == TOKENS + 4 and r["user_hook_saw_gathered"], r


def load_inside_generation(directory: str, how: str) -> dict:
    """A checkpoint or pretrained load inside ``engine.generation()`` after decode forwards: refused
    before ('load_checkpoint while parameters are gathered'), though docs/api.md said the load releases
    what the mode kept; now the next forward computes with the loaded weights."""
    from gpt import synthetic_batch

    want, model = reference_and_partitioned()
    engine = zero3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6),
                              {"param_persistence_threshold": 0})
    engine.save_checkpoint(directory, tag="start")
    state = engine.consolidated_state_dict(rank0_only=False)
    x, y = synthetic_batch(0, 2, CFG)
    engine.backward(engine(x, y))
    engine.step()  # the weights move away from what was saved
    model.eval()
    with engine.generation():
        moved = decode(engine)
        if how == "checkpoint":
            engine.load_checkpoint(directory, tag="start")
        else:
            zero3.pretrained.load_state_dict(engine, state)
        again = decode(engine)
    return {"moved": not torch.equal(moved, want), "loaded": torch.equal(again, want)}


@pytest.mark.parametrize("how", ["checkpoint", "pretrained"])
def test_a_load_inside_generation_mode_is_what_the_next_forward_computes_with(pools, tmp_path, how):
    for r in pools.get(2).run(load_inside_generation, str(tmp_path), how, timeout=120):
        assert r["moved"] and r["loaded"], r  # the step changed the tokens; the load brought them back
