"""The Pallas GDN / conv / paged decode attention kernels (interpret mode on CPU) against the pure-jnp references;
CUDA cross-lowering so a Triton-illegal shape fails here and not on the GPU; model logits with the interpret kernels
= reference's; and a decode step lowered for CUDA has no host synchronisation (no while / conditional)."""
import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import fixture_dir
from bench import kernel_sweeps
from pallas_kernels import (conv1d, conv1d_reference, expert_gemm, gdn, gdn_mgpu, gdn_reference, gemv,
                            paged_attention, prefill_attention)
from qwen35_jax.model.attention import decode_attention, paged_attention as paged_attention_reference
from qwen35_jax.model.backends import KernelConfig, make_kernels
from qwen35_jax.model.sharding import Layout

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")

LENS = [1, 3, 63, 64, 65, 200, 0]      # the last row is a padded row on the null slot


def rel(x, y):
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    return float(np.linalg.norm(x - y) / np.linalg.norm(y))


def gdn_inputs(seed, n, t, hk, hv, dk, dv, slots=10, dtype=jnp.float32):
    """Realistic raw inputs: unnormalised q/k (the kernel l2-normalises), sigmoid beta from normal b, decay from
    A_log spanning slow (exp(A_log) ~ 0.05) to fast heads, non-zero initial states."""
    ks = jax.random.split(jax.random.key(seed), 8)
    q = (2.0 * jax.random.normal(ks[0], (n, t, hk, dk))).astype(dtype)
    k = (2.0 * jax.random.normal(ks[1], (n, t, hk, dk))).astype(dtype)
    v = jax.random.normal(ks[2], (n, t, hv, dv)).astype(dtype)
    a = jax.random.normal(ks[3], (n, t, hv)).astype(dtype)
    b = jax.random.normal(ks[4], (n, t, hv)).astype(dtype)
    A_log = jnp.linspace(-3.0, 2.0, hv) + 0.1 * jax.random.normal(ks[5], (hv,))
    dt_bias = 0.5 * jax.random.normal(ks[6], (hv,))
    pool = 0.3 * jax.random.normal(ks[7], (slots, hv, dv, dk))
    return q, k, v, a, b, A_log, dt_bias, pool


@functools.lru_cache(maxsize=None)
def _prefill_fn(config=None):
    return jax.jit(functools.partial(gdn.gdn_prefill, config=config, interpret=True))


WY = gdn.DEFAULT_PREFILL


@pytest.mark.parametrize("ratio,dk,dv,config,lens_l", [(1, 16, 32, WY, LENS), (3, 16, 16, WY, [3, 130, 64, 0]),
                                                       (2, 16, 32, dataclasses.replace(WY, solve_grid="key"),
                                                        [70, 130, 1, 0])],
                         ids=["r1", "r3", "r2-solve-per-key-head"])
def test_gdn_prefill_matches_token_scan(ratio, dk, dv, config, lens_l):
    """fp32 model inputs select near-fp32 dots (tf32x3; fp32 in interpret mode) and the T solve + P / f prep with the
    Triton scan: far inside the issue's bars."""
    n, t = len(lens_l), max(lens_l)
    q, k, v, a, b, A_log, dt_bias, pool = gdn_inputs(ratio, n, t, 2, 2 * ratio, dk, dv)
    slots = jnp.array([3, 1, 5, 9, 2, 7, 0])[-n:]
    lens = jnp.array(lens_l)
    use = jnp.array([True, False, True, True, False, True, False])[-n:]
    o, new = _prefill_fn(config)(q, k, v, a, b, A_log, dt_bias, pool, slots, lens, use)
    o_ref, new_ref = gdn_reference.gdn_prefill(q, k, v, a, b, A_log, dt_bias, pool, slots, lens, use, method="scan")
    real = (np.arange(t)[None] < np.asarray(lens)[:, None])[..., None, None]
    assert rel(np.where(real, o, 0), np.where(real, o_ref, 0)) <= 1e-4
    for i, s in enumerate(np.asarray(slots[:-1])):
        assert rel(new[s], new_ref[s]) <= 1e-4, f"row {i} (len {lens_l[i]}) state"
        assert rel(np.asarray(o)[i, :lens_l[i]], np.asarray(o_ref)[i, :lens_l[i]]) <= 1e-4, f"row {i} output"
    assert np.all(np.asarray(o)[~np.broadcast_to(real, o.shape)] == 0)       # padding rows are written as zeros
    untouched = np.setdiff1d(np.arange(pool.shape[0]), np.asarray(slots))
    np.testing.assert_array_equal(new[untouched], pool[untouched])


# bf16 model inputs through the Triton scan (dk = 32: the Mosaic GPU scan does not take it). Interpret mode rounds the
# operands as the tensor cores do ("bf16", "bf16x2", "tf32").
BF16_CASES = {
    "default": (WY, LENS, 1.5e-3),
    "solve2-per-value-head": (dataclasses.replace(WY, prep_mode="solve2", solve_grid="value"), [130, 1, 0], 1.5e-3),
    "solve2-per-key-head": (dataclasses.replace(WY, prep_mode="solve2", solve_grid="key"), [130, 1, 0], 1.5e-3),
    "bv16-two-stages": (dataclasses.replace(WY, bv=16, num_stages=2), [200, 65, 0], 1.5e-3),
}


@pytest.mark.parametrize("case", list(BF16_CASES))
def test_gdn_prefill_bf16_inputs_meet_issue_bars(case):
    """Bars of the issue against an fp32 token scan: output rel-L2 <= 4e-3, final state <= 3e-3 (fla's level). The
    output error includes the bf16 rounding of o itself (~1.2e-3 rel-L2), so the state is the sharper check: the
    Triton scan is held to 1.5e-3 (its CPU emulation at 9B head dims gives ~3e-4)."""
    config, lens_l, state_bar = BF16_CASES[case]
    n = len(lens_l)
    check_bf16_prefill(config, lens_l, 11, 32, 32, [3, 1, 5, 9, 2, 7, 0][-n:], [True] * (n - 1) + [False],
                       min(3e-3, state_bar))


def check_bf16_prefill(config, lens_l, seed, dk, dv, slots, use, state_bar):
    """bf16 inputs (2 key heads, 4 value heads) through gdn_prefill against the fp32 token scan: o rel-L2 <= 4e-3,
    the final states of all rows but the last <= state_bar, padding rows written as zeros, other slots untouched."""
    n, t = len(lens_l), max(lens_l)
    q, k, v, a, b, A_log, dt_bias, pool = gdn_inputs(seed, n, t, 2, 4, dk, dv, dtype=jnp.bfloat16)
    slots, lens, use = jnp.array(slots), jnp.array(lens_l), jnp.array(use)
    o, new = _prefill_fn(config)(q, k, v, a, b, A_log, dt_bias, pool, slots, lens, use)
    f32 = [x.astype(jnp.float32) for x in (q, k, v, a, b)]
    o_ref, new_ref = gdn_reference.gdn_prefill(*f32, A_log, dt_bias, pool, slots, lens, use, method="scan")
    real = (np.arange(t)[None] < np.asarray(lens)[:, None])[..., None, None]
    err_o = rel(np.where(real, np.asarray(o, np.float32), 0), np.where(real, o_ref, 0))
    err_s = rel(new[slots[:-1]], new_ref[slots[:-1]])
    assert err_o <= 4e-3 and err_s <= state_bar, (err_o, err_s)
    assert np.all(np.asarray(o, np.float32)[~np.broadcast_to(real, o.shape)] == 0)
    untouched = np.setdiff1d(np.arange(pool.shape[0]), np.asarray(slots))
    np.testing.assert_array_equal(new[untouched], pool[untouched])


MGPU_CASES = {"auto": dict(), "bv32": dict(mgpu_bv=32), "bv64": dict(mgpu_bv=64),
              "solve2-per-value-head": dict(prep_mode="solve2", solve_grid="value"),
              "solve2-per-key-head": dict(prep_mode="solve2", solve_grid="key")}


@pytest.mark.parametrize("case", list(MGPU_CASES))
def test_mgpu_scan_meets_issue_bars(case):
    """The Mosaic GPU scan (Mosaic GPU's interpreter: TMA copies, barriers and wgmma emulated) on bf16 inputs at
    dk = 64, dv = 128 (two or four V-blocks per head), ragged lengths with tail chunks (stored as row pieces of 16 + 8,
    4 + 2 and 1), an empty row and a fresh state, after either prep: the issue's bars against an fp32 token scan
    (X, Vnew and fk Vnew rounded to bf16 as fla's v_new: the state to fla's level), padding rows zero, other slots
    untouched."""
    config = dataclasses.replace(WY, **MGPU_CASES[case])
    check_bf16_prefill(config, [152, 70, 1, 0], 13, 64, 128, [3, 1, 5, 0], [True, False, True, False], 3e-3)


@pytest.mark.parametrize("t_prec,bar", [("tf32x3", 1e-6), ("tf32", 2e-3)])
def test_fused_prep_t_matches_the_solve_kernel(t_prec, bar):
    """The fused prep: T by recursive doubling on the whole tile equals the solve kernel's (16x16 substitutions and
    merges, exact in interpret mode) on random keys and on the hard case of one key repeated (beta ~ 1, no decay:
    A's strictly lower entries all ~1), and its P and f equal the P / f prep's (per key head)."""
    q, k, v, a, b, A_log, dt_bias, _ = gdn_inputs(3, 1, 200, 2, 4, 64, 64, dtype=jnp.bfloat16)
    q, k, v, a, b = (x[0] for x in (q, k, v, a, b))
    _, row0, nvalid = gdn.chunk_map(jnp.array([0]), jnp.array([200]), 5)
    used = np.asarray(nvalid) > 0
    hard = (jnp.broadcast_to(k[:1], k.shape), jnp.full_like(a, -8.0), jnp.full_like(b, 8.0))
    for kk, aa, bb in ((k, a, b), hard):
        t_ref = gdn.wy_solve(kk, aa, bb, A_log, dt_bias, row0, nvalid, prec="tf32", inv_prec="tf32x3", interpret=True)
        t, p, f = gdn.wy_prep(q, kk, aa, bb, A_log, dt_bias, row0, nvalid, prec="tf32", with_t=True, t_prec=t_prec,
                              interpret=True)
        p_ref, f_ref = gdn.wy_prep(q, kk, aa, bb, A_log, dt_bias, row0, nvalid, prec="tf32", interpret=True)
        assert rel(t[used], t_ref[used]) <= bar
        np.testing.assert_array_equal(p[used], p_ref[used])
        np.testing.assert_array_equal(f[used], f_ref[used])


def test_mgpu_scan_applies_where_its_shapes_allow():
    """The default runs the Mosaic GPU scan on bf16 inputs with 8-row aligned starts, dk % 64 and dv % 32, and the
    Triton scan elsewhere (fp32 models, unaligned starts, other head dims); mgpu=False forces the Triton scan."""
    assert gdn_mgpu.applies(8192, 128, 128, True) and not gdn_mgpu.applies(8192, 128, 128, False)
    assert not gdn_mgpu.applies(8192, 128, 128, True, jnp.float32)           # fp32 models: the Triton scan
    assert not gdn_mgpu.applies(8192, 32, 128, True) and not gdn_mgpu.applies(8190, 128, 128, True)
    assert gdn_mgpu.pick_bv(1, 32, 128) == 32 and gdn_mgpu.pick_bv(8, 32, 128) == 64
    q, k, v, a, b, A_log, dt_bias, pool = gdn_inputs(14, 1, 24, 1, 1, 64, 64, dtype=jnp.bfloat16)
    flat = [x[0] for x in (q, k, v, a, b)]
    args = (*flat, A_log, dt_bias, pool, jnp.array([0]), jnp.array([20]), jnp.array([2]), jnp.array([True]))
    shapes = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in args]
    for aligned, config, mosaic in ((False, WY, False), (True, WY, True), (True, dataclasses.replace(WY, mgpu=False),
                                                                             False)):
        text = lower_for_cuda(lambda *x: gdn.gdn_prefill_packed(*x, config=config, starts_aligned=aligned), *shapes)
        assert ("mosaic_gpu" in text) == mosaic                              # one chunk: the fused prep
        assert text.count("__gpu$xla.gpu.triton") == 1 + (not mosaic)
    with pytest.raises(ValueError, match="prep_mode"):
        gdn.gdn_prefill_packed(*args, config=dataclasses.replace(WY, prep_mode="tile"), interpret=True)


def test_mgpu_scan_cross_lowers_for_cuda():
    """The Mosaic GPU scan at both V-blocks lowers for CUDA (sm_90a) at the 9B shapes, one packed call of 8 sequences
    and the padded contract the model calls (where the default picks the Mosaic scan)."""
    S, i32 = jax.ShapeDtypeStruct, jnp.int32
    packed = packed_prefill_shapes(8 * 1024, 8, 16, 32, 128, 128, 9)
    cfgs = [WY] + [dataclasses.replace(WY, mgpu_bv=bv) for bv in (32, 64)]
    text = lower_for_cuda(lambda *x: [gdn.gdn_prefill_packed(*x, config=c, starts_aligned=True) for c in cfgs],
                          *packed)
    assert text.count("__gpu$xla.gpu.triton") == 2 * len(cfgs) and text.count("mosaic_gpu") >= len(cfgs)
    for t, triton in ((128, 1), (512, 2)):     # 6 chunk ids x 32 heads: the fused prep; 18 x 32: T solve + P / f
        padded = tuple(S((2, t) + s.shape[1:], s.dtype) for s in packed[:5]) + packed[5:8] + (
            S((2,), i32), S((2,), i32), S((2,), jnp.bool_))
        text = lower_for_cuda(gdn.gdn_prefill, *padded)
        assert "mosaic_gpu" in text and text.count("__gpu$xla.gpu.triton") == triton

def test_wy_solve_per_value_head_equals_per_key_head():
    """The T solve's two grids (a key head's value heads in one program, or one program each) write the same T."""
    q, k, v, a, b, A_log, dt_bias, _ = gdn_inputs(12, 1, 150, 2, 6, 16, 16, dtype=jnp.bfloat16)
    flat = lambda x: x.reshape(150, *x.shape[2:])
    _, row0, nvalid = gdn.chunk_map(jnp.array([0]), jnp.array([150]), 4)
    solve = lambda pvh: gdn.wy_solve(flat(k), flat(a), flat(b), A_log, dt_bias, row0, nvalid, prec="tf32",
                                     inv_prec="tf32", per_value_head=pvh, interpret=True)
    t_key, t_value = solve(False), solve(True)
    np.testing.assert_array_equal(np.asarray(t_value[:3]), np.asarray(t_key[:3]))    # chunk 3 is unused
    assert np.all(np.isfinite(np.asarray(t_key[:3])))


@pytest.mark.parametrize("config", [WY, dataclasses.replace(WY, solve_grid="key")], ids=["default", "solve-key-grid"])
def test_gdn_prefill_packed_ragged(config):
    """Packed sequences at arbitrary offsets (not chunk-aligned), one call; rows outside sequences untouched."""
    hk, hv, dk, dv = 2, 4, 32, 16
    lens = [65, 1, 130, 3]
    starts = [1, 66, 67, 197]
    total = 208
    q, k, v, a, b, A_log, dt_bias, pool = gdn_inputs(5, 1, total, hk, hv, dk, dv)
    q, k, v, a, b = (x[0] for x in (q, k, v, a, b))
    slots = jnp.array([4, 2, 8, 6])
    use = jnp.array([True, True, False, True])
    fn = jax.jit(functools.partial(gdn.gdn_prefill_packed, config=config, interpret=True))
    o, new = fn(q, k, v, a, b, A_log, dt_bias, pool, jnp.array(starts), jnp.array(lens), slots, use)
    for i, (s, ln) in enumerate(zip(starts, lens)):
        sl = slice(s, s + ln)
        o_ref, p_ref = gdn_reference.gdn_prefill(q[None, sl], k[None, sl], v[None, sl], a[None, sl], b[None, sl],
                                                 A_log, dt_bias, pool, slots[i:i + 1], jnp.array([ln]),
                                                 use[i:i + 1], method="scan")
        assert rel(o[sl], o_ref[0]) <= 1e-4
        assert rel(new[slots[i]], p_ref[slots[i]]) <= 1e-4


@pytest.mark.parametrize("ratio,config", [(1, gdn.DEFAULT_DECODE), (2, gdn.DEFAULT_DECODE),
                                          (3, gdn.DecodeConfig(bv=16)),
                                          (2, gdn.DecodeConfig(bv=16, num_warps=2))],
                         ids=["r1", "r2", "r3-bv16", "r2-bv16-w2"])
def test_gdn_decode_in_place(ratio, config):
    n, hk, dk, dv = 5, 2, 32, 16
    q, k, v, a, b, A_log, dt_bias, pool = gdn_inputs(20 + ratio, n, 1, hk, hk * ratio, dk, dv)
    q, k, v, a, b = (x[:, 0] for x in (q, k, v, a, b))
    slots = jnp.array([4, 1, 0, 7, 0])          # rows 2 and 4: padding on the null slot (no state read or written)
    fn = jax.jit(functools.partial(gdn.gdn_decode, config=config, interpret=True))
    o, new = fn(q, k, v, a, b, A_log, dt_bias, pool, slots)
    o_ref, new_ref = gdn_reference.gdn_decode(q, k, v, a, b, A_log, dt_bias, pool, slots)
    live = [0, 1, 3]
    assert rel(new[slots[jnp.array(live)]], new_ref[slots[jnp.array(live)]]) <= 1e-5
    assert rel(o[jnp.array(live)], o_ref[jnp.array(live)]) <= 1e-5
    untouched = np.setdiff1d(np.arange(pool.shape[0]), np.asarray(slots)[live])   # the null slot 0 among them
    np.testing.assert_array_equal(new[untouched], pool[untouched])
    np.testing.assert_array_equal(new_ref[untouched], pool[untouched])
    assert not np.asarray(o[jnp.array([2, 4])]).any() and not np.asarray(o_ref[jnp.array([2, 4])]).any()


@pytest.mark.parametrize("config", [gdn.DEFAULT_DECODE, gdn.DecodeConfig(bv=16)], ids=["default", "bv16"])
def test_gdn_decode_packed_reads_the_layer_arrays_in_place(config):
    """The model's decode contract: q | k | v from the conv output and b, a from the end of the input projection
    ([.. | z | b | a]), read where they lie: bit-exact with gdn_decode on the slices, and the reference agrees."""
    n, hk, ratio, dk, dv = 5, 2, 3, 32, 16
    q, k, v, a, b, A_log, dt_bias, pool = gdn_inputs(31, n, 1, hk, hk * ratio, dk, dv)
    q, k, v, a, b = (x[:, 0] for x in (q, k, v, a, b))
    qkv = jnp.concatenate([q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)], axis=1)
    z = jax.random.normal(jax.random.key(5), (n, hk * ratio * dv))
    proj = jnp.concatenate([qkv + 1.0, z, b, a], axis=1)        # leading columns differ from qkv on purpose
    slots = jnp.array([4, 1, 0, 7, 0])
    packed = jax.jit(functools.partial(gdn.gdn_decode_packed, config=config, interpret=True))
    split = jax.jit(functools.partial(gdn.gdn_decode, config=config, interpret=True))
    o, new = packed(qkv, proj, A_log, dt_bias, pool, slots)
    o_s, new_s = split(q, k, v, a, b, A_log, dt_bias, pool, slots)
    np.testing.assert_array_equal(np.asarray(o), np.asarray(o_s))
    np.testing.assert_array_equal(np.asarray(new), np.asarray(new_s))
    o_r, new_r = gdn_reference.gdn_decode_packed(qkv, proj, A_log, dt_bias, pool, slots)
    o_rs, new_rs = gdn_reference.gdn_decode(q, k, v, a, b, A_log, dt_bias, pool, slots)
    np.testing.assert_array_equal(np.asarray(o_r), np.asarray(o_rs))
    np.testing.assert_array_equal(np.asarray(new_r), np.asarray(new_rs))
    with pytest.raises(ValueError, match="do not match the state pool"):
        gdn.gdn_decode_packed(qkv[:, 1:], proj, A_log, dt_bias, pool, slots, interpret=True)


@pytest.mark.parametrize("config", [gdn.DEFAULT_DECODE, gdn.DecodeConfig(bv=16)], ids=["default", "bv16"])
def test_gdn_decode_tokens_verify_then_commit(config):
    """Speculative decoding's GDN passes on packed activations: verify (write False) gives every token's output
    and leaves the pool as it was; commit (write True, lens = accepted) leaves each row's state after its first
    lens tokens: the state T = lens single decode steps reach. The reference agrees; untouched slots stay."""
    n, t, hk, ratio, dk, dv = 4, 4, 2, 2, 32, 16
    q, k, v, a, b, A_log, dt_bias, pool = gdn_inputs(41, n, t, hk, hk * ratio, dk, dv)
    qkv = jnp.concatenate([q.reshape(n, t, -1), k.reshape(n, t, -1), v.reshape(n, t, -1)], axis=2)
    z = jax.random.normal(jax.random.key(6), (n, t, hk * ratio * dv))
    proj = jnp.concatenate([qkv - 1.0, z, b, a], axis=2)
    slots, lens = jnp.array([4, 1, 0, 7]), jnp.array([3, 4, 0, 1])        # row 2: padding on the null slot
    fn = jax.jit(functools.partial(gdn.gdn_decode_tokens_packed, config=config, interpret=True),
                 static_argnames="write")
    o, same = fn(qkv, proj, A_log, dt_bias, pool, slots, jnp.full(n, t), write=False)
    np.testing.assert_array_equal(np.asarray(same), np.asarray(pool))
    _, new = fn(qkv, proj, A_log, dt_bias, pool, slots, lens, write=True)
    step = lambda p, i: gdn_reference.gdn_decode(q[:, i], k[:, i], v[:, i], a[:, i], b[:, i], A_log, dt_bias, p,
                                                 slots)
    chain, steps, want_o = pool, pool, []       # T single decode steps: all of them, and each row's first lens
    for i in range(t):
        o_i, chain = step(chain, i)
        want_o.append(o_i)
        keep = (i < lens)[:, None, None, None]
        steps = steps.at[slots].set(jnp.where(keep, step(steps, i)[1][slots], steps[slots]))
    live = jnp.array([0, 1, 3])
    assert rel(o[live], jnp.stack(want_o, 1)[live]) <= 1e-5
    assert rel(new[slots[live]], steps[slots[live]]) <= 1e-5
    untouched = np.setdiff1d(np.arange(pool.shape[0]), np.asarray(slots)[live])   # the null slot among them
    np.testing.assert_array_equal(np.asarray(new)[untouched], np.asarray(pool)[untouched])
    o_r, new_r = gdn_reference.gdn_decode_tokens_packed(qkv, proj, A_log, dt_bias, pool, slots, lens, write=True)
    assert rel(new_r[slots[live]], steps[slots[live]]) <= 1e-5
    np.testing.assert_array_equal(np.asarray(new_r)[untouched], np.asarray(pool)[untouched])
    assert not np.asarray(o[2]).any() and not np.asarray(o_r[2]).any()       # padding: zeros, no state read
    _, same_r = gdn_reference.gdn_decode_tokens_packed(qkv, proj, A_log, dt_bias, pool, slots, lens, write=False)
    np.testing.assert_array_equal(np.asarray(same_r), np.asarray(pool))


def test_conv_prefill_and_decode_exact():
    n, c = 8, 160                                        # channels not a power of two (ratio-3 layout)
    lens = jnp.array([1, 2, 3, 63, 64, 65, 200, 0])
    t = 200
    key = jax.random.key(3)
    x = jax.random.normal(key, (n, t, c)).astype(jnp.bfloat16)
    w = (0.5 * jax.random.normal(jax.random.fold_in(key, 1), (4, c))).astype(jnp.bfloat16)
    pool = jax.random.normal(jax.random.fold_in(key, 2), (12, 3, c)).astype(jnp.bfloat16)
    slots = jnp.array([2, 5, 1, 9, 4, 11, 3, 0])
    use = jnp.array([True, True, False, True, False, True, True, False])
    y, new = jax.jit(functools.partial(conv1d.conv_prefill, interpret=True))(x, w, pool, slots, lens, use)
    y_ref, new_ref = conv1d_reference.conv_prefill(x, w, pool, slots, lens, use)
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(y_ref, np.float32))
    live = np.asarray(slots[:-1])
    np.testing.assert_array_equal(np.asarray(new[live], np.float32), np.asarray(new_ref[live], np.float32))
    untouched = np.setdiff1d(np.arange(12), np.asarray(slots))
    np.testing.assert_array_equal(np.asarray(new[untouched], np.float32), np.asarray(pool[untouched], np.float32))
    # prefill reads the conv channels as the first columns of a wider input (the model's whole input projection)
    xw = jnp.concatenate([x, jnp.full((n, t, 21), 7.0, x.dtype)], axis=-1)
    yw, neww = jax.jit(functools.partial(conv1d.conv_prefill, interpret=True))(xw, w, pool, slots, lens, use)
    np.testing.assert_array_equal(np.asarray(yw, np.float32), np.asarray(y, np.float32))
    np.testing.assert_array_equal(np.asarray(neww, np.float32), np.asarray(new, np.float32))
    np.testing.assert_array_equal(np.asarray(conv1d_reference.conv_prefill(xw, w, pool, slots, lens, use)[0],
                                             np.float32), np.asarray(y_ref, np.float32))
    # the model's q | k | v: each part written by the kernel as an array of its own (channel blocks of 32 here)
    split = jax.jit(functools.partial(conv1d.conv_prefill, interpret=True), static_argnames="split")
    parts_ref, _ = conv1d_reference.conv_prefill(xw, w, pool, slots, lens, use, split=(32, 64))
    parts, news = split(xw, w, pool, slots, lens, use, split=(32, 64))
    assert [p.shape for p in parts] == [p.shape for p in parts_ref] == [(n, t, 32), (n, t, 32), (n, t, 96)]
    for part, ref in zip(parts, parts_ref):
        np.testing.assert_array_equal(np.asarray(part, np.float32), np.asarray(ref, np.float32))
    np.testing.assert_array_equal(np.asarray(news, np.float32), np.asarray(new, np.float32))
    for bad in ((64, 32), (0, 32), (32, c)):
        with pytest.raises(ValueError, match="must be increasing channel offsets"):
            conv1d.conv_prefill(xw, w, pool, slots, lens, use, split=bad, interpret=True)
    # decode, padded rows on the null slot
    dslots = jnp.array([6, 0, 10, 0])
    xd = x[:4, 0]
    yd, newd = jax.jit(functools.partial(conv1d.conv_decode, interpret=True))(xd, w, pool, dslots)
    yd_ref, newd_ref = conv1d_reference.conv_decode(xd, w, pool, dslots)
    np.testing.assert_array_equal(np.asarray(yd[::2], np.float32), np.asarray(yd_ref[::2], np.float32))
    np.testing.assert_array_equal(np.asarray(newd[jnp.array([6, 10])], np.float32),
                                  np.asarray(newd_ref[jnp.array([6, 10])], np.float32))
    rest = np.setdiff1d(np.arange(12), [0, 6, 10])
    np.testing.assert_array_equal(np.asarray(newd[rest], np.float32), np.asarray(pool[rest], np.float32))
    # the model passes the whole input projection: only its first C columns are the conv's channels
    wide = jnp.concatenate([xd, jnp.full((4, 37), 9.0, xd.dtype)], axis=1)
    yw, neww = jax.jit(functools.partial(conv1d.conv_decode, interpret=True))(wide, w, pool, dslots)
    np.testing.assert_array_equal(np.asarray(yw, np.float32), np.asarray(yd, np.float32))
    np.testing.assert_array_equal(np.asarray(neww, np.float32), np.asarray(newd, np.float32))
    yw_ref, _ = conv1d_reference.conv_decode(wide, w, pool, dslots)
    np.testing.assert_array_equal(np.asarray(yw_ref, np.float32), np.asarray(yd_ref, np.float32))
    with pytest.raises(ValueError, match="fewer than"):
        conv1d.conv_decode(xd[:, :-1], w, pool, dslots, interpret=True)


# ---------------------------------------------------------------------------------------------------------------
# Paged decode attention


def attention_inputs(seed, n, hq, hkv, d, page_size, pages_per_seq, ctx, dtype):
    """Rows with their pages scattered over a shared pool (page 0 = null page, left zero)."""
    rng = np.random.default_rng(seed)
    num_pages = 1 + n * pages_per_seq
    k = rng.standard_normal((hkv, num_pages, page_size, d)).astype(np.float32)
    v = rng.standard_normal((hkv, num_pages, page_size, d)).astype(np.float32)
    k[:, 0] = v[:, 0] = 0.0
    q = 2.0 * rng.standard_normal((n, hq, d))
    pages = np.zeros((n, pages_per_seq), np.int32)
    free = rng.permutation(np.arange(1, num_pages))
    for i, c in enumerate(ctx):
        used = -(-c // page_size)
        pages[i, :used] = free[i * pages_per_seq:i * pages_per_seq + used]
    cast = lambda x: jnp.asarray(x, dtype)
    return cast(q), cast(k), cast(v), jnp.asarray(pages), jnp.asarray(ctx, jnp.int32)


@pytest.mark.parametrize("hq,hkv,config", [
    (4, 4, None), (8, 4, None), (6, 2, paged_attention.DecodeAttentionConfig(pages_per_block=2, target_programs=64)),
    (12, 2, paged_attention.DecodeAttentionConfig(pages_per_block=1, target_programs=1)),
    (8, 4, paged_attention.DecodeAttentionConfig(pages_per_block=4))])
def test_paged_decode_attention_matches_reference(hq, hkv, config):
    """G = 1, 2, 3, 6 query heads per KV head (padded to 16 rows); contexts empty (padded row), one token, page
    boundaries, long; several splits and one; one, two and four pages per step."""
    ctx = [0, 1, 15, 16, 17, 64, 200, 127]
    args = attention_inputs(0, len(ctx), hq, hkv, 32, 8, 32, ctx, jnp.float32)
    ref = decode_attention(*args)
    got = jax.jit(functools.partial(paged_attention.paged_decode_attention, config=config, interpret=True))(*args)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=2e-6, rtol=1e-5)
    assert not np.asarray(got[0]).any()                    # no visible key: zeros


@pytest.mark.parametrize("hq,hkv,d,rd,dtype", [(16, 4, 256, 64, jnp.bfloat16), (24, 4, 256, 64, jnp.bfloat16),
                                               (8, 4, 32, 8, jnp.float32)])
def test_decode_prologue_matches_the_model_ops(hq, hkv, d, rd, dtype):
    """decode_prologue against the ops it replaces (model.rms_norm_1p and rope on q and k, attention.write_kv,
    paged_decode_attention's scaling and padding): the 9B and 27B head shapes (G 4 and 6) in bf16, the test
    models' in fp32; a padding row (lens 0) writes the null page only, and no other page slot changes."""
    from qwen35_jax.model import attention as attn_ops
    from qwen35_jax.model.forward import rms_norm_1p, rope
    n, ps, num_pages, per_row = 4, 16, 11, 3
    ks = jax.random.split(jax.random.key(hq + d), 5)
    qkv = jax.random.normal(ks[0], (n, hq * 2 * d + 2 * hkv * d)).astype(dtype)
    qw, kw = ((0.1 * jax.random.normal(k, (d,))).astype(dtype) for k in ks[1:3])
    kp, vp = (jax.random.normal(k, (hkv, num_pages, ps, d)).astype(dtype) for k in ks[3:5])
    pages = jnp.asarray(1 + np.arange(n * per_row).reshape(n, per_row) % (num_pages - 1), jnp.int32)
    pos, lens = jnp.asarray([3, 16, 47, 5], jnp.int32), jnp.asarray([1, 1, 1, 0], jnp.int32)
    got = paged_attention.decode_prologue(qkv, qw, kw, kp, vp, pages, pos, lens, q_heads=hq, rotary_dim=rd,
                                          theta=1e7, eps=1e-6, interpret=True)
    q = qkv[:, :hq * 2 * d].reshape(n, 1, hq, 2 * d)[..., :d]
    k, v = (qkv[:, hq * 2 * d + i * hkv * d:][:, :hkv * d].reshape(n, 1, hkv, d) for i in (0, 1))
    q, k = (rope(rms_norm_1p(x, w, 1e-6), pos[:, None], rd, 1e7) for x, w in ((q, qw), (k, kw)))
    k_want, v_want = attn_ops.write_kv(kp, vp, k, v, pages, pos[:, None], lens)
    g, rows = hq // hkv, paged_attention.query_rows(hq, hkv)
    tiles = (q[:, 0].astype(jnp.float32) * d ** -0.5).astype(dtype).reshape(n, hkv, g, d)
    tiles = jnp.pad(tiles, ((0, 0), (0, 0), (0, rows - g), (0, 0)))
    ulp = 0 if dtype == jnp.bfloat16 else 1e-6          # fp32: an ulp or two of the norm's summation order
    for a, b in zip(got, (tiles, k_want, v_want)):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=ulp, atol=ulp)
    changed = np.argwhere(np.any(np.asarray(got[1] != kp, bool), axis=(0, 3)))      # (page, slot) pairs written
    assert {tuple(x) for x in changed} <= {(int(pages[i, pos[i] // ps]), int(pos[i] % ps)) for i in range(3)} | {(0, 0)}


def test_paged_decode_attention_bf16():
    ctx = [33, 300, 7]
    args = attention_inputs(1, 3, 16, 4, 64, 16, 24, ctx, jnp.bfloat16)
    ref = np.asarray(decode_attention(*args), np.float32)
    got = np.asarray(paged_attention.paged_decode_attention(*args, interpret=True), np.float32)
    assert rel(got, ref) < 5e-3


def test_paged_decode_attention_splits():
    cfg = paged_attention.DEFAULT
    assert paged_attention.num_splits(64, 4, 512, cfg) == 2          # 9B batch 64: 512 programs from 2 splits
    assert paged_attention.num_splits(1, 4, 512, cfg) == cfg.max_splits
    assert paged_attention.num_splits(1, 4, 3, cfg) == -(-3 // cfg.pages_per_block)   # never more splits than
    assert paged_attention.num_splits(1, 4, 1, cfg) == 1                                # page blocks


@pytest.mark.parametrize("hq,hkv,d,dtype,config", [
    (8, 2, 32, jnp.float32, prefill_attention.PrefillAttentionConfig(block_q=16, block_k=16)),
    (12, 2, 32, jnp.float32, prefill_attention.PrefillAttentionConfig(block_q=32, block_k=16)),
    (8, 2, 32, jnp.float32, prefill_attention.PrefillAttentionConfig(block_q=16, block_k=16, target_programs=1)),
    (12, 2, 32, jnp.float32, prefill_attention.PrefillAttentionConfig(block_q=16, block_k=16, target_programs=4096)),
    (16, 4, 256, jnp.bfloat16, None), (24, 4, 256, jnp.bfloat16, None)])
def test_paged_prefill_attention_matches_reference(hq, hkv, d, dtype, config):
    """Prefill chunks of several rows in one launch (varlen: other starts and lengths, a padded row) against the
    jnp reference: GQA groups 4 and 6, chunks starting mid-page and at 0, contexts across page and key-block
    boundaries, a chunk longer than a query block and one shorter; unsplit (target_programs 1), split in 3 or 4
    (these small grids under the default target) and in as many splits as key blocks, where most splits of the
    early query blocks see no key; the 9B and 27B head shapes in bf16 with the default tiles (as close to an fp32
    reference as the jnp one is: both ~1.7e-3)."""
    cfg = config or prefill_attention.DEFAULT
    programs = 5 * hkv * -(-40 * (hq // hkv) // cfg.block_q)
    splits = prefill_attention.num_splits(programs, 16 * 8 // cfg.block_k, cfg)
    assert (splits == 1) == (cfg.target_programs == 1) and (splits == 8 or cfg.target_programs != 4096)
    n, t, ps, per_row = 5, 40, 8, 16
    starts = np.array([0, 13, 61, 0, 5])                  # 13, 61, 5: mid-page
    lens = np.array([40, 27, 40, 0, 3])                   # row 3: padding (ctx 0)
    ctx = starts + lens
    q, k, v, pages, _ = attention_inputs(hq + d, n, hq, hkv, d, ps, per_row, ctx.tolist(), dtype)
    q = jnp.asarray(np.random.default_rng(1).standard_normal((n, t, hq, d)), dtype)
    positions = jnp.asarray(starts[:, None] + np.arange(t)[None], jnp.int32)
    ctx = jnp.asarray(ctx, jnp.int32)
    want = paged_attention_reference(q, k, v, pages, positions, ctx)
    got = jax.jit(functools.partial(prefill_attention.paged_prefill_attention, config=config, interpret=True))(
        q, k, v, pages, positions, ctx)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert not np.asarray(got[3], np.float32).any()         # no visible key: zeros
    real = np.arange(t)[None, :] < lens[:, None]
    got, want = np.asarray(got, np.float32)[real], np.asarray(want, np.float32)[real]
    if dtype == jnp.float32:
        np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-5)
    else:
        assert rel(got, want) < 2e-3
    with pytest.raises(ValueError, match="power of two"):
        prefill_attention.paged_prefill_attention(q, k, v, pages, positions, ctx, interpret=True,
                                                  config=prefill_attention.PrefillAttentionConfig(block_q=24))


# ---------------------------------------------------------------------------------------------------------------
# CUDA cross-lowering on the CPU (jax-anchors section 6): Triton-illegal shapes or ops fail here.


def lower_for_cuda(fn, *shapes):
    dev = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", platform="gpu", num_cores=132)
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=dev)):
        return jax.jit(fn).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()


def packed_prefill_shapes(total, n, hk, hv, dk, dv, slots):
    """Abstract arguments of gdn.gdn_prefill_packed: bf16 q, k, v, a, b over `total` rows, n sequences, a state
    pool of `slots` slots."""
    S, bf, f32, i32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.float32, jnp.int32
    return (S((total, hk, dk), bf), S((total, hk, dk), bf), S((total, hv, dv), bf), S((total, hv), bf),
            S((total, hv), bf), S((hv,), f32), S((hv,), f32), S((slots, hv, dv, dk), f32), S((n,), i32),
            S((n,), i32), S((n,), i32), S((n,), jnp.bool_))


@pytest.mark.parametrize("hk,hv,dk,dv,conv_ch", [(16, 32, 128, 128, 8192), (2, 6, 16, 32, 256 + 96)])
def test_kernels_cross_lower_for_cuda(hk, hv, dk, dv, conv_ch):
    """Every configuration the GPU benchmarks sweep (bench/kernel_sweeps.py, the defaults first), at the 9B shapes
    and at a small one, so the GPU run cannot fail on a Triton-illegal shape (unaligned rows: the Triton scan)."""
    S, bf, f32, i32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.float32, jnp.int32
    n, t, slots = 3, 300, 9
    prefill = (S((n, t, hk, dk), bf), S((n, t, hk, dk), bf), S((n, t, hv, dv), bf), S((n, t, hv), bf),
               S((n, t, hv), bf), S((hv,), f32), S((hv,), f32), S((slots, hv, dv, dk), f32), S((n,), i32),
               S((n,), i32), S((n,), jnp.bool_))
    configs = kernel_sweeps.prefill_sweep()
    text = lower_for_cuda(lambda *x: [gdn.gdn_prefill(*x, config=cfg) for cfg in configs], *prefill)
    resolved = [gdn.resolve_prep(c, n * (-(-t // 64)), hv, bf) for c in configs]
    kernels = sum(2 + (c.prep_mode == "solve2") for c in resolved)           # (T solve +) prep, scan
    assert text.count("__gpu$xla.gpu.triton") == kernels
    packed = (S((t, hk, dk), bf), S((t, hk, dk), bf), S((t, hv, dv), bf), S((t, hv), bf), S((t, hv), bf),
              S((hv,), f32), S((hv,), f32), S((slots, hv, dv, dk), f32), S((n,), i32), S((n,), i32), S((n,), i32),
              S((n,), jnp.bool_))
    assert "__gpu$xla.gpu.triton" in lower_for_cuda(gdn.gdn_prefill_packed, *packed)
    f32_prefill = tuple(S(s.shape, f32) if s.dtype == bf else s for s in prefill)   # fp32 models: tf32x3 dots
    assert "__gpu$xla.gpu.triton" in lower_for_cuda(gdn.gdn_prefill, *f32_prefill)
    decode = (S((n, hk, dk), bf), S((n, hk, dk), bf), S((n, hv, dv), bf), S((n, hv), bf), S((n, hv), bf),
              S((hv,), f32), S((hv,), f32), S((slots, hv, dv, dk), f32), S((n,), i32))
    dcfgs = kernel_sweeps.decode_sweep()
    text = lower_for_cuda(lambda *x: [gdn.gdn_decode(*x, config=cfg) for cfg in dcfgs], *decode)
    assert text.count("__gpu$xla.gpu.triton") == len(dcfgs)
    width = 2 * hk * dk + hv * dv
    tokens = (S((n, 4, width), bf), S((n, 4, width + hv * dv + 2 * hv), bf), S((hv,), f32), S((hv,), f32),
              S((slots, hv, dv, dk), f32), S((n,), i32), S((n,), i32))
    text = lower_for_cuda(lambda *x: [gdn.gdn_decode_tokens_packed(*x, write=w) for w in (False, True)], *tokens)
    assert text.count("__gpu$xla.gpu.triton") == 2
    conv = (S((n, t, conv_ch), bf), S((4, conv_ch), bf), S((slots, 3, conv_ch), bf), S((n,), i32), S((n,), i32),
            S((n,), jnp.bool_))
    ccfgs = kernel_sweeps.conv_prefill_sweep()
    text = lower_for_cuda(lambda *x: [conv1d.conv_prefill(*x, config=cfg) for cfg in ccfgs]
                          + [conv1d.conv_prefill(*x, split=(hk * dk, 2 * hk * dk))], *conv)   # the model's q, k, v
    assert text.count("__gpu$xla.gpu.triton") == len(ccfgs) + 1
    ccfgs = kernel_sweeps.conv_decode_sweep()
    text = lower_for_cuda(lambda *x: [conv1d.conv_decode(*x, config=cfg) for cfg in ccfgs], S((n, conv_ch), bf),
                          S((4, conv_ch), bf), S((slots, 3, conv_ch), bf), S((n,), i32))
    assert text.count("__gpu$xla.gpu.triton") == len(ccfgs)

    for b, hq in ((64, 16), (3, 24)):                    # the decode prologue and attention on its tiles, 9B / 27B
        prologue = functools.partial(paged_attention.decode_prologue, q_heads=hq, rotary_dim=64, theta=1e7, eps=1e-6)
        text = lower_for_cuda(prologue, S((b, hq * 512 + 2048), bf), S((256,), bf), S((256,), bf),
                              S((4, 4097, 16, 256), bf), S((4, 4097, 16, 256), bf), S((b, 512), i32), S((b,), i32),
                              S((b,), i32))
        text += lower_for_cuda(lambda *x: paged_attention.attend_tiles(x[0], hq, *x[1:]),
                               S((b, 4, paged_attention.query_rows(hq, 4), 256), bf), S((4, 4097, 16, 256), bf),
                               S((4, 4097, 16, 256), bf), S((b, 512), i32), S((b,), i32))
        assert text.count("__gpu$xla.gpu.triton") == 2

    # 9B (G 4) and 27B (G 6) prefill attention, unsplit; a 64-token chunk (of a mixed step), split
    assert prefill_attention.num_splits(16, 4097 * 16 // 32, prefill_attention.DEFAULT) == 32
    for n, t, hq in ((1, 2048, 16), (4, 512, 24), (1, 64, 16)):
        pcfgs = kernel_sweeps.prefill_attention_sweep()
        text = lower_for_cuda(lambda *x: [prefill_attention.paged_prefill_attention(*x, config=c) for c in pcfgs],
                              S((n, t, hq, 256), bf), S((4, 4097, 16, 256), bf), S((4, 4097, 16, 256), bf),
                              S((n, 512), i32), S((n, t), i32), S((n,), i32))
        assert text.count("__gpu$xla.gpu.triton") == len(pcfgs)

    for b, hq in ((1, 16), (64, 16), (3, 24)):                     # 9B (G 4) and 27B (G 6) decode attention
        attn = (S((b, hq, 256), bf), S((4, 4097, 16, 256), bf), S((4, 4097, 16, 256), bf), S((b, 512), i32),
                S((b,), i32))
        acfgs = kernel_sweeps.attention_sweep()
        text = lower_for_cuda(lambda *x: [paged_attention.paged_decode_attention(*x, config=c) for c in acfgs], *attn)
        assert text.count("__gpu$xla.gpu.triton") == len(acfgs)
    for k, n, out in ((4096, 12352, bf), (2048, 12352, bf), (5120, 16432, bf), (4096, 4096, f32)):   # decode GEMVs
        text = lower_for_cuda(lambda x, w: gemv.gemv(x, w, out), S((1, k), bf), S((k, n), bf))
        assert text.count("__gpu$xla.gpu.triton") == 1
    for m, e, k in ((1, 256, 8), (64, 512, 10)):                   # 35B-A3B's and 397B's routers, 4 and 1 warps
        text = lower_for_cuda(lambda x, live: [expert_gemm.router_top_k(x, k, live, num_warps=w) for w in (4, 1)],
                              S((m, e), bf), S((m,), jnp.bool_))
        assert text.count("xla.gpu.triton") == 2
    for m, i_s, fn in ((1, 512, expert_gemm.routed_experts), (16, 512, expert_gemm.routed_experts),
                       (4, 128, expert_gemm.routed_experts), (64, 512, expert_gemm.sorted_experts),
                       (256, 512, expert_gemm.sorted_experts),   # 35B-A3B's experts at batch 1 to 256; Is / 4;
                       (2048, 512, expert_gemm.sorted_experts)):  # a prefill chunk (blocks of 64 copies)
        shared = (S((2048, 2 * i_s), bf), S((i_s, 2048), bf), S((2048, 1), bf))
        text = lower_for_cuda(fn, S((m, 2048), bf), S((m, 8), i32), S((m, 8), bf),
                              S((256, 2048, 1024), bf), S((256, 512, 2048), bf), shared)
        assert text.count("__gpu$xla.gpu.triton") == 2


@pytest.mark.parametrize("m,k,n,config,dtype,out_dtype", [
    (1, 256, 96, gemv.GemvConfig(block_n=32, block_k=64), jnp.bfloat16, None),            # K split in 4
    (3, 100, 40, gemv.GemvConfig(block_n=16, block_k=32), jnp.float32, None),              # ragged N, K; split
    (16, 64, 48, gemv.GemvConfig(block_n=64, block_k=64, min_programs=1), jnp.bfloat16, jnp.float32),   # one
    (2, 96, 1000, gemv.GemvConfig(block_n=128, block_k=16, min_programs=4), jnp.bfloat16, jnp.float32)])
def test_gemv_matches_the_dot(m, k, n, config, dtype, out_dtype):
    """The GEMV kernel (interpret mode) against its contract: x @ w with fp32 accumulation rounded once, any N and K
    (masked tiles), K split or not."""
    ks = jax.random.split(jax.random.key(m), 2)
    x = jax.random.normal(ks[0], (m, k)).astype(dtype)
    w = jax.random.normal(ks[1], (k, n)).astype(dtype)
    want = gemv.gemv_reference(x, w, out_dtype)
    got = gemv.gemv(x, w, out_dtype, config=config, interpret=True)
    assert got.dtype == want.dtype and got.shape == (m, n)
    if got.dtype == jnp.bfloat16:            # one rounding of nearly the same fp32 sum: at most one bf16 ulp apart
        assert np.mean(np.asarray(got != want)) < 0.02 and rel(got, want) <= 1e-2
    else:
        assert rel(got, want) <= 1e-6
    with pytest.raises(ValueError, match="at most 16 rows"):
        gemv.gemv(jnp.zeros((17, k), dtype), w, config=config, interpret=True)


@pytest.mark.parametrize("kernels", ["per_copy", "sorted"])
@pytest.mark.parametrize("m,k,e,h,i,i_s,dtype", [(3, 4, 8, 64, 32, 32, jnp.float32),
                                                   (2, 8, 16, 128, 64, 16, jnp.bfloat16),    # shared narrower
                                                   (2, 2, 4, 64, 16, 48, jnp.float32),       # shared wider
                                                   (21, 4, 4, 64, 32, 32, jnp.float32)])     # groups of 2+ blocks
def test_expert_kernels_match_the_sorted_reference(kernels, m, k, e, h, i, i_s, dtype):
    """The per-copy and the sorted expert kernels (interpret mode) against routed_experts_reference (sorted copies,
    ragged_dot, the shared expert as HF): two tokens sharing an expert, copies of another rank's experts (-1) adding
    nothing, a token with none here (the shared expert's output alone), a shared expert narrower and wider than the
    routed, groups (the shared expert's too) over several blocks of 16 copies."""
    ks = jax.random.split(jax.random.key(m), 8)
    x = jax.random.normal(ks[0], (m, h)).astype(dtype)
    wg = (0.2 * jax.random.normal(ks[1], (e, h, 2 * i))).astype(dtype)
    wd = (0.2 * jax.random.normal(ks[2], (e, i, h))).astype(dtype)
    shared = tuple((0.2 * jax.random.normal(key, shape)).astype(dtype)
                   for key, shape in zip(ks[5:], ((h, 2 * i_s), (i_s, h), (h, 1))))
    ids = np.stack([np.asarray(jax.random.permutation(key, e)[:k]) for key in jax.random.split(ks[3], m)])
    if ids[0, 0] not in ids[1]:
        ids[1, 0] = ids[0, 0]                                 # a shared expert
    ids[0, -1] = ids[-1, 1] = -1                              # another rank's
    ids[-1] = -1 if m > 2 else ids[-1]                        # no expert on this rank
    weights = jax.nn.softmax(jax.random.normal(ks[4], (m, k)), -1).astype(dtype)
    want = expert_gemm.routed_experts_reference(x, jnp.asarray(ids), weights, wg, wd, shared)
    tiles = expert_gemm.ExpertGemmConfig(block_n=16, block_k=16, copy_block_n=16, copy_block_k=16)
    fn = expert_gemm.routed_experts if kernels == "per_copy" else expert_gemm.sorted_experts
    got = fn(x, jnp.asarray(ids), weights, wg, wd, shared, interpret=True, config=tiles)
    assert rel(got, want) <= (1e-6 if dtype == jnp.float32 else 1e-2)
    alone = expert_gemm.shared_expert_reference(x, *shared).astype(jnp.float32)
    if m > 2:                                                 # no routed expert here: the shared expert's output
        assert rel(got[-1], alone[-1]) <= 1e-6
    assert rel(got[0], alone[0]) > 0.01


@pytest.mark.parametrize("block_m_max,bm", [(16, 16), (64, 32)])
def test_sorted_experts_blocks_grow_with_the_groups(block_m_max, bm):
    """A prefill-sized call (a mean of 40 copies per group) cuts its groups into blocks of 32 copies (up to
    block_m_max) and matches the reference as blocks of 16 do (interpret mode)."""
    m, k, e, h, i = 40, 4, 4, 64, 32
    ks = jax.random.split(jax.random.key(3), 8)
    x = jax.random.normal(ks[0], (m, h))
    wg, wd = 0.2 * jax.random.normal(ks[1], (e, h, 2 * i)), 0.2 * jax.random.normal(ks[2], (e, i, h))
    shared = tuple(0.2 * jax.random.normal(key, shape) for key, shape in zip(ks[5:], ((h, 2 * i), (i, h), (h, 1))))
    ids = jnp.stack([jax.random.permutation(key, e)[:k] for key in jax.random.split(ks[3], m)]).at[0, -1].set(-1)
    weights = jax.nn.softmax(jax.random.normal(ks[4], (m, k)), -1)
    want = expert_gemm.routed_experts_reference(x, ids, weights, wg, wd, shared)
    tiles = expert_gemm.ExpertGemmConfig(block_n=16, block_k=16, block_m_max=block_m_max)
    assert expert_gemm.block_m(tiles, m * (k + 1), e + 1) == bm
    got = expert_gemm.sorted_experts(x, ids, weights, wg, wd, shared, interpret=True, config=tiles)
    assert rel(got, want) <= 1e-6
    assert [expert_gemm.block_m(expert_gemm.DEFAULT, 9 * t, 257) for t in (64, 512, 2048)] == [16, 16, 32]


@pytest.mark.parametrize("m,e,k,dtype", [(5, 16, 4, jnp.float32), (3, 32, 10, jnp.float32), (4, 256, 8, jnp.bfloat16)])
def test_router_top_k_kernel_matches_softmax_and_top_k(m, e, k, dtype):
    """The router kernel (interpret mode) against softmax + jax.lax.top_k + renormalisation: the same experts in the
    same order (ties to the lower index), weights within fp32 / bf16 rounding; a padding row routes nowhere; k = 10
    pads its outputs to 16."""
    logits = jax.random.normal(jax.random.key(e), (m, e)).astype(dtype)
    logits = logits.at[0, 3].set(logits[0, 7]).at[0, 7].set(logits.max() + 1).at[0, 3].set(logits.max() + 1)
    live = jnp.arange(m) != 1                                            # row 1: padding
    want_w, want_i = expert_gemm.router_top_k_reference(logits, k, live)
    got_w, got_i = expert_gemm.router_top_k(logits, k, live, interpret=True)
    assert got_w.dtype == dtype and got_i.shape == (m, k)
    np.testing.assert_array_equal(np.asarray(got_i), np.asarray(want_i))
    assert list(np.asarray(got_i[0, :2])) == [3, 7]                     # a tie: the lower index first
    assert (np.asarray(got_i[1]) == -1).all() and not np.asarray(got_w[1], np.float32).any()
    assert rel(got_w, want_w) <= (1e-6 if dtype == jnp.float32 else 1e-2)


def test_expert_gemm_backend_runs_the_kernel_for_decode_rows():
    """The pallas backends run the per-copy kernels up to ExpertGemmConfig.copies_max token copies and the sorted
    kernels past them, prefill-sized calls too (ragged_dot is a dense dot over every expert on a GPU);
    expert_gemm=None and the reference backend run ragged_dot; a MoE model whose widths the tiles cannot take is
    refused before anything compiles."""
    from qwen35_jax.model.config import load_config
    f32, i32 = jnp.float32, jnp.int32
    w = (jax.ShapeDtypeStruct((8, 64, 64), f32), jax.ShapeDtypeStruct((8, 32, 64), f32))
    shared = (jax.ShapeDtypeStruct((64, 32), f32), jax.ShapeDtypeStruct((16, 64), f32),
              jax.ShapeDtypeStruct((64, 1), f32))
    args = lambda m: (jax.ShapeDtypeStruct((m, 64), f32), jax.ShapeDtypeStruct((m, 4), i32),
                      jax.ShapeDtypeStruct((m, 4), f32), *w, shared)
    jaxpr = lambda c, m: str(jax.make_jaxpr(make_kernels(c.resolved()).routed_experts)(*args(m)))
    kernel = KernelConfig(backend="pallas_interpret",
                          expert_gemm=expert_gemm.ExpertGemmConfig(copies_max=16))
    assert "expert_gate_up" in jaxpr(kernel, 4) and "ragged_dot" not in jaxpr(kernel, 4)
    for m in (5, 4096):                                                 # 20 copies; a prefill chunk's 16384
        grouped = jaxpr(kernel, m)
        assert "sorted_gate_up" in grouped and "expert_gate_up" not in grouped and "ragged_dot" not in grouped
    for c in (KernelConfig(backend="pallas_interpret", expert_gemm=None), KernelConfig(backend="reference")):
        assert "ragged_dot" in jaxpr(c, 2) and "pallas_call" not in jaxpr(c, 2)
    with pytest.raises(ValueError, match="2\\^31 elements"):                     # int32 offsets in the kernels
        jax.eval_shape(expert_gemm.sorted_experts, *args(8)[:3], jax.ShapeDtypeStruct((512, 64, 2 ** 16), jnp.bfloat16),
                       jax.ShapeDtypeStruct((512, 2 ** 15, 64), f32), shared)
    with pytest.raises(ValueError, match="2\\^31 elements"):
        big = jax.ShapeDtypeStruct((512, 64, 2 ** 16), jnp.bfloat16)
        jax.eval_shape(expert_gemm.routed_experts, *args(2)[:3], big, jax.ShapeDtypeStruct((512, 2 ** 15, 64), f32),
                       shared)
    cfg = load_config(fixture_dir("moe_text_untied_e16_k4"))                     # moe_intermediate_size 24
    with pytest.raises(ValueError, match="moe_intermediate_size=24"):
        KernelConfig(backend="pallas_interpret").check(cfg, Layout.build(cfg, 1), 16)
    KernelConfig(backend="pallas_interpret", expert_gemm=None).check(cfg, Layout.build(cfg, 1), 16)


@pytest.mark.parametrize("tp", [1, 2])
def test_moe_block_with_the_expert_kernel_equals_ragged_dot(tp):
    """A whole MoE layer (router, top k, experts split over tp, shared expert, all-reduce) on decode rows gives the
    same output with the kernels (interpret mode: the sorted grouped kernels, the per-copy kernels) as with
    ragged_dot; a padding row (live False) gets the shared expert alone and changes no other row; a prefill chunk
    of 128 tokens runs the sorted kernels on blocks of 32 (tp 1) or 64 copies (tp 2: 8 experts per rank)."""
    from qwen35_jax.model.config import load_config
    from qwen35_jax.model.forward import moe_block
    from qwen35_jax.model.sharding import TP
    from qwen35_jax.model.weights import MLP, MoE
    P = jax.sharding.PartitionSpec
    cfg = dataclasses.replace(load_config(fixture_dir("moe_text_untied_e16_k4")), moe_intermediate_size=32)
    h, e, im = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    ks = jax.random.split(jax.random.key(tp), 7)
    r = lambda i, *shape: 0.2 * jax.random.normal(ks[i], shape)
    w = MoE(router=r(0, h, e), gate_up=r(1, e, h, 2 * im), down=r(2, e, im, h),
            shared=MLP(gate_up=r(3, h, 2 * 64), down=r(4, 64, h)), shared_gate=r(5, h, 1))
    x = r(6, 6, 1, h)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:tp]), (TP,))
    specs = MoE(router=P(), gate_up=P(TP), down=P(TP), shared=MLP(gate_up=P(None, TP), down=P(TP)),
                shared_gate=P())
    base = make_kernels(KernelConfig(backend="reference").resolved())
    live = jnp.arange(6) != 2                                              # row 2: padding
    run = lambda kern, live=live, x=x: jax.jit(jax.shard_map(
        lambda w, x: moe_block(cfg, Layout.build(cfg, tp), kern, w, x, live), mesh=mesh, in_specs=(specs, P()),
        out_specs=P(), check_vma=False))(w, x)
    alive, padded = run(base, None), run(base)
    assert rel(padded[live], alive[live]) == 0 and rel(padded[2], alive[2]) > 0.01   # routed: nothing for row 2
    tiles = expert_gemm.ExpertGemmConfig(block_n=32, block_k=32, copy_block_n=16, copy_block_k=16, block_m_max=64)
    grouped = functools.partial(expert_gemm.sorted_experts, interpret=True, config=tiles)
    per_copy = functools.partial(expert_gemm.routed_experts, interpret=True, config=tiles)
    top_k = functools.partial(expert_gemm.router_top_k, interpret=True)
    for experts in (grouped, per_copy):
        assert rel(run(dataclasses.replace(base, routed_experts=experts, router_top_k=top_k)), run(base)) <= 1e-6
    chunk = jax.random.normal(ks[6], (1, 128, h))
    assert expert_gemm.block_m(tiles, 128 * (cfg.num_experts_per_tok + 1), e // tp + 1) == 32 * tp
    got = run(dataclasses.replace(base, routed_experts=grouped, router_top_k=top_k), None, chunk)
    assert rel(got, run(base, None, chunk)) <= 1e-6


def test_model_projections_round_once():
    """model.project: prefill rows ask the GEMM for the output dtype itself (no fp32 result and convert); decode
    rows ask for fp32 and round after (where XLA's K split adds its partial sums), unless the GEMM rounds itself;
    a single row against fewer than VECTOR_DOT_LIMIT weight elements runs as two rows."""
    from qwen35_jax.model.forward import project
    spec = lambda t: (jax.ShapeDtypeStruct((3, t, 1024), jnp.bfloat16), jax.ShapeDtypeStruct((1024, 256), jnp.bfloat16))
    prefill, decode, rounds = (str(jax.jit(lambda x, w: project(x, w, gemm_rounds=r)).trace(*spec(t)).jaxpr)
                               for t, r in ((2, False), (1, False), (1, True)))
    assert "preferred_element_type=bfloat16" in prefill and "convert_element_type" not in prefill
    assert "preferred_element_type=float32" in decode and "convert_element_type" in decode
    assert "preferred_element_type=bfloat16" in rounds and "convert_element_type" not in rounds
    # One row against a small weight is multiplied as two (XLA:GPU would make it a multiply and a reduce).
    one = lambda n: str(jax.make_jaxpr(project)(jax.ShapeDtypeStruct((1, 1, n), jnp.bfloat16),
                                                 jax.ShapeDtypeStruct((n, 2048), jnp.bfloat16)))
    assert "concatenate" in one(2048) and "concatenate" not in one(8192)
    assert jax.eval_shape(project, *spec(1)[:1], spec(1)[1]).shape == (3, 1, 256)
    x, w = jax.random.normal(jax.random.key(0), (1, 1, 64)), jax.random.normal(jax.random.key(1), (64, 32))
    assert rel(project(x, w), x[0] @ w) <= 1e-6 and project(x, w).shape == (1, 1, 32)


def test_gate_up_rounds_in_the_gemm_from_64_decode_rows():
    """Decode batches of gate_up_rounds_from rows or more ask gate_up's GEMM for bf16 itself (no fp32 result), the
    SiLU then on bf16 gate / up as in prefill and HF; smaller ones keep the fp32 path; both agree within bf16
    roundings; KernelConfig.gate_up_rounds_from moves the threshold, a negative one is refused."""
    import dataclasses as dc
    from qwen35_jax.model.forward import mlp_block
    from qwen35_jax.model.sharding import TP
    from qwen35_jax.model.weights import MLP
    P = jax.sharding.PartitionSpec
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), (TP,))
    kernels = make_kernels(KernelConfig(backend="pallas_interpret").resolved())
    assert kernels.gate_up_rounds_from == make_kernels(KernelConfig().resolved()).gate_up_rounds_from == 64
    mlp = MLP(gate_up=(0.05 * jax.random.normal(jax.random.key(2), (256, 2 * 128))).astype(jnp.bfloat16),
              down=(0.05 * jax.random.normal(jax.random.key(3), (128, 256))).astype(jnp.bfloat16))
    run = lambda k, x: jax.shard_map(lambda x: mlp_block(k, mlp, x), mesh=mesh, in_specs=P(), out_specs=P(),
                                     check_vma=False)(x)
    for rows in (16, 64):
        x = jax.random.normal(jax.random.key(rows), (rows, 1, 256), jnp.bfloat16)
        text = str(jax.make_jaxpr(lambda x: run(kernels, x))(x))
        gate_up_dot = re.search(r"preferred_element_type=(\w+)", text).group(1)      # the first dot: gate_up
        assert gate_up_dot == ("bfloat16" if rows >= 64 else "float32"), text
        fp32_path = jax.jit(lambda x: run(dc.replace(kernels, gate_up_rounds_from=1 << 30), x))(x)
        assert rel(jax.jit(lambda x: run(kernels, x))(x).astype(jnp.float32), fp32_path.astype(jnp.float32)) <= 8e-3
    moved = KernelConfig(backend="pallas_interpret", gate_up_rounds_from=16).resolved()
    assert make_kernels(moved).gate_up_rounds_from == 16
    with pytest.raises(ValueError, match="gate_up_rounds_from must be >= 0"):
        KernelConfig(gate_up_rounds_from=-1)


def test_decode_step_has_no_host_synchronisation():
    """XLA:GPU runs a while loop with a data-dependent trip count, and a conditional, by copying the predicate to
    the host and blocking on the stream; a decode step must have neither, so the engine can dispatch ahead. The
    decode step with the Pallas kernels, lowered for CUDA: no while / case / if outside the Triton kernels."""
    from bench.compile_time import lower_decode_for_cuda
    from qwen35_jax.model.config import load_config
    cfg = load_config(fixture_dir("mm_tied_r2_g2"))
    kernels = make_kernels(KernelConfig(backend="pallas", decode_split_k=4))     # lowered for CUDA on the CPU
    lowered = lambda kernels, mode="top": lower_decode_for_cuda(cfg, kernels, batch=4, slots=4, pages=9,
                                                                 pages_per_seq=8, mode=mode)

    text = lowered(kernels)
    for mode in ("greedy", "lean", "full"):
        assert "stablehlo.while" not in lowered(kernels, mode)
    # Each kernel is lowered once (backends jit-wraps them) and called from every layer of its kind.
    assert text.count("__gpu$xla.gpu.triton") == 4          # GDN decode, conv decode, attention and its prologue
    gdn_layers = sum(t == "linear_attention" for t in cfg.layer_types)
    assert text.count("call @gdn_decode_packed(") == text.count("call @conv_decode(") == gdn_layers
    attention_layers = len(cfg.layer_types) - gdn_layers
    assert text.count("call @decode_prologue(") == text.count("call @attend_tiles(") == attention_layers
    for op in ("stablehlo.while", "stablehlo.case", "stablehlo.if"):
        assert op not in text, f"{op} in the decode step: a host round trip per step on GPU"
    # The check sees a loop where there is one: the jnp attention walks its pages in a data-dependent while.
    assert "stablehlo.while" in lowered(dataclasses.replace(kernels, attention_decode=decode_attention,
                                                            attention_prologue=None, attention_tiles=None))


def test_moe_decode_step_has_no_host_synchronisation():
    """The same for a MoE model: its decode step, lowered for CUDA with the per-copy expert kernels and with the
    sorted ones, has no while / case / if (the sorted kernels' block table is built by comparisons:
    jnp.searchsorted's default scan is a while loop)."""
    from bench.compile_time import lower_decode_for_cuda
    from qwen35_jax.model.config import load_config
    cfg = dataclasses.replace(load_config(fixture_dir("moe_text_untied_e16_k4")), moe_intermediate_size=32)
    for copies_max, call in ((16, "call @routed_experts("), (8, "call @sorted_experts(")):  # batch 4 of k 4: 16 copies
        config = KernelConfig(backend="pallas", decode_split_k=4,
                              expert_gemm=expert_gemm.ExpertGemmConfig(copies_max=copies_max))
        text = lower_decode_for_cuda(cfg, make_kernels(config), batch=4, slots=4, pages=9, pages_per_seq=8)
        assert call in text and "call @router_top_k(" in text
        for op in ("stablehlo.while", "stablehlo.case", "stablehlo.if"):
            assert op not in text, f"{op} in the MoE decode step: a host round trip per step on GPU"


def test_prefill_step_walks_no_data_dependent_loop():
    """A prefill chunk's attention runs in the prefill attention kernel: lowered for CUDA, the model's prefill
    forward has no while loop but the static-trip-count scan of jnp.searchsorted (the GDN kernels' varlen packing),
    where the jnp attention walks its key blocks in a data-dependent one (a host round trip per block on GPU)."""
    from qwen35_jax.model import forward as fw
    from qwen35_jax.model.config import load_config
    from qwen35_jax.model.sharding import DP, TP, Layout
    from qwen35_jax.model.state import abstract_state
    from qwen35_jax.model.weights import abstract_weights
    cfg = load_config(fixture_dir("mm_tied_r2_g2"))
    layout = Layout.build(cfg, 1)
    S, i32 = jax.ShapeDtypeStruct, jnp.int32
    struct = lambda tree: jax.tree.map(lambda p: S(p.shape, p.dtype), tree, is_leaf=lambda x: hasattr(x, "axes"))
    weights = struct(abstract_weights(cfg, layout, jnp.bfloat16))
    state = struct(abstract_state(cfg, layout, 4, 33, 16, jnp.bfloat16))
    n, t = 2, 64
    batch = fw.Batch(tokens=S((n, t), i32), start=S((n,), i32), lens=S((n,), i32), slots=S((n,), i32),
                     pages=S((n, 8), i32))
    dev = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", platform="gpu", num_cores=132)
    mesh = jax.sharding.AbstractMesh((1, 1), (DP, TP), abstract_device=dev)

    def loops(config):
        fn = jax.shard_map(functools.partial(fw.forward, cfg, layout, make_kernels(config), all_logits=False),
                           mesh=mesh, in_specs=jax.sharding.PartitionSpec(), out_specs=jax.sharding.PartitionSpec(),
                           check_vma=False)
        with jax.sharding.use_abstract_mesh(mesh):
            text = jax.jit(fn).trace(weights, state, batch).lower(lowering_platforms=("cuda",)).as_text()
        funcs = re.split(r"\n\s*func\.func ", text)
        return text, [f.split("(", 1)[0] for f in funcs if "stablehlo.while" in f]

    text, where = loops(KernelConfig(backend="pallas", decode_split_k=4))
    assert "paged_prefill_attention" in text and all("searchsorted" in name for name in where), where
    _, where = loops(KernelConfig(backend="pallas", decode_split_k=4, prefill_attention=None))
    assert any("searchsorted" not in name for name in where)


def test_backend_kernels_follow_the_config():
    """make_kernels builds each Pallas kernel with the KernelConfig's tile configuration; decode_attention None
    runs the jnp reference (without the prologue kernel)."""
    config = lambda kernel: kernel.__wrapped__.keywords["config"]       # each kernel: jit(partial(kernel, ...))
    k = make_kernels(KernelConfig(backend="pallas_interpret").resolved())
    assert k.attention_prologue is not None and config(k.attention_tiles) == paged_attention.DEFAULT
    assert config(k.attention_decode) == paged_attention.DEFAULT
    assert config(k.gdn_prefill) == gdn.DEFAULT_PREFILL and config(k.gdn_decode) == gdn.DEFAULT_DECODE
    assert config(k.conv_prefill) == conv1d.ConvConfig() and (k.split_k, k.split_k_from) == (4, 64)
    assert config(k.attention_prefill) == prefill_attention.DEFAULT
    other = KernelConfig.parse("gdn_decode.bv=32 gdn_decode.num_warps=2 conv.bt=64 conv.num_warps=8 "
                               "decode_attention.pages_per_block=4 prefill_attention.block_k=64",
                               KernelConfig(backend="pallas_interpret"))
    k = make_kernels(other.resolved())
    assert config(k.gdn_decode) == dataclasses.replace(gdn.DEFAULT_DECODE, bv=32, num_warps=2)
    assert config(k.conv_prefill) == conv1d.ConvConfig(bt=64, num_warps=8)
    assert config(k.attention_decode) == dataclasses.replace(paged_attention.DEFAULT, pages_per_block=4)
    assert config(k.attention_prefill) == dataclasses.replace(prefill_attention.DEFAULT, block_k=64)
    jnp_attention = KernelConfig(backend="pallas_interpret", decode_attention=None, attention_prologue=False,
                                 prefill_attention=None)
    k = make_kernels(jnp_attention.resolved())
    assert k.attention_decode is decode_attention and k.attention_prologue is None and k.attention_tiles is None
    assert k.attention_prefill is paged_attention_reference


def test_sweep_names_unique():
    """bench/kernel_sweeps.py: each list starts with the kernel's default and names each configuration once."""
    ks = kernel_sweeps
    for sweep, default, name in ((ks.prefill_sweep(), gdn.DEFAULT_PREFILL, "name"),
                                 (ks.decode_sweep(), gdn.DEFAULT_DECODE, "name"),
                                 (ks.attention_sweep(), paged_attention.DEFAULT, "name"),
                                 (ks.prefill_attention_sweep(), prefill_attention.DEFAULT, "name"),
                                 (ks.conv_prefill_sweep(), conv1d.ConvConfig(), "prefill_name"),
                                 (ks.conv_decode_sweep(), conv1d.ConvConfig(), "decode_name")):
        names = [getattr(c, name) for c in sweep]
        assert sweep[0] == default and len(names) == len(set(names)), names


def test_illegal_head_dim_raises():
    with pytest.raises(ValueError, match="power of two"):
        gdn._check_dims(96, 128, 16, 32)


# ---------------------------------------------------------------------------------------------------------------
# Model level: the whole forward (prefill rows of different lengths, a padded row, then decode steps).


@pytest.mark.parametrize("tp", [1, 2])
def test_model_logits_pallas_interpret_equal_reference(tp):
    from qwen35_jax.model.config import load_config
    from qwen35_jax.model.runner import ModelRunner, make_batch
    from qwen35_jax.model.sharding import make_mesh
    from qwen35_jax.model.weights import load_weights
    model = fixture_dir("mm_tied_r2_g2")
    cfg = load_config(model)
    mesh = make_mesh(tp)
    weights = load_weights(model, cfg, mesh, jnp.float32)
    rng = np.random.default_rng(0)
    t, pages = 80, 6
    lens = [70, 5, 0]
    tokens = rng.integers(0, cfg.vocab_size, (3, t))
    page_table = np.array([1 + np.arange(pages), 1 + pages + np.arange(pages), np.zeros(pages, int)])
    out = {}
    for backend in ("reference", "pallas_interpret"):
        kernels = make_kernels(KernelConfig(backend=backend).resolved())
        runner = ModelRunner(cfg, mesh, Layout.build(cfg, tp), weights, jnp.float32, kernels, num_slots=3,
                             num_pages=1 + 2 * pages, page_size=16)
        logits = [runner.run(make_batch(tokens, [0, 0, 0], lens, [1, 2, 0], page_table), all_logits=True)]
        for step in range(2):
            nxt = tokens[:, step:step + 1]
            logits.append(runner.run(make_batch(nxt, [70 + step, 5 + step, 0], [1, 1, 0], [1, 2, 0], page_table)))
        out[backend] = [np.asarray(x, np.float32) for x in logits]
    ref = out["reference"]
    # |logits| reach ~300 here, where one fp32 ulp is 3e-5: a literal 1e-4 absolute bar is ~3 ulps of summation
    # order. The bar is 1e-6 relative to the largest logit (~3e-4 absolute, ~10 ulps).
    scale = np.abs(ref[0][:2, :, :cfg.vocab_size]).max()
    got = out["pallas_interpret"]
    for i, n in enumerate(lens[:2]):
        err = np.abs(got[0][i, :n, :cfg.vocab_size] - ref[0][i, :n, :cfg.vocab_size]).max()
        assert err <= 1e-6 * scale, f"prefill row {i}: max |dlogit| {err:.2e} (max |logit| {scale:.0f})"
    for step in (1, 2):
        err = np.abs(got[step][:2, :cfg.vocab_size] - ref[step][:2, :cfg.vocab_size]).max()
        assert err <= 1e-6 * scale, f"decode step {step}: max |dlogit| {err:.2e} (max |logit| {scale:.0f})"


def test_prefill_head_on_the_gemv_equals_the_dot():
    """KernelConfig.gemv: a prefill step's logits (each row's last token, an untied head) from the GEMV kernel
    equal XLA's dot (fp32, 1e-6 of the largest logit), and the kernel is in the step (a tied head is not: it would
    be copied transposed)."""
    from qwen35_jax.model.config import load_config
    from qwen35_jax.model.runner import ModelRunner, make_batch
    from qwen35_jax.model.sharding import make_mesh
    from qwen35_jax.model.weights import load_weights
    out, calls = {}, {}
    for model in ("text_untied_r1_g6", "text_tied_r2_g1"):
        cfg = load_config(fixture_dir(model))
        mesh = make_mesh(1)
        weights = load_weights(fixture_dir(model), cfg, mesh, jnp.float32)
        tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 24))
        batch = make_batch(tokens, [0, 0], [24, 9], [1, 2], np.array([[1, 2], [3, 4]]))
        for head in (False, True):
            config = KernelConfig(backend="pallas_interpret",   # K split as far as it goes
                                  gemv=gemv.GemvConfig(block_n=16, block_k=16, min_programs=10 ** 4) if head else None)
            runner = ModelRunner(cfg, mesh, Layout.build(cfg, 1), weights, jnp.float32,
                                 make_kernels(config.resolved()), num_slots=3, num_pages=5, page_size=16)
            out[model, head] = np.asarray(runner.run(batch), np.float32)[:, :cfg.vocab_size]
            calls[model, head] = "name=gemv" in str(jax.make_jaxpr(lambda b: runner.run(b))(batch))
    assert calls == {("text_untied_r1_g6", False): False, ("text_untied_r1_g6", True): True,
                     ("text_tied_r2_g1", False): False, ("text_tied_r2_g1", True): False}
    want, got = out["text_untied_r1_g6", False], out["text_untied_r1_g6", True]
    assert np.abs(got - want).max() <= 1e-6 * np.abs(want).max()


def test_prep_auto_picks_the_fused_prep_for_few_chunks():
    """prep_mode "auto" (the default): the fused T / P / f kernel while its (chunk, value head) programs are few, on
    bf16 inputs only; the T solve + the per-key-head P / f prep otherwise; explicit modes pass through, a bad one
    (or the fused prep on fp32 inputs) is refused."""
    few, many = gdn.FUSED_PREP_PROGRAMS // 32, gdn.FUSED_PREP_PROGRAMS // 32 + 1
    assert gdn.resolve_prep(WY, few, 32, jnp.bfloat16) == dataclasses.replace(WY, prep_mode="fused", solve_grid="value")
    assert gdn.resolve_prep(WY, many, 32, jnp.bfloat16) == dataclasses.replace(WY, prep_mode="solve2",
                                                                               solve_grid="value")
    assert gdn.resolve_prep(WY, few, 32, jnp.float32).prep_mode == "solve2"               # fp32: near-fp32 merges
    assert gdn.resolve_prep(dataclasses.replace(WY, prep_mode="solve2"), few, 32, jnp.bfloat16).prep_mode == "solve2"
    for bad, dtype in (("tile", jnp.bfloat16), ("fused", jnp.float32)):
        with pytest.raises(ValueError, match="prep_mode"):
            gdn.resolve_prep(dataclasses.replace(WY, prep_mode=bad), few, 32, dtype)


def test_solve_grid_auto_goes_per_value_head_for_few_chunks():
    """solve_grid "auto" (the default): the T solve per value head while its programs run in one wave, per key head
    beyond (where the grid's extra K K^T products cost more than the shorter chain saves); a bad value is refused."""
    one_wave = gdn.SOLVE_WAVE_PROGRAMS // 32
    grid = lambda chunks, c=WY: gdn.resolve_prep(c, chunks, 32, jnp.bfloat16).solve_grid
    assert (grid(one_wave), grid(one_wave + 1)) == ("value", "key")
    assert grid(one_wave + 1, dataclasses.replace(WY, solve_grid="value")) == "value"      # explicit grids pass through
    assert grid(1, dataclasses.replace(WY, solve_grid="key")) == "key"
    with pytest.raises(ValueError, match="solve_grid"):
        grid(1, dataclasses.replace(WY, solve_grid="heads"))


def test_prep_kernels_take_their_own_warps():
    """The fused prep runs on prep_warps; after the T solve (solve_warps, one program per key head or value head as
    solve_grid says), the P / f prep on pf_warps (read from the lowered kernels' Triton parameters and grids)."""
    hk, hv = 2, 4
    for total in (64 * 12, 64 * 100):          # "auto": the fused prep (12 chunks x 4 heads), then solve2
        packed = packed_prefill_shapes(total, 1, hk, hv, 64, 64, 3)
        for c in (WY, dataclasses.replace(WY, pf_warps=8, solve_grid="key")):
            text = lower_for_cuda(lambda *x: gdn.gdn_prefill_packed(*x, config=c, starts_aligned=True), *packed)
            warps = sorted(int(w) for w in re.findall(r"num_warps = (\d+) : i32", text))
            if total == 64 * 12:
                assert warps == [c.prep_warps]
            else:
                assert warps == sorted([c.solve_warps, c.pf_warps])
                solve = text[:text.index('name = "gdn_solve"')]                  # its custom call's grid precedes
                assert re.findall(r"grid_y = (\d+)", solve)[-1] == str(hv if c.solve_grid == "auto" else hk)


@pytest.mark.parametrize("tp", [1, 2])
def test_decode_split_k_keeps_the_logits(tp):
    """KernelConfig.decode_split_k=S: the row-parallel decode GEMMs as one batched dot over S ranges of K
    (model.row_parallel, from decode_split_k_from rows) give the logits of the single dot within fp32 summation
    order; prefill, and decode batches below the threshold, are untouched."""
    from qwen35_jax.model.config import load_config
    from qwen35_jax.model.runner import ModelRunner, make_batch
    from qwen35_jax.model.sharding import make_mesh
    from qwen35_jax.model.weights import load_weights
    model = fixture_dir("mm_tied_r2_g2")
    cfg = load_config(model)
    mesh = make_mesh(tp)
    weights = load_weights(model, cfg, mesh, jnp.float32)
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 24))
    page_table = np.array([1 + np.arange(2), 3 + np.arange(2)])

    def run(split, split_from, prefill=True):
        """(prefill logits or None, decode logits) of a fresh runner under these settings (2 rows)."""
        config = KernelConfig(backend="reference", decode_split_k=int(split), decode_split_k_from=int(split_from))
        runner = ModelRunner(cfg, mesh, Layout.build(cfg, tp), weights, jnp.float32, make_kernels(config.resolved()),
                             num_slots=2, num_pages=5, page_size=16)
        assert (runner.kernels.split_k, runner.kernels.split_k_from) == (int(split), int(split_from))
        pre = runner.run(make_batch(tokens, [0, 0], [20, 24], [1, 2], page_table), all_logits=True) if prefill else None
        dec = runner.run(make_batch(tokens[:, :1], [20, 24], [1, 1], [1, 2], page_table))
        return [None if x is None else np.asarray(x, np.float32)[..., :cfg.vocab_size] for x in (pre, dec)]

    out = {split: run(split, "2") for split in ("1", "4")}
    scale = np.abs(out["1"][1]).max()
    assert np.array_equal(out["1"][0], out["4"][0])
    assert 0 < np.abs(out["4"][1] - out["1"][1]).max() <= 1e-6 * scale      # split: other summation order
    assert np.array_equal(run("4", "3")[1], out["1"][1])                   # 2 rows: below it, no split
    with pytest.raises(ValueError, match="decode_split_k must be >= 1"):
        KernelConfig(decode_split_k=0)
    with pytest.raises(ValueError, match="does not divide"):               # 7 divides no K of this model
        run("7", "2", prefill=False)
