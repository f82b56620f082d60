"""Uses of a model zero3 manages that cannot work, refused with the way that does: copying it
(``copy.deepcopy``, pickle), compiling it whole (``torch.compile(model)``), running it under a
torch.func transform while it gathers parameters, a double backward through released weights, and embeddings whose
forward or gradient zero3's sharding cannot carry (``sparse=True``, ``max_norm``), tensors that share a
parameter's memory, and a parameter layout that gathers would drop (``channels_last``). Torch's
parametrize and prune calls are routed through zero3's checks in `parametrize_routes`."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm

from ..comm.process_group import is_dtensor
from ..errors import ZeroConfigError, ZeroStateError
from ..partition.param import ZeroParameter

try:  # 20 ns: whether a torch.compile'd call is running (dynamo then compiles every frame entered)
    from torch._C._dynamo.eval_frame import get_eval_frame_callback as eval_frame_callback
except ImportError:  # pragma: no cover - a torch without dynamo
    def eval_frame_callback() -> Any:
        return None

EAGER = (None, False)
"""What `eval_frame_callback` returns outside any torch.compile'd call. Inside one, where dynamo
traces a hook, the call itself breaks the graph and runs eagerly, so it tells there too."""


def refuse_compiled_call() -> None:
    """A module's forward began inside a torch.compile'd call (the hooks found ``eval_frame_callback()
    not in EAGER``): dynamo would compile zero3's hooks, or read parameters they have not gathered."""
    raise ZeroStateError(
        "torch.compile of a model zero3 manages: a module's forward ran inside a torch.compile'd call "
        "(torch.compile(model) or torch.compile(engine), model.compile() before or after initialize, or a compiled "
        "function that calls the model or the engine), where dynamo compiles every frame, zero3's hooks too (they run "
        "in Python, outside any graph). Compile its blocks instead, before zero3.initialize: zero3.compile_blocks(model, [Block]) "
        "(docs/compile.md), as FSDP2 users compile per block; or call the model uncompiled")


transform_level = torch._C._functorch.maybe_current_level
"""80 ns: None outside every torch.func transform (grad, vjp, jvp, vmap, jacrev, functional_call inside one)."""


def refuse_transform(module: str) -> None:
    """A module whose parameters zero3 gathers ran inside a torch.func transform (`transform_level`
    not None). The gather writes the full parameter in place and a release frees it, which a transform
    forbids for tensors it captured (torch raises, with a different error on each rank, when it does);
    and the transform's own backward would run zero3's hooks at its level. Refused before the gather,
    on every rank alike: every rank runs the same forward under the same transform."""
    raise ZeroStateError(
        f"module {module!r} ran inside a torch.func transform (grad, vjp, jvp, vmap, jacrev, ...) "
        "with parameters zero3 gathers for it; a transform cannot follow zero3's in-place gathers and "
        "releases. Either make those parameters persistent (param_persistence_threshold above their size: "
        "persistent parameters stay gathered and a transform works with them), or run the transform over a "
        "plain copy of the model (model.load_state_dict(engine.consolidated_state_dict()) on an "
        "unpartitioned instance). zero3 gathered nothing for it")


def refuse_copy(module: Any) -> ZeroStateError:
    """``copy.deepcopy`` or pickle of a model zero3 manages: its hooks hold the engine and its process
    group, and its parameters are shards, so the copy could not work; the error names what does."""
    what = type(module).__name__ if module is not None else "a module"
    return ZeroStateError(
        f"cannot deepcopy or pickle {what}: zero3 manages it (its hooks hold the engine and its process group, "
        "and its parameters are shards). For a second copy (an EMA, a reference model), build another "
        "instance under zero3.Init, give it an engine of its own (zero3.initialize(copy, None, config)) and "
        "copy the weights shard by shard with zero3.safe_get_local_fp32_param and safe_set_local_fp32_param "
        "(docs/api.md, 'A second copy of a model'); to save it, use engine.save_checkpoint() or "
        "engine.consolidated_state_dict(); to export, fuse or quantize it (torch.ao, fuse_conv_bn_eval), load "
        "engine.consolidated_state_dict() into a plain instance; or deep-copy it before zero3.Init/initialize")


def refuse_unshardable_embeddings(model: nn.Module) -> None:
    """At ``initialize``, before it changes anything: an embedding with ``sparse=True`` (its gradients
    are sparse; zero3 reduces dense gradient shards) or with ``max_norm`` (its forward renormalizes the
    looked-up rows of the weight in place; zero3 runs the forward on a gathered copy, so the change
    would be lost and training would differ from torch's without a word: FSDP2 loses it the same way,
    checked on 2 ranks). Module attributes only: ``F.embedding(idx, p, max_norm=...)`` on a module's
    own parameter is not seen (docs/api.md: what works instead)."""
    for name, m in model.named_modules():
        if not isinstance(m, (nn.Embedding, nn.EmbeddingBag)):
            continue
        what = f"{name or 'the model'} ({type(m).__name__})"
        if m.sparse:
            raise ZeroConfigError(
                f"{what} has sparse=True: its gradients are sparse, and zero3 reduces dense gradient shards. "
                "Build it with sparse=False; zero3.initialize changed nothing")
        if m.max_norm is not None:
            raise ZeroConfigError(
                f"{what} has max_norm={m.max_norm}: each forward renormalizes the rows it looks up in the weight "
                "itself, and zero3 runs the forward on a gathered copy of the weight that it then frees, so the "
                "renormalization would be lost (on every rank; FSDP2 loses it too) and training would differ "
                "from torch's. Build it without max_norm (to bound the rows, rescale them between steps inside "
                "zero3.GatheredParameters(..., modifier_rank=0)); zero3.initialize changed nothing")


def _span(t: torch.Tensor) -> tuple[float, float]:
    """The bytes of its storage ``t`` can reach (empty for no elements). A partitioned parameter's
    storage is empty while it is released (its data is in its shards), so any other tensor with
    elements on it is a view of it: the whole storage."""
    if t.numel() == 0:
        return 0, 0
    if t.untyped_storage().nbytes() == 0:
        return 0, math.inf
    start = t.storage_offset() * t.element_size()
    reach = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
    return start, start + reach * t.element_size()


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` may share an element (their byte spans on one storage meet)."""
    if _storage_key(a) is None or _storage_key(a) != _storage_key(b):
        return False
    (s, e), (s2, e2) = _span(a), _span(b)
    return s < e and s2 < e2 and s < e2 and s2 < e


def refuse_shared_storage(model: nn.Module) -> None:
    """At ``initialize``, before it changes anything: a parameter whose memory another parameter, a
    buffer or a plain tensor attribute of a module also uses. Partitioning gives each parameter storage
    of its own and frees the full one, so two overlapping parameters would train apart (torch moves both
    with either's step), and a tensor attribute kept as a view (``self.rows = self.lin.weight[:2]``)
    would keep the first values, or, built under ``Init``, read freed memory (probe 29A). Parameters
    that only sit side by side in one tensor (``base[:6]``, ``base[6:]``: a flat buffer's views) share no
    element and pass. One sort per storage: thousands of views of one flat buffer cost milliseconds."""
    spans: dict[int, list[tuple[float, float, str, torch.Tensor]]] = {}
    seen: set[int] = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen or p.numel() == 0:
            continue  # the same Parameter under two names is a tie zero3 keeps as one
        seen.add(id(p))
        key = _storage_key(p)
        if key is not None and not isinstance(p, ZeroParameter) and _span(p)[1] > p.untyped_storage().nbytes():
            raise ZeroConfigError(  # read, it crashed the process (probe 37A)
                f"parameter {name} {tuple(p.shape)} views memory that was freed (its storage holds "
                f"{p.untyped_storage().nbytes()} bytes): made from a gathered parameter inside "
                "zero3.GatheredParameters, it kept a view of memory the block's end released. Make it from a "
                ".clone() inside the block; zero3.initialize changed nothing")
        if key is not None:
            spans.setdefault(key, []).append((*_span(p), name, p))
    for items in spans.values():
        items.sort(key=lambda item: item[0])
        widest = items[0]
        for item in items[1:]:
            if item[0] < widest[1] and not (isinstance(item[3], ZeroParameter) and isinstance(widest[3], ZeroParameter)):
                raise ZeroConfigError(
                    f"parameters {widest[2]} and {item[2]} share memory (one is a view of the other, or both of "
                    "one tensor): zero3 gives each parameter its own shards, so they would train apart where torch "
                    "moves both. Tie them as one Parameter (module.b.weight = module.a.weight), or give each its "
                    "own tensor (.clone()); zero3.initialize changed nothing")
            if item[1] > widest[1]:
                widest = item
    for mname, m in model.named_modules():
        # torch's old spectral_norm keeps weight_orig's .data as the attribute `weight`, and its forward
        # pre-hook sets it anew before every use: never stale (as the old weight_norm's, a new tensor)
        redone = {h.name for h in m._forward_pre_hooks.values() if isinstance(h, (SpectralNorm, WeightNorm))}
        found = [("tensor attribute", a, t) for a, t in vars(m).items()
                 if isinstance(t, torch.Tensor) and not isinstance(t, nn.Parameter) and a not in redone]
        found += [("buffer", a, t) for a, t in m._buffers.items() if t is not None]
        for kind, attr, t in found:
            hit = next((item for item in spans.get(_storage_key(t), ()) if _overlap(t, item[3])), None)
            if hit is not None:
                raise ZeroConfigError(
                    f"{kind} {f'{mname}.{attr}' if mname else attr} shares memory with parameter {hit[2]} (one is a "
                    "view of the other, or its .data): zero3 partitions the parameter into shards and frees its "
                    "full data, so the tensor would keep stale values or read freed memory. Compute it from the "
                    f"parameter inside forward (a property returning a view of {hit[2]}), or keep a .clone(); "
                    "zero3.initialize changed nothing")


def _storage_key(t: torch.Tensor) -> int | None:
    """Its storage's identity, or None for a tensor without one (sparse, mkldnn): no parameter's view."""
    if t.layout is not torch.strided:
        return None
    try:
        return t.untyped_storage()._cdata
    except (NotImplementedError, RuntimeError):
        return None


def refuse_memory_format(model: nn.Module) -> None:
    """At ``initialize``: a parameter in ``torch.channels_last`` (or ``channels_last_3d``) layout.
    Every gather hands a parameter back contiguous, so the layout asked for would be dropped without a
    word, as it is refused after ``initialize`` (partition/conversion.py). Other strides (a transposed
    parameter) only change speed, not values, and come back contiguous too (docs/api.md)."""
    for name, p in model.named_parameters():
        if isinstance(p, ZeroParameter) or p.dim() not in (4, 5) or p.is_contiguous():
            continue
        fmt = torch.channels_last if p.dim() == 4 else torch.channels_last_3d
        if p.is_contiguous(memory_format=fmt):
            raise ZeroConfigError(
                f"parameter {name} is in {fmt} layout (its strides are {fmt}'s, as model.to(memory_format={fmt}) "
                "makes them): zero3 gathers every parameter contiguous, so that layout would be dropped. Make it "
                "contiguous before zero3.initialize (model.to(memory_format=torch.contiguous_format), or "
                f"p.data = p.data.contiguous()); for a convolution, convert its inputs instead (x.to(memory_format={fmt})): "
                "torch's convolutions follow their input's layout. zero3.initialize changed nothing")


def refuse_dtensors(model: nn.Module) -> None:
    """At ``initialize``: a DTensor parameter (torch's tensor parallelism, ``parallelize_module``, or FSDP2's
    ``fully_shard``). zero3 shards plain tensors; partitioning a DTensor failed inside torch's dispatch,
    which the first broadcast reported as a timeout and closed zero3's group (probe 38F)."""
    for name, p in model.named_parameters():
        if is_dtensor(p):
            raise ZeroConfigError(
                f"parameter {name} is a DTensor (placements {list(p.placements)}: torch's parallelize_module or "
                "FSDP2's fully_shard made it): zero3 shards plain tensors and does the data-parallel sharding itself. "
                "Give zero3.initialize the model before fully_shard; for tensor parallelism beside zero3, use "
                "Megatron-style layers and pass mpu= (docs/api.md). zero3.initialize changed nothing")


def unshardable(p: torch.Tensor) -> bool:
    """A parameter zero3 cannot split into flat shards: complex, or not strided (sparse)."""
    return p.is_complex() or p.layout is not torch.strided


def unshardable_refusal(name: str, p: torch.Tensor, tail: str) -> ZeroConfigError:
    """The refusal of an `unshardable` parameter: a sparse one failed inside torch's reshape (review 29Z1)."""
    if p.layout is not torch.strided:
        return ZeroConfigError(
            f"parameter {name} is a {p.layout} tensor: zero3 splits, reduces and stores dense tensors only. Keep it "
            f"dense (nn.Parameter(t.to_dense())) and make the sparse view in the forward; {tail}")
    return complex_refusal(name, tail)


def complex_refusal(name: str, tail: str = "nothing was partitioned") -> ZeroConfigError:
    """A complex parameter (``torch.complex64``): zero3's gradient reduction, flat buffers and
    checkpoints carry real dtypes, so its gradient lost its imaginary part at world size 2 and more
    (torch only warned) and a checkpoint failed. Refused by ``initialize`` and by ``Init``."""
    return ZeroConfigError(
        f"parameter {name} is complex: zero3 reduces, stores and checkpoints real tensors only. Keep the real and "
        "imaginary parts as one real parameter with a last dimension of 2 and view it in the forward "
        f"(torch.view_as_complex(self.w)); {tail}")


def create_graph_refusal(module: str) -> ZeroStateError:
    """A backward with ``create_graph=True`` builds a graph of its own that saves the gathered
    weights, which zero3 releases when the module's backward ends: the backward through that graph (a
    gradient penalty, a Hessian-vector product) would then fail inside autograd on an empty
    parameter. Refused at the first such module (``module``); the hooks end the step aborted."""
    return ZeroStateError(
        f"a backward with create_graph=True (double backward: a gradient penalty, a Hessian-vector "
        f"product) reached {module or 'the model'}, whose partitioned parameters zero3 "
        "releases after their module's backward; the graph it builds saves them, so the backward "
        "through it would fail. Keep those parameters gathered across both backwards: "
        "`with zero3.GatheredParameters(list(model.parameters())):` around the forward and both "
        "backwards, or a param_persistence_threshold above their size")


STOP_RECOMPUTATION = getattr(torch.utils.checkpoint, "_StopRecomputationError", ())
"""What torch's non-reentrant checkpoint raises through the recompute's forward to stop it early (its
default): for a checkpoint of the whole model, the root's post-forward sees it, and it is no failure
of the step (hooks.py `_post_forward`; review 26X: the step was aborted, and the backward failed)."""


def unpartitioned_refusal(name: str, module: str, p: torch.Tensor) -> ZeroStateError:
    """A module's parameter ``name`` is not partitioned when its call collects them: registered after
    ``initialize`` (probe 34C: named neither, and advised Init to a model built under it), or the plain
    tensor ``torch.func.functional_call`` put there in the module's first call (probe 34A), or the stand-in
    ``torch.export`` traces with (probe 37X: it blamed the user for a registration)."""
    if torch.compiler.is_exporting():
        return ZeroStateError(
            f"torch.export reached module {module or '<root>'!r}, whose parameter {name!r} it traces as a stand-in "
            "zero3 does not manage: exporting a model zero3 manages is not supported. Export a plain copy: load "
            "engine.consolidated_state_dict() into a plain instance of the model (on every rank: a collective)")
    return ZeroStateError(
        f"parameter {name!r} of module {module or '<root>'!r} with shape {tuple(p.shape)} is not partitioned: " + (
            "it was registered after zero3.initialize (made in a forward, or set as an attribute since), and zero3 "
            "partitions the parameters a model has at initialize. Register it before initialize (in __init__)"
            if isinstance(p, nn.Parameter) else "a plain tensor in its place (torch.func.functional_call) in the "
            "module's first call, before zero3 knew its parameters: call it plainly once first (a forward without "
            "functional_call, under torch.no_grad() if you like), then functional_call works"))


def removed_refusal(module: str) -> ZeroStateError:
    """A backward through a forward run before ``engine.remove_hooks()`` reached ``module``."""
    return ZeroStateError(f"a backward reached {module or 'the model'} through a forward run before "
                          "engine.remove_hooks(): its gradients would not be reduced into the shards; run the "
                          "backward first, or the forward again under a new engine")


def unscaled_backward_refusal(p: torch.Tensor | None, clipped: bool) -> ZeroStateError:
    """Under fp16 loss scaling a gradient reached parameter ``p`` from a backward that was no
    engine's ``engine.backward``: it carries no loss scale, while the step divides every gradient by
    this engine's, so the update would be that many times too small (and mixed with the scaled
    gradients of the same accumulation window). Or (``clipped``) from another engine's backward
    after clipping unscaled this window's gradients, whose overflow check and norm it would miss.
    The hooks drop what autograd accumulated before it is reduced and end the step aborted."""
    name = p._zero.name if isinstance(p, ZeroParameter) else "a parameter" if p is not None else "this model"
    if clipped:
        return ZeroStateError(
            f"a gradient reached {name} from a backward (another engine's) after clip_grad_norm_ unscaled this "
            "engine's gradients for its step: their overflow check and norm are taken, and this gradient would "
            "join them unchecked. Clip after the last backward that reaches this model; nothing of this "
            "backward was reduced")
    return ZeroStateError(
        f"a gradient reached {name} from a backward that was not engine.backward(loss) (loss.backward(), "
        "torch.autograd.backward, or a torch.amp.GradScaler's) while fp16 loss scaling is on: "
        "engine.backward multiplies the loss by the loss scale and engine.step() divides the gradients "
        "by it, so this gradient would step that many times too small. Call engine.backward(loss) (any "
        "engine's: another engine's backward reaching this model is rescaled); nothing of this backward was reduced")


def swapped_or_traced_refusal(name: str, swapped: bool) -> ZeroStateError:
    """A module's forward began where zero3's hooks cannot serve it (probe 37X): a module torch.ao swapped in
    for one zero3 manages (``quantize_dynamic``/``prepare_qat``/``fuse_modules_qat`` with ``inplace=True``
    copy its hooks onto the new module, which then raised a TypeError from zero3's hook), or a
    ``torch.jit.trace``, whose tracer met the first gather's collective and closed zero3's process group."""
    what = (f"module {name or '<root>'} was replaced by another that kept its zero3 hooks (torch.ao quantization or "
            "fusion with inplace=True swaps modules and copies their hooks)") if swapped else \
        f"torch.jit.trace reached module {name or '<root>'}, whose parameters zero3 gathers with collectives"
    return ZeroStateError(
        f"{what}: zero3 cannot run it. Quantize, fuse or trace a plain copy instead: load "
        "engine.consolidated_state_dict() into a plain instance of the model (on every rank: a collective)")
