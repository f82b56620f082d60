"""A partitioned parameter keeps its metadata, refuses computation outside a gather, and gathers
back to its true values (param.py [Note: parameter storage])."""

from __future__ import annotations

import contextlib

import copy
import faulthandler
import gc
import math
import os
import pickle
import signal
import time
import weakref
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zero3
from _reference import train_alike
from zero3 import ParamStatus, ZeroStateError
from zero3.partition.param import PendingGradParameter, partition


@pytest.fixture
def partitioned():
    """A small Sequential after initialize with no persistent params, plus its original weights."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 2))
    original = {k: v.detach().clone() for k, v in model.state_dict().items()}
    engine = zero3.initialize(model, None, {"param_persistence_threshold": 0})
    return model, engine, original


def test_partitioned_parameter_keeps_its_true_shape_and_ds_metadata(partitioned):
    model, _, original = partitioned
    w = model[0].weight
    assert zero3.is_partitioned(w)
    assert isinstance(w, zero3.ZeroParameter)
    assert w.shape == torch.Size([5, 3])
    assert w.ds_shape == torch.Size([5, 3])
    assert w.ds_numel == 15
    assert w.ds_status is ParamStatus.NOT_AVAILABLE
    assert isinstance(w.ds_id, int)
    assert w.ds_tensor.dim() == 1
    assert w.ds_tensor.numel() == math.ceil(15 / 1)
    # world size 1: the shard is the whole tensor, flattened
    assert torch.equal(w.ds_tensor, original["0.weight"].reshape(-1))


def test_every_parameter_gets_a_distinct_ds_id(partitioned):
    model, _, _ = partitioned
    ids = [p.ds_id for p in model.parameters()]
    assert len(set(ids)) == len(ids) == 4


def test_partitioned_parameter_owns_no_full_memory(partitioned):
    model, _, _ = partitioned
    w = model[0].weight
    assert w.untyped_storage().nbytes() == 0


def test_ds_attributes_are_read_only(partitioned):
    model, _, _ = partitioned
    w = model[0].weight
    with pytest.raises(AttributeError):
        w.ds_status = ParamStatus.AVAILABLE
    assert w.ds_status is ParamStatus.NOT_AVAILABLE


X = torch.randn(3, 4)
COMPUTATIONS = {
    "matmul operator": lambda w: w @ X,
    "add operator": lambda w: w + 1,
    "torch.matmul": lambda w: torch.matmul(w, X),
    "F.linear": lambda w: F.linear(torch.randn(2, 3), w),
    "sum": lambda w: w.sum(),
    "clone": lambda w: w.clone(),
    "detach": lambda w: w.detach(),
    "indexing": lambda w: w[0],
    "transpose property": lambda w: w.T,
    "to dtype": lambda w: w.to(torch.float64),
    "tolist": lambda w: w.tolist(),
    "not-equal comparison": lambda w: w != 0,
}


@pytest.mark.parametrize("how", sorted(COMPUTATIONS))
def test_computing_with_a_partitioned_parameter_raises_naming_it(partitioned, how):
    model, _, _ = partitioned
    w = model[0].weight
    with pytest.raises(ZeroStateError, match=r"0\.weight.*GatheredParameters"):
        COMPUTATIONS[how](w)
    assert w.ds_status is ParamStatus.NOT_AVAILABLE


def test_load_state_dict_on_a_partitioned_model_raises_naming_zero3s_loader_which_loads_it(partitioned):
    model, _, original = partitioned
    changed = {k: v + 1 for k, v in original.items()}
    with pytest.raises(RuntimeError, match=r"zero3\.pretrained\.load_state_dict\(model, state_dict\)"):
        model.load_state_dict(changed)
    assert all(p.ds_status is ParamStatus.NOT_AVAILABLE for p in model.parameters())
    zero3.pretrained.load_state_dict(model, changed)
    with zero3.GatheredParameters(list(model.parameters())):
        assert all(torch.equal(v, changed[k]) for k, v in model.state_dict().items())


def test_a_refused_load_state_dict_loads_nothing_where_some_parameters_are_kept_gathered():
    """Probe 36H: with the biases persistent (under the threshold) and the weights partitioned, torch
    copied the file into the biases, and zero3 into their shards and masters, while the weights refused:
    a half-loaded model trained on. Also a load started below the root (``model[2]``)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 2), nn.BatchNorm1d(2))
    engine = zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {"param_persistence_threshold": 6})
    assert model[0].weight.ds_status is ParamStatus.NOT_AVAILABLE and model[0].bias.ds_status is ParamStatus.AVAILABLE
    with zero3.GatheredParameters(list(model.parameters())):
        before = {k: v.clone() for k, v in model.state_dict().items()}
    changed = {k: v + 1 for k, v in before.items()}
    for target, prefix in ((model, ""), (model[2], "2.")):
        with pytest.raises(ZeroStateError, match=r"weight.*nothing was loaded.*zero3\.pretrained\.load_state_dict"):
            target.load_state_dict({k[len(prefix):]: v for k, v in changed.items() if k.startswith(prefix)})
        with zero3.GatheredParameters(list(model.parameters())):
            assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
        assert all(torch.equal(engine.master_shard(p), before[p._zero.name].reshape(-1)) for p in engine.params)
    zero3.pretrained.load_state_dict(model, changed)
    with zero3.GatheredParameters(list(model.parameters())):
        assert all(torch.equal(v, changed[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("how", ["wrapper made after initialize", "torch.compile", "checkpoint_wrapper"])
def test_a_load_that_reaches_the_model_under_another_name_is_refused_before_anything_loads(how):
    """Review 36R2: the refusal acted where the load started only, by the parameters' own names: a load
    through a wrapper module, ``torch.compile``'s ``_orig_mod`` or torch's ``checkpoint_wrapper`` (whose
    parameter names hold a part its keys do not) half-loaded the model as before."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    torch.manual_seed(0)
    wrap = checkpoint_wrapper if how == "checkpoint_wrapper" else (lambda m: m)
    model = nn.Sequential(wrap(nn.Linear(4, 6)), nn.Tanh(), wrap(nn.Linear(6, 3)))
    zero3.initialize(model, None, {"param_persistence_threshold": 10})
    outer = nn.Sequential(model) if how.startswith("wrapper") else torch.compile(model) if how == "torch.compile" \
        else model
    with zero3.GatheredParameters(list(model.parameters())):
        before = {k: v.clone() for k, v in outer.state_dict().items()}
    with pytest.raises(ZeroStateError, match=r"weight.*nothing was loaded"):
        outer.load_state_dict({k: v + 1 for k, v in before.items()})
    with zero3.GatheredParameters(list(model.parameters())):
        assert all(torch.equal(v, before[k]) for k, v in outer.state_dict().items())


@pytest.mark.parametrize("threshold", [0, 10**6])  # partitioned, and kept gathered (persistent)
def test_load_state_dict_with_assign_is_refused_and_keeps_zero3s_parameters(threshold):
    """``assign=True`` put plain tensors in place of zero3's parameters ("All keys matched"); the next
    forward failed naming neither. Refused before the first module with zero3 parameters loads."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 2))
    ref = copy.deepcopy(model)
    changed = {k: v + 1 for k, v in model.state_dict().items()}
    engine = zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                              {"param_persistence_threshold": threshold})
    params = list(model.parameters())
    with pytest.raises(ZeroStateError, match=r"assign=True\) would replace zero3's parameter 0\.weight .*"
                                             r"zero3\.pretrained\.load_state_dict"):
        model.load_state_dict(changed, assign=True)
    assert [id(p) for p in model.parameters()] == [id(p) for p in params]
    assert all(zero3.is_zero_param(p) for p in model.parameters())
    zero3.pretrained.load_state_dict(model, changed)  # the way the message names
    ref.load_state_dict(changed)
    x = torch.randn(4, 3)
    torch.testing.assert_close(engine(x), ref(x))


def test_in_place_init_outside_init_context_raises(partitioned):
    model, _, _ = partitioned
    w = model[0].weight
    with pytest.raises(ZeroStateError, match=r"0\.weight"):
        nn.init.zeros_(w)


def test_metadata_reads_do_not_raise(partitioned):
    model, _, _ = partitioned
    w = model[0].weight
    assert w.shape == (5, 3)
    assert w.size() == (5, 3) and w.size(0) == 5
    assert w.dim() == 2 and w.ndim == 2
    assert w.numel() == 15
    assert len(w) == 5
    assert w.dtype is torch.float32
    assert w.device == torch.device("cpu")
    assert w.requires_grad is True
    assert w.is_leaf
    assert w.grad is None
    assert "0.weight" in w.ds_summary()
    assert hash(w) == hash(w)
    assert "Linear(in_features=3, out_features=5" in repr(model)  # module repr prints no values


@pytest.mark.parametrize("how", ["repr", "format"])  # str() takes the same path as repr()
def test_printing_a_partitioned_parameter_shows_its_shape_without_crashing(partitioned, how):
    w = partitioned[0][0].weight

    def body() -> None:
        s = repr(w) if how == "repr" else f"{w}"
        assert "5, 3" in s, s

    assert _run_isolated(body) == "ok"


@pytest.mark.parametrize("how", ["w == 0", "w in [torch.zeros(5, 3)]"])
def test_comparing_a_partitioned_parameter_raises_instead_of_crashing(partitioned, how):
    w = partitioned[0][0].weight

    def body() -> None:
        with pytest.raises(ZeroStateError, match=r"0\.weight"):
            _ = (w == 0) if how == "w == 0" else (w in [torch.zeros(5, 3)])

    assert _run_isolated(body) == "ok"


def test_computing_with_data_of_a_partitioned_parameter_does_not_crash(partitioned):
    w = partitioned[0][0].weight

    def body() -> None:
        with pytest.raises(ZeroStateError, match=r"0\.weight"):
            w.data.sum()

    assert _run_isolated(body) == "ok"


def test_gathered_parameters_shows_the_original_values(partitioned):
    model, _, original = partitioned
    w, b = model[0].weight, model[0].bias
    with zero3.GatheredParameters([w, b]) as gathered:
        assert w.ds_status is ParamStatus.AVAILABLE
        assert torch.equal(w, original["0.weight"])
        assert torch.equal(b, original["0.bias"])
        assert torch.equal(w @ X, original["0.weight"] @ X)  # computing is allowed while gathered
        assert {p.ds_id for p in gathered} == {w.ds_id, b.ds_id}
    assert w.ds_status is ParamStatus.NOT_AVAILABLE
    assert b.ds_status is ParamStatus.NOT_AVAILABLE
    with pytest.raises(ZeroStateError):
        w @ X


def test_gathered_parameters_accepts_a_single_parameter(partitioned):
    model, _, original = partitioned
    w = model[2].weight
    with zero3.GatheredParameters(w):
        assert torch.equal(w, original["2.weight"])
    assert w.ds_status is ParamStatus.NOT_AVAILABLE


def test_nested_gathered_parameters_keep_the_parameter_until_the_outer_exit(partitioned):
    model, engine, original = partitioned
    w = model[0].weight
    with zero3.GatheredParameters([w]):
        with zero3.GatheredParameters([w]):
            pass
        assert w.ds_status is ParamStatus.AVAILABLE
        assert torch.equal(w, original["0.weight"])
    assert w.ds_status is ParamStatus.NOT_AVAILABLE
    assert engine.coordinator.live_params == []
    engine.coordinator.check_valid()


def test_forward_works_and_leaves_parameters_partitioned(partitioned):
    model, engine, original = partitioned
    torch.manual_seed(1)
    ref = nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 2))
    ref.load_state_dict(original)
    x = torch.randn(4, 3)
    assert torch.equal(model(x), ref(x))
    assert all(p.ds_status is ParamStatus.NOT_AVAILABLE for p in model.parameters())
    assert engine.coordinator.live_params == []


def test_state_dict_of_a_partitioned_model_raises_naming_the_parameter(partitioned):
    # Designed behaviour: state_dict detaches each parameter, which is a computation on a
    # partitioned tensor, so it raises (the message says 'detach', not 'state_dict').
    model, _, _ = partitioned
    with pytest.raises(ZeroStateError, match=r"0\.weight.*GatheredParameters"):
        model.state_dict()


def test_state_dict_inside_gathered_parameters_gives_the_values_when_cloned(partitioned):
    model, _, original = partitioned
    with zero3.GatheredParameters(list(model.parameters())):
        sd = {k: v.clone() for k, v in model.state_dict().items()}
    assert sd.keys() == original.keys()
    for k in original:
        assert torch.equal(sd[k], original[k]), k


def test_state_dict_taken_inside_gathered_parameters_is_safe_to_read_after_exit(partitioned):
    model = partitioned[0]
    with zero3.GatheredParameters(list(model.parameters())):
        sd = model.state_dict()

    def body() -> None:
        try:
            float(sd["0.weight"].sum())
        except Exception:  # noqa: BLE001, S110 - a Python error is acceptable; a crash is not
            pass

    assert _run_isolated(body) == "ok"


def test_persistent_parameter_stays_gathered_and_usable():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 2))
    w0 = model[0].weight.detach().clone()
    zero3.initialize(model, None, None)  # default threshold 1e5: every param here is persistent
    w = model[0].weight
    assert w.ds_persist
    assert w.ds_status is ParamStatus.AVAILABLE
    assert torch.equal(w @ X, w0 @ X)
    with zero3.GatheredParameters([w]):
        pass
    assert w.ds_status is ParamStatus.AVAILABLE  # already gathered before: stays gathered


def test_a_forward_inside_gathered_parameters_between_steps_sees_torchs_class(partitioned):
    """The block guards .grad of what it gathers (review 35R1); a forward run inside it gets torch's class
    back for its step (compiled blocks and torch's fast path see nn.Parameter), and the guard after it."""
    model, _, _ = partitioned
    w, seen = model[0].weight, []
    model[0].register_forward_pre_hook(lambda m, args: seen.append(type(m.weight)))
    with zero3.GatheredParameters([w]):
        assert type(w) is PendingGradParameter
        with torch.no_grad():  # an evaluation forward: its step ends with it
            model(torch.randn(2, 3))
        assert seen == [nn.Parameter]
        assert type(w) is PendingGradParameter
        with pytest.raises(ZeroStateError, match="safe_set_full_grad"):
            w.grad = torch.ones(5, 3)


def test_deepcopy_of_a_partitioned_parameter_raises_naming_it(partitioned):
    model, _, _ = partitioned
    with pytest.raises(ZeroStateError, match=r"cannot deepcopy partitioned parameter 0\.weight"):
        copy.deepcopy(model[0].weight)


def test_a_gathered_parameter_is_a_plain_nn_parameter_that_keeps_the_zero3_api(partitioned):
    """Gathered, the class is torch's nn.Parameter (exactly, in a step: torch's fast path; between steps
    its subclass that guards only .grad, review 35R1), and the API still answers."""
    model, _, original = partitioned
    w = model[0].weight
    with zero3.GatheredParameters([w]):
        assert type(w) is PendingGradParameter
        assert isinstance(w, zero3.ZeroParameter) and zero3.is_partitioned(w)
        assert w.ds_status is ParamStatus.AVAILABLE
        assert (w.ds_shape, w.ds_numel, w.ds_persist) == (torch.Size([5, 3]), 15, False)
        assert w.ds_tensor is w._zero.shard
        assert "0.weight" in w.ds_summary() and "AVAILABLE" in w.ds_summary()
        assert torch.equal(w, original["0.weight"])
    assert type(w) is zero3.partition.param.PartitionedParameter
    assert w.ds_status is ParamStatus.NOT_AVAILABLE
    assert not isinstance(nn.Parameter(torch.zeros(2)), zero3.ZeroParameter)
    assert not isinstance(torch.zeros(2), zero3.ZeroParameter)


def test_deepspeed_all_gather_then_partition_works_on_the_gathered_parameter(partitioned):
    """``p.all_gather()`` makes ``p`` torch's class (between steps the subclass that guards .grad, review
    35R2); its ``partition()`` must still be there."""
    model, _, original = partitioned
    w = model[0].weight
    w.all_gather()
    assert type(w) is PendingGradParameter and torch.equal(w, original["0.weight"])
    w.partition()
    assert w.ds_status is ParamStatus.NOT_AVAILABLE
    assert w.untyped_storage().nbytes() == 0


def test_a_gathered_parameter_deep_copies_plainly_and_still_refuses_pickling(partitioned):
    """Gathered, a deep copy is torch's: a plain parameter with the full values (one per parameter
    within one copy, so ties stay tied); pickling still raises (save a checkpoint instead)."""
    model, _, original = partitioned
    w = model[0].weight
    with zero3.GatheredParameters([w]):
        twice = copy.deepcopy([w, w])
        with pytest.raises(ZeroStateError, match=r"cannot pickle partitioned parameter 0\.weight"):
            pickle.dumps(w)
    assert type(twice[0]) is nn.Parameter and twice[0] is twice[1] and twice[0].requires_grad
    assert torch.equal(twice[0], original["0.weight"]) and twice[0].untyped_storage().nbytes() == 60
    assert w.ds_status is ParamStatus.NOT_AVAILABLE


def test_a_dropped_partitioned_parameter_is_freed_without_the_cyclic_gc():
    """The API kept in its __dict__ holds it weakly: no reference cycle keeps it alive."""
    p = partition(nn.Parameter(torch.ones(6)), name="p", world_size=1, rank=0, group=None)
    ref = weakref.ref(p)
    gc.disable()
    try:
        del p
        assert ref() is None
    finally:
        gc.enable()


def _run_isolated(body: Callable[[], None], timeout: float = 60.0) -> str:
    """Run ``body`` in a forked child, so that a segfault fails the test instead of killing pytest.

    Returns "ok", "raised" (a Python exception) or "signal N" (the child crashed).
    """
    pid = os.fork()
    if pid == 0:  # child: never return into pytest
        faulthandler.disable()  # pytest enables it; a crash here is the expected failure, keep it quiet
        code = 1
        try:
            body()
            code = 0
        except BaseException:  # noqa: BLE001 - any Python exception is reported as "raised"
            code = 1
        finally:
            os._exit(code)
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return "timeout"
        time.sleep(0.01)
    if os.WIFSIGNALED(status):
        return f"signal {os.WTERMSIG(status)}"
    return "ok" if os.WEXITSTATUS(status) == 0 else "raised"


def test_isolation_helper_reports_success_exceptions_and_crashes():
    assert _run_isolated(lambda: None) == "ok"

    def fail() -> None:
        raise ValueError("x")

    assert _run_isolated(fail) == "raised"
    assert _run_isolated(lambda: os.kill(os.getpid(), signal.SIGSEGV)) == f"signal {int(signal.SIGSEGV)}"


def test_autograd_grad_with_respect_to_partitioned_parameters_says_what_works():
    """It said 'outside a forward, wrap the code in GatheredParameters' for a call inside a step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4))
    ref = torch.nn.Sequential(torch.nn.Linear(8, 4))
    ref.load_state_dict(model.state_dict())
    zero3.initialize(model, None, {"param_persistence_threshold": 0})
    x = torch.randn(3, 8)
    with pytest.raises(zero3.ZeroStateError, match=r"torch.autograd.grad with respect to partitioned parameters.*"
                                                    r"GatheredParameters\(list\(model.parameters\(\)\)\)"):
        torch.autograd.grad(model(x).sum(), list(model.parameters()))
    with zero3.GatheredParameters(list(model.parameters())):  # the way the message names
        grads = torch.autograd.grad(model(x).sum(), list(model.parameters()))
    for g, r in zip(grads, torch.autograd.grad(ref(x).sum(), list(ref.parameters()))):
        torch.testing.assert_close(g, r, rtol=1e-6, atol=0)


def test_backward_with_inputs_naming_released_parameters_says_what_works():
    """It said 'outside a forward, wrap the code in GatheredParameters', inside engine.backward.
    Named parameters that are kept gathered work as in torch: only they get gradients."""
    def build():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))

    x = torch.randn(3, 8)
    model = build()
    engine = zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {"param_persistence_threshold": 0})
    with pytest.raises(zero3.ZeroStateError, match=r"backward\(inputs=\[\.\.\.\]\) names partitioned parameter "
                                                    r"0\.weight .*requires_grad_\(False\)"):
        engine.backward(engine(x).sum(), inputs=[model[0].weight])
    ref, model = build(), build()
    engine = zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {})  # all kept gathered
    engine.backward(engine(x).sum(), inputs=[model[2].weight])
    ref(x).sum().backward(inputs=[ref[2].weight])
    for p, r in zip(model.parameters(), ref.parameters()):
        full = zero3.safe_get_full_grad(p)
        if r.grad is None:
            assert full is None or not full.any(), p.ds_id
        else:
            torch.testing.assert_close(full, r.grad, rtol=1e-6, atol=0)


def test_a_persistent_parameter_deep_copies_plainly_as_a_gathered_one_does():
    """Kept gathered by the engine (persistent), its values are there: torch's copy, as inside
    GatheredParameters; a partitioned one is still refused."""
    torch.manual_seed(0)
    with zero3.Init():
        model = nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 400))
    zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {"param_persistence_threshold": 100})
    small, large = model[0].weight, model[1].weight
    assert small.ds_status is ParamStatus.AVAILABLE and large.ds_status is ParamStatus.NOT_AVAILABLE
    copied = copy.deepcopy(small)
    assert type(copied) is nn.Parameter and torch.equal(copied, small.detach())
    with pytest.raises(ZeroStateError, match="cannot deepcopy partitioned parameter 1.weight"):
        copy.deepcopy(large)


def test_pruning_a_partitioned_parameter_is_refused_before_torch_moves_it_and_inside_a_gather_trains_as_torch():
    """torch's prune moved ``weight`` to ``weight_orig`` (a second pruning: took the pruning hook off)
    before its first use of the values, where the guard raised: the module was left without
    ``weight``, its forward failed, and so did the retry the error suggests (probe 31H). Refused
    before anything changes; inside GatheredParameters(modifier_rank=0), once and again (torch's
    PruningContainer), it trains as torch's."""
    import torch.nn.utils.prune as prune

    def build():
        return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))

    torch.manual_seed(0)
    ref = build()
    torch.manual_seed(0)
    with zero3.Init():
        model = build()
    engine = zero3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6),
                              {"param_persistence_threshold": 0})
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-6)

    for pruned in (False, True):
        before = ([n for n, _ in model[2].named_parameters()], [n for n, _ in model[2].named_buffers()],
                  [type(h) for h in model[2]._forward_pre_hooks.values()])
        for around in (contextlib.nullcontext, zero3.Init):  # another model's Init exempted it (review 31RC)
            with pytest.raises(ZeroStateError, match=r"pruning \(L1Unstructured\) of 2\.weight(_orig)? .*while it "
                                                     r"is partitioned.*GatheredParameters.*Nothing was changed"):
                with around():
                    prune.l1_unstructured(model[2], "weight", amount=0.5)
        after = ([n for n, _ in model[2].named_parameters()], [n for n, _ in model[2].named_buffers()],
                 [type(h) for h in model[2]._forward_pre_hooks.values()])
        assert after == before and prune.is_pruned(model) == pruned
        with zero3.GatheredParameters(list(model[2].parameters()), modifier_rank=0):
            prune.l1_unstructured(model[2], "weight", amount=0.5)
        prune.l1_unstructured(ref[2], "weight", amount=0.5)
        train_alike(engine, model, ref, ref_opt)
    with pytest.raises(ZeroStateError, match=r"prune.remove of 2\.weight .*GatheredParameters.*Nothing was changed"):
        prune.remove(model[2], "weight")  # the guard's generic error before (review 31RC)
    assert prune.is_pruned(model)
    with zero3.GatheredParameters(list(model[2].parameters()), modifier_rank=0):
        prune.remove(model[2], "weight")
    prune.remove(ref[2], "weight")
    assert not prune.is_pruned(model)
    train_alike(engine, model, ref, ref_opt)


class _RootParam(nn.Module):
    """GPT-2's layout: the root owns a bare parameter (``wpe``) above the persistence threshold."""

    def __init__(self) -> None:
        super().__init__()
        self.wpe = nn.Parameter(torch.randn(16, 4))
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        return self.head(x + self.wpe[: x.shape[0]])


@pytest.mark.parametrize("how", ["root.forward", "child.forward", "prepended pre-hook", "outside any forward"])
def test_a_use_that_skipped_zero3s_hooks_says_to_call_the_module(how):
    """model.forward(x) (or model.head.forward(h), or a pre-hook prepended after initialize) ran no zero3
    hook: the error said to use GatheredParameters / register_external_parameter (probe 33U)."""
    torch.manual_seed(0)
    model = _RootParam()
    engine = zero3.initialize(model, None, {"param_persistence_threshold": 0})
    x = torch.randn(5, 4)
    try:
        if how == "outside any forward":  # a plain refusal outside any forward keeps the generic advice
            with pytest.raises(ZeroStateError, match=r"Outside a forward, wrap the code in") as info:
                model.wpe.sum()
            assert "forward was called directly" not in str(info.value)
        elif how == "prepended pre-hook":
            model.register_forward_pre_hook(lambda m, a: m.wpe.sum(), prepend=True)
            with pytest.raises(ZeroStateError, match=r"wpe .*hook of the model that runs outside zero3's.*prepend=True"):
                model(x)
        else:
            call = model.forward if how == "root.forward" else model.head.forward
            what = "model" if how == "root.forward" else "model.head"
            with pytest.raises(ZeroStateError, match=rf"{what}\.forward was called directly.*call `module\(x\)` "
                                                     rf"\(here `{what}\(\.\.\.\)`"):
                call(x)
            model(x).sum().backward()  # called as a module it trains as torch does
    finally:
        engine.remove_hooks()


class _ListRead(nn.Module):
    """The root's forward reads a child's parameter from a plain list, its first argument not named self."""

    def __init__(self) -> None:
        super().__init__()
        self.blk = nn.Linear(4, 4)
        self.sub = nn.Module()
        self.sub.g = nn.Parameter(torch.ones(4))
        self._l = [self.sub.g]

    def forward(s, x):  # noqa: N805 - the point of the test
        return s.blk(x) * s._l[0]


class _ListReadArgs(_ListRead):
    def forward(*args):  # noqa: N805
        return args[0].blk(args[1]) * args[0]._l[0]


class _ListReadStatic(_ListRead):
    @staticmethod
    def forward(x):
        return _STATIC[0].blk(x) * _STATIC[0]._l[0]


def _fwd(self, x):
    return self.blk(x) * self._l[0]


class _ListReadAssigned(_ListRead):
    forward = _fwd


_STATIC: list = []


@pytest.mark.parametrize("cls", [_ListRead, _ListReadArgs, _ListReadStatic, _ListReadAssigned])
def test_a_forward_however_written_gets_the_generic_advice(cls):
    """Probe 38B: the advice looked for a local named ``self``; with ``def forward(s, x)`` it took the
    root's ``__call__`` for a hook and blamed a prepended pre-hook no one registered; review 38R1: so it
    did for ``forward(*args)``, a static forward and an assigned one (a forward is known by its code)."""
    model = cls()
    _STATIC[:] = [model]
    engine = zero3.initialize(model, None, {"param_persistence_threshold": 0})
    try:
        with pytest.raises(ZeroStateError, match=r"sub\.g .*register_external_parameter") as info:
            model(torch.randn(2, 4))
        assert "prepend=True" not in str(info.value)
    finally:
        engine.remove_hooks()


def test_a_free_function_named_forward_is_not_taken_for_a_forward_called_directly():
    """Review 38R1: a function named ``forward`` whose first argument is the model was said to be
    ``model.forward`` called directly."""
    model = _RootParam()
    engine = zero3.initialize(model, None, {"param_persistence_threshold": 0})

    def forward(m, x):
        return x + m.wpe[: x.shape[0]]

    try:
        with pytest.raises(ZeroStateError, match=r"Outside a forward, wrap the code in") as info:
            forward(model, torch.randn(5, 4))
        assert "called directly" not in str(info.value)
    finally:
        engine.remove_hooks()
