import dataclasses
import json

import pytest

from conftest import fixture_dir
from qwen35_jax.model.config import ModelConfig, load_config


def test_multimodal_and_text_layouts():
    mm = load_config(fixture_dir("mm_tied_r2_g2"))
    assert mm.multimodal and mm.tie_word_embeddings
    assert mm.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert (mm.linear_key_head_dim, mm.linear_value_head_dim) == (16, 32)
    assert mm.rotary_dim == 8 and mm.head_dim == 32
    text = load_config(fixture_dir("text_untied_r1_g6"))
    assert not text.multimodal and not text.tie_word_embeddings
    assert text.layer_types[0] == "full_attention" and text.attn_layers == (0, 3)   # read, never assumed


def test_released_configs(shared_configs):
    for name, raw in shared_configs.items():
        cfg = ModelConfig.from_hf(raw)
        assert cfg.rotary_dim == 64 and cfg.head_dim == 256, name
        assert len(cfg.gdn_layers) == 3 * len(cfg.attn_layers), name


@pytest.fixture
def shared_configs():
    import glob
    import os
    paths = glob.glob(os.path.join(os.path.dirname(__file__), "..", "bench", "configs", "qwen3.5-*.json"))
    assert paths, "bench/configs holds the released text configs"
    return {os.path.basename(p): json.load(open(p)) for p in paths}


def test_layer_types_fallback_and_partial_rotary_top_level():
    raw = json.load(open(fixture_dir("text_tied_r2_g1") + "/config.json"))
    raw.pop("layer_types")
    raw["num_hidden_layers"] = 8
    raw["rope_parameters"] = {"rope_type": "default"}
    raw["rope_theta"] = 1e6
    raw["partial_rotary_factor"] = 0.5
    cfg = ModelConfig.from_hf(raw)
    assert cfg.attn_layers == (3, 7) and cfg.rotary_dim == 16 and cfg.rope_theta == 1e6


@pytest.mark.parametrize("model_type,needle", [("qwen3_5_moe", "text_config"), ("qwen3_next", "not supported yet"),
                                               ("llama", "not a Qwen3.5 model")])
def test_unsupported_model_types(model_type, needle):
    with pytest.raises(ValueError, match=needle):
        ModelConfig.from_hf({"model_type": model_type})


def test_moe_configs():
    """A MoE text config inside a multimodal one is read as MoE (its expert fields are required); the expert
    fields parse, the dense MLP width is absent; bad expert counts and mlp_only_layers are refused."""
    raw = json.load(open(fixture_dir("mm_tied_r2_g2") + "/config.json"))
    raw["text_config"]["model_type"] = "qwen3_5_moe_text"
    with pytest.raises(ValueError, match="num_experts"):
        ModelConfig.from_hf(raw)
    raw["text_config"].update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                              shared_expert_intermediate_size=24)
    raw["text_config"].pop("intermediate_size")
    cfg = ModelConfig.from_hf(raw)
    assert cfg.moe and cfg.multimodal and cfg.intermediate_size == 0
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
            cfg.shared_expert_intermediate_size) == (8, 2, 16, 24)
    assert ModelConfig.from_hf(dict(cfg.to_hf_text(), model_type="qwen3_5_moe_text")) == \
        dataclasses.replace(cfg, multimodal=False)
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        ModelConfig.from_hf(dict(raw, text_config=dict(raw["text_config"], num_experts_per_tok=9)))
    with pytest.raises(ValueError, match="mlp_only_layers"):
        ModelConfig.from_hf(dict(raw, text_config=dict(raw["text_config"], mlp_only_layers=[0])))


def test_missing_field_and_bad_layer_types():
    raw = json.load(open(fixture_dir("text_tied_r2_g1") + "/config.json"))
    bad = dict(raw)
    bad.pop("linear_num_value_heads")
    with pytest.raises(ValueError, match="linear_num_value_heads"):
        ModelConfig.from_hf(bad)
    bad = dict(raw, layer_types=["linear_attention"] * 3)
    with pytest.raises(ValueError, match="num_hidden_layers"):
        ModelConfig.from_hf(bad)
    bad = dict(raw, layer_types=["linear_attention"] * 3 + ["sliding_attention"])
    with pytest.raises(ValueError, match="sliding_attention"):
        ModelConfig.from_hf(bad)
