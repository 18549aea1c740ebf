"""Qwen3.5-MoE (issue 40) through the engine: the fp32 HF parity of the MoE fixtures is in test_hf_parity.py (both
expert layouts, tp 1 / 2 / 4, experts split over tp); here greedy decoding against HF's generate, batch
invariance, seeds, slot reuse, bf16, and the expert count tp must divide."""
import dataclasses
import functools

import numpy as np
import pytest

from conftest import engine_args, fixture_dir, reference
from qwen35_jax.engine.sampling_params import SamplingParams
from qwen35_jax.llm import LLM

CASE = "moe_text_untied_e16_k4"
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@functools.lru_cache(maxsize=2)
def llm(tp, case=CASE, dtype="float32"):
    return LLM(fixture_dir(case), tensor_parallel_size=tp, skip_tokenizer_init=True,
               **engine_args(precompile=False, dtype=dtype))


def prompts(n, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(2, 250, size=int(rng.integers(3, 40))).tolist() for _ in range(n)]


@pytest.mark.parametrize("tp,case", [(1, CASE), (2, CASE), (4, CASE), (2, "moe_mm_tied_e8_k2")])
def test_greedy_matches_hf_and_is_batch_invariant(tp, case):
    """HF's greedy continuation (fp32), and the same tokens for a prompt alone or among others: a token's routing
    does not depend on the rows beside it."""
    model = llm(tp, case)
    ref = reference(case)
    long = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    assert model.generate([ref["prompt_7"].tolist()], long)[0].outputs[0].token_ids == ref["greedy_7"].tolist()
    ps = prompts(6, seed=tp)
    alone = [model.generate([p], GREEDY)[0].outputs[0].token_ids for p in ps]
    assert alone == [o.outputs[0].token_ids for o in model.generate(ps, GREEDY)]


def test_seeds_and_recycled_slots():
    """A seeded request samples the same tokens alone and in a mixed batch, after its slot held other requests;
    a fresh engine gives the same greedy tokens as one whose slots were used."""
    model = llm(1)
    p = prompts(1, seed=11)[0]
    sp = SamplingParams(max_tokens=10, temperature=1.0, top_k=50, seed=1234, ignore_eos=True)
    alone = model.generate([p], sp)[0].outputs[0].token_ids
    model.generate(prompts(8, seed=21), SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True))
    mixed = model.generate(prompts(3, seed=12) + [p], [GREEDY] * 3 + [sp])
    assert mixed[-1].outputs[0].token_ids == alone
    q = prompts(1, seed=22)[0]
    fresh = LLM(fixture_dir(CASE), skip_tokenizer_init=True, **engine_args(precompile=False))
    assert model.generate([q], GREEDY)[0].outputs[0].token_ids == fresh.generate([q], GREEDY)[0].outputs[0].token_ids
    fresh.engine.shutdown()


def test_decode_min_rows_on_a_moe_model():
    """decode_min_rows (default 2): a lone request decodes beside a padding row (null slot; not a live token, so
    the router gives it no expert), with the tokens it has alone (decode_min_rows = 1)."""
    from qwen35_jax.model.backends import KernelConfig
    p = prompts(1, seed=31)[0]
    want = llm(1).generate([p], GREEDY)[0].outputs[0].token_ids
    model = LLM(fixture_dir(CASE), skip_tokenizer_init=True,
                **engine_args(precompile=False, kernel_config=KernelConfig(decode_min_rows=1)))
    assert model.generate([p], GREEDY)[0].outputs[0].token_ids == want
    model.engine.shutdown()


def test_bf16_logits_close_to_fp32():
    """The bf16 path (expert GEMMs and router in bf16, fp32 softmax and accumulation) agrees with the fp32 HF
    reference on the top token at most positions of these random-weight fixtures."""
    ref = reference(CASE)
    got, want = llm(1, CASE, "bfloat16").logits(ref["prompt_70"]), ref["logits_70"]
    assert np.isfinite(got).all()
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.9


def test_tp_must_divide_the_experts():
    from qwen35_jax.model.config import load_config
    from qwen35_jax.model.sharding import Layout
    cfg = dataclasses.replace(load_config(fixture_dir(CASE)), num_experts=6, num_experts_per_tok=2)
    with pytest.raises(ValueError, match="does not divide num_experts=6"):
        Layout.build(cfg, 4)


def test_397b_layout_lowers_at_reduced_depth_on_8_devices():
    """Qwen3.5-397B-A17B's widths (E 512, k 10, H 4096) at 4 layers on 8 simulated devices, tp 8 (docs/moe.md):
    each device holds 64 whole experts, and the decode forward lowers with one all-reduce per layer (attention,
    GDN and MoE each in the place of the dense model's) plus the embedding's. Lowered, not run: one such layer's
    experts alone are 13 GB."""
    import jax
    import jax.numpy as jnp
    from qwen35_jax.model import forward as fw
    from qwen35_jax.model.backends import KernelConfig, make_kernels
    from qwen35_jax.model.config import ModelConfig
    from qwen35_jax.model.sharding import Layout, make_mesh, named
    from qwen35_jax.model.state import abstract_state, state_specs
    from qwen35_jax.model.weights import abstract_weights, weight_specs
    raw = {
        "model_type": "qwen3_5_moe_text", "vocab_size": 248320, "hidden_size": 4096, "num_hidden_layers": 4,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"], "num_attention_heads": 32,
        "num_key_value_heads": 2, "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 64,
        "linear_key_head_dim": 128, "linear_value_head_dim": 128, "num_experts": 512, "num_experts_per_tok": 10,
        "moe_intermediate_size": 1024, "shared_expert_intermediate_size": 1024,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}}
    cfg = ModelConfig.from_hf(raw)
    mesh, layout = make_mesh(8), Layout.build(cfg, 8)
    aw = abstract_weights(cfg, layout, jnp.bfloat16)
    leaf = lambda x: hasattr(x, "axes")
    weights = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=named(mesh, p.axes)), aw,
                           is_leaf=leaf)
    moe = weights.layers[0].mlp
    assert moe.gate_up.sharding.shard_shape(moe.gate_up.shape) == (64, 4096, 2048)
    assert moe.down.sharding.shard_shape(moe.down.shape) == (64, 1024, 4096)
    st = abstract_state(cfg, layout, 4, 64, 16, jnp.bfloat16)
    state = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=named(mesh, p.axes)), st,
                         is_leaf=leaf)
    fn = fw.make_forward(cfg, layout, mesh, make_kernels(KernelConfig(backend="reference").resolved()),
                         weight_specs(aw), state_specs(st), all_logits=False)
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
    batch = fw.Batch(tokens=i32(4, 1), start=i32(4), lens=i32(4), slots=i32(4), pages=i32(4, 8))
    text = jax.jit(fn).trace(weights, state, batch).lower().as_text()
    assert text.count("stablehlo.all_reduce") == 2 * cfg.num_layers + 1


def test_speculative_decoding_on_a_moe_model(tmp_path):
    """A MoE checkpoint's MTP head carries a MoE layer (loaded as one): with its drafts (random weights, k = 2),
    greedy output equals plain greedy decoding of the same weights, so verify and commit keep a MoE model exact."""
    import json
    import shutil
    from qwen35_jax.engine.engine import EngineArgs, build_engine
    raw = json.load(open(fixture_dir(CASE) + "/config.json"))
    json.dump(dict(raw, mtp_num_hidden_layers=1), open(tmp_path / "config.json", "w"))
    shutil.copy(fixture_dir(CASE) + "/generation_config.json", tmp_path)
    args = EngineArgs(load_format="dummy", skip_tokenizer_init=True, **engine_args(precompile=False))
    spec = build_engine(str(tmp_path), dataclasses.replace(
        args, speculative_config={"method": "mtp", "num_speculative_tokens": 2}))
    assert spec.weights.mtp.layer.mlp.gate_up.shape[0] == raw["num_experts"]
    plain = build_engine(str(tmp_path), args, weights=dataclasses.replace(spec.weights, mtp=None))
    ps = prompts(4, seed=5)
    tokens = lambda e: [o.outputs[0].token_ids for o in e.generate(ps, [GREEDY] * len(ps))]
    assert tokens(spec) == tokens(plain)
    assert spec.stats.spec_steps > 0
    spec.shutdown()
    plain.shutdown()


def test_decode_floor_counts_only_the_experts_a_step_reads():
    """The decode floor (bench/moe.py's, bench/throughput.py's) reads a MoE layer's experts only in the share the
    step routes to: all of them at E touched, k / E of them at k, and the uniform-routing expectation by default."""
    from qwen35_jax.tools.profile import decode_floor_bytes
    engine = llm(1).engine
    cfg, w, state = engine.cfg, engine.weights, engine.executor.state
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    experts = sum(layer.mlp.gate_up.nbytes + layer.mlp.down.nbytes for layer in w.layers)
    floor = lambda b, touched=None: decode_floor_bytes(cfg, w, state, b, 100, touched)["weights"]
    assert floor(1, e) - floor(1, k) == pytest.approx(experts * (1 - k / e), abs=len(w.layers))
    assert floor(1) == floor(1, k)
    assert floor(8) == floor(8, e * (1 - (1 - k / e) ** 8)) < floor(8, e)
