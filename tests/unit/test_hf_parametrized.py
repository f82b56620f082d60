"""Hugging Face models beyond the causal LMs, loaded through zero3 (probe 29E): Wav2Vec2, whose
positional convolution is weight-norm parametrized, failed to load both ways (zero3.from_pretrained
raised "used by '_weight_norm' while it is partitioned" inside transformers' init functions; transformers'
from_pretrained under zero3.Init raised "aten::equal ... Meta tensors"); and a ViT head missing from the
checkpoint got other random values than transformers' from_pretrained with the same seed (ViT's __init__
draws from the RNG, and zero3 built on CPU where transformers builds on meta)."""

from __future__ import annotations

import pytest
import torch

import zero3

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")


def _wav2vec2_config():
    return transformers.Wav2Vec2Config(
        vocab_size=12, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        conv_dim=(16, 16), conv_stride=(4, 2), conv_kernel=(8, 4), num_conv_pos_embeddings=8,
        num_conv_pos_embedding_groups=4, hidden_dropout=0.0, activation_dropout=0.0, attention_dropout=0.0,
        feat_proj_dropout=0.0, final_dropout=0.0, layerdrop=0.0, mask_time_prob=0.0, pad_token_id=0)


@pytest.mark.parametrize("how", ["zero3.from_pretrained", "from_pretrained under Init"])
def test_a_weight_norm_parametrized_model_loads_and_runs_as_transformers(tmp_path, how):
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    transformers.Wav2Vec2ForCTC(_wav2vec2_config()).save_pretrained(tmp_path)
    ref = transformers.Wav2Vec2ForCTC.from_pretrained(tmp_path)
    if how == "zero3.from_pretrained":
        model = zero3.from_pretrained(transformers.Wav2Vec2ForCTC, tmp_path, dtype=torch.float32,
                                      zero_config={"param_persistence_threshold": 0})
    else:
        with zero3.Init(config_dict_or_path={"param_persistence_threshold": 0}):
            model = transformers.Wav2Vec2ForCTC.from_pretrained(tmp_path)
    assert all(zero3.is_partitioned(p) for p in model.parameters())
    zero3.initialize(model, None, {"param_persistence_threshold": 0})
    x = torch.randn(2, 400, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(input_values=x).logits, ref(input_values=x).logits, rtol=0, atol=0)


def test_a_missing_head_gets_the_draws_of_transformers_from_pretrained(tmp_path):
    transformers.logging.set_verbosity_error()
    cfg = transformers.ViTConfig(image_size=8, patch_size=4, num_channels=3, hidden_size=16, num_hidden_layers=1,
                                 num_attention_heads=2, intermediate_size=32, num_labels=5)
    torch.manual_seed(0)
    transformers.ViTModel(cfg, add_pooling_layer=False).save_pretrained(tmp_path)
    torch.manual_seed(11)
    ref = transformers.ViTForImageClassification.from_pretrained(tmp_path, num_labels=5)
    torch.manual_seed(11)
    model = zero3.from_pretrained(transformers.ViTForImageClassification, tmp_path, dtype=torch.float32,
                                  num_labels=5)
    for name in ("classifier.weight", "classifier.bias"):
        got = zero3.safe_get_full_fp32_param(model.get_parameter(name))
        torch.testing.assert_close(got, ref.get_parameter(name).detach(), rtol=0, atol=0)
