"""Loading fails closed, shards are 1/tp per device, host memory stays bounded, and converted weights round-trip."""
import json
import os
import shutil
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

from conftest import engine_args, fixture_dir, reference
from qwen35_jax.model.checkpoint import Checkpoint, _read_header, write_safetensors
from qwen35_jax.model.config import load_config
from qwen35_jax.llm import LLM
from qwen35_jax.model.sharding import Layout, make_mesh
from qwen35_jax.model.state import abstract_state, init_state
from qwen35_jax.model.weights import abstract_weights, load_weights

CASE = "text_untied_r1_g6"     # single-file checkpoint, Hq=12, Hkv=2, Hk=Hv=4, I=128


def _rewrite(tmp_path, edit):
    """Copy the fixture and rewrite its safetensors through `edit(dict of arrays) -> dict`."""
    dst = tmp_path / "model"
    shutil.copytree(fixture_dir(CASE), dst)
    path = str(dst / "model.safetensors")
    header = _read_header(path)
    arrays = {k: np.array(np.memmap(path, dtype=i.dtype, mode="r", offset=i.offset, shape=i.shape))
              for k, i in header.items()}
    write_safetensors(path, edit(arrays))
    return str(dst)


def test_missing_tensor_is_named(tmp_path):
    key = "model.layers.1.linear_attn.A_log"
    d = _rewrite(tmp_path, lambda a: {k: v for k, v in a.items() if k != key})
    with pytest.raises(ValueError, match=r"missing tensor 'layers\.1\.linear_attn\.A_log' \(expected shape \[4\]\)"):
        LLM(d, skip_tokenizer_init=True)


def test_wrong_shape_is_named(tmp_path):
    key = "model.layers.0.self_attn.k_proj.weight"
    d = _rewrite(tmp_path, lambda a: {**a, key: a[key][:-32]})
    with pytest.raises(ValueError, match=r"'layers\.0\.self_attn\.k_proj\.weight' has shape \[32, 64\], "
                                         r"expected \[64, 64\]"):
        LLM(d, skip_tokenizer_init=True)


def test_visual_tensors_are_skipped_and_mtp_is_loaded_only_when_asked(tmp_path):
    extra = {"model.visual.blocks.0.w": np.ones((2,), np.float32)}
    d = _rewrite(tmp_path, lambda a: {**a, **extra, **_mtp_tensors(a)})
    ckpt = Checkpoint(d)
    assert not any(k.startswith(("visual", "model.visual")) for k in ckpt.tensors)
    assert "mtp.fc.weight" in ckpt and "mtp.layers.0.self_attn.q_proj.weight" in ckpt
    ref = reference(CASE)
    got = LLM(d, skip_tokenizer_init=True, **engine_args(precompile=False)).logits(ref["prompt_7"])
    assert np.abs(got - ref["logits_7"]).max() < 1e-3
    cfg = load_config(d)
    with pytest.raises(ValueError, match="mtp_num_hidden_layers = 1"):
        abstract_weights(cfg, Layout.build(cfg, 1), mtp=True)


def _mtp_tensors(a):
    """An MTP head (random values, HF key names and shapes) for the fixture checkpoint's text decoder."""
    rng = np.random.default_rng(0)
    full = next(int(k.split(".")[2]) for k in a if ".self_attn." in k)
    out = {k.replace(f"model.layers.{full}.", "mtp.layers.0."): rng.standard_normal(v.shape).astype(v.dtype)
           for k, v in a.items() if k.startswith(f"model.layers.{full}.")}
    h = a["model.norm.weight"].shape[0]
    out |= {"mtp.fc.weight": rng.standard_normal((h, 2 * h)).astype(np.float32)}
    out |= {f"mtp.{n}.weight": rng.standard_normal(h).astype(np.float32)
            for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}
    return out


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_to_checkpoint_inverts_loading(tmp_path, tp):
    """Writing trained weights back in HF layout (tools/train_tiny) is the exact inverse of loading, at any tp
    (stitched per-rank layouts, replicated KV heads at tp 4, vocab padding), the MTP head included."""
    import jax.numpy as jnp
    from qwen35_jax.model.weights import to_checkpoint
    d = _rewrite(tmp_path, lambda a: {**a, **_mtp_tensors(a)})
    with open(os.path.join(d, "config.json")) as f:
        config = json.load(f)
    (config.get("text_config") or config)["mtp_num_hidden_layers"] = 1
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(config, f)
    cfg = load_config(d)
    ckpt = Checkpoint(d)
    got = to_checkpoint(load_weights(d, cfg, make_mesh(tp), jnp.float32, mtp=True), cfg, tp)
    assert sorted(got) == sorted(ckpt.tensors)
    for key, x in got.items():
        np.testing.assert_array_equal(x, ckpt.read(key).astype(np.float32), err_msg=key)


@pytest.mark.parametrize("tp,field", [(8, "num_attention_heads=12"), (3, None)])
def test_tp_not_dividing_heads_fails_at_construction(tp, field):
    if tp == 3:
        with pytest.raises(ValueError, match="must be 1, 2, 4 or 8"):
            LLM(fixture_dir(CASE), tensor_parallel_size=tp, skip_tokenizer_init=True)
    else:
        with pytest.raises(ValueError, match=f"tensor_parallel_size={tp} does not divide {field}"):
            LLM(fixture_dir(CASE), tensor_parallel_size=tp, skip_tokenizer_init=True)


def test_gdn_head_count_error_names_the_field():
    cfg = load_config(fixture_dir("mm_untied_r3_g3"))          # Hk = 4, Hv = 12, Hq = 12, Hkv = 4
    import dataclasses
    bad = dataclasses.replace(cfg, linear_num_key_heads=6, linear_num_value_heads=12)
    with pytest.raises(ValueError, match="does not divide linear_num_key_heads=6"):
        Layout.build(bad, 4)


def test_shards_are_one_over_tp_per_device():
    tp = 4
    case = "mm_tied_r2_g2"
    cfg = load_config(fixture_dir(case))
    mesh = make_mesh(tp)
    layout = Layout.build(cfg, tp)
    abstract = abstract_weights(cfg, layout)
    weights = load_weights(fixture_dir(case), cfg, mesh)
    sharded = 0
    for p, arr in zip(jax.tree.leaves(abstract, is_leaf=lambda x: hasattr(x, "axes")), jax.tree.leaves(weights)):
        per_dev = [s.data.nbytes for s in arr.addressable_shards]
        if any(a is not None and a not in ("embed", "taps", "head_dim") for a in p.axes):
            sharded += 1
            assert all(b * tp == arr.nbytes for b in per_dev), p
        else:
            assert all(b == arr.nbytes for b in per_dev), p
    assert sharded > 10
    state = init_state(abstract_state(cfg, layout, num_slots=4, num_pages=9, page_size=16), mesh)
    for rec in state.recurrent + state.conv:
        assert [s.data.nbytes * tp for s in rec.addressable_shards] == [rec.nbytes] * tp


def test_orbax_round_trip(tmp_path):
    ref = reference(CASE)
    llm = LLM(fixture_dir(CASE), tensor_parallel_size=2, skip_tokenizer_init=True, converted_weights_dir=str(tmp_path),
              **engine_args(precompile=False))
    assert os.path.isdir(tmp_path / "tp2-float32")
    again = LLM(fixture_dir(CASE), tensor_parallel_size=2, skip_tokenizer_init=True,
                converted_weights_dir=str(tmp_path), **engine_args(precompile=False))
    for a, b in zip(jax.tree.leaves(llm.weights), jax.tree.leaves(again.weights)):
        assert a.sharding == b.sharding
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert np.abs(again.logits(ref["prompt_7"]) - ref["logits_7"]).max() < 1e-3


def test_loading_host_memory_is_bounded(tmp_path):
    """Load a ~250 MB checkpoint at tp=4 in a fresh process. On CPU the device buffers are host memory, so what is
    measured is the host memory beyond them: loading never stages the checkpoint (each device reads only its own
    slices, one shard at a time), so the transient peak is a small fraction of the weight bytes."""
    script = textwrap.dedent(f"""
        import json, os, sys, threading, time
        import psutil
        import jax
        jax.config.update("jax_num_cpu_devices", 4)
        jax.config.update("jax_platforms", "cpu")
        import jax.numpy as jnp, numpy as np
        from qwen35_jax.model.config import load_config
        from qwen35_jax.model.sharding import make_mesh
        from qwen35_jax.model.weights import load_weights
        d = {str(tmp_path)!r}
        cfg = load_config(d)
        mesh = make_mesh(4)
        jax.block_until_ready(jnp.ones(4) + 1)
        proc = psutil.Process()
        base = peak = proc.memory_info().rss
        done = False
        def sample():
            global peak
            while not done:
                peak = max(peak, proc.memory_info().rss)
                time.sleep(0.002)
        t = threading.Thread(target=sample)
        t.start()
        w = load_weights(d, cfg, mesh, dtype=jnp.bfloat16)
        jax.block_until_ready(w)
        done = True
        t.join()
        after = proc.memory_info().rss
        peak = max(peak, after)
        held = sum(s.data.nbytes for a in jax.tree.leaves(w) for s in a.addressable_shards)
        print(json.dumps(dict(base=base, peak=peak, after=after, held=held)))
    """)
    from qwen35_jax.tools.make_tiny_model import TEXT_CONFIG, _random_weights
    text = dict(TEXT_CONFIG, hidden_size=1024, intermediate_size=8192, num_hidden_layers=4, vocab_size=8192,
                num_attention_heads=8, num_key_value_heads=4, head_dim=128, linear_num_key_heads=8,
                linear_num_value_heads=16, linear_key_head_dim=64, linear_value_head_dim=64,
                layer_types=["linear_attention"] * 3 + ["full_attention"], eos_token_id=0)
    weights = _random_weights(text, np.random.default_rng(0))
    total = sum(a.nbytes for a in weights.values())
    write_safetensors(str(tmp_path / "model.safetensors"), weights)
    with open(tmp_path / "config.json", "w") as f:
        json.dump({"model_type": "qwen3_5", "text_config": text}, f)
    del weights
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    m = json.loads(out.stdout.strip().splitlines()[-1])
    transient = m["peak"] - m["after"]                   # freed again by the end of loading
    retained = m["after"] - m["base"] - m["held"]        # kept beyond the device buffers (allocator, runtime)
    assert total > 150e6 and m["held"] >= total * 0.99
    assert transient < 0.10 * total, f"transient host memory {transient / 1e6:.0f} MB for {total / 1e6:.0f} MB"
    assert retained < 0.20 * total, f"retained host memory {retained / 1e6:.0f} MB for {total / 1e6:.0f} MB"


def test_relayout_between_tp_sizes_equals_loading():
    """Random-weight benchmarks compare tp sizes by re-laying-out one set of weights: the result must be exactly
    what loading the checkpoint at the destination tp gives (stitching, KV replication, vocab padding)."""
    from qwen35_jax.model.weights import relayout
    import jax.numpy as jnp
    cfg = load_config(fixture_dir(CASE))                  # Hkv = 2 (replicated at tp=4), vocab 250 (padded)
    m1, m4 = make_mesh(1), make_mesh(4)
    moved = relayout(load_weights(fixture_dir(CASE), cfg, m1, jnp.float32), cfg, m1, m4)
    for a, b in zip(jax.tree.leaves(load_weights(fixture_dir(CASE), cfg, m4, jnp.float32)), jax.tree.leaves(moved)):
        assert a.sharding == b.sharding
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
