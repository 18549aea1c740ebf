"""tools/train_tiny: a few steps on a small corpus are reproducible, learn, and write a checkpoint the engine and the
evaluation read back (MTP head included)."""
import json
import os

import numpy as np
import pytest

TEXT = ("The interpreter reads a line, runs it and prints the result. A module is a file of definitions; its name "
        "is the file name without the suffix. Functions are defined with the def statement, classes with class. ")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    docs = {"train.jsonl": [f"Section {i}\n\n" + TEXT * 3 for i in range(6)],
            "heldout.jsonl": ["Modules\n\n" + TEXT * 4]}
    for name, texts in docs.items():
        with open(d / name, "w") as f:
            for i, t in enumerate(texts):
                f.write(json.dumps({"path": f"doc{i}.rst.txt", "text": t}) + "\n")
    with open(d / "manifest.json", "w") as f:
        json.dump({"package": "test", "version": "0"}, f)
    return str(d)


def test_training_is_reproducible_and_the_checkpoint_reads_back(corpus, tmp_path):
    import jax
    import jax.numpy as jnp

    from qwen35_jax.model.checkpoint import Checkpoint
    from qwen35_jax.model.config import load_config
    from qwen35_jax.model.sharding import make_mesh
    from qwen35_jax.model.weights import load_weights
    from qwen35_jax.tools import train_tiny as tt

    from conftest import XLA_CACHE
    jax.config.update("jax_compilation_cache_dir", XLA_CACHE)        # the second run loads the first's compiles
    tc = tt.TrainConfig(seq_len=64, batch=4, steps=30, lr=3e-3, warmup=5, eval_every=30, eval_windows=2,
                        vocab_size=384)
    small = dict(tt.TEXT_CONFIG, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                 layer_types=["linear_attention"] * 3 + ["full_attention"])      # the same kinds of layers, fewer
    a = tt.train(corpus, str(tmp_path / "a"), tc, log=lambda s: None, text_config=small)
    b = tt.train(corpus, str(tmp_path / "b"), tc, log=lambda s: None, text_config=small)
    strip = lambda curve: [{k: v for k, v in row.items() if k != "seconds"} for row in curve]
    assert strip(a["curve"]) == strip(b["curve"])                         # same seed, same curve
    assert a["curve"][-1]["main"] < a["curve"][0]["main"] - 1.0          # it learns

    d = str(tmp_path / "a")
    keys = set(Checkpoint(d).tensors)
    assert "mtp.fc.weight" in keys and "mtp.layers.0.self_attn.q_proj.weight" in keys
    assert "embed_tokens.weight" in keys and "lm_head.weight" not in keys      # tied, multimodal key names
    cfg = load_config(d)
    assert cfg.multimodal and cfg.mtp_layers == 1 and cfg.vocab_size == 384
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "training_log.json",
              "heldout.jsonl", "README.md"):
        assert os.path.exists(os.path.join(d, f)), f
    # The evaluation of record is reproduced from the files alone.
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(d, "tokenizer.json"))
    windows = tt.heldout_windows(tok, os.path.join(d, "heldout.jsonl"), tc.seq_len, tok.token_to_id("<|endoftext|>"))
    ev = tt.evaluate(load_config(d), load_weights(d, cfg, make_mesh(1), jnp.float32, mtp=True), windows)
    assert ev["nll"] == pytest.approx(a["heldout"]["nll"], rel=1e-6)
    assert 0 <= ev["mtp_top1"] <= 1 and np.isfinite(ev["perplexity"])


def test_engine_perplexity_equals_the_training_evaluation():
    """The instrument: held-out perplexity through the engine (prompt logprobs) is the training script's evaluation
    of the shipped model (bench/perplexity.py does this over the whole held-out set)."""
    import jax.numpy as jnp
    from tokenizers import Tokenizer

    from conftest import engine_args
    from qwen35_jax import LLM, SamplingParams
    from qwen35_jax.model.config import load_config
    from qwen35_jax.model.hub import default_model_dir
    from qwen35_jax.model.sharding import make_mesh
    from qwen35_jax.model.weights import load_weights
    from qwen35_jax.tools import train_tiny as tt

    d = default_model_dir()
    tok = Tokenizer.from_file(os.path.join(d, "tokenizer.json"))
    windows = tt.heldout_windows(tok, os.path.join(d, "heldout.jsonl"), 512, tok.token_to_id("<|endoftext|>"))[:2]
    cfg = load_config(d)
    ref = tt.evaluate(cfg, load_weights(d, cfg, make_mesh(1), jnp.float32, mtp=True), windows)
    with LLM(d, **engine_args(max_model_len=1024, max_num_batched_tokens=256, precompile=False)) as llm:
        outs = llm.generate([{"prompt_token_ids": w.tolist()} for w in windows],
                            SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
    nll = -sum(o.prompt_logprobs[i][int(w[i])].logprob for w, o in zip(windows, outs) for i in range(1, 512))
    assert nll / (2 * 511) == pytest.approx(ref["nll"], rel=1e-4)
    assert ref["perplexity"] < 200 and ref["mtp_top1"] > 0.2           # a trained model, not noise
