"""One engine used from several threads (hooks.py [Note: one thread]): a forward begun while another
thread's forward runs is refused before it changes anything, and the running one goes on as in
torch; whole calls one after another from any thread train as torch does (probe 26D: two threads'
forwards at once returned wrong outputs, or crashed in a gather's copy)."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import zero3
from _reference import assert_same_weights

CONFIG = {"param_persistence_threshold": 0, "max_reuse_distance": 0, "max_live_parameters": 200}


class Paused(nn.Module):
    """Blocks its caller's thread mid-forward, after its own gather, until ``go`` is set, when ``hold`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.hold = threading.Event()
        self.inside = threading.Event()
        self.go = threading.Event()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if self.hold.is_set():
            self.hold.clear()
            self.inside.set()
            assert self.go.wait(30)
        return torch.tanh(y)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.p = Paused()
        self.b = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.p(torch.tanh(self.a(x))))


def _build() -> tuple[nn.Module, nn.Module, zero3.Engine]:
    torch.manual_seed(0)
    ref = Net()
    with zero3.Init():
        model = Net()
    with zero3.GatheredParameters(list(model.parameters()), modifier_rank=0):
        for p, r in zip(model.parameters(), ref.parameters()):
            p.data.copy_(r.data)
    engine = zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), CONFIG)
    return ref, model, engine


@pytest.mark.parametrize("call", ["engine", "model"])
@pytest.mark.parametrize("grad", [True, False])
def test_a_forward_begun_while_another_thread_s_forward_runs_is_refused_and_the_running_one_goes_on(call, grad):
    ref, model, engine = _build()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    run = engine if call == "engine" else model
    x, x2 = torch.randn(3, 8), torch.randn(3, 8)
    out: dict[str, torch.Tensor] = {}

    def first() -> None:
        with torch.set_grad_enabled(grad):
            out["first"] = run(x)

    model.p.hold.set()
    t = threading.Thread(target=first)
    t.start()
    assert model.p.inside.wait(30)  # the first thread is inside the model's forward, parameters gathered
    with pytest.raises(zero3.ConcurrentForwardError, match="while thread .* runs a forward of the model"):
        run(x2)
    model.p.go.set()
    t.join(30)
    assert not t.is_alive()
    torch.testing.assert_close(out["first"], ref(x), rtol=1e-6, atol=1e-7)
    if grad:  # the running forward's step went on: its backward and step are torch's
        engine.backward(out["first"].square().sum())
        engine.step()
        ref(x).square().sum().backward()
        ref_opt.step()
        assert_same_weights(model, ref)
    with torch.no_grad():  # the refused thread's next call, now alone, is torch's
        torch.testing.assert_close(run(x2), ref(x2), rtol=1e-6, atol=1e-7)
    assert engine.context.claim.owner is None


def test_whole_steps_from_several_threads_one_after_another_train_as_torch() -> None:
    ref, model, engine = _build()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    data = [torch.randn(3, 8) for _ in range(6)]

    def step(x: torch.Tensor) -> None:
        engine.backward(engine(x).square().mean())
        with torch.no_grad():
            engine(x)  # an eval forward between steps, from the same thread
        engine.step()

    for i, x in enumerate(data):
        if i % 2:
            t = threading.Thread(target=step, args=(x,))
            t.start()
            t.join(30)
        else:
            step(x)
        ref_opt.zero_grad()
        ref(x).square().mean().backward()
        ref_opt.step()
    assert_same_weights(model, ref)


def test_a_forward_from_another_thread_during_a_resident_decode_forward_is_refused_too():
    """Review 26Y: in generation mode with the whole model resident, the root's decode forwards skip the
    hooks; a second thread's forward then went unrefused and ran without hooks (with grad on, its
    gradients would never be reduced). It is refused as any other, and decoding goes on as torch's."""
    ref, model, engine = _build()
    x, x2 = torch.randn(3, 8), torch.randn(3, 8)
    out: dict[str, torch.Tensor] = {}
    with engine.generation(), torch.no_grad():
        engine(x)  # gathers the whole model: the next decode forwards are resident
        engine(x)
        assert engine.hooks._resident_calls == 0 and engine.coordinator.generation_resident

        t = _paused_forward(engine, model, x, out)
        assert engine.hooks._resident_calls == 1  # the paused forward is a resident one
        with torch.enable_grad(), pytest.raises(zero3.ConcurrentForwardError):
            engine(x2)
        model.p.go.set()
        t.join(30)
        assert not t.is_alive()
        torch.testing.assert_close(out["y"], ref(x), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(engine(x2), ref(x2), rtol=1e-6, atol=1e-7)
    assert engine.context.claim.owner is None


def test_a_refused_call_s_post_forward_after_the_owner_s_forward_returned_leaves_the_step_alone():
    """Review 26X: torch runs a refused call's post-forward anyway (always_call). When the owner's
    forward had returned by then, the claim was free, so that post-forward took the refused call for
    a failed forward of the owner's step and aborted it (world 2: the ranks then disagreed). A user's
    post-hook that waits in the refused thread stands for that thread being preempted there."""
    ref, model, engine = _build()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x, x2 = torch.randn(3, 8), torch.randn(3, 8)
    owner_done, refused_ids, out = threading.Event(), [], {}

    def slow_post(module, args, output):
        if threading.get_ident() in refused_ids:
            assert owner_done.wait(30)

    model.register_forward_hook(slow_post, prepend=True, always_call=True)

    def owner() -> None:
        out["y"] = engine(x)
        owner_done.set()

    def refused() -> None:
        refused_ids.append(threading.get_ident())
        with pytest.raises(zero3.ConcurrentForwardError):
            engine(x2)
        out["refused"] = True

    model.p.hold.set()
    threads = [threading.Thread(target=owner), threading.Thread(target=refused)]
    threads[0].start()
    assert model.p.inside.wait(30)
    threads[1].start()
    while not refused_ids:
        threading.Event().wait(0.01)
    threading.Event().wait(0.2)  # the refused call reached its post-hooks
    model.p.go.set()
    for t in threads:
        t.join(30)
    assert out.get("refused") and engine.hooks.phase.name == "FORWARD"  # the owner's step is still open
    engine.backward(out["y"].square().sum())
    engine.step()
    ref(x).square().sum().backward()
    ref_opt.step()
    assert_same_weights(model, ref)


def _paused_forward(engine: zero3.Engine, model: nn.Module, x: torch.Tensor, out: dict) -> threading.Thread:
    """A thread whose forward of ``engine`` waits inside the model (``model.p.go`` lets it go on)."""
    def run() -> None:
        with torch.no_grad():
            out["y"] = engine(x)

    model.p.hold.set()
    t = threading.Thread(target=run)
    t.start()
    assert model.p.inside.wait(30)
    return t


def test_checkpoint_calls_and_memory_report_during_another_thread_s_forward_are_refused(tmp_path):
    """Probe 38A: a save_checkpoint from a second thread while training went unrefused; at world size 2
    the two threads' collectives interleaved on one group (gloo aborted both ranks, or errors named other
    causes), and memory_report read gradients the training thread was dropping (a segfault)."""
    ref, model, engine = _build()
    x = torch.randn(3, 8)
    out: dict[str, torch.Tensor] = {}
    t = _paused_forward(engine, model, x, out)
    for call in (lambda: engine.save_checkpoint(tmp_path, tag="t"), lambda: engine.load_checkpoint(tmp_path),
                 engine.consolidated_state_dict, engine.memory_report, lambda: engine.step(),
                 lambda: engine.backward(torch.ones((), requires_grad=True))):
        with pytest.raises(zero3.ConcurrentForwardError, match=r"began while thread .* runs a forward of the model"):
            call()
    model.p.go.set()
    t.join(30)
    assert not t.is_alive() and engine.context.claim.owner is None
    torch.testing.assert_close(out["y"], ref(x), rtol=1e-6, atol=1e-7)
    assert not (tmp_path / "t").exists()  # the refused save wrote nothing
    engine.save_checkpoint(tmp_path, tag="t")  # alone, it works
    assert engine.memory_report()["param_shard_bytes"] > 0


def test_a_forward_or_a_save_while_another_thread_s_engine_step_runs_is_refused(tmp_path):
    ref, model, engine = _build()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x, x2 = torch.randn(3, 8), torch.randn(3, 8)
    inside, go = threading.Event(), threading.Event()

    def wait_in_step(optimizer, args, kwargs):
        if not go.is_set():
            inside.set()
            assert go.wait(30)

    engine.backward(engine(x).square().sum())
    handle = engine.optimizer.register_step_pre_hook(wait_in_step)  # the user's SGD, stepping the shards
    t = threading.Thread(target=engine.step)
    t.start()
    assert inside.wait(30)
    with pytest.raises(zero3.ConcurrentForwardError, match=r"a forward of the model began while thread .* runs "
                                                           r"engine\.step\(\)"):
        engine(x2)
    with pytest.raises(zero3.ConcurrentForwardError, match=r"engine\.save_checkpoint\(\) began"):
        engine.save_checkpoint(tmp_path)
    go.set()
    t.join(30)
    handle.remove()
    assert not t.is_alive() and engine.context.claim.owner is None
    ref(x).square().sum().backward()
    ref_opt.step()
    assert_same_weights(model, ref)
    with torch.no_grad():
        torch.testing.assert_close(engine(x2), ref(x2), rtol=1e-6, atol=1e-7)


def test_leaving_generation_while_another_thread_decodes_waits_for_its_forward(caplog):
    """Probe 38A: a generate thread feeding a streamer, the block left early: the mode ended under the
    thread's forward (an internal error, then divergence and the group closed at world size 2)."""
    ref, model, engine = _build()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x = torch.randn(3, 8)
    out: dict[str, torch.Tensor] = {}
    with engine.generation():
        with torch.no_grad():
            engine(x)
        t = _paused_forward(engine, model, x, out)
        threading.Timer(0.3, model.p.go.set).start()
    assert "was left while thread" in caplog.text  # it waited, and said so
    t.join(30)
    assert not t.is_alive() and engine.context.claim.owner is None
    torch.testing.assert_close(out["y"], ref(x), rtol=1e-6, atol=1e-7)
    assert not engine.coordinator.generating and not engine.coordinator.live_params
    engine.backward(engine(x).square().sum())  # training goes on as torch's
    engine.step()
    ref(x).square().sum().backward()
    ref_opt.step()
    assert_same_weights(model, ref)


def test_collective_accessors_and_clipping_during_another_thread_s_forward_are_refused():
    """Review 38R1: safe_get_full_fp32_param and clip_grad_norm_ from a monitoring thread during training
    aborted both ranks in gloo at world size 2; review 38R4: a local accessor's read crashed a rank too."""
    ref, model, engine = _build()
    x = torch.randn(3, 8)
    out: dict[str, torch.Tensor] = {}
    t = _paused_forward(engine, model, x, out)
    w = model.b.weight
    for call in (lambda: zero3.safe_get_full_fp32_param(w), lambda: zero3.safe_set_full_fp32_param(w, torch.zeros(4, 8)),
                 lambda: zero3.clip_grad_norm_(engine, 1.0), lambda: engine.offload_states(),
                 lambda: zero3.safe_get_local_fp32_param(w)):
        with pytest.raises(zero3.ConcurrentForwardError, match=r"began while thread .* runs a forward of the model"):
            call()
    assert engine.get_lr() == [0.1]  # what a logger thread may read while training runs
    model.p.go.set()
    t.join(30)
    torch.testing.assert_close(zero3.safe_get_full_fp32_param(w), ref.b.weight, rtol=0, atol=0)


@pytest.mark.parametrize("where", ["another thread", "this thread"])
@pytest.mark.parametrize("how", ["engine", "model"])
def test_a_forward_ended_by_a_base_exception_does_not_hold_the_engine_for_other_threads(how, where):
    """Review 38R1: torch runs always_call hooks for Exception only, so a forward ended by KeyboardInterrupt or
    SystemExit kept its claim: every other thread's calls were refused for good, and leaving generation()
    waited for ever once that thread had ended."""
    ref, model, engine = _build()
    run = engine if how == "engine" else model
    x = torch.randn(3, 8)

    def interrupted() -> None:
        def stop(module, args, output):
            raise KeyboardInterrupt

        handle = model.p.register_forward_hook(stop)
        try:
            run(x)
        except KeyboardInterrupt:
            pass
        finally:
            handle.remove()

    if where == "this thread":  # Ctrl-C in a notebook cell, the cell run again: its no-grad forward ends the step
        with torch.enable_grad():
            interrupted()
    else:
        t = threading.Thread(target=interrupted)
        t.start()
        t.join(30)
        assert not t.is_alive()
    with torch.no_grad():  # another thread (this one) can use the engine: the ended thread's claim is taken over
        torch.testing.assert_close(engine(x), ref(x), rtol=1e-6, atol=1e-7)
    with torch.no_grad(), engine.generation():  # and leave generation mode
        torch.testing.assert_close(engine(x), ref(x), rtol=1e-6, atol=1e-7)
    assert engine.context.claim.owner is None


def test_a_decode_forward_ended_by_ctrl_c_leaves_the_engine_usable():
    """Review 38R4: a KeyboardInterrupt in a resident decode forward (the whole model gathered in
    engine.generation()) left the resident count at 1 and the submodule hooks off: every later forward
    failed on a partitioned parameter."""
    ref, model, engine = _build()
    x = torch.randn(3, 8)
    with torch.no_grad(), engine.generation():
        engine(x)  # the whole model gathered: the next forwards are resident
        handle = model.p.register_forward_hook(lambda m, a, o: (_ for _ in ()).throw(KeyboardInterrupt))
        with pytest.raises(KeyboardInterrupt):
            model(x)
        handle.remove()
        torch.testing.assert_close(model(x), ref(x), rtol=1e-6, atol=1e-7)
    engine.backward(engine(x).square().sum())
    engine.step()
    assert engine.context.claim.owner is None


def _interrupted(model: nn.Module, x: torch.Tensor, done: threading.Event | None = None) -> None:
    """``model(x)`` ended by a KeyboardInterrupt inside it (Ctrl-C), caught; then ``done`` is set."""
    handle = model.p.register_forward_hook(lambda m, a, o: (_ for _ in ()).throw(KeyboardInterrupt))
    try:
        model(x)
    except KeyboardInterrupt:
        pass
    finally:
        handle.remove()
        if done is not None:
            done.set()


def test_an_ended_holder_s_thread_id_given_to_a_new_thread_does_not_keep_the_engine():
    """Review 38R4: threads were told apart by id; the next thread started after one ended holding the
    engine got its id, and the engine was refused for as long as that unrelated thread lived."""
    ref, model, engine = _build()
    x = torch.randn(3, 8)
    t = threading.Thread(target=_interrupted, args=(model, x))
    t.start()
    t.join(30)
    stop = threading.Event()
    idle = threading.Thread(target=stop.wait, args=(30,))  # most often given the ended thread's id
    idle.start()
    try:
        with torch.no_grad():
            torch.testing.assert_close(engine(x), ref(x), rtol=1e-6, atol=1e-7)
    finally:
        stop.set()
        idle.join(30)


def test_a_thread_not_started_by_threading_that_ended_holding_the_engine_does_not_keep_it():
    """Review 38R5: a thread not started by ``threading`` (a C++ pool's, ``_thread``'s) has a stand-in
    object that says it is alive for ever, so one that ended holding the engine kept it for good."""
    import _thread

    ref, model, engine = _build()
    x = torch.randn(3, 8)
    done = threading.Event()
    _thread.start_new_thread(_interrupted, (model, x, done))
    assert done.wait(30)
    for _ in range(100):  # the raw thread's last bytecodes after set()
        if engine.context.claim.owner is None:
            break
        with torch.no_grad():
            try:
                torch.testing.assert_close(engine(x), ref(x), rtol=1e-6, atol=1e-7)
                break
            except zero3.ConcurrentForwardError:
                threading.Event().wait(0.05)
    with torch.no_grad():
        torch.testing.assert_close(engine(x), ref(x), rtol=1e-6, atol=1e-7)


def test_a_backward_s_hook_on_autograd_s_device_thread_may_call_the_engine(monkeypatch):
    """Review 38R5: on CUDA autograd runs a backward's hooks on a device thread of its own; a hook that
    reads an accessor there while engine.backward holds the engine is part of that call. (The rule,
    with the device thread stood for by a thread whose graph task is set; no GPU here.)"""
    from zero3.runtime.thread_claim import BACKWARD, FORWARD, ThreadClaim

    claim = ThreadClaim()
    token = claim.take(BACKWARD)
    said = {}

    def device_thread(in_graph_task: bool) -> None:
        monkeypatch.setattr(torch._C, "_current_graph_task_id", lambda: 7 if in_graph_task else -1)
        try:
            said[in_graph_task] = claim.take("zero3.safe_get_local_fp32_param")
        except zero3.ConcurrentForwardError as exc:
            said[in_graph_task] = exc

    for in_graph_task in (True, False):
        t = threading.Thread(target=device_thread, args=(in_graph_task,))
        t.start()
        t.join(30)
    assert said[True] is None and isinstance(said[False], zero3.ConcurrentForwardError)
    claim.release(token)
    assert claim.take(FORWARD) is not None
