"""GDN / conv kernel benchmark on the GPU: our Pallas kernels and fla-core 0.6.0 side by side, in one run.

Run on the GPU machine (fla-core carried as a wheel, see shared/tools/fla_baseline.py):
  pip install --no-index --no-deps --target /tmp/site .whl/fla_core-0.6.0-py3-none-any.whl
  PYTHONPATH=/tmp/site:. FLA_FLASH_QLA=0 FLA_TILELANG=0 COMMIT=<sha> python3 bench/kernels.py [--sweep] [--model]
Writes $OUT/results.json, $OUT/RESULTS_section.md (the markdown section for bench/RESULTS.md) and prints it last.

Shapes: Qwen3.5-9B GDN (Hk 16, Hv 32, dk = dv = 128, conv channels 8192), bf16 activations, fp32 state,
random realistic inputs (raw q/k, normal a/b projections, A_log = log U(1, 16), random initial states).

GPU time, host dispatch excluded on both sides:
- ours: one jitted program runs R back-to-back kernel calls (the state pool threaded through, in place);
  time per call = slope of the program's wall time between R1 and R2 calls (fixed dispatch/sync cost cancels).
  Inputs rotate over several sets / slot groups so the L2 (50 MB) never holds a call's data from the last one.
- fla: one call captured in a CUDA graph, `triton.testing.do_bench` median of graph replays (L2 flushed between
  replays), as shared/tools/fla_baseline.py; where capture fails (varlen), eager do_bench (noted).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import platform
import subprocess
import sys
import time
import traceback

os.environ.setdefault("FLA_FLASH_QLA", "0")
os.environ.setdefault("FLA_TILELANG", "0")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pallas_kernels import conv1d, conv1d_reference, gdn, gdn_reference  # noqa: E402

OUT = os.environ.get("OUT", "/tmp/bench_out")
os.makedirs(OUT, exist_ok=True)
DRY = os.environ.get("BENCH_DRY") == "1"     # CPU smoke test of this script: tiny shapes, interpret-mode kernels
HK, HV, DK, DV, CONV_CH = (2, 4, 16, 16, 96) if DRY else (16, 32, 128, 128, 8192)
if DRY:
    for mod, names in ((gdn, ("gdn_prefill_packed", "gdn_decode")), (conv1d, ("conv_prefill", "conv_decode"))):
        for nm in names:
            setattr(mod, nm, functools.partial(getattr(mod, nm), interpret=True))
STATE_BYTES = HV * DV * DK * 4
T_START = time.time()
RES: dict = {"errors": {}}
LOG = open(os.path.join(OUT, "log.txt"), "a")


def log(*a):
    s = " ".join(str(x) for x in a)
    print(s, flush=True)
    LOG.write(s + "\n")
    LOG.flush()


def elapsed():
    return time.time() - T_START


def section(name, budget_left=0.0):
    """Run a section, record its error instead of dying; skip it when past the deadline."""
    def deco(fn):
        if elapsed() > ARGS.deadline - budget_left:
            RES["errors"][name] = f"skipped: past the deadline ({elapsed():.0f}s)"
            log(f"[{name}] skipped (deadline)")
            return fn
        t0 = time.time()
        try:
            fn()
        except Exception as e:  # noqa: BLE001
            RES["errors"][name] = repr(e)[:800]
            log(f"[{name}] ERROR {e!r}"[:2000])
            traceback.print_exc()
        log(f"[{name}] {time.time() - t0:.1f}s (total {elapsed():.0f}s)")
        json.dump(RES, open(os.path.join(OUT, "results.json"), "w"), indent=1, default=str)
        try:                                   # the report so far, in case the run is cut off
            open(os.path.join(OUT, "RESULTS_section.md"), "w").write(report())
        except Exception as e:  # noqa: BLE001
            log("report failed", repr(e))
        return fn
    return deco


def rel(x, y):
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    return float(np.linalg.norm(x - y) / np.linalg.norm(y))


# ---------------------------------------------------------------------------------------------------------------
# Timing of our kernels: slope of R back-to-back calls inside one jitted program.


def time_calls(call, pool, sets, r1=2, r2=12, reps=5):
    """call(pool, *args) -> (out, pool). sets: list of argument tuples (rotated). Returns (us per call, pool)."""
    inner = jax.jit(call)
    if DRY:
        r1, r2, reps = 1, 2, 1

    def prog(pool, sets, r):
        acc = jnp.float32(0)
        for i in range(r):
            out, pool = inner(pool, *sets[i % len(sets)])
            acc = acc + out.reshape(-1)[0].astype(jnp.float32)
        return acc, pool

    fns = {r: jax.jit(functools.partial(prog, r=r), donate_argnums=0) for r in (r1, r2)}
    meds = {}
    for r, f in fns.items():
        t0 = time.perf_counter()
        acc, pool = f(pool, sets)                         # compile + warm up
        acc.block_until_ready()
        RES.setdefault("first_call_s", []).append(round(time.perf_counter() - t0, 2))
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            acc, pool = f(pool, sets)
            acc.block_until_ready()
            ts.append(time.perf_counter() - t0)
        meds[r] = float(np.median(ts))
    return (meds[r2] - meds[r1]) / (r2 - r1) * 1e6, pool


def n_sets(set_bytes, target=256 << 20, cap=8):
    return int(min(cap, max(1, math.ceil(target / max(set_bytes, 1)))))


# ---------------------------------------------------------------------------------------------------------------
# Inputs.


def gdn_inputs(key, total, a_scale=1.0):
    ks = jax.random.split(key, 5)
    bf = jnp.bfloat16
    q = jax.random.normal(ks[0], (total, HK, DK), bf)
    k = jax.random.normal(ks[1], (total, HK, DK), bf)
    v = jax.random.normal(ks[2], (total, HV, DV), bf)
    a = (a_scale * jax.random.normal(ks[3], (total, HV))).astype(bf)
    b = jax.random.normal(ks[4], (total, HV), bf)
    return q, k, v, a, b


def gates_params(key):
    A_log = jnp.log(jax.random.uniform(key, (HV,), jnp.float32, 1.0, 16.0))
    dt_bias = 0.5 * jax.random.normal(jax.random.fold_in(key, 1), (HV,), jnp.float32)
    return A_log, dt_bias


def rand_pool(key, slots):
    return 0.1 * jax.random.normal(key, (slots, HV, DV, DK), jnp.float32)


# ---------------------------------------------------------------------------------------------------------------
# fla side.

FLA = {}


def fla_setup():
    import torch
    import torch.nn.functional as F
    from triton.testing import do_bench
    import fla
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    from fla.modules.causal_conv1d import causal_conv1d, causal_conv1d_update
    FLA.update(torch=torch, F=F, do_bench=do_bench, chunk=chunk_gated_delta_rule,
               recur=fused_recurrent_gated_delta_rule, conv=causal_conv1d, conv_update=causal_conv1d_update)
    RES["env"]["fla"] = fla.__version__
    RES["env"]["torch"] = torch.__version__


def fla_med(fn, rep=200):
    return FLA["do_bench"](fn, warmup=25, rep=rep, quantiles=[0.5, 0.2, 0.8])[0] * 1e3


def fla_graph_us(fn, rep=200):
    torch = FLA["torch"]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    torch.cuda.synchronize()
    return fla_med(g.replay, rep)


# ---------------------------------------------------------------------------------------------------------------

PREFILL_CASES = ({"1x1k": [100], "1x8k": [130], "1x32k": [64], "8x2k": [70] * 3} if DRY else
                 {"1x1k": [1024], "1x8k": [8192], "1x32k": [32768], "8x2k": [2048] * 8})


def prefill_floor_us(tokens, n_seq):
    """gdn-kernels.md section 6: max(FLOP floor at the measured bf16 matmul rate, byte floor at the copy rate)."""
    flops = 183e3 * HV * tokens
    byts = 24.3 * 1024 * tokens + 2 * STATE_BYTES * n_seq
    mm = RES["ceilings"].get("matmul_TFLOPs", 790.0) * 1e12
    cp = RES["ceilings"].get("copy_TBps_torch", 4.25) * 1e12
    return max(flops / mm, byts / cp) * 1e6


def our_prefill_us(lens, config, key=jax.random.key(7)):
    total = sum(lens)
    n = len(lens)
    starts = jnp.array(np.cumsum([0] + lens[:-1]), jnp.int32)
    lens_a = jnp.array(lens, jnp.int32)
    A_log, dt_bias = gates_params(jax.random.fold_in(key, 99))
    set_bytes = total * (2 * HK * DK * 2 + HV * DV * 2 * 2)
    ns = 2 if DRY else n_sets(set_bytes)
    nslots = ns * n + 1
    pool = rand_pool(key, nslots)
    sets = []
    for i in range(ns):
        sl = 1 + i * n + jnp.arange(n, dtype=jnp.int32)
        sets.append((*gdn_inputs(jax.random.fold_in(key, i), total), sl))

    def call(pool, q, k, v, a, b, slots):
        return gdn.gdn_prefill_packed(q, k, v, a, b, A_log, dt_bias, pool, starts, lens_a, slots,
                                      jnp.ones(n, bool), config=config)
    us, _ = time_calls(call, pool, sets, r1=2, r2=5 if total >= 32768 else 8)
    return us


def our_solve_us(lens, config, key=jax.random.key(8)):
    total, n = sum(lens), len(lens)
    starts = jnp.array(np.cumsum([0] + lens[:-1]), jnp.int32)
    lens_a = jnp.array(lens, jnp.int32)
    A_log, dt_bias = gates_params(key)
    q, k, v, a, b = gdn_inputs(key, total)
    mc = -(-total // 64) + n

    def call(dummy, k, a, b):
        off, t = gdn.solve_t(k, a, b, A_log, dt_bias, starts, lens_a, mc, HV // HK, "tf32", config, DRY)
        return t, dummy + t[0, 0, 0, 0]
    us, _ = time_calls(call, jnp.zeros((), jnp.float32), [(k, a, b)], r1=2, r2=12)
    return us


def fla_prefill_us(lens):
    torch = FLA["torch"]
    F = FLA["F"]
    total, n = sum(lens), len(lens)
    g = torch.Generator(device="cuda").manual_seed(3)
    dev = "cuda"
    eq = len(set(lens)) == 1
    B, T = (n, lens[0]) if eq else (1, total)
    q = torch.randn(B, T, HK, DK, device=dev, dtype=torch.bfloat16, generator=g)
    k = torch.randn(B, T, HK, DK, device=dev, dtype=torch.bfloat16, generator=g)
    v = torch.randn(B, T, HV, DV, device=dev, dtype=torch.bfloat16, generator=g)
    gg = F.logsigmoid(torch.randn(B, T, HV, device=dev, generator=g))
    beta = torch.sigmoid(torch.randn(B, T, HV, device=dev, generator=g))
    h0 = 0.1 * torch.randn(n, HV, DV, DK, device=dev, generator=g)
    out = {}
    with torch.inference_mode():
        fn = lambda: FLA["chunk"](q, k, v, gg, beta, initial_state=h0, output_final_state=True,
                                  use_qk_l2norm_in_kernel=True, state_v_first=True)
        out["graph_us"] = fla_graph_us(fn)
        if n > 1:   # the same tokens as a packed varlen batch (what a server runs)
            qv, kv, vv = (x.reshape(1, total, *x.shape[2:]) for x in (q, k, v))
            gv, bv = gg.reshape(1, total, HV), beta.reshape(1, total, HV)
            cu = torch.tensor(np.cumsum([0] + lens), device=dev, dtype=torch.long)
            fv = lambda: FLA["chunk"](qv, kv, vv, gv, bv, initial_state=h0, output_final_state=True,
                                      use_qk_l2norm_in_kernel=True, state_v_first=True, cu_seqlens=cu)
            fv()
            out["varlen_eager_us"] = fla_med(fv)      # host-synchronising chunk indexing: not graph-capturable
    return out


def main():
    RES["env"] = dict(jax=jax.__version__, device=str(jax.devices()[0]), kind=jax.devices()[0].device_kind,
                      commit=os.environ.get("COMMIT", "?"), host=platform.node(), python=platform.python_version(),
                      command=" ".join(sys.argv))
    RES["ceilings"] = {}
    log("env", RES["env"])
    log("argv", ARGS)

    @section("fla_import")
    def _():
        fla_setup()

    @section("ceilings")
    def _():
        x = jax.random.normal(jax.random.key(0), (1 << (16 if DRY else 29),), jnp.float32)       # 2 GiB
        f = jax.jit(lambda x: x * 1.0001)
        y = f(x); y.block_until_ready()
        ts = []
        for _ in range(10):
            t0 = time.perf_counter(); y = f(x); y.block_until_ready(); ts.append(time.perf_counter() - t0)
        RES["ceilings"]["copy_TBps_jax"] = 2 * x.nbytes / np.median(ts) / 1e12
        del x, y
        if FLA:
            torch = FLA["torch"]
            a = torch.empty(1 << 30, device="cuda", dtype=torch.bfloat16).normal_()
            b = torch.empty_like(a)
            ms = FLA["do_bench"](lambda: b.copy_(a), warmup=25, rep=100, quantiles=[0.5, 0.2, 0.8])[0]
            RES["ceilings"]["copy_TBps_torch"] = 2 * a.numel() * 2 / (ms * 1e-3) / 1e12
            m = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
            ms = FLA["do_bench"](lambda: m @ m, warmup=25, rep=100, quantiles=[0.5, 0.2, 0.8])[0]
            RES["ceilings"]["matmul_TFLOPs"] = 2 * 8192 ** 3 / (ms * 1e-3) / 1e12
            del a, b, m
            torch.cuda.empty_cache()
        log("ceilings", RES["ceilings"])

    # ------------------------------------------------------------------ correctness on the GPU
    @section("correct_prefill")
    def _():
        key = jax.random.key(1)
        lens = [100, 777, 65, 1]
        total = sum(lens)
        starts = jnp.array(np.cumsum([0] + lens[:-1]), jnp.int32)
        q, k, v, a, b = gdn_inputs(key, total)
        A_log, dt_bias = gates_params(jax.random.fold_in(key, 5))
        pool = rand_pool(jax.random.fold_in(key, 6), 8)
        slots = jnp.array([5, 2, 7, 3], jnp.int32)
        use = jnp.array([True, True, False, True])
        tmax = max(lens)                                   # one padded reference call (one compile)
        padded = [jnp.stack([jnp.pad(x[int(s0):int(s0) + ln].astype(jnp.float32),
                                     [(0, tmax - ln)] + [(0, 0)] * (x.ndim - 1))
                             for s0, ln in zip(np.asarray(starts), lens)]) for x in (q, k, v, a, b)]
        o_r, p_r = jax.jit(functools.partial(gdn_reference.gdn_prefill, method="scan"))(
            *padded, A_log, dt_bias, pool, slots, jnp.array(lens), use)
        refs = [(slice(int(s0), int(s0) + ln), np.asarray(o_r[i, :ln]), np.asarray(p_r[slots[i]]))
                for i, (s0, ln) in enumerate(zip(np.asarray(starts), lens))]
        out = {}
        for name, cfg in [("default(tf32)", gdn.PrefillConfig())]:
            try:
                o, p = jax.jit(functools.partial(gdn.gdn_prefill_packed, config=cfg))(
                    q, k, v, a, b, A_log, dt_bias, pool, starts, jnp.array(lens), slots, use)
                o = np.asarray(o.astype(jnp.float32))
                o_err = rel(np.concatenate([o[sl] for sl, _, _ in refs]), np.concatenate([r for _, r, _ in refs]))
                s_err = rel(np.stack([np.asarray(p[slots[i]]) for i in range(4)]), np.stack([r for _, _, r in refs]))
                untouched = bool(np.array_equal(np.asarray(p[jnp.array([0, 1, 4, 6])]),
                                                np.asarray(pool[jnp.array([0, 1, 4, 6])])))
                out[name] = dict(o_rel=o_err, state_rel=s_err, untouched_ok=untouched, finite=bool(np.isfinite(o).all()))
            except Exception as e:  # noqa: BLE001
                out[name] = dict(error=repr(e)[:600])
            log("prefill correctness", name, out[name])
        if FLA:
            torch = FLA["torch"]
            tq, tk, tv = (torch.from_numpy(np.asarray(x.astype(jnp.float32))).cuda().to(torch.bfloat16)[None]
                          for x in (q, k, v))
            g_, beta_ = gdn_reference.gates(a, b, A_log, dt_bias)
            tg, tb = (torch.from_numpy(np.asarray(x)).cuda()[None] for x in (g_, beta_))
            h0 = torch.from_numpy(np.asarray(jnp.where(use[:, None, None, None], pool[slots], 0))).cuda()
            cu = torch.tensor(np.cumsum([0] + lens), device="cuda", dtype=torch.long)
            with torch.inference_mode():
                fo, fs = FLA["chunk"](tq, tk, tv, tg, tb, initial_state=h0, output_final_state=True,
                                      use_qk_l2norm_in_kernel=True, state_v_first=True, cu_seqlens=cu)
            fo = fo[0].float().cpu().numpy()
            out["fla"] = dict(o_rel=rel(np.concatenate([fo[sl] for sl, _, _ in refs]),
                                        np.concatenate([r for _, r, _ in refs])),
                              state_rel=rel(fs.cpu().numpy(), np.stack([r for _, _, r in refs])))
            log("prefill correctness fla", out["fla"])
        RES["correct_prefill"] = out

    @section("correct_decode_conv")
    def _():
        key = jax.random.key(2)
        n = 8
        q, k, v, a, b = (x[:n] for x in gdn_inputs(key, n))
        A_log, dt_bias = gates_params(key)
        pool = rand_pool(jax.random.fold_in(key, 1), 12)
        slots = jnp.array([3, 0, 7, 1, 0, 11, 5, 9], jnp.int32)
        live = np.array([0, 2, 3, 5, 6, 7])
        o_r, p_r = gdn_reference.gdn_decode(q, k, v, a, b, A_log, dt_bias, pool, slots)
        out = {}
        for bv, nw in [(32, 2)]:
            o, p = jax.jit(functools.partial(gdn.gdn_decode, config=gdn.DecodeConfig(bv=bv, num_warps=nw)))(
                q, k, v, a, b, A_log, dt_bias, pool, slots)
            out[f"decode_bv{bv}_w{nw}"] = dict(
                state_rel=rel(p[slots[live]], p_r[slots[live]]),
                o_rel=rel(np.asarray(o[live], np.float32), np.asarray(o_r[live], np.float32)),
                untouched_ok=bool(np.array_equal(np.asarray(p[jnp.array([2, 4, 6, 8, 10])]),
                                                 np.asarray(pool[jnp.array([2, 4, 6, 8, 10])]))))
        x = jax.random.normal(key, (3, 300, CONV_CH), jnp.bfloat16)
        w = (0.3 * jax.random.normal(jax.random.fold_in(key, 2), (4, CONV_CH))).astype(jnp.bfloat16)
        cpool = jax.random.normal(jax.random.fold_in(key, 3), (6, 3, CONV_CH), jnp.bfloat16)
        cs, cl, cu = jnp.array([4, 1, 2]), jnp.array([300, 2, 130]), jnp.array([True, True, False])
        y, p = jax.jit(conv1d.conv_prefill)(x, w, cpool, cs, cl, cu)
        y_r, p_r = conv1d_reference.conv_prefill(x, w, cpool, cs, cl, cu)
        d = np.abs(np.asarray(y, np.float32) - np.asarray(y_r, np.float32))
        ulp = np.abs(np.asarray(y_r, np.float32)) * 2.0 ** -7 + 1e-30
        out["conv_prefill"] = dict(exact_frac=float((d == 0).mean()), max_ulps=float((d / ulp).max()),
                                   state_equal=bool(np.array_equal(np.asarray(p, np.float32), np.asarray(p_r, np.float32))))
        yd, pd = jax.jit(conv1d.conv_decode)(x[:, 0], w, cpool, jnp.array([4, 0, 2]))
        yd_r, pd_r = conv1d_reference.conv_decode(x[:, 0], w, cpool, jnp.array([4, 0, 2]))
        d = np.abs(np.asarray(yd, np.float32) - np.asarray(yd_r, np.float32))[jnp.array([0, 2])]
        out["conv_decode"] = dict(exact_frac=float((d == 0).mean()),
                                  state_equal=bool(np.array_equal(np.asarray(pd[jnp.array([2, 4])], np.float32),
                                                                  np.asarray(pd_r[jnp.array([2, 4])], np.float32))))
        RES["correct_decode_conv"] = out
        for kk, vv in out.items():
            log("correct", kk, vv)

    # ------------------------------------------------------------------ decode
    RES["decode"] = {}
    dec_cfgs = [(32, 2), (64, 4), (128, 8)] if ARGS.sweep else [(32, 2)]

    @section("decode")
    def _():
        key = jax.random.key(4)
        A_log, dt_bias = gates_params(key)
        for n in ((1, 8) if DRY else (1, 8, 32, 128, 256)):
            r = RES["decode"].setdefault(n, {})
            ns = 2 if DRY else n_sets(n * 2 * STATE_BYTES, target=512 << 20, cap=64)
            pool = rand_pool(key, ns * n + 1)
            sets = []
            for i in range(ns):
                q, k, v, a, b = (x[:n] for x in gdn_inputs(jax.random.fold_in(key, i), n))
                sets.append((q, k, v, a, b, 1 + i * n + jnp.arange(n, dtype=jnp.int32)))
            for bv, nw in dec_cfgs:
                cfg = gdn.DecodeConfig(bv=bv, num_warps=nw)
                call = lambda pool, q, k, v, a, b, s, cfg=cfg: gdn.gdn_decode(q, k, v, a, b, A_log, dt_bias, pool,
                                                                            s, config=cfg)
                try:
                    us, pool = time_calls(call, pool, sets, r1=4, r2=44)
                    r[f"bv{bv}_w{nw}"] = us
                except Exception as e:  # noqa: BLE001
                    RES["errors"][f"decode_{n}_{bv}_{nw}"] = repr(e)[:600]
            del pool
            if FLA:
                torch = FLA["torch"]
                tq = torch.randn(n, 1, HK, DK, device="cuda", dtype=torch.bfloat16)
                tk = torch.randn(n, 1, HK, DK, device="cuda", dtype=torch.bfloat16)
                tv = torch.randn(n, 1, HV, DV, device="cuda", dtype=torch.bfloat16)
                ta = torch.randn(n, 1, HV, device="cuda", dtype=torch.bfloat16)
                tb = torch.randn(n, 1, HV, device="cuda", dtype=torch.bfloat16)
                h0 = 0.1 * torch.randn(n, HV, DV, DK, device="cuda")
                tal = torch.from_numpy(np.asarray(A_log)).cuda()
                tdb = torch.from_numpy(np.asarray(dt_bias)).cuda()
                with torch.inference_mode():
                    fn = lambda: FLA["recur"](tq, tk, tv, g=ta, beta=tb, initial_state=h0, output_final_state=True,
                                              use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=tal,
                                              dt_bias=tdb, use_beta_sigmoid_in_kernel=True, state_v_first=True)
                    try:
                        r["fla_us"] = fla_graph_us(fn)
                    except Exception as e:  # noqa: BLE001
                        RES["errors"][f"fla_decode_{n}"] = repr(e)[:600]
            log("decode", n, r)

    # ------------------------------------------------------------------ prefill
    sweep = [gdn.PrefillConfig(bv=bv, num_warps=nw, num_stages=ns)
             for bv, nw, ns in [(32, 4, 2), (32, 8, 2), (32, 8, 1), (64, 8, 2), (128, 8, 2)]]
    sweep.append(gdn.PrefillConfig(bv=32, num_warps=8, prec="bf16", solve_prec="bf16"))
    cfg_name = lambda c: f"bv{c.bv}_w{c.num_warps}_s{c.num_stages}_{c.prec or 'auto'}"
    RES["prefill"] = {}

    def pick(case):
        """The fastest swept configuration of auto precision for this case (the default when not swept)."""
        sw = RES["prefill"].get(case, {}).get("sweep", {})
        ok = {c: sw.get(cfg_name(c)) for c in sweep if c.prec is None and sw.get(cfg_name(c))}
        return min(ok, key=ok.get) if ok else gdn.PrefillConfig()

    @section("prefill_sweep")
    def _():
        if not ARGS.sweep:
            return
        for case in ("1x8k",):
            for cfg in sweep:
                name = cfg_name(cfg)
                try:
                    us = our_prefill_us(PREFILL_CASES[case], cfg)
                except Exception as e:  # noqa: BLE001
                    us = None
                    RES["errors"][f"prefill_{case}_{name}"] = repr(e)[:600]
                RES["prefill"].setdefault(case, {}).setdefault("sweep", {})[name] = us
                log(f"prefill {case} {name}: {us}")
        for sw in (4, 8):
            cfg = dataclasses.replace(pick("1x8k"), solve_warps=sw)
            try:
                RES["prefill"].setdefault("solve_1x8k", {})[f"w{sw}"] = our_solve_us([8192], cfg)
            except Exception as e:  # noqa: BLE001
                RES["errors"][f"solve_w{sw}"] = repr(e)[:600]
            log("solve 1x8k", sw, RES["prefill"].get("solve_1x8k"))

    @section("prefill_main")
    def _():
        sv = RES["prefill"].get("solve_1x8k", {})
        solve_w = int(min(sv, key=lambda k: sv[k] or 1e9)[1:]) if sv else gdn.PrefillConfig().solve_warps
        for case, lens in PREFILL_CASES.items():
            r = RES["prefill"].setdefault(case, {})
            cfg = dataclasses.replace(pick("1x8k"), solve_warps=solve_w)
            r["config"] = cfg_name(cfg) + f"_solvew{solve_w}"
            try:
                swept = r.get("sweep", {}).get(cfg_name(cfg)) if solve_w == 4 else None
                r["ours_us"] = swept or our_prefill_us(lens, cfg)
            except Exception as e:  # noqa: BLE001
                RES["errors"][f"prefill_{case}"] = repr(e)[:600]
            if FLA:
                try:
                    r["fla"] = fla_prefill_us(lens)
                except Exception as e:  # noqa: BLE001
                    RES["errors"][f"fla_prefill_{case}"] = repr(e)[:600]
            r["floor_us"] = prefill_floor_us(sum(lens), len(lens))
            log("prefill", case, r)

    # ------------------------------------------------------------------ conv
    RES["conv"] = {}

    @section("conv")
    def _():
        key = jax.random.key(5)
        w = (0.3 * jax.random.normal(key, (4, CONV_CH))).astype(jnp.bfloat16)
        dcfgs = [(1024, 4), (2048, 8)] if ARGS.sweep else [(1024, 4)]
        for n in ((1, 8) if DRY else (1, 64, 256)):
            r = RES["conv"].setdefault(f"decode_{n}", {})
            ns = 2 if DRY else n_sets(n * CONV_CH * 16, cap=64)
            pool = jax.random.normal(key, (ns * n + 1, 3, CONV_CH), jnp.bfloat16)
            sets = [(jax.random.normal(jax.random.fold_in(key, i), (n, CONV_CH), jnp.bfloat16),
                     1 + i * n + jnp.arange(n, dtype=jnp.int32)) for i in range(ns)]
            for bc, nw in dcfgs:
                cfg = conv1d.ConvConfig(decode_bc=bc, decode_warps=nw)
                call = lambda pool, x, s, cfg=cfg: conv1d.conv_decode(x, w, pool, s, config=cfg)
                try:
                    us, pool = time_calls(call, pool, sets, r1=4, r2=44)
                    r[f"bc{bc}_w{nw}"] = us
                except Exception as e:  # noqa: BLE001
                    RES["errors"][f"conv_decode_{n}_{bc}"] = repr(e)[:600]
            r["bytes"] = n * CONV_CH * 2 * (1 + 1 + 3 + 3)
            if FLA:
                torch = FLA["torch"]
                tx = torch.randn(n, CONV_CH, device="cuda", dtype=torch.bfloat16)
                cache = torch.randn(n, CONV_CH, 4, device="cuda", dtype=torch.bfloat16)
                tw = torch.randn(CONV_CH, 4, device="cuda", dtype=torch.bfloat16)
                with torch.inference_mode():
                    r["fla_us"] = fla_graph_us(lambda: FLA["conv_update"](tx, cache, weight=tw, activation="silu"))
                r["fla_bytes"] = n * CONV_CH * 2 * (1 + 1 + 4 + 4)
            log("conv decode", n, r)
        pcfgs = [(64, 128, 4), (64, 64, 2), (32, 128, 4)] if ARGS.sweep else [(64, 128, 4)]
        for t in ((200,) if DRY else (8192, 32768)):
            r = RES["conv"].setdefault(f"prefill_{t}", {})
            x = jax.random.normal(key, (1, t, CONV_CH), jnp.bfloat16)
            for bt, bc, nw in pcfgs:
                cfg = conv1d.ConvConfig(bt=bt, bc=bc, num_warps=nw)
                call = lambda pool, x, cfg=cfg: conv1d.conv_prefill(x, w, pool, jnp.array([1]), jnp.array([t]),
                                                                    jnp.array([True]), config=cfg)
                try:
                    us, _ = time_calls(call, jax.random.normal(key, (2, 3, CONV_CH), jnp.bfloat16), [(x,)])
                    r[f"bt{bt}_bc{bc}_w{nw}"] = us
                except Exception as e:  # noqa: BLE001
                    RES["errors"][f"conv_prefill_{t}_{bt}_{bc}"] = repr(e)[:600]
            r["bytes"] = 2 * t * CONV_CH * 2
            if FLA:
                torch = FLA["torch"]
                tx = torch.randn(1, t, CONV_CH, device="cuda", dtype=torch.bfloat16)
                s0 = torch.randn(1, CONV_CH, 4, device="cuda", dtype=torch.bfloat16)
                tw = torch.randn(CONV_CH, 4, device="cuda", dtype=torch.bfloat16)
                fn = lambda: FLA["conv"](tx, weight=tw, activation="silu", initial_state=s0, output_final_state=True,
                                         backend="triton")
                with torch.inference_mode():
                    fn()
                    try:
                        r["fla_graph_us"] = fla_graph_us(fn)
                    except Exception as e:  # noqa: BLE001
                        r["fla_eager_us"] = fla_med(fn)
                        RES["errors"][f"fla_conv_graph_{t}"] = repr(e)[:300]
            log("conv prefill", t, r)

    # ------------------------------------------------------------------ whole model decode step
    @section("model_step", budget_left=60)
    def _():
        if not ARGS.model or DRY:
            return
        from qwen35_jax.config import ModelConfig
        from qwen35_jax.runner import ModelRunner, make_batch
        from qwen35_jax.sharding import make_mesh
        from qwen35_jax.weights import random_weights
        cfg = ModelConfig.from_hf(json.load(open(os.path.join(os.path.dirname(__file__), "configs",
                                                              "qwen3.5-9b.json"))))
        mesh = make_mesh(1)
        weights = random_weights(cfg, mesh, jnp.bfloat16)
        pos, page = 512, 16
        res = RES.setdefault("model_step", {})
        for n in ARGS.model_batches:
            pp = -(-(pos + 16) // page)
            logits = {}
            for backend in ("pallas", "reference"):
                if elapsed() > ARGS.deadline:
                    RES["errors"][f"model_{n}_{backend}"] = "skipped: deadline"
                    continue
                runner = ModelRunner(cfg, mesh, weights, jnp.bfloat16, num_slots=n, num_pages=1 + n * pp,
                                     page_size=page, kernel_backend=backend)
                keys = iter(jax.random.split(jax.random.key(11), 1000))
                runner.state = jax.tree.map(
                    lambda x: (0.1 * jax.random.normal(next(keys), x.shape, jnp.float32)).astype(x.dtype),
                    runner.state)
                tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (n, 1))
                pages = 1 + np.arange(n)[:, None] * pp + np.arange(pp)[None]
                batch = make_batch(tokens, [pos] * n, [1] * n, 1 + np.arange(n), pages)
                t0 = time.time()
                out = runner.run(batch)
                out.block_until_ready()
                compile_s = time.time() - t0
                logits[backend] = np.asarray(out[:, :cfg.vocab_size], np.float32)
                ts = []
                for _ in range(8):
                    t0 = time.perf_counter()
                    runner.run(batch).block_until_ready()
                    ts.append(time.perf_counter() - t0)
                res[f"{n}_{backend}"] = dict(ms=float(np.median(ts)) * 1e3, first_call_s=compile_s)
                log("model step", n, backend, res[f"{n}_{backend}"])
                del runner, out
            if len(logits) == 2:
                res[f"{n}_logit_maxdiff"] = float(np.abs(logits["pallas"] - logits["reference"]).max())
                res[f"{n}_top1_agree"] = float((logits["pallas"].argmax(-1) == logits["reference"].argmax(-1)).mean())
                log("model logits", n, res[f"{n}_logit_maxdiff"], res[f"{n}_top1_agree"])

    json.dump(RES, open(os.path.join(OUT, "results.json"), "w"), indent=1, default=str)
    md = report()
    open(os.path.join(OUT, "RESULTS_section.md"), "w").write(md)
    log(md)


# ---------------------------------------------------------------------------------------------------------------


def fmt(x, spec=".1f"):
    return "—" if x is None else format(x, spec)


def report() -> str:
    env, ceil = RES["env"], RES.get("ceilings", {})
    cp = ceil.get("copy_TBps_torch") or ceil.get("copy_TBps_jax") or float("nan")
    L = [f"## Kernel benchmark, {time.strftime('%Y-%m-%d')} (commit {env.get('commit')})", "",
         f"Machine: one {env.get('kind')} (`nvidia-h200` device machine), jax {env.get('jax')}, torch "
         f"{env.get('torch', '?')}, fla-core {env.get('fla', 'not available')} (FLA_FLASH_QLA=0 FLA_TILELANG=0).",
         f"Command: `{ARGS.command_line}`", "",
         "Timing: ours = slope of wall time over R back-to-back calls inside one jitted program (dispatch cancels; "
         "inputs/slots rotated so L2 never holds the previous call's data); fla = CUDA-graph replay of one call, "
         "`do_bench` median with L2 flushed (as shared/tools/fla_baseline.py). Same process, same GPU, one run.",
         f"Ceilings measured in this run: copy {fmt(ceil.get('copy_TBps_torch'), '.2f')} TB/s (torch), "
         f"{fmt(ceil.get('copy_TBps_jax'), '.2f')} TB/s (JAX `x*c`); bf16 matmul "
         f"{fmt(ceil.get('matmul_TFLOPs'), '.0f')} TFLOP/s.", ""]
    cpf = RES.get("correct_prefill", {})
    if cpf:
        L += ["**GPU accuracy** vs fp32 token scan (4 packed sequences 100/777/65/1, 9B heads, bf16 inputs): ",
              "| variant | o rel-L2 | state rel-L2 |", "|---|---|---|"]
        for k, v in cpf.items():
            L.append(f"| {k} | {fmt(v.get('o_rel'), '.2e')} | {fmt(v.get('state_rel'), '.2e')} |")
        L.append("")
    cd = RES.get("correct_decode_conv", {})
    if cd:
        L.append("Decode / conv on GPU: " + "; ".join(
            f"{k}: " + ", ".join(f"{kk}={vv:.2e}" if isinstance(vv, float) else f"{kk}={vv}" for kk, vv in v.items())
            for k, v in cd.items()))
        L.append("")
    L += ["**Prefill** (GDN core incl. l2norm + gates, initial state read, final state written):",
          "| case | ours µs (config) | fla µs (graph; 8x2k as B=8 x 2048) | ours/fla | floor µs | ours/floor |", "|---|---|---|---|---|---|"]
    for case in PREFILL_CASES:
        r = RES.get("prefill", {}).get(case, {})
        ours, f = r.get("ours_us"), r.get("fla", {})
        fl = f.get("graph_us")
        extra = ""
        if "varlen_eager_us" in f:
            extra = f" (as varlen, eager: {fmt(f.get('varlen_eager_us'))})"
        ratio = ours / fl if ours and fl else None
        fr = ours / r["floor_us"] if ours and r.get("floor_us") else None
        L.append(f"| {case} | {fmt(ours)} ({r.get('config')}) | {fmt(fl)}{extra} | {fmt(ratio, '.2f')} | {fmt(r.get('floor_us'))} | "
                 f"{fmt(fr, '.1f')} |")
    L.append("")
    for case in ("1x8k", "8x2k"):
        sw = RES.get("prefill", {}).get(case, {}).get("sweep")
        if sw:
            L.append(f"Sweep {case} (µs): " + ", ".join(f"{k} {fmt(v)}" for k, v in sw.items()))
    sv = RES.get("prefill", {}).get("solve_1x8k")
    if sv:
        L.append("Solve kernel alone 1x8k (µs): " + ", ".join(f"{k} {fmt(v)}" for k, v in sv.items()))
    L += ["", "**Decode** (one token per row, state read + written in place; traffic = 2 x 2 MiB per row):",
          "| batch | ours µs (best config) | ours TB/s | % of copy | fla µs (graph, v-first) | fla TB/s |",
          "|---|---|---|---|---|---|"]
    for n, r in sorted(RES.get("decode", {}).items(), key=lambda kv: int(kv[0])):
        ours = {k: v for k, v in r.items() if k.startswith("bv") and v}
        if not ours:
            continue
        best = min(ours, key=ours.get)
        us = ours[best]
        byts = int(n) * 2 * STATE_BYTES
        fl = r.get("fla_us")
        L.append(f"| {n} | {us:.1f} ({best}) | {byts / us / 1e6:.2f} | {100 * byts / us / 1e6 / cp:.0f}% | "
                 f"{fmt(fl)} | {fmt(byts / fl / 1e6 if fl else None, '.2f')} |")
    L += ["", "**Conv** (width 4, 8192 channels, bf16; decode bytes = x + y + 3-row state r/w; fla's cache has 4 rows):",
          "| case | ours µs (best) | ours TB/s | fla µs | fla TB/s |", "|---|---|---|---|---|"]
    for case, r in RES.get("conv", {}).items():
        ours = {k: v for k, v in r.items() if (k.startswith("bc") or k.startswith("bt")) and v}
        if not ours:
            continue
        best = min(ours, key=ours.get)
        us = ours[best]
        fl = r.get("fla_us") or r.get("fla_graph_us") or r.get("fla_eager_us")
        fb = r.get("fla_bytes", r.get("bytes"))
        L.append(f"| {case} | {us:.1f} ({best}) | {r['bytes'] / us / 1e6:.2f} | {fmt(fl)} | "
                 f"{fmt(fb / fl / 1e6 if fl else None, '.2f')} |")
    ms = RES.get("model_step")
    if ms:
        L += ["", "**Whole 9B-shaped model, one decode step** (random weights, bf16, tp=1, position 512, wall time "
              "per jitted step incl. dispatch, median of 8):", "| batch | pallas ms | reference ms | speed-up | "
              "max abs dlogit | top-1 agree |", "|---|---|---|---|---|---|"]
        for n in ARGS.model_batches:
            p, r = ms.get(f"{n}_pallas", {}).get("ms"), ms.get(f"{n}_reference", {}).get("ms")
            L.append(f"| {n} | {fmt(p, '.2f')} | {fmt(r, '.2f')} | {fmt(r / p if p and r else None, '.2f')} | "
                     f"{fmt(ms.get(f'{n}_logit_maxdiff'), '.3f')} | {fmt(ms.get(f'{n}_top1_agree'), '.2f')} |")
    if RES["errors"]:
        L += ["", "Errors / skipped: " + "; ".join(f"{k}: {v}" for k, v in RES["errors"].items())]
    return "\n".join(L) + "\n"


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true", help="time several launch configurations")
    ap.add_argument("--model", action="store_true", help="time the whole 9B-shaped model's decode step")
    ap.add_argument("--model-batches", type=int, nargs="+", default=[64, 1])
    ap.add_argument("--deadline", type=float, default=480.0, help="seconds after which sections are skipped")
    ARGS = ap.parse_args()
    ARGS.command_line = os.environ.get("BENCH_COMMAND", "python3 bench/kernels.py " + " ".join(sys.argv[1:]))
    main()
