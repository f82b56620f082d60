"""ZeroConfig: DeepSpeed-equal defaults, immutability, construction from dicts/JSON, validation."""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from zero3 import ZeroConfig, ZeroConfigError
from zero3.config import resolve_config

# DeepSpeed's documented ZeRO-3 defaults (deepspeed/runtime/zero/config.py).
DEEPSPEED_DEFAULTS = {
    "prefetch_bucket_size": 50_000_000,
    "max_live_parameters": 1_000_000_000,
    "max_reuse_distance": 1_000_000_000,
    "param_persistence_threshold": 100_000,
    "reduce_bucket_size": 500_000_000,
    "allgather_bucket_size": 500_000_000,
    "overlap_comm": True,
}


@pytest.mark.parametrize("name,expected", sorted(DEEPSPEED_DEFAULTS.items()))
def test_default_equals_deepspeed_default(name, expected):
    value = ZeroConfig().to_dict()[name]
    assert value == expected
    assert type(value) is type(expected)


def test_config_is_immutable():
    cfg = ZeroConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.budget.max_live_parameters = 5  # type: ignore[misc]
    assert cfg.budget.max_live_parameters == 1_000_000_000


def test_config_rejects_new_attributes():
    cfg = ZeroConfig()
    # frozen+slots dataclass: CPython 3.11 raises TypeError (a super() quirk of slots=True) rather
    # than FrozenInstanceError for a name that is not a field; what matters is that it is refused.
    with pytest.raises((dataclasses.FrozenInstanceError, AttributeError, TypeError)):
        cfg.not_a_field = 1  # type: ignore[attr-defined]
    assert not hasattr(cfg, "not_a_field")


def test_constructor_is_keyword_only():
    with pytest.raises(TypeError):
        ZeroConfig(5)  # type: ignore[misc]


def test_from_dict_with_our_names_sets_exactly_those_fields():
    d = {"max_live_parameters": 123, "prefetch_bucket_size": 0, "overlap_comm": False,
         "param_persistence_threshold": 7, "reduce_scatter_impl": "all_reduce"}
    cfg = ZeroConfig.from_dict(d)
    for k, v in d.items():
        assert cfg.to_dict()[k] == v
    untouched = ZeroConfig().to_dict()
    for k, v in cfg.to_dict().items():
        if k not in d:
            assert v == untouched[k], k


def test_from_dict_coerces_integral_floats_to_int():
    cfg = ZeroConfig.from_dict({"max_live_parameters": 1e6, "reduce_bucket_size": 5e8})
    assert cfg.budget.max_live_parameters == 1_000_000 and type(cfg.budget.max_live_parameters) is int
    assert cfg.comm.reduce_bucket_size == 500_000_000 and type(cfg.comm.reduce_bucket_size) is int


def test_from_dict_rejects_non_integral_float():
    with pytest.raises(ValueError, match=r"max_live_parameters.*1\.5"):
        ZeroConfig.from_dict({"max_live_parameters": 1.5})


def test_to_dict_round_trips():
    cfg = ZeroConfig(max_reuse_distance=17, overlap_comm=False, max_live_bytes=1024)
    assert ZeroConfig.from_dict(cfg.to_dict()) == cfg


def test_replace_validates_the_new_value():
    cfg = ZeroConfig()
    assert cfg.replace(max_live_parameters=3).budget.max_live_parameters == 3
    with pytest.raises(ValueError, match=r"max_live_parameters.*-3"):
        cfg.replace(max_live_parameters=-3)


DEEPSPEED_DICT = {
    "train_batch_size": 8,
    "gradient_accumulation_steps": 1,
    "zero_optimization": {
        "stage": 3,
        "stage3_max_live_parameters": 1e6,
        "stage3_prefetch_bucket_size": 2e5,
        "stage3_max_reuse_distance": 3e6,
        "stage3_param_persistence_threshold": 1e3,
        "stage3_model_persistence_threshold": 1e7,
        "reduce_bucket_size": 4e5,
        "allgather_bucket_size": 6e5,
        "overlap_comm": False,
        "contiguous_gradients": True,  # understood, no effect
    },
}


def test_from_dict_maps_deepspeed_zero_optimization_keys():
    cfg = ZeroConfig.from_dict(DEEPSPEED_DICT)
    expected = {
        "max_live_parameters": 1_000_000,
        "prefetch_bucket_size": 200_000,
        "max_reuse_distance": 3_000_000,
        "param_persistence_threshold": 1_000,
        "model_persistence_threshold": 10_000_000,
        "reduce_bucket_size": 400_000,
        "allgather_bucket_size": 600_000,
        "overlap_comm": False,
    }
    for k, v in expected.items():
        got = cfg.to_dict()[k]
        assert got == v, k
        assert type(got) is type(v), (k, type(got))


def test_deepspeed_dict_without_zero_section_gives_defaults():
    # The batch sizes are kept (issue 20: the world size fixes the missing ones at initialize).
    assert ZeroConfig.from_dict({"train_batch_size": 8}) == ZeroConfig(train_batch_size=8)
    assert ZeroConfig.from_dict({"train_batch_size": 8}).replace(train_batch_size=None) == ZeroConfig()


def test_deepspeed_dict_without_stage_is_accepted_as_stage3():
    cfg = ZeroConfig.from_dict({"zero_optimization": {"stage3_max_live_parameters": 10}})
    assert cfg.budget.max_live_parameters == 10


@pytest.mark.parametrize("stage", [0, 1, 2, "3"])
def test_deepspeed_stage_other_than_3_is_rejected(stage):
    with pytest.raises(ValueError, match=r"stage must be 3.*got " + re.escape(repr(stage))):
        ZeroConfig.from_dict({"zero_optimization": {"stage": stage}})


def test_zero_optimization_must_be_a_dict():
    with pytest.raises(ValueError, match=r"zero_optimization must be a dict, got \[3\]"):
        ZeroConfig.from_dict({"zero_optimization": [3]})


def test_from_json_reads_a_file(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(DEEPSPEED_DICT))
    assert ZeroConfig.from_json(path) == ZeroConfig.from_dict(DEEPSPEED_DICT)
    assert ZeroConfig.from_json(str(path)).budget.max_live_parameters == 1_000_000


def test_from_json_with_invalid_json_names_the_file(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match=re.escape(str(path))):
        ZeroConfig.from_json(path)


def test_resolve_config_accepts_every_documented_form(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"max_live_parameters": 9}))
    cfg = ZeroConfig(max_live_parameters=9)
    assert resolve_config(None) == ZeroConfig()
    assert resolve_config(cfg) is cfg
    assert resolve_config({"max_live_parameters": 9}) == cfg
    assert resolve_config(path) == cfg
    assert resolve_config(str(path)) == cfg
    with pytest.raises(ValueError, match="got int"):
        resolve_config(42)


def test_from_dict_rejects_non_dict():
    with pytest.raises(ValueError, match="config must be a dict, got list"):
        ZeroConfig.from_dict([("max_live_parameters", 1)])  # type: ignore[arg-type]


def test_unknown_key_is_named_and_closest_key_suggested():
    with pytest.raises(ValueError, match=r"unknown config key 'max_live_parameter'; did you mean 'max_live_parameters'\?"):
        ZeroConfig.from_dict({"max_live_parameter": 5})


def test_unknown_key_error_is_a_zero_config_error():
    with pytest.raises(ZeroConfigError):
        ZeroConfig.from_dict({"totally_unrelated": 5})


def test_unknown_key_inside_zero_optimization_is_named_and_suggested():
    with pytest.raises(ValueError, match=(r"zero_optimization: unknown config key 'stage3_max_live_parameter'; "
                                          r"did you mean 'stage3_max_live_parameters'\?")):
        ZeroConfig.from_dict({"zero_optimization": {"stage": 3, "stage3_max_live_parameter": 1e6}})


def test_unknown_top_level_deepspeed_key_is_named_and_suggested():
    with pytest.raises(ValueError, match=r"unknown config key 'train_batch_sizes'; did you mean 'train_batch_size'\?"):
        ZeroConfig.from_dict({"train_batch_sizes": 8, "zero_optimization": {"stage": 3}})


@pytest.mark.parametrize("key,value,pattern", [
    ("max_live_parameters", "1e9", r"max_live_parameters must be an int >= 0, got '1e9' \(str\)"),
    ("max_live_parameters", True, r"max_live_parameters must be an int >= 0, got True \(bool\)"),
    ("prefetch_bucket_size", None, r"prefetch_bucket_size must be an int >= 0, got None \(NoneType\)"),
    ("max_reuse_distance", -1, r"max_reuse_distance must be >= 0, got -1"),
    ("param_persistence_threshold", -5.0, r"param_persistence_threshold must be >= 0, got -5"),
    ("overlap_comm", 1, r"overlap_comm must be a bool, got 1 \(int\)"),
    ("overlap_comm", "yes", r"overlap_comm must be a bool, got 'yes' \(str\)"),
    ("max_live_bytes", -1, r"max_live_bytes must be >= 0, got -1"),
    ("max_live_bytes", "big", r"max_live_bytes must be None or an int >= 0, got 'big'"),
    ("reduce_scatter_impl", "ring", r"reduce_scatter_impl must be one of .*got 'ring'"),
    ("max_traces", 0, r"max_traces must be >= 1, got 0"),
])
def test_invalid_value_names_key_and_value(key, value, pattern):
    with pytest.raises(ValueError, match=pattern):
        ZeroConfig.from_dict({key: value})
    if not isinstance(value, float):
        with pytest.raises(ValueError, match=pattern):
            ZeroConfig(**{key: value})


def test_invalid_value_inside_deepspeed_dict_names_the_key_as_written():
    """Probe 29B: the error named zero3's flat knob (prefetch_bucket_size), not the key in the file."""
    with pytest.raises(ValueError, match=r"zero_optimization.stage3_max_live_parameters must be >= 0, got -1"):
        ZeroConfig.from_dict({"zero_optimization": {"stage": 3, "stage3_max_live_parameters": -1}})
    with pytest.raises(ValueError, match=r"zero_optimization.stage3_prefetch_bucket_size must be an int >= 0, "
                                         r"got 'big' \(str\)"):
        ZeroConfig.from_dict({"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": "big"}})
    with pytest.raises(ValueError, match=r"fp16.loss_scale_window must be an int >= 1, got 'x'"):
        ZeroConfig.from_dict({"fp16": {"enabled": True, "loss_scale_window": "x"}})
    for bad in (0, -2):  # one bound, whichever side (review 29X: -1 was ">= 0", 0 ">= 1")
        with pytest.raises(ValueError, match=rf"aio.thread_count must be >= 1, got {bad}"):
            ZeroConfig.from_dict({"zero_optimization": {"stage": 3}, "aio": {"thread_count": bad}})
        with pytest.raises(ValueError, match=rf"zero_optimization.sub_group_size must be >= 1, got {bad}"):
            ZeroConfig.from_dict({"zero_optimization": {"stage": 3, "sub_group_size": bad}})
        with pytest.raises(ValueError, match=rf"^steps_per_print must be >= 1, got {bad}"):
            ZeroConfig.from_dict({"zero_optimization": {"stage": 3}, "steps_per_print": bad})
    for bad in ("x", True):  # a wrong type states the same bound (review 29Z1)
        with pytest.raises(ValueError, match=r"zero_optimization.sub_group_size must be an int >= 1, got"):
            ZeroConfig.from_dict({"zero_optimization": {"stage": 3, "sub_group_size": bad}})
        with pytest.raises(ValueError, match=r"^train_batch_size must be None or an int >= 1, got"):
            ZeroConfig.from_dict({"zero_optimization": {"stage": 3}, "train_batch_size": bad})
    with pytest.raises(ValueError, match=r"^max_traces must be an int >= 1, got 'auto' \(str\)$"):  # no Trainer here
        ZeroConfig.from_dict({"max_traces": "auto"})
    with pytest.raises(ValueError, match=r"gradient_clipping must be a finite number >= 0, got 'auto' \(str\) "
                                         r"\('auto' is what"):
        ZeroConfig.from_dict({"zero_optimization": {"stage": 3}, "gradient_clipping": "auto"})
    np = pytest.importorskip("numpy")  # review 29Z2: comparing an array with "auto" raised numpy's ambiguity error
    with pytest.raises(ZeroConfigError, match=r"train_batch_size must be None or an int >= 1, got array"):
        ZeroConfig(train_batch_size=np.array([8, 8]))
    with pytest.raises(ValueError, match=r"train_micro_batch_size_per_gpu must be None or an int >= 1, got 'auto' "
                                         r"\('auto' is what Hugging Face's Trainer fills in"):
        ZeroConfig.from_dict({"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": "auto"})


def test_auto_in_a_zero_optimization_knob_takes_the_default_as_deepspeed_drops_it():
    """Probe 29B: OpenRLHF passes "auto" for six of these straight to deepspeed.initialize, whose
    config model drops it; zero3 refused every such config."""
    default = ZeroConfig()
    keys = ["sub_group_size", "stage3_max_live_parameters", "stage3_max_reuse_distance", "overlap_comm",
            "stage3_param_persistence_threshold", "stage3_prefetch_bucket_size", "reduce_bucket_size",
            "stage3_model_persistence_threshold", "allgather_bucket_size"]
    got = ZeroConfig.from_dict({"zero_optimization": {"stage": 3, **{k: "auto" for k in keys}}})
    assert got == default
    set_one = ZeroConfig.from_dict({"zero_optimization": {"stage": 3, "stage3_max_live_parameters": 7,
                                                          "reduce_bucket_size": "auto"}})
    assert set_one.budget.max_live_parameters == 7 and set_one.comm.reduce_bucket_size == default.comm.reduce_bucket_size


def test_deepspeeds_older_spellings_and_what_accelerate_writes_are_read_as_deepspeed_reads_them():
    """Probe 29B: Accelerate writes steps_per_print=inf into every config it hands DeepSpeed (so no
    Accelerate or Trainer run could start); DeepSpeed-Chat writes memory_efficient_linear and a
    hybrid_engine section off; older configs use DeepSpeed's deprecated names."""
    base = {"zero_optimization": {"stage": 3}}
    assert ZeroConfig.from_dict({**base, "steps_per_print": float("inf")}).training.steps_per_print >= 2**62
    for value in (True, False):
        ZeroConfig.from_dict({"zero_optimization": {"stage": 3, "memory_efficient_linear": value},
                              "zero_force_ds_cpu_optimizer": value})
    ZeroConfig.from_dict({**base, "hybrid_engine": {"enabled": False, "max_out_tokens": 512}})
    with pytest.raises(ZeroConfigError, match=r"hybrid_engine.*the hybrid engine.*does not implement"):
        ZeroConfig.from_dict({**base, "hybrid_engine": {"enabled": True}})
    ZeroConfig.from_dict({**base, "bf16": {"enabled": True}, "torch_autocast": {"enabled": False}})  # probe 30D
    with pytest.raises(ZeroConfigError, match=r"torch_autocast.*wrap your forward in torch.autocast"):
        ZeroConfig.from_dict({**base, "torch_autocast": {"enabled": True, "dtype": "bfloat16"}})
    for raw in ("torch_autocast", "amp"):  # DeepSpeed reads their "enabled" raw: the string "false" turns them on
        with pytest.raises(ZeroConfigError, match=rf"{raw}=.*does not implement"):
            ZeroConfig.from_dict({**base, raw: {"enabled": "false"}})
    old = ZeroConfig.from_dict({"zero_optimization": {"stage": 3, "stage3_gather_fp16_weights_on_model_save": True}})
    assert old.training.gather_16bit_weights_on_model_save
    with pytest.raises(ZeroConfigError, match="given twice"):
        ZeroConfig.from_dict({"zero_optimization": {"stage": 3, "stage3_gather_fp16_weights_on_model_save": True,
                                                    "stage3_gather_16bit_weights_on_model_save": False}})
    cpu = ZeroConfig.from_dict({"zero_optimization": {"stage": 3, "cpu_offload": True, "cpu_offload_param": True,
                                                      "cpu_offload_use_pin_memory": True}})
    want = ZeroConfig.from_dict({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                                       "offload_param": {"device": "cpu"}}})
    assert cpu.offload == want.offload
    assert ZeroConfig.from_dict({"zero_optimization": {"stage": 3, "cpu_offload": False}}).offload == ZeroConfig().offload
    with pytest.raises(ZeroConfigError, match=r"cpu_offload must be a boolean as DeepSpeed reads it \(true/false, 0/1, "
                                              r"\"yes\"/\"no\"\), got \[1\]"):  # read: not "no effect"
        ZeroConfig.from_dict({"zero_optimization": {"stage": 3, "cpu_offload": [1]}})
    for old, new in (("cpu_offload", "offload_optimizer"), ("cpu_offload_param", "offload_param")):
        with pytest.raises(ZeroConfigError, match=rf"zero_optimization.{old} .*and zero_optimization.{new} are both given"):
            ZeroConfig.from_dict({"zero_optimization": {"stage": 3, old: False, new: {"device": "cpu"}}})


@pytest.mark.parametrize("value, dtype", [(1, "fp16"), (0, "fp32"), (True, "fp16"), (None, "fp32")])
def test_a_precision_section_enabled_as_zero_or_one_is_read_as_deepspeed_reads_it(value, dtype):
    assert ZeroConfig.from_dict({"fp16": {"enabled": value}}).precision.dtype == dtype


@pytest.mark.parametrize("value, needle", [("false", "read a string differently"), ("auto", "Trainer fills in"),
                                           (2, r"\(int\); write true or false")])
def test_a_precision_section_enabled_as_a_string_is_refused_saying_why(value, needle):
    with pytest.raises(ZeroConfigError, match=rf"bf16.enabled must be a bool, got {value!r}.*{needle}"):
        ZeroConfig.from_dict({"bf16": {"enabled": value}})


# -- activation_checkpointing ---------------------------------------------------------------------------
AC_SECTION = {"partition_activations": True, "cpu_checkpointing": True, "contiguous_memory_optimization": True,
              "number_checkpoints": 8, "synchronize_checkpoint_boundary": True, "profile": True}


def test_activation_checkpointing_section_is_absent_by_default_and_off_field_by_field():
    from zero3.config import ActivationCheckpointingConfig

    assert ZeroConfig().activation_checkpointing is None
    off = ActivationCheckpointingConfig()
    assert not any(getattr(off, k) for k in AC_SECTION if k != "number_checkpoints")
    assert off.number_checkpoints is None


@pytest.mark.parametrize("wrap", [
    lambda s: {"activation_checkpointing": s},  # our names (the same as DeepSpeed's)
    lambda s: {"zero_optimization": {"stage": 3}, "train_batch_size": 8, "activation_checkpointing": s},
])
def test_activation_checkpointing_section_reads_every_deepspeed_key(wrap):
    cfg = ZeroConfig.from_dict(wrap(dict(AC_SECTION, number_checkpoints=8.0)))
    section = cfg.activation_checkpointing
    for key, value in AC_SECTION.items():
        assert getattr(section, key) == value and type(getattr(section, key)) is type(value), key


@pytest.mark.parametrize("section,pattern", [
    ({"partition_activation": True}, r"activation_checkpointing: unknown config key 'partition_activation'; "
                                     r"did you mean 'partition_activations'\?"),
    ({"profile": 1}, r"activation_checkpointing.profile must be a bool, got 1 \(int\)"),
    ({"number_checkpoints": -2}, r"number_checkpoints must be None or an int >= 1, got -2"),
    ({"contiguous_memory_optimization": True, "number_checkpoints": 2}, r"needs partition_activations"),
    ({"contiguous_memory_optimization": True, "partition_activations": True}, r"needs number_checkpoints"),
    (True, r"activation_checkpointing must be a dict"),
])
def test_activation_checkpointing_section_refuses_bad_values_by_name(section, pattern):
    with pytest.raises(ValueError, match=pattern):
        ZeroConfig.from_dict({"zero_optimization": {"stage": 3}, "activation_checkpointing": section})


@pytest.mark.parametrize("bad", [0, -2, 2.0, True, "auto", None])
def test_hpz_partition_size_must_be_minus_one_or_a_positive_int(bad):
    with pytest.raises(ZeroConfigError, match=re.escape(f"zero_hpz_partition_size must be an int >= 1 (1: off) or "
                                                        f"-1 (the ranks per node), got {bad!r}")):
        ZeroConfig(zero_hpz_partition_size=bad)


def test_zero_plus_plus_keys_are_read_from_deepspeeds_zero_optimization_section():
    cfg = ZeroConfig.from_dict({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 8,
                                                      "zero_quantized_weights": True,
                                                      "zero_quantized_gradients": True}})
    assert (cfg.comm.zero_hpz_partition_size, cfg.comm.zero_quantized_weights, cfg.comm.zero_quantized_gradients) == (8, True, True)
    assert ZeroConfig().comm.zero_hpz_partition_size == 1  # off, as in DeepSpeed
    assert ZeroConfig(zero_hpz_partition_size=-1).comm.zero_hpz_partition_size == -1


# -- sections -------------------------------------------------------------------------------------------
def test_flat_keywords_are_filed_under_their_sections():
    from zero3.config import BudgetConfig, CommConfig, OffloadConfig, PrecisionConfig, TrainingConfig

    cfg = ZeroConfig(max_live_parameters=5, dtype="bf16", overlap_comm=False, offload_param="cpu",
                     gradient_accumulation_steps=3, leaf_modules=["Expert"])
    assert cfg.budget == BudgetConfig(max_live_parameters=5)
    assert cfg.precision == PrecisionConfig(dtype="bf16")
    assert cfg.comm == CommConfig(overlap_comm=False)
    assert cfg.offload == OffloadConfig(offload_param="cpu")
    assert cfg.training == TrainingConfig(gradient_accumulation_steps=3, leaf_modules=("Expert",))
    assert ZeroConfig(budget=BudgetConfig(max_live_parameters=5), dtype="bf16", overlap_comm=False,
                      offload=OffloadConfig(offload_param="cpu"), gradient_accumulation_steps=3,
                      leaf_modules=("Expert",)) == cfg


def test_flat_keywords_change_a_given_section_and_replace_takes_both_forms():
    from zero3.config import BudgetConfig

    cfg = ZeroConfig(budget=BudgetConfig(max_live_parameters=5, max_traces=2), max_traces=3)
    assert (cfg.budget.max_live_parameters, cfg.budget.max_traces) == (5, 3)
    assert cfg.replace(budget=BudgetConfig()).budget == BudgetConfig()
    assert cfg.replace(dtype="fp16").budget is cfg.budget and cfg.replace(dtype="fp16").precision.dtype == "fp16"
    assert dataclasses.replace(cfg, budget=BudgetConfig()) == cfg.replace(budget=BudgetConfig())


def test_the_runtime_reads_knobs_only_through_their_sections():
    cfg = ZeroConfig()
    assert not hasattr(cfg, "max_live_parameters") and not hasattr(cfg, "dtype")
    assert [f.name for f in dataclasses.fields(cfg)] == ["budget", "comm", "precision", "offload", "training",
                                                         "activation_checkpointing"]


def test_unknown_keyword_and_wrong_section_type_are_refused_by_name():
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'max_live_parameter'; "
                                        r"did you mean 'max_live_parameters'\?"):
        ZeroConfig(max_live_parameter=5)
    with pytest.raises(ZeroConfigError, match=r"budget must be a BudgetConfig, got \{'max_traces': 2\}"):
        ZeroConfig(budget={"max_traces": 2})  # type: ignore[arg-type]


def test_a_section_validates_its_fields_by_their_types():
    from zero3.config import CommConfig, OffloadConfig, PrecisionConfig

    with pytest.raises(ZeroConfigError, match=r"allgather_impl must be one of \('auto', 'all_gather', 'p2p', 'shm'\), "
                                              r"got 'ring'"):
        CommConfig(allgather_impl="ring")
    with pytest.raises(ZeroConfigError, match=r"verify_collectives must be None or a bool, got 1"):
        CommConfig(verify_collectives=1)
    with pytest.raises(ZeroConfigError, match=r"collective_timeout must be a finite number >= 0, got inf"):
        CommConfig(collective_timeout=float("inf"))
    with pytest.raises(ZeroConfigError, match=r"offload_param_nvme_path must be None or a non-empty path string"):
        OffloadConfig(offload_param_nvme_path="")
    with pytest.raises(ZeroConfigError, match=r"min_loss_scale must be > 0, got 0.0"):
        PrecisionConfig(min_loss_scale=0.0)
    with pytest.raises(ZeroConfigError, match=r"fp16.min_loss_scale must be > 0, got -1"):  # one bound (probe 30D)
        ZeroConfig.from_dict({"fp16": {"enabled": True, "min_loss_scale": -1}})
    with pytest.raises(ZeroConfigError, match=r"leaf_modules must be a list of non-empty strings, got \(''"):
        ZeroConfig(leaf_modules=("",))


def test_every_section_field_has_a_docstring():
    import ast
    import inspect

    from zero3.config import flat
    from zero3.config.training import ActivationCheckpointingConfig

    for cls in [*flat.SECTIONS.values(), ActivationCheckpointingConfig, ZeroConfig]:
        body = ast.parse(inspect.getsource(cls)).body[0].body
        for node, after in zip(body, body[1:] + [None]):
            if isinstance(node, ast.AnnAssign):
                assert isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant), \
                    f"{cls.__name__}.{node.target.id} has no docstring"


def test_deepspeed_translation_lives_beside_the_deepspeed_names():
    from zero3.config.deepspeed import translate

    assert translate({"zero_optimization": {"stage": 3, "stage3_max_live_parameters": 1e6},
                      "bf16": {"enabled": True}}) == {"dtype": "bf16", "max_live_parameters": 1_000_000}


# -- batch sizes (DeepSpeed's rule: train_batch = micro x accumulation x data-parallel ranks) -----------
@pytest.mark.parametrize("given,world,fixed", [
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, 2, (32, 4, 4)),
    ({"train_batch_size": 32, "gradient_accumulation_steps": 2}, 4, (32, 4, 2)),
    ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3}, 2, (24, 4, 3)),
    ({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4}, 2, (16, 2, 4)),
    ({"train_batch_size": 8}, 4, (8, 2, 1)),  # one given: no accumulation, as in DeepSpeed
    ({"train_micro_batch_size_per_gpu": 3}, 2, (6, 3, 1)),
])
def test_any_two_batch_knobs_fix_the_third_given_the_world_size(given, world, fixed):
    cfg = ZeroConfig.from_dict({"zero_optimization": {"stage": 3}, **given})
    t = cfg.for_world_size(world).training
    assert (t.train_batch_size, t.train_micro_batch_size_per_gpu, t.gradient_accumulation_steps) == fixed


def test_without_batch_sizes_the_world_size_changes_nothing():
    cfg = ZeroConfig(gradient_accumulation_steps=3)
    assert cfg.for_world_size(8) is cfg and cfg.training.gradient_accumulation_steps == 3
    assert ZeroConfig().training.gradient_accumulation_steps == 1
    pending = ZeroConfig(train_batch_size=8, train_micro_batch_size_per_gpu=2)
    assert pending.training.gradient_accumulation_steps is None  # until the world size is known


@pytest.mark.parametrize("given,world,pattern", [
    ({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4}, 4,
     r"train_batch_size \(16\) must equal train_micro_batch_size_per_gpu \(2\) x gradient_accumulation_steps \(4\) "
     r"x 4 data-parallel rank\(s\) = 32"),
    ({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4}, 1,
     r"train_batch_size \(10\) is not a whole multiple of train_micro_batch_size_per_gpu \(4\) x 1 data-parallel "
     r"rank\(s\): no gradient_accumulation_steps gives it"),
    ({"train_batch_size": 2, "gradient_accumulation_steps": 1}, 4,
     r"train_batch_size \(2\) is not a whole multiple of gradient_accumulation_steps \(1\) x 4 data-parallel"),
])
def test_batch_knobs_that_cannot_agree_are_refused_by_name(given, world, pattern):
    with pytest.raises(ZeroConfigError, match=pattern):
        ZeroConfig(**given).for_world_size(world)


@pytest.mark.parametrize("key", ["train_batch_size", "train_micro_batch_size_per_gpu"])
def test_batch_sizes_must_be_positive_ints(key):
    with pytest.raises(ZeroConfigError, match=rf"{key} must be >= 1, got 0"):
        ZeroConfig.from_dict({"zero_optimization": {}, key: 0})
    with pytest.raises(ZeroConfigError, match=rf"{key} must be at most 2147483647, got 1{'0' * 30}"):
        ZeroConfig.from_dict({"zero_optimization": {}, key: 10**30})
    assert ZeroConfig.from_dict({"steps_per_print": 10**12}).training.steps_per_print == 10**12  # DeepSpeed's "never"
    with pytest.raises(ZeroConfigError, match=rf"{key} must be None or an int >= 1, got 'auto' \('auto' is what Hugging"):
        ZeroConfig.from_dict({"zero_optimization": {}, key: "auto"})


def test_staged_step_is_read_from_deepspeeds_offload_section_and_refused_where_nothing_is_staged():
    from zero3.config import OffloadConfig

    ds = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp/x",
                                                                  "staged_step": False}}}
    cfg = resolve_config(ds)
    assert cfg.offload.offload_optimizer == "nvme" and cfg.offload.offload_optimizer_staged_step is False
    assert resolve_config({"offload_optimizer": {"device": "nvme", "nvme_path": "/tmp/x"}}
                          ).offload.offload_optimizer_staged_step is True
    for device in ("none", "cpu"):
        with pytest.raises(ZeroConfigError, match=r"offload_optimizer_staged_step=False only applies with "
                                                  rf"offload_optimizer='nvme' \(got offload_optimizer='{device}'\)"):
            OffloadConfig(offload_optimizer=device, offload_optimizer_staged_step=False)
    with pytest.raises(ZeroConfigError, match=r"offload_optimizer_staged_step must be a bool, got 'no'"):
        OffloadConfig(offload_optimizer="nvme", offload_optimizer_nvme_path="/tmp/x", offload_optimizer_staged_step="no")


def test_step_in_backward_is_read_from_deepspeeds_offload_section_and_refused_beside_what_needs_every_gradient():
    from zero3.config import OffloadConfig

    nvme = {"device": "nvme", "nvme_path": "/tmp/x"}
    ds = {"zero_optimization": {"stage": 3, "offload_optimizer": {**nvme, "step_in_backward": True}}}
    cfg = resolve_config(ds)
    assert cfg.offload.offload_optimizer_step_in_backward is True
    assert resolve_config({"offload_optimizer": nvme}).offload.offload_optimizer_step_in_backward is False
    for device in ("none", "cpu"):  # the optimizer in memory steps in backward too (agreed, never staged)
        assert OffloadConfig(offload_optimizer=device, offload_optimizer_step_in_backward=True
                             ).offload_optimizer_step_in_backward is True
    with pytest.raises(ZeroConfigError, match=r"offload_optimizer_step_in_backward must be a bool, got 1"):
        OffloadConfig(offload_optimizer="nvme", offload_optimizer_nvme_path="/tmp/x", offload_optimizer_step_in_backward=1)
    flat = {"offload_optimizer": {**nvme, "step_in_backward": True}}
    with pytest.raises(ZeroConfigError, match=r"cannot be used with gradient_clipping=1.0: clipping by the global norm"):
        resolve_config({**flat, "gradient_clipping": 1.0})
    with pytest.raises(ZeroConfigError, match=r"cannot be used with dtype='fp16': the overflow check"):
        resolve_config({**flat, "dtype": "fp16"})
    # shared-memory gathers and reductions go beside it (optim/backward_step.py: reads after a send are checked)
    shm = resolve_config({**flat, "allgather_impl": "shm", "reduce_scatter_impl": "shm"})
    assert (shm.comm.allgather_impl, shm.comm.reduce_scatter_impl) == ("shm", "shm")
    # bf16 is fine: its masters are fp32 and nothing is skipped
    assert resolve_config({**flat, "dtype": "bf16", "gradient_clipping": 0.0}).precision.dtype == "bf16"


# -- values inside the optimizer and scheduler sections, the DeepSpeed keys refused when on ---------------
@pytest.mark.parametrize("section, kind, key, value", [
    ("optimizer", "AdamW", "lr", True), ("optimizer", "AdamW", "lr", float("inf")), ("optimizer", "AdamW", "lr", "auto"),
    ("optimizer", "AdamW", "amsgrad", "false"), ("optimizer", "Adam", "adam_w_mode", "false"),
    ("optimizer", "SGD", "nesterov", "false"), ("optimizer", "AdamW", "betas", [0.9, 0.99, 0.5]),
    ("optimizer", "AdamW", "betas", 0.9), ("optimizer", "AdamW", "weight_decay", -0.1),
    ("scheduler", "WarmupLR", "warmup_num_steps", 2.9), ("scheduler", "WarmupLR", "warmup_num_steps", "100"),
    ("scheduler", "WarmupLR", "warmup_max_lr", -1), ("scheduler", "WarmupLR", "warmup_max_lr", float("nan")),
    ("scheduler", "WarmupLR", "last_batch_iteration", 5.5), ("scheduler", "WarmupDecayLR", "total_num_steps", 0),
    ("scheduler", "WarmupCosineLR", "cos_min_ratio", 5), ("scheduler", "WarmupCosineLR", "warmup_min_ratio", -1),
])
def test_a_wrong_value_in_an_optimizer_or_scheduler_section_is_refused_naming_it(section, kind, key, value):
    params = {key: value}
    if kind in ("WarmupDecayLR", "WarmupCosineLR") and key != "total_num_steps":
        params["total_num_steps"] = 100
    with pytest.raises(ZeroConfigError, match=rf"{section} {kind}: params\.{key} must be"):
        ZeroConfig.from_dict({section: {"type": kind, "params": params}})


def test_auto_in_a_section_names_the_trainer_that_fills_it_in():
    with pytest.raises(ZeroConfigError, match="Hugging Face's Trainer fills in"):
        ZeroConfig.from_dict({"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}})


@pytest.mark.parametrize("params", [[], 0, False, "lr=1e-3"])
def test_params_that_are_not_a_dict_are_refused(params):
    with pytest.raises(ZeroConfigError, match="optimizer.params must be a dict"):
        ZeroConfig.from_dict({"optimizer": {"type": "AdamW", "params": params}})


def test_a_section_keeps_its_own_copy_of_the_params():
    given = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95]}}}
    cfg = ZeroConfig.from_dict(given)
    given["optimizer"]["params"]["betas"].append(0.5)
    assert cfg.training.optimizer.params["betas"] == (0.9, 0.95)


@pytest.mark.parametrize("torch_adam, decay", [(False, 0.0), (True, 0.01)])
def test_deepspeeds_adam_without_weight_decay_decays_as_deepspeed_chooses(torch_adam, decay):
    """DeepSpeed builds its FusedAdam/CPUAdam (no weight decay by default) unless torch_adam, which is
    torch's AdamW (0.01)."""
    import torch

    from zero3.optim.schedulers import build_optimizer

    spec = ZeroConfig.from_dict({"optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": torch_adam}}})
    opt = build_optimizer(spec.training.optimizer, [torch.nn.Parameter(torch.zeros(2))])
    assert type(opt) is torch.optim.AdamW and opt.defaults["weight_decay"] == decay


@pytest.mark.parametrize("section, key", [("fp16", "auto_cast"), ("fp16", "fp16_master_weights_and_grads"),
                                          ("bf16", "bf16_master_weights_and_grads"), ("bf16", "bf16_optimizer_states"),
                                          ("bf16", "check_grad_overflow")])
def test_deepspeed_keys_that_would_change_training_are_refused_when_on_and_accepted_off(section, key):
    with pytest.raises(ZeroConfigError, match=rf"{section}\.{key}=True is not supported"):
        ZeroConfig.from_dict({section: {"enabled": True, key: True}})
    assert ZeroConfig.from_dict({section: {"enabled": True, key: False}}).precision.dtype == section


@pytest.mark.parametrize("knob, value", [("initial_scale_power", 200), ("initial_scale_power", -1),
                                         ("loss_scale", 1e300), ("min_loss_scale", 1e300)])
def test_a_loss_scale_past_fp32s_range_is_refused(knob, value):
    with pytest.raises(ZeroConfigError, match=rf"{knob} must be"):
        ZeroConfig(dtype="fp16", **{knob: value})


def test_a_json_key_given_twice_is_refused(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{"max_live_parameters": 1, "max_live_parameters": 2}')
    with pytest.raises(ZeroConfigError, match="'max_live_parameters' is given twice"):
        ZeroConfig.from_json(path)


DEEPSPEED_FILE_WITH_COMMENTS = """{
  // micro batch per GPU
  "train_micro_batch_size_per_gpu": 2,  # DeepSpeed's hjson reads both line comments
  /* ZeRO-3, with the knobs zero3 maps */
  "zero_optimization": {"stage": 3, "stage3_max_live_parameters": 1e6,},
  "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95,],},},
}
"""


def test_a_config_file_with_deepspeeds_comments_and_trailing_commas_is_read(tmp_path):
    """DeepSpeed reads its config with hjson, which takes comments and trailing commas (json.load refused them)."""
    path = tmp_path / "ds_config.json"
    path.write_text(DEEPSPEED_FILE_WITH_COMMENTS)
    plain = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3, "stage3_max_live_parameters": 1e6},
             "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95]}}}
    assert ZeroConfig.from_json(path) == ZeroConfig.from_dict(plain)
    path.write_text('{"max_live_parameters": 9, // nine\n "reduce_dtype": "fp32", # "//" in a comment\n}')
    assert ZeroConfig.from_json(path).budget.max_live_parameters == 9


def test_a_config_file_with_a_byte_order_mark_is_read(tmp_path):
    """Windows editors write a UTF-8 byte-order mark; DeepSpeed's reader skips it, json refused it (review 32RB)."""
    path = tmp_path / "ds_config.json"
    path.write_bytes(b"\xef\xbb\xbf" + b'{"max_live_parameters": 9, // nine\r\n}')
    assert ZeroConfig.from_json(path).budget.max_live_parameters == 9


def test_comment_markers_and_commas_inside_strings_are_kept():
    from zero3.config.json_file import loads_config_text
    text = r'{"a//b": "c # d /* e */ ,} ,]", "q\"//": "\"#,}", "z": "\\"}  // end'
    assert loads_config_text(text) == {"a//b": "c # d /* e */ ,} ,]", 'q"//': '"#,}', "z": "\\"}


@pytest.mark.parametrize("text, place", [
    ('{\n  max_live_parameters: 9\n}', "line 2 column 3"),                # an unquoted key
    ('{"dtype": bf16}', "line 1 column 11"),                              # an unquoted string
    ('{\n"a": 1\n"b": 2}', "line 3 column 1"),                            # a newline for a comma
    ("{\"a\": '''\nx\n'''}", "line 1 column 7"),                          # a multiline string
    ("[1,,]", "line 1 column 4"), ("{,}", "line 1 column 2"),             # a comma after no value
])
def test_hjson_beyond_comments_and_trailing_commas_is_refused_naming_the_place_and_what_is_read(
        tmp_path, text, place):
    path = tmp_path / "ds.json"
    path.write_text(text)
    with pytest.raises(ZeroConfigError, match=rf"{re.escape(str(path))}: not valid JSON \(.*{place}.*\); zero3 reads "
                                              r"JSON plus // and # line comments, /\* \*/ block comments and trailing"):
        ZeroConfig.from_json(path)
    path.write_text('{"max_live_parameters": 9,\n /* open')
    with pytest.raises(ZeroConfigError, match=r"a /\* comment at line 2 column 2 is never closed"):
        ZeroConfig.from_json(path)


def test_a_json_key_given_twice_is_refused_with_comments_around_it(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{"zero_optimization": {"stage": 3, // first\n "stage": 3,},}')
    with pytest.raises(ZeroConfigError, match="'stage' is given twice"):
        ZeroConfig.from_json(path)


_MARKED_TEXT = st.lists(st.sampled_from(['"//', '"#', '"/*', "*/", ",}", ",]", '"', "\\", "\n", "a"]) | st.characters(),
                        max_size=6).map("".join)  # comment markers, commas and quotes inside strings
_JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | _MARKED_TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_MARKED_TEXT, inner, max_size=4), max_leaves=12)
_LINE_COMMENT = st.text(st.sampled_from(list('/#*,}]"\\ ab')) | st.characters(blacklist_characters="\n"), max_size=6)
_BLOCK_COMMENT = st.text(st.sampled_from(list('/#*,}]"\\\n ab')), max_size=6).filter(
    lambda t: "*/" not in t and not t.endswith("*"))
_FILLER = st.lists(st.sampled_from([" ", "\n", "\t", "\r\n"]) | _LINE_COMMENT.map(lambda t: f"//{t}\n")
                   | _LINE_COMMENT.map(lambda t: f"#{t}\n") | _BLOCK_COMMENT.map(lambda t: f"/*{t}*/"),
                   max_size=3).map("".join)


@st.composite
def _decorated(draw: st.DrawFn, value) -> str:
    """``value`` as JSON with comments and whitespace drawn into every legal place, and maybe a trailing comma."""
    if not isinstance(value, (dict, list)):
        return json.dumps(value)
    items = ([f"{json.dumps(k)}{draw(_FILLER)}:{draw(_FILLER)}{draw(_decorated(v))}" for k, v in value.items()]
             if isinstance(value, dict) else [draw(_decorated(v)) for v in value])
    body = ",".join(f"{draw(_FILLER)}{item}{draw(_FILLER)}" for item in items)
    if items and draw(st.booleans()):
        body += "," + draw(_FILLER)
    opening, closing = "{}" if isinstance(value, dict) else "[]"
    return opening + body + draw(_FILLER) + closing


@settings(max_examples=300, deadline=None)
@given(data=st.data(), value=_JSON_VALUES)
def test_a_file_with_comments_and_trailing_commas_reads_as_json_loads_of_the_plain_text(data, value):
    from zero3.config.json_file import loads_config_text
    text = data.draw(_FILLER) + data.draw(_decorated(value)) + data.draw(_FILLER)
    assert loads_config_text(text) == json.loads(json.dumps(value))


def test_a_config_file_that_cannot_be_read_is_a_config_error_naming_it(tmp_path):
    """A ZeroConfigError is what the ranks agree on: one rank's missing file raises on every rank."""
    with pytest.raises(ZeroConfigError, match="cannot be read"):
        ZeroConfig.from_json(tmp_path / "missing.json")
    with pytest.raises(ZeroConfigError, match="cannot be read"):
        ZeroConfig.from_json(tmp_path)  # a directory
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(ZeroConfigError, match="a config is a JSON object, got a list"):
        ZeroConfig.from_json(tmp_path / "list.json")


def test_a_collective_timeout_past_a_process_groups_range_is_refused():
    with pytest.raises(ZeroConfigError, match="collective_timeout must be at most"):
        ZeroConfig(collective_timeout=1e30)


@pytest.mark.parametrize("knob", ["prefetch_bucket_bytes", "max_reuse_distance_bytes"])
def test_a_byte_knob_without_max_live_bytes_is_refused_not_ignored(knob):
    """The plan counts in elements unless max_live_bytes is set: alone, the byte knob did nothing."""
    with pytest.raises(ZeroConfigError, match=rf"{knob}=1000 counts in bytes.*set max_live_bytes too"):
        ZeroConfig(**{knob: 1000})
    assert getattr(ZeroConfig(max_live_bytes=10**6, **{knob: 1000}).budget, knob) == 1000


@pytest.mark.parametrize("extra", [
    {"flops_profiler": {"enabled": False, "profile_step": 1}}, {"tensorboard": {"enabled": False, "output_path": "x"}},
    {"wandb": {"enabled": False}}, {"elasticity": {"enabled": False}}, {"comms_logger": {}}, {"memory_breakdown": False},
    {"dump_state": 0}, {"sparse_gradients": 0}, {"gradient_predivide_factor": 1}, {"memory_breakdown": 0.0},
    {"tensorboard": {"enabled": "false"}}, {"comms_logger": {"enabled": 0}}, {"data_efficiency": {"enabled": False}},
    {"checkpoint": {"tag_validation": "Warn", "load_universal": False, "parallel_write": {"pipeline_stage": False}}},
])
def test_a_deepspeed_feature_zero3_lacks_is_accepted_off(extra):
    """DeepSpeed's example configs carry these off; they were refused as unknown keys, with a
    suggestion of another knob (flops_profiler: "did you mean 'offload_optimizer'?"; probe 23D)."""
    ZeroConfig.from_dict({"train_batch_size": 4, "zero_optimization": {"stage": 3}, **extra})


@pytest.mark.parametrize("extra, needle", [
    ({"flops_profiler": {"enabled": True}}, "the FLOPs profiler"),
    ({"tensorboard": {"enabled": True}}, "TensorBoard logging"),
    ({"memory_breakdown": True}, "see_memory_usage"),
    ({"gradient_predivide_factor": 2.0}, "dividing gradients by a factor"),
    ({"sparse_gradients": True}, "sparse embedding gradients"),
    ({"checkpoint": {"tag_validation": "Fail"}}, "checkpoint options beyond DeepSpeed's defaults"),
    ({"amp": {"enabled": True}}, "apex AMP"),
    ({"prescale_gradients": "banana"}, "prescale_gradients must be a boolean"),
    ({"dump_state": "false"}, "a dump of the engine's state"),  # DeepSpeed reads it raw: a true value
    ({"compression_training": {"weight_quantization": {"shared_parameters": {"enabled": True}}}}, "compression"),
    ({"data_efficiency": {"data_routing": {"random_ltd": {"enabled": True}}}}, "data efficiency"),
])
def test_a_deepspeed_feature_zero3_lacks_is_refused_on_by_name(extra, needle):
    with pytest.raises(ZeroConfigError, match=needle):
        ZeroConfig.from_dict({"train_batch_size": 4, "zero_optimization": {"stage": 3}, **extra})


@pytest.mark.parametrize("value", [False, "false", 0])
def test_load_from_fp32_weights_off_is_refused_not_ignored(value):
    """DeepSpeed rebuilds the fp32 masters from the 16-bit weights at a load when it is false; zero3
    loads its fp32 masters always, and took false in silence (probe 23D)."""
    with pytest.raises(ZeroConfigError, match="load_from_fp32_weights.*not supported"):
        ZeroConfig.from_dict({"zero_optimization": {"stage": 3, "load_from_fp32_weights": value}})
    ZeroConfig.from_dict({"zero_optimization": {"stage": 3, "load_from_fp32_weights": True}})


def test_deepspeed_booleans_take_0_and_1_as_deepspeed_reads_them():
    """Probe 34B: overlap_comm, zero_quantized_weights/gradients (and an offload section's pin_memory)
    refused 0/1, which DeepSpeed's config model reads as booleans; a flat zero3 config still refuses them."""
    for flag in (0, 1):
        cfg = resolve_config({"zero_optimization": {"stage": 3, "overlap_comm": flag, "zero_quantized_weights": flag,
                                                    "zero_quantized_gradients": flag,
                                                    "offload_param": {"device": "cpu", "pin_memory": flag}}})
        values = (cfg.comm.overlap_comm, cfg.comm.zero_quantized_weights, cfg.comm.zero_quantized_gradients,
                  cfg.offload.offload_param_pin_memory)
        assert values == (bool(flag),) * 4 and all(type(v) is bool for v in values), values
    with pytest.raises(ZeroConfigError, match=r"zero_optimization.overlap_comm must be a bool, got 'yes'"):
        resolve_config({"zero_optimization": {"stage": 3, "overlap_comm": "yes"}})
    with pytest.raises(ZeroConfigError, match=r"overlap_comm must be a bool, got 1 \(int\)"):
        resolve_config({"overlap_comm": 1})


# -- probe 38D: the config findings F1-F7 ---------------------------------------------------------------------------

_ZERO3 = {"stage": 3}


@pytest.mark.parametrize("where", [
    {"zero_optimization": {**_ZERO3, "stage3_prefetch_bucket_size": "auto"}},
    {"zero_optimization": {**_ZERO3, "stage3_gather_16bit_weights_on_model_save": "auto"}},
    {"zero_optimization": {**_ZERO3, "cpu_offload": "auto"}},
    {"zero_optimization": {**_ZERO3, "contiguous_gradients": "auto"}},
    {"zero_optimization": _ZERO3, "prescale_gradients": "auto"},
    {"zero_optimization": _ZERO3, "bf16": {"enabled": True, "immediate_grad_update": "auto"}},
    *({"zero_optimization": {**_ZERO3, "offload_optimizer": {"device": "cpu", key: "auto"}}}
      for key in ("buffer_count", "fast_init", "pipeline_read", "pipeline_write", "pipeline")),
])
def test_auto_takes_the_default_where_config_md_says(where):
    """Probe 38D F1: config.md said "auto" outside the nine mapped keys and the booleans was refused,
    yet offload_optimizer's no-effect keys took it (as DeepSpeed's config model does: it drops "auto").
    The code stays; config.md now lists the three places "auto" takes the default, those keys among them."""
    ZeroConfig.from_dict(where)
    doc = (Path(__file__).parents[2] / "docs" / "config.md").read_text()
    rule = doc[doc.index('`"auto"` (what Hugging Face'):doc.index('`"auto"` anywhere else is refused')]
    for key in ("buffer_count", "fast_init", "pipeline_read", "pipeline_write", "`pipeline`", "prescale_gradients",
                "immediate_grad_update", "cpu_offload", "stage3_gather_16bit_weights_on_model_save"):
        assert key in rule, key


@pytest.mark.parametrize("where, named", [
    ({"zero_optimization": {**_ZERO3, "offload_param": {"device": "cpu", "buffer_count": "auto"}}},
     "offload_param.buffer_count"),
    ({"zero_optimization": {**_ZERO3, "offload_optimizer": {"device": "cpu", "pin_memory": "auto"}}},
     "offload_optimizer.pin_memory"),
    ({"zero_optimization": {**_ZERO3, "zero_quantized_weights": "auto"}}, "zero_quantized_weights"),
    ({"zero_optimization": _ZERO3, "wall_clock_breakdown": "auto"}, "wall_clock_breakdown"),
    ({"zero_optimization": _ZERO3, "fp16": {"enabled": True, "auto_cast": "auto"}}, "fp16.auto_cast"),
    ({"zero_optimization": {**_ZERO3, "offload_optimizer": {"device": "cpu", "ratio": "auto"}}}, "ratio"),
    ({"zero_optimization": {**_ZERO3, "offload_param": {"device": "nvme", "nvme_path": "auto"}}},  # review 38R2: a
     "zero_optimization.offload_param.nvme_path"),                                                # dir ./auto was made
    ({"offload_optimizer": "nvme", "offload_optimizer_nvme_path": "auto"}, "offload_optimizer_nvme_path"),
])
def test_auto_is_refused_naming_the_key_everywhere_else(where, named):
    with pytest.raises(ZeroConfigError, match=re.escape(named) + ".*'auto'"):
        ZeroConfig.from_dict(where)


@pytest.mark.parametrize("flat", [
    {"offload_param": {"device": "cpu", "pin_memory": 1}},
    {"offload_optimizer": {"device": "cpu", "step_in_backward": 1}},
    {"offload_optimizer": {"device": "cpu", "pin_memory": 0}},
    {"gradient_accumulation_steps": 2, "overlap_comm": 1},
    {"steps_per_print": 5, "broadcast_buffers": 1},
    {"optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "offload_param": {"device": "cpu", "pin_memory": 1}},
])
def test_a_flat_config_takes_true_false_only_whatever_keys_it_holds(flat):
    """Probe 38D F2: the DeepSpeed-form offload section of a flat config took 0/1, and so did every
    boolean of a flat dict that held a key DeepSpeed also has at its top level (gradient_accumulation_steps,
    steps_per_print, optimizer, ...): those keys are zero3's flat names too and no longer make it DeepSpeed's."""
    with pytest.raises(ZeroConfigError, match=r"must be a bool, got [01] \(int\)"):
        ZeroConfig.from_dict(flat)
    as_deepspeed = {"zero_optimization": {**_ZERO3, **{k: v for k, v in flat.items() if k.startswith("offload_")}},
                    **{k: v for k, v in flat.items() if not k.startswith("offload_")}}
    ZeroConfig.from_dict(as_deepspeed)  # a zero_optimization section: DeepSpeed's format, 0/1 read as booleans


def test_a_dict_of_keys_both_formats_have_is_read_as_deepspeed_s():
    """Review 38R2: a stage-0 DeepSpeed file (no zero_optimization, bf16 or fp16) was read as a flat
    config after probe 38D F2, and its 0/1 booleans and Infinity refused: with no key of zero3's names
    alone, the dict is DeepSpeed's (whose reading of those keys takes all the flat one does)."""
    cfg = ZeroConfig.from_dict({"train_batch_size": 8, "gradient_accumulation_steps": 2, "wall_clock_breakdown": 0,
                                "steps_per_print": float("inf"), "zero_allow_untested_optimizer": 1})
    assert (cfg.training.gradient_accumulation_steps, cfg.training.wall_clock_breakdown) == (2, False)


def test_a_flat_offload_section_s_error_names_the_key_as_written():
    with pytest.raises(ZeroConfigError, match=r"^offload_param\.pin_memory must be a bool, got 1"):
        ZeroConfig.from_dict({"offload_param": {"device": "cpu", "pin_memory": 1}})


def test_zero_optimization_nested_in_itself_says_so():
    with pytest.raises(ZeroConfigError, match="nested twice") as exc:
        ZeroConfig.from_dict({"zero_optimization": {**_ZERO3, "zero_optimization": {"stage": 3}}})
    assert "did you mean" not in str(exc.value)


def test_a_swap_directory_with_a_nul_byte_is_refused_naming_it():
    """Review 38R2: os.makedirs raises ValueError for it, which reached every rank as a config that could
    not be read, naming neither the path nor the key."""
    from zero3.offload.swapfile import check_swap_directories
    with pytest.raises(ZeroConfigError, match=r"cannot create the swap directory '/tmp/sw\\x00ap'.*null byte"):
        check_swap_directories(["/tmp/sw\x00ap"])


def test_a_deepspeed_only_top_level_key_makes_a_deepspeed_config():
    cfg = ZeroConfig.from_dict({"bf16": {"enabled": True}, "overlap_comm": 0,
                                "offload_param": {"device": "cpu", "pin_memory": 1}})
    assert (cfg.precision.dtype, cfg.comm.overlap_comm, cfg.offload.offload_param_pin_memory) == ("bf16", False, True)


@pytest.mark.parametrize("key", ["gradient_clipping", "optimizer", "memory_breakdown", "flops_profiler", "tensorboard",
                                 "amp", "checkpoint", "gradient_predivide_factor", "sparse_gradients", "wandb"])
def test_every_top_level_deepspeed_key_inside_zero_optimization_is_refused_with_where_it_belongs(key):
    """Probe 38D F3: those zero3 reads at the top level beside TOP_LEVEL's got "unknown config key"
    and an unrelated suggestion (checkpoint: "did you mean 'elastic_checkpoint'?")."""
    with pytest.raises(ZeroConfigError, match=f"'{key}' is a top-level key of a DeepSpeed config.*move it out") as exc:
        ZeroConfig.from_dict({"zero_optimization": {**_ZERO3, key: {"enabled": False}}})
    assert "did you mean" not in str(exc.value)


def test_a_key_given_twice_in_a_config_file_is_named_with_its_line_and_column(tmp_path):
    """Probe 38D F4: config.md says the refusal names the file, the line and the column; it named the
    file and the key only (json's hook has no positions), so in a config with several objects the
    duplicate could not be found."""
    path = tmp_path / "ds_config.json"
    path.write_text('{\n  // comment\n  "zero_optimization": {"stage": 3,\n'
                    '    "stage3_max_live_parameters": 5,\n    "stage3_max_live_parameters": 6},\n'
                    '  "optimizer": {"type": "SGD", "params": {"lr": 0.1, "l\\u0072": 0.2}}\n}\n')
    with pytest.raises(ZeroConfigError, match=(re.escape(str(path)) + r": the key 'stage3_max_live_parameters' is "
                                               r"given twice in one object at line 5 column 5 \(first at line 4 "
                                               r"column 5\)")):
        ZeroConfig.from_json(path)
    path.write_text('{"optimizer": {"type": "SGD", "params": [{"lr": 1}, {"lr": 0.1, "a": {"lr": 1}, "l\\u0072": 0.2}]}}')
    with pytest.raises(ZeroConfigError, match=r"the key 'lr' is given twice in one object at line 1 column 81 "
                                              r"\(first at line 1 column 54\)"):
        ZeroConfig.from_json(path)


def test_config_docstrings_say_what_the_code_does():
    """Probe 38D F5, F7: the profile field named a logger nothing logs to; max_live_parameters' docstring
    said the cap is exceeded "only" when the running modules need more, omitting config.md's two other cases."""
    from zero3.activation import checkpointing as module
    from zero3.config import BudgetConfig
    from zero3.config.training import ActivationCheckpointingConfig
    profile_doc = inspect.getsource(ActivationCheckpointingConfig).split("profile: bool")[1][:300]
    assert f"``{module.logger.name}`` logger" in profile_doc, profile_doc
    live_doc = inspect.getsource(BudgetConfig).split("max_live_parameters: int")[1][:700]
    assert "Exceeded only" not in live_doc and "use_reentrant=False" in live_doc and "called\n    again" in live_doc


_HUGE = 10**400  # an integer JSON can write; float() of it raises OverflowError


@pytest.mark.parametrize("config, named", [
    ({"gradient_clipping": _HUGE}, "gradient_clipping"),
    ({"zero_optimization": _ZERO3, "gradient_clipping": _HUGE}, "gradient_clipping"),
    ({"collective_timeout": _HUGE}, "collective_timeout"),
    ({"dtype": "fp16", "loss_scale": _HUGE}, "loss_scale"),
    ({"optimizer": {"type": "SGD", "params": {"lr": _HUGE}}}, "params.lr"),
    ({"zero_optimization": _ZERO3, "communication_data_type": ["bf16"]}, "communication_data_type"),
    ({1: 2}, "unknown config key 1 (int: config keys are strings)"),
    ({"zero_optimization": {**_ZERO3, 7: 1}}, "zero_optimization: unknown config key 7"),
    ({"zero_optimization": {**_ZERO3, "offload_param": {5: 1}}}, "offload_param: unknown config key 5"),
    ({"activation_checkpointing": {3: True}}, "activation_checkpointing: unknown config key 3"),
    ({"optimizer": {"type": "SGD", "params": {3: 1}}}, "optimizer SGD: unknown config key 3"),
    ({"zero_optimization": _ZERO3, "fp16": {"enabled": True, None: 1}}, "fp16: unknown config key None"),
])
def test_every_bad_value_or_key_raises_zero_config_error_naming_it(config, named):
    """Probe 38D F6: these raised OverflowError or TypeError naming nothing."""
    with pytest.raises(ZeroConfigError) as exc:
        ZeroConfig.from_dict(config)
    assert named in str(exc.value) and len(str(exc.value)) < 2000, str(exc.value)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(["gradient_clipping", "collective_timeout", "max_live_parameters", "overlap_comm", "dtype",
                        "reduce_scatter_impl", "offload_param", "leaf_modules", "memory_budget", "steps_per_print",
                        "stage3_max_live_parameters", "communication_data_type", "zero_quantized_weights"]),
       st.one_of(st.integers(min_value=-10**500, max_value=10**500), st.floats(), st.text(max_size=5),
                 st.lists(st.integers(), max_size=2), st.dictionaries(st.integers(), st.integers(), max_size=1),
                 st.none(), st.booleans()),
       st.booleans())
def test_any_value_anywhere_is_taken_or_refused_with_zero_config_error(key, value, deepspeed):
    """Probe 38D F6: nothing but ZeroConfigError comes out of reading a config, in either format."""
    config = {"zero_optimization": {**_ZERO3, key: value}} if deepspeed else {key: value}
    try:
        ZeroConfig.from_dict(config)
    except ZeroConfigError:
        pass
