"""Static model configuration parsed from a HF `config.json`: dense (multimodal `qwen3_5`, text-only `qwen3_5_text`)
or sparse (`qwen3_5_moe`, `qwen3_5_moe_text`: every layer's MLP a routed mixture of experts plus a shared expert)."""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

SUPPORTED = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
MULTIMODAL = ("qwen3_5", "qwen3_5_moe")
KNOWN_UNSUPPORTED = {
    "qwen3_next": "Qwen3-Next (fused in_proj_qkvz layout, MoE) is not supported yet",
}
LAYER_KINDS = ("linear_attention", "full_attention")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Text-decoder shape of a Qwen3.5 model. Hashable, so it can be a static argument of jitted functions."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int       # dense MLP width (0 for MoE models)
    layer_types: tuple[str, ...]
    num_heads: int               # full-attention query heads (Hq)
    num_kv_heads: int            # full-attention KV heads (Hkv)
    head_dim: int                # D, explicit (not hidden/Hq)
    rotary_dim: int              # int(head_dim * partial_rotary_factor); RoPE acts on the first rotary_dim dims
    rope_theta: float
    linear_num_key_heads: int    # GDN q/k heads (Hk)
    linear_num_value_heads: int  # GDN v heads (Hv)
    linear_key_head_dim: int     # dk
    linear_value_head_dim: int   # dv
    conv_kernel: int             # causal conv width (4)
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...] = ()
    multimodal: bool = False     # checkpoint keys live under model.language_model.
    mtp_layers: int = 0          # mtp_num_hidden_layers: decoder layers of the multi-token-prediction head
    num_experts: int = 0         # E routed experts per layer (0: dense MLP layers)
    num_experts_per_tok: int = 0     # k experts per token (top-k of the router's softmax, renormalised)
    moe_intermediate_size: int = 0   # Im: each routed expert's SwiGLU width
    shared_expert_intermediate_size: int = 0   # Is: the shared expert's SwiGLU width (sigmoid-gated)

    @property
    def moe(self) -> bool:
        return self.num_experts > 0

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @property
    def gdn_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")

    @property
    def attn_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "full_attention")

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> "ModelConfig":
        """Parse either HF layout; raise a ValueError that names the problem for anything else."""
        model_type = raw.get("model_type")
        if model_type in KNOWN_UNSUPPORTED:
            raise ValueError(f"model_type {model_type!r}: {KNOWN_UNSUPPORTED[model_type]}")
        if model_type not in SUPPORTED:
            raise ValueError(f"model_type {model_type!r} is not a Qwen3.5 model (supported: {', '.join(SUPPORTED)})")
        multimodal = model_type in MULTIMODAL
        text = raw.get("text_config") if multimodal else raw
        if not isinstance(text, dict):
            raise ValueError("multimodal qwen3_5 config.json has no text_config")
        if multimodal and text.get("model_type") in KNOWN_UNSUPPORTED:
            raise ValueError(f"text_config.model_type {text['model_type']!r}: {KNOWN_UNSUPPORTED[text['model_type']]}")

        def need(key):
            if key not in text:
                raise ValueError(f"config.json is missing text field {key!r}")
            return text[key]

        n = int(need("num_hidden_layers"))
        layer_types = text.get("layer_types")
        if layer_types is None:   # HF's fallback: every `full_attention_interval`-th layer is full attention
            interval = int(text.get("full_attention_interval", 4))
            layer_types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)]
        layer_types = tuple(layer_types)
        if len(layer_types) != n:
            raise ValueError(f"layer_types has {len(layer_types)} entries but num_hidden_layers is {n}")
        bad = sorted(set(layer_types) - set(LAYER_KINDS))
        if bad:
            raise ValueError(f"unsupported layer_types {bad} (supported: {', '.join(LAYER_KINDS)})")
        moe = bool(text.get("num_experts")) or any(str(t).startswith("qwen3_5_moe")
                                                    for t in (model_type, text.get("model_type")))
        if moe and text.get("mlp_only_layers"):
            raise ValueError("mlp_only_layers (dense layers among the MoE ones) is not supported: every Qwen3.5-MoE "
                             "layer is sparse")

        rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"rope_type {rope_type!r} is not supported (only 'default')")
        theta = float(rope.get("rope_theta", text.get("rope_theta", 10000.0)))
        factor = float(rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 1.0)))
        num_heads = int(need("num_attention_heads"))
        head_dim = int(text.get("head_dim") or need("hidden_size") // num_heads)
        rotary_dim = int(head_dim * factor)
        if rotary_dim % 2:
            raise ValueError(f"rotary dim {rotary_dim} (head_dim * partial_rotary_factor) must be even")
        if text.get("attention_bias"):
            raise ValueError("attention_bias=true is not supported (no released Qwen3.5 model uses it)")
        if text.get("hidden_act", "silu") not in ("silu", "swish"):
            raise ValueError(f"hidden_act {text['hidden_act']!r} is not supported (only silu)")

        eos = text.get("eos_token_id", raw.get("eos_token_id"))
        eos = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
        tie = text.get("tie_word_embeddings", raw.get("tie_word_embeddings", False))
        cfg = cls(
            vocab_size=int(need("vocab_size")), hidden_size=int(need("hidden_size")),
            intermediate_size=int(text.get("intermediate_size") or 0) if moe else int(need("intermediate_size")),
            layer_types=layer_types,
            num_heads=num_heads, num_kv_heads=int(text.get("num_key_value_heads", num_heads)), head_dim=head_dim,
            rotary_dim=rotary_dim, rope_theta=theta,
            linear_num_key_heads=int(need("linear_num_key_heads")),
            linear_num_value_heads=int(need("linear_num_value_heads")),
            linear_key_head_dim=int(need("linear_key_head_dim")),
            linear_value_head_dim=int(need("linear_value_head_dim")),
            conv_kernel=int(text.get("linear_conv_kernel_dim", 4)), rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(tie), max_position_embeddings=int(text.get("max_position_embeddings", 32768)),
            eos_token_ids=eos, multimodal=multimodal, mtp_layers=int(text.get("mtp_num_hidden_layers", 0)),
            **({} if not moe else dict(
                num_experts=int(need("num_experts")), num_experts_per_tok=int(need("num_experts_per_tok")),
                moe_intermediate_size=int(need("moe_intermediate_size")),
                shared_expert_intermediate_size=int(need("shared_expert_intermediate_size")))))
        cfg.validate()
        return cfg

    def validate(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads {self.num_heads} is not a multiple of num_key_value_heads "
                             f"{self.num_kv_heads}")
        if self.moe and not (1 <= self.num_experts_per_tok <= self.num_experts and self.moe_intermediate_size > 0
                             and self.shared_expert_intermediate_size > 0):
            raise ValueError(f"MoE config needs 1 <= num_experts_per_tok ({self.num_experts_per_tok}) <= num_experts "
                             f"({self.num_experts}) and positive moe_intermediate_size / "
                             f"shared_expert_intermediate_size")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(f"linear_num_value_heads {self.linear_num_value_heads} is not a multiple of "
                             f"linear_num_key_heads {self.linear_num_key_heads}")

    def to_hf_text(self) -> dict[str, Any]:
        """The `qwen3_5_text` (`qwen3_5_moe_text`) config.json fields of this shape (used to write random-weight
        models)."""
        moe = dict(model_type="qwen3_5_moe_text", architectures=["Qwen3_5MoeForCausalLM"],
                   num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                   moe_intermediate_size=self.moe_intermediate_size,
                   shared_expert_intermediate_size=self.shared_expert_intermediate_size) if self.moe else {}
        return {**dict(
            model_type="qwen3_5_text", architectures=["Qwen3_5ForCausalLM"], vocab_size=self.vocab_size,
            hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers, layer_types=list(self.layer_types),
            num_attention_heads=self.num_heads, num_key_value_heads=self.num_kv_heads, head_dim=self.head_dim,
            linear_num_key_heads=self.linear_num_key_heads, linear_num_value_heads=self.linear_num_value_heads,
            linear_key_head_dim=self.linear_key_head_dim, linear_value_head_dim=self.linear_value_head_dim,
            linear_conv_kernel_dim=self.conv_kernel, rms_norm_eps=self.rms_norm_eps, hidden_act="silu",
            attention_bias=False, tie_word_embeddings=self.tie_word_embeddings,
            max_position_embeddings=self.max_position_embeddings,
            rope_parameters=dict(rope_type="default", rope_theta=self.rope_theta,
                                 partial_rotary_factor=self.rotary_dim / self.head_dim),
            eos_token_id=list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
            mtp_num_hidden_layers=self.mtp_layers, mtp_use_dedicated_embeddings=False, dtype="bfloat16"), **moe}


def load_config(model_dir: str) -> ModelConfig:
    path = os.path.join(model_dir, "config.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"no config.json in {model_dir!r}")
    with open(path) as f:
        return ModelConfig.from_hf(json.load(f))


DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float32": "float32", "fp32": "float32"}


def resolve_dtype(dtype):
    """A dtype name ("bfloat16" / "bf16" / "float32" / "fp32") or a jnp dtype -> the jnp dtype; others refused."""
    import jax.numpy as jnp
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        return getattr(jnp, DTYPES[dtype])
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        raise ValueError(f"dtype must be bfloat16 or float32, got {dtype}")
    return dtype
