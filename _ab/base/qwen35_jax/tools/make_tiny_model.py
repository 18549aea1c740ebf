"""Write a small random-weight Qwen3.5 model in the real multimodal HF layout, with a locally trained tokenizer.

    python -m qwen35_jax.tools.make_tiny_model DIR [--seed 0]

The result needs no download: a byte-level BPE tokenizer trained with `tokenizers` on the text shipped beside this
file (tokenizer_builder.py: Qwen3.5's pre-tokenizer regex, added tokens and chat template), a
`qwen3_5` config.json with a nested text_config, bf16 safetensors under `model.language_model.` (A_log and the
gated-norm weight in F32, as released checkpoints store them), and a generation_config.json with the eos ids.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile

import ml_dtypes
import numpy as np

from qwen35_jax.model.checkpoint import write_safetensors
from qwen35_jax.tools import tokenizer_builder

CORPUS = os.path.join(os.path.dirname(__file__), "tiny_corpus.txt")
VOCAB_SIZE = 1024

TEXT_CONFIG = dict(
    model_type="qwen3_5_text", hidden_size=128, intermediate_size=256, num_hidden_layers=8,
    layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=64,
    linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=32, linear_value_head_dim=32,
    linear_conv_kernel_dim=4, hidden_act="silu", rms_norm_eps=1e-6, attention_bias=False,
    max_position_embeddings=32768, tie_word_embeddings=True, full_attention_interval=4, dtype="bfloat16",
    rope_parameters=dict(rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25,
                         mrope_section=[3, 3, 2], mrope_interleaved=True),
    mamba_ssm_dtype="float32")


def train_tokenizer(vocab_size: int = VOCAB_SIZE):
    """The tiny model's tokenizer: tokenizer_builder's, trained on the text shipped beside this file."""
    with open(CORPUS, encoding="utf-8") as f:
        return tokenizer_builder.train_tokenizer(f, vocab_size)


def _random_weights(text: dict, rng: np.random.Generator) -> dict[str, np.ndarray]:
    h, v, i = text["hidden_size"], text["vocab_size"], text["intermediate_size"]
    hq, hkv, d = text["num_attention_heads"], text["num_key_value_heads"], text["head_dim"]
    hk, hv = text["linear_num_key_heads"], text["linear_num_value_heads"]
    dk, dv, kc = text["linear_key_head_dim"], text["linear_value_head_dim"], text["linear_conv_kernel_dim"]
    conv = 2 * hk * dk + hv * dv
    bf = lambda *shape, s=1.0: (rng.standard_normal(shape) * s).astype(ml_dtypes.bfloat16)
    lin = lambda o, n: bf(o, n, s=n ** -0.5)
    p = "model.language_model."
    # embedding scale keeps the tied head's logits spread out (std ~2), so sampling has something to choose from
    out = {p + "embed_tokens.weight": bf(v, h, s=0.15), p + "norm.weight": bf(h, s=0.1)}
    for n, kind in enumerate(text["layer_types"]):
        q = f"{p}layers.{n}."
        out |= {q + "input_layernorm.weight": bf(h, s=0.1), q + "post_attention_layernorm.weight": bf(h, s=0.1),
                q + "mlp.gate_proj.weight": lin(i, h), q + "mlp.up_proj.weight": lin(i, h),
                q + "mlp.down_proj.weight": lin(h, i)}
        if kind == "full_attention":
            a = q + "self_attn."
            out |= {a + "q_proj.weight": lin(2 * hq * d, h), a + "k_proj.weight": lin(hkv * d, h),
                    a + "v_proj.weight": lin(hkv * d, h), a + "o_proj.weight": lin(h, hq * d),
                    a + "q_norm.weight": bf(d, s=0.1), a + "k_norm.weight": bf(d, s=0.1)}
        else:
            g = q + "linear_attn."
            out |= {g + "in_proj_qkv.weight": lin(conv, h), g + "in_proj_z.weight": lin(hv * dv, h),
                    g + "in_proj_b.weight": lin(hv, h), g + "in_proj_a.weight": lin(hv, h),
                    g + "conv1d.weight": bf(conv, 1, kc, s=0.5), g + "dt_bias": bf(hv, s=0.5),
                    g + "A_log": np.log(rng.uniform(1.0, 16.0, hv)).astype(np.float32),
                    g + "norm.weight": (1 + 0.1 * rng.standard_normal(dv)).astype(np.float32),
                    g + "out_proj.weight": lin(h, hv * dv)}
    return out


def make_tiny_model(out_dir: str, seed: int = 0) -> str:
    """Build the model into out_dir (written to a temporary dir first, then moved into place)."""
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=parent, prefix=".tiny-")
    ids = tokenizer_builder.write_tokenizer_files(train_tokenizer(), tmp, model_max_length=32768)
    text = dict(TEXT_CONFIG, vocab_size=-(-VOCAB_SIZE // 64) * 64,
                eos_token_id=ids["<|endoftext|>"], bos_token_id=None, pad_token_id=None)
    config = dict(architectures=["Qwen3_5ForConditionalGeneration"], model_type="qwen3_5", text_config=text,
                  vision_config=dict(model_type="qwen3_5_vision", depth=1, hidden_size=32, intermediate_size=64,
                                     num_heads=2, out_hidden_size=text["hidden_size"]),
                  tie_word_embeddings=text["tie_word_embeddings"],
                  transformers_version="5.17.0")
    files = {
        "config.json": config,
        "generation_config.json": dict(eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]],
                                       pad_token_id=ids["<|endoftext|>"], do_sample=True, temperature=0.7,
                                       top_p=0.8, top_k=20),
    }
    for name, obj in files.items():
        with open(os.path.join(tmp, name), "w") as f:
            json.dump(obj, f, indent=1)
    weights = _random_weights(text, np.random.default_rng(seed))
    write_safetensors(os.path.join(tmp, "model.safetensors"), weights, {"format": "pt"})
    if os.path.exists(out_dir):
        raise FileExistsError(f"{out_dir} already exists")
    os.replace(tmp, out_dir)
    return out_dir


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(make_tiny_model(args.out_dir, args.seed))


if __name__ == "__main__":
    main()
