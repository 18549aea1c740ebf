"""GDN / conv kernel benchmark on the GPU: our Pallas kernels (old and new variants) and fla-core 0.6.0 side by side.

One invocation, under a hard time limit (`--time-limit`, checked before every section and sweep point, so it ends
cleanly and records what it got), from the repo root on the GPU machine:

  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/fla_core-0.6.0-py3-none-any.whl
  PYTHONPATH=/tmp/site:$PWD FLA_FLASH_QLA=0 FLA_TILELANG=0 QWEN35_COMMIT=<sha> python3 bench/kernels.py \
      --time-limit 240

(the fla-core wheel is the ignored .whl/ folder, carried to the GPU machine; bench/gpu_session.sh runs the same
line with its own limit). 240 s covers the checks of the defaults, the headline numbers and the model step at
batch 64; about 600 s covers every section. Give the outside timeout ~60 s more than --time-limit: a compile that
starts just before the limit still finishes.

Order (most valuable first; the model step has a reserved slice of the time, `--model-reserve`, so it always runs):
 1. ceilings (copy bandwidth, bf16 matmul rate) and fla import;
 2. GPU correctness of the defaults and the candidate (bench/kernel_sweeps.CANDIDATE_PREFILL) against the references
    (prefill:
    fp32 token scan, 4 packed sequences 100/777/65/1 (8-row-aligned starts) with random initial states, one fresh;
    decode: 8 rows, 2 on the null slot);
 3. headline: prefill 1x8k and decode batch 1 / 256 for the defaults, the candidate prefill, the previous decode
    and fla;
 4. the other cases with the defaults, the candidate and fla: prefill 1x1k, 1x32k, 8x2k packed; decode 8, 32, 128;
 5. GPU correctness of every other variant (prefill, decode, conv);
 6. prefill sweep at 1x8k: each WY scan configuration on its own (prep outputs precomputed), each prep variant on
    its own; then the best WY combination (fastest scan + fastest prep) on every prefill case;
 7. decode sweep: every valid configuration at batch 1, 8, 32, 128, 256;
 8. conv decode / prefill sweeps and fla;
 9. the whole 9B-shaped model's decode step with the `pallas` and `reference` backends (batch 64, then 1).
No variant is timed before it passed its check: failing one of the bars (prefill o <= 4e-3 and state <= 3e-3
rel-L2, decode state <= 1e-5, untouched slots bit-identical, finite outputs; conv bit-exact) or failing to compile
is reported in the results and excludes it from timing.
Writes $OUT/results.json, $OUT/log.txt, $OUT/RESULTS_section.md, records the run through bench/results.py (a JSON
file under bench/runs/, copied to $OUT, and its section appended to bench/runs/history.md); prints a short summary
table last.

Shapes: Qwen3.5-9B GDN (Hk 16, Hv 32, dk = dv = 128, conv channels 8192), bf16 activations, fp32 state, random
realistic inputs (raw q/k, normal a/b projections, A_log = log U(1, 16), random initial states).

GPU time, host dispatch excluded:
- ours: one compiled program runs R rounds (a static loop count: no host round trip per round) of back-to-back calls
  over rotating input sets / slot groups (so the 50 MB L2 never holds the previous call's data); the state pool is
  threaded through and updated in place. The program is dispatched k1 and k2 times back to back; time per call =
  slope of wall time (dispatch and sync cancel). (Runs before commit 4e2b9a5 used a dynamic round count, which
  XLA:GPU runs with a host round trip per round: a small upward bias, visible only for the tiniest calls.) The
  compiled HLO is checked for a copy of the carried pool; if XLA inserted one, the unrolled two-program method is
  used instead (noted in the results).
- fla: (a) one call captured in a CUDA graph, `triton.testing.do_bench` median of replays with L2 flushed between
  replays (as shared/tools/fla_baseline.py, comparable to earlier runs); (b) for decode also R calls back to back in
  one CUDA graph over rotating inputs, time / R (the same method as ours).
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import re
import shutil
import sys
import time
import traceback

os.environ.setdefault("FLA_FLASH_QLA", "0")
os.environ.setdefault("FLA_TILELANG", "0")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench import results as results_md  # noqa: E402
from bench import kernel_sweeps as ks  # noqa: E402
from bench.timing import traced_events  # noqa: E402
from pallas_kernels import conv1d, conv1d_reference, gdn, gdn_reference  # noqa: E402

results_md.machine = functools.lru_cache(maxsize=None)(results_md.machine)   # nvidia-smi once, not per save
results_md.commit = functools.lru_cache(maxsize=None)(results_md.commit)

OUT = os.environ.get("OUT", "/tmp/bench_out")
os.makedirs(OUT, exist_ok=True)
DRY = os.environ.get("BENCH_DRY") == "1"     # CPU smoke test of this script: tiny shapes, interpret-mode kernels
HK, HV, DK, DV, CONV_CH = (2, 4, 16, 32, 96) if DRY else (16, 32, 128, 128, 8192)
CONV_W = CONV_CH + HV * DV + 2 * HV         # the in_proj output the model's conv reads its channels from (9B: 12352)
CONV_SPLIT = (CONV_CH // 4, CONV_CH // 2)    # the model's q | k | v channel offsets (9B: 2048, 4096)
CONV_MODEL_FORM = ("bt64_bc128_w8", "bt32_bc128_w4", "bt32_bc128_w8", "bt16_bc128_w8", "bt16_bc64_w4")
STATE_BYTES = HV * DV * DK * 4
TITLE = "GDN / conv kernels vs fla (issue 3)"
T_START = time.time()
RES: dict = {"errors": {}, "skipped": [], "notes": []}
LOG = open(os.path.join(OUT, "log.txt"), "a")
ARGS = None
PREFILL_BARS = (4e-3, 3e-3)
DECODE_STATE_BAR = 1e-5


def log(*a):
    s = " ".join(str(x) for x in a)
    print(s, flush=True)
    LOG.write(s + "\n")
    LOG.flush()


def elapsed():
    return time.time() - T_START


def model_pending():
    return ARGS.model and "model_step_done" not in RES and (not ARGS.only or "model_step" in ARGS.only)


def time_left(reserve_model=True):
    """Seconds left for the current work; the model step's reserved slice is held back while it has not run."""
    left = ARGS.time_limit - elapsed()
    if reserve_model and model_pending():
        left -= ARGS.model_reserve
    return left


def have_time(what, need=5.0, reserve_model=True):
    if time_left(reserve_model) >= need:
        return True
    RES["skipped"].append(what)
    log(f"[skip] {what} (time limit: {elapsed():.0f}s elapsed)")
    return False


def save():
    """Results so far: $OUT/results.json, $OUT/RESULTS_section.md and (unless --no-record) the run recorded under
    bench/runs/, after every section and sweep point, so a run cut off from outside still leaves them."""
    json.dump(RES, open(os.path.join(OUT, "results.json"), "w"), indent=1, default=str)
    try:
        md = report()
        open(os.path.join(OUT, "RESULTS_section.md"), "w").write(md)
        if not ARGS.no_record:
            record(md, quiet=True)
    except Exception as e:  # noqa: BLE001
        log("report failed", repr(e))
        traceback.print_exc()


def section(name, need=10.0, reserve_model=True):
    """Run a section; record its error instead of dying; skip it when the time is up."""
    def deco(fn):
        if ARGS.only and name not in ARGS.only + ["fla_import", "ceilings"]:
            RES["skipped"].append(f"section {name} (--only)")
            return fn
        if not have_time(f"section {name}", need, reserve_model):
            return fn
        t0 = time.time()
        try:
            fn()
        except Exception as e:  # noqa: BLE001
            RES["errors"][name] = repr(e)[:800]
            log(f"[{name}] ERROR {e!r}"[:2000])
            traceback.print_exc()
        log(f"[{name}] {time.time() - t0:.1f}s (total {elapsed():.0f}s)")
        save()
        return fn
    return deco


def rel(x, y):
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    return float(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30))


def kernel_kw():
    return {"interpret": True} if DRY else {}


# ---------------------------------------------------------------------------------------------------------------
# Timing of our kernels.


def _pool_copies(hlo_text, carry):
    """Number of HLO copies whose result has the carried pool's shape (there should be none)."""
    leaves = jax.tree.leaves(carry)
    big = max(leaves, key=lambda x: x.size)
    dt = {jnp.dtype(jnp.float32): "f32", jnp.dtype(jnp.bfloat16): "bf16"}.get(jnp.dtype(big.dtype), str(big.dtype))
    shape = f"{dt}[{','.join(str(d) for d in big.shape)}]"
    return len(re.findall(re.escape(shape) + r"\{[^}]*\} copy(-start)?\(", hlo_text))


def time_calls(call, carry, sets, calls=(4, 24), reps=5):
    """call(carry, *set) -> carry. Returns (us per call, carry). One compiled program makes R rounds (a round = one
    call per set) in a loop with a static trip count, which XLA:GPU runs without a host round trip (a loop bound
    read from the data would copy the predicate to the host and block on the stream every round); it is
    dispatched k1 and k2 times back to back, and the time per call is the slope (dispatch and sync cancel)."""
    ns = len(sets)
    rounds = max(1, -(-calls[0] // ns))
    k1, k2 = 1, max(2, -(-calls[1] // (rounds * ns)))
    if DRY:
        k1, k2, reps = 1, 2, 1

    def prog(carry, sets):
        def body(_, c):
            for s in sets:
                c = call(c, *s)
            return c
        return jax.lax.fori_loop(0, rounds, body, carry)

    t0 = time.perf_counter()
    compiled = jax.jit(prog, donate_argnums=0).lower(carry, sets).compile()
    copies = 0 if DRY else _pool_copies(compiled.as_text(), carry)
    if copies:
        RES["notes"].append(f"timing loop had {copies} pool copies: used the unrolled method")
        return time_calls_unrolled(call, carry, sets, calls, reps)
    RES.setdefault("compile_s", []).append(round(time.perf_counter() - t0, 2))
    carry = compiled(carry, sets)                                      # warm up
    jax.block_until_ready(carry)
    meds = {}
    for k in (k1, k2):
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            for _ in range(k):
                carry = compiled(carry, sets)
            jax.block_until_ready(carry)
            ts.append(time.perf_counter() - t0)
        meds[k] = float(np.median(ts))
    return (meds[k2] - meds[k1]) / ((k2 - k1) * rounds * ns) * 1e6, carry


def time_calls_unrolled(call, carry, sets, calls=(4, 24), reps=5):
    """Fallback: two programs of R1 and R2 unrolled calls; slope."""
    meds = {}
    for r in calls:
        def prog(carry, sets, r=r):
            for i in range(r):
                carry = call(carry, *sets[i % len(sets)])
            return carry
        f = jax.jit(prog, donate_argnums=0)
        carry = f(carry, sets)
        jax.block_until_ready(carry)
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            carry = f(carry, sets)
            jax.block_until_ready(carry)
            ts.append(time.perf_counter() - t0)
        meds[r] = float(np.median(ts))
    return (meds[calls[1]] - meds[calls[0]]) / (calls[1] - calls[0]) * 1e6, carry


def n_sets(set_bytes, target=256 << 20, cap=8):
    return 2 if DRY else int(min(cap, max(1, math.ceil(target / max(set_bytes, 1)))))


# ---------------------------------------------------------------------------------------------------------------
# Inputs.


def gdn_inputs(key, total):
    ks = jax.random.split(key, 5)
    bf = jnp.bfloat16
    return (jax.random.normal(ks[0], (total, HK, DK), bf), jax.random.normal(ks[1], (total, HK, DK), bf),
            jax.random.normal(ks[2], (total, HV, DV), bf), jax.random.normal(ks[3], (total, HV), bf),
            jax.random.normal(ks[4], (total, HV), bf))


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


def fla_med(fn, rep=100):
    return FLA["do_bench"](fn, warmup=10, rep=rep, quantiles=[0.5, 0.2, 0.8])[0] * 1e3


def fla_graph(fns):
    """One CUDA graph holding the calls fns (captured after a warm-up on a side stream)."""
    torch = FLA["torch"]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            for fn in fns:
                fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for fn in fns:
            fn()
    torch.cuda.synchronize()
    return g


def fla_graph_us(fn, rep=100):
    """(a) one call per graph, do_bench median with L2 flushed between replays."""
    return fla_med(fla_graph([fn]).replay, rep)


def fla_b2b_us(fns, reps=20):
    """(b) len(fns) calls back to back in one graph (rotating inputs): time per call, as our slope method."""
    torch = FLA["torch"]
    g = fla_graph(fns)
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / len(fns))
    return float(np.median(ts))


def fla_free():
    if FLA:
        FLA["torch"].cuda.empty_cache()


# ---------------------------------------------------------------------------------------------------------------
# Prefill.

PREFILL_CASES = ({"1x1k": [100], "1x8k": [130], "1x32k": [200], "8x2k": [70] * 3} if DRY else
                 {"1x1k": [1024], "1x8k": [8192], "1x32k": [32768], "8x2k": [2048] * 8})
SWEEP_CASE = "1x8k"


def prefill_floor_us(tokens, n_seq):
    """docs/kernels.md: max(FLOP floor at the measured bf16 matmul rate, byte floor at the copy rate)."""
    flops = 183e3 * HV * tokens
    byts = 24.3 * 1024 * tokens + 2 * STATE_BYTES * n_seq
    mm = RES["ceilings"].get("matmul_TFLOPs") or 790.0
    cp = RES["ceilings"].get("copy_TBps_torch") or RES["ceilings"].get("copy_TBps_jax") or 4.25
    return max(flops / (mm * 1e12), byts / (cp * 1e12)) * 1e6


class PrefillProblem:
    """Packed sequences `lens`, ns rotating input sets and slot groups, everything on the device."""

    def __init__(self, lens, key=jax.random.key(7)):
        self.lens = list(lens)
        self.total, self.n = sum(lens), len(lens)
        self.starts = jnp.array(np.cumsum([0] + self.lens[:-1]), jnp.int32)
        self.lens_a = jnp.array(self.lens, jnp.int32)
        self.use = jnp.ones(self.n, bool)
        self.A_log, self.dt_bias = gates_params(jax.random.fold_in(key, 99))
        set_bytes = self.total * (2 * HK * DK * 2 + HV * DV * 2 * 2)
        self.ns = n_sets(set_bytes)
        self.key = key
        self.sets = [(*gdn_inputs(jax.random.fold_in(key, i), self.total),
                      1 + i * self.n + jnp.arange(self.n, dtype=jnp.int32)) for i in range(self.ns)]
        self.mc = -(-self.total // gdn.CHUNK) + self.n
        self.aligned = all(x % 8 == 0 for x in np.cumsum([0] + self.lens[:-1]))   # (the Mosaic GPU scan's need)

    def pool(self):
        return rand_pool(self.key, self.ns * self.n + 1)

    def carry(self):
        """(state pool, a scalar that every call's output feeds: no kernel of the call is dead code)."""
        return self.pool(), jnp.zeros((1,), jnp.float32)

    def args(self, st, pool, dt_bias=None):
        """gdn_prefill_packed's arguments for input set st (q, k, v, a, b, slots) and a state pool (dt_bias: in place
        of the problem's)."""
        return (*st[:5], self.A_log, self.dt_bias if dt_bias is None else dt_bias, pool, self.starts, self.lens_a,
                st[5], self.use)

    def prefill(self, config, **jit_kw):
        """gdn_prefill_packed on this problem's sequences under config, jitted (jit_kw: e.g. donate_argnums=7)."""
        return jax.jit(functools.partial(gdn.gdn_prefill_packed, config=config, starts_aligned=self.aligned,
                                         **kernel_kw()), **jit_kw)

    def full_us(self, config):
        def call(c, *st):
            # every kernel of a call waits for the previous call's output, as a model's layers do: the prep kernels
            # read no state, and without the link (dt_bias + 0 x the last output) a command buffer may run them
            # beside the previous call's scan, which a single call (and fla's one-call graph) never does
            o, pool = gdn.gdn_prefill_packed(*self.args(st, c[0], dt_bias=self.dt_bias + 0.0 * c[1]), config=config,
                                             starts_aligned=self.aligned, **kernel_kw())
            # the barrier makes every row of o be computed: without it XLA fuses the slice below into the XLA ops
            # that form o (the Mosaic scan's chunk-tile gather), which then compute one row (the figures of
            # mgpu_out="chunks" timed up to c257dc4 left the gather out: 45 us at 1x8k, 91 at 8x2k)
            o = jax.lax.optimization_barrier(o)
            return pool, c[1] + o[0, 0, :1].astype(jnp.float32)
        # at ~100 us per call, (2, 10) calls left a slope over one extra dispatch of a few calls, under the host's
        # jitter: 1x1k read 64-98 us for one configuration in one session (2026-12-03)
        calls = (2, 6) if self.total >= 32768 else (2, 10) if self.total >= 4096 else (16, 160)
        us, _ = time_calls(call, self.carry(), self.sets, calls=calls)
        return us

    def outputs(self, config):
        """(o, the sequences' final states) of one call on the first input set, from the first pool."""
        o, pool = self.prefill(config)(*self.args(self.sets[0], self.pool()))
        return o, pool[self.sets[0][5]]

    def device_us(self, config):
        """Device time per call: every kernel event of one call per input set under the profiler, summed (XLA's
        glue included, no host launch in it: the slope reads the host's pace where a call is a few tens of µs)."""
        run = self.prefill(config, donate_argnums=7)
        pool = jax.block_until_ready(run(*self.args(self.sets[0], self.pool()))[1])       # compile, warm up

        def calls():
            nonlocal pool
            outs = []
            for st in self.sets:
                o, pool = run(*self.args(st, pool))
                outs.append(o)
            return outs, pool
        return device_total_us(calls, len(self.sets), lambda *a: jax.block_until_ready(a))

    def reference(self):
        """(o, the sequences' final states) of the fp32 token scan (gdn_reference) on the first input set, from the
        first pool: what outputs() returns, exact."""
        q, k, v, a, b, slots = self.sets[0]
        tmax = max(self.lens)
        padded = [jnp.stack([jnp.pad(x[s0:s0 + ln].astype(jnp.float32), [(0, tmax - ln)] + [(0, 0)] * (x.ndim - 1))
                             for s0, ln in zip(np.asarray(self.starts).tolist(), self.lens)]) for x in (q, k, v, a, b)]
        o, pool = jax.jit(functools.partial(gdn_reference.gdn_prefill, method="scan"))(
            *padded, self.A_log, self.dt_bias, self.pool(), slots, self.lens_a, self.use)
        return jnp.concatenate([o[i, :ln] for i, ln in enumerate(self.lens)]), pool[slots]


def fla_prefill(lens):
    torch, F = FLA["torch"], FLA["F"]
    total, n = sum(lens), len(lens)
    g = torch.Generator(device="cuda").manual_seed(3)
    dev = "cuda"
    B, T = (n, lens[0]) if len(set(lens)) == 1 else (1, total)
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
        try:
            out["device_us"] = device_total_us(lambda: [fn() for _ in range(4)], 4,
                                               lambda *_: torch.cuda.synchronize())
        except Exception as e:  # noqa: BLE001    (the graph figure stands without it)
            RES["errors"]["fla prefill device time"] = repr(e)[:400]
        if n > 1 and time_left() > 20:   # the same tokens as a packed varlen batch (what a server runs)
            qv, kv, vv = (x.reshape(1, total, *x.shape[2:]) for x in (q, k, v))
            gv, bv = gg.reshape(1, total, HV), beta.reshape(1, total, HV)
            cu = torch.tensor(np.cumsum([0] + lens), device=dev, dtype=torch.long)
            fv = lambda: FLA["chunk"](qv, kv, vv, gv, bv, initial_state=h0, output_final_state=True,
                                      use_qk_l2norm_in_kernel=True, state_v_first=True, cu_seqlens=cu)
            fv()
            out["varlen_eager_us"] = fla_med(fv)      # host-synchronising chunk indexing: not graph-capturable
    q = k = v = gg = beta = h0 = None       # the lambdas' cells hold the tensors: release them before fla_free
    fla_free()
    return out


# ---------------------------------------------------------------------------------------------------------------
# Decode.

DECODE_BATCHES = (1, 8) if DRY else (1, 8, 32, 128, 256)      # --decode-batches overrides


class DecodeProblem:
    def __init__(self, n, key=jax.random.key(4)):
        self.n = n
        self.A_log, self.dt_bias = gates_params(key)
        self.ns = n_sets(n * 2 * STATE_BYTES, target=512 << 20, cap=64)
        self.key = key
        self.sets = []
        for i in range(self.ns):
            q, k, v, a, b = (x[:n] for x in gdn_inputs(jax.random.fold_in(key, i), n))
            self.sets.append((q, k, v, a, b, 1 + i * n + jnp.arange(n, dtype=jnp.int32)))

    def call(self, config):
        def call(pool, q, k, v, a, b, s):
            return gdn.gdn_decode(q, k, v, a, b, self.A_log, self.dt_bias, pool, s, config=config, **kernel_kw())[1]
        return call

    def us(self, config):
        us, _ = time_calls(self.call(config), rand_pool(self.key, self.ns * self.n + 1), self.sets, calls=(8, 72))
        return us

    def kernel_us(self, config):
        """Median device time of the decode kernel itself (the profiler's kernel events over one call per input
        set): the GPU time with no launch in it, which the slope cannot give for a few-µs kernel when the host
        launches each call of the loop (batch 1 read 4.0 to 14.1 µs by the slope in runs of the same kernel)."""
        call = self.call(config)
        step = jax.jit(lambda pool, sets: functools.reduce(lambda c, st: call(c, *st), sets, pool), donate_argnums=0)
        pool = jax.block_until_ready(step(rand_pool(self.key, self.ns * self.n + 1), self.sets))   # compile, warm up
        return device_kernel_us(lambda: step(pool, self.sets), "gdn_decode", lambda *a: jax.block_until_ready(a))


def fla_decode(n, A_log, dt_bias):
    torch = FLA["torch"]
    ns = max(2, min(16, (1 << 30) // (n * 2 * STATE_BYTES)))       # rotating inputs for the back-to-back graph
    sets = []
    for _ in range(ns):
        sets.append(dict(q=torch.randn(n, 1, HK, DK, device="cuda", dtype=torch.bfloat16),
                         k=torch.randn(n, 1, HK, DK, device="cuda", dtype=torch.bfloat16),
                         v=torch.randn(n, 1, HV, DV, device="cuda", dtype=torch.bfloat16),
                         g=torch.randn(n, 1, HV, device="cuda", dtype=torch.bfloat16),
                         beta=torch.randn(n, 1, HV, device="cuda", dtype=torch.bfloat16),
                         h0=0.1 * torch.randn(n, HV, DV, DK, device="cuda")))
    tal = torch.from_numpy(np.asarray(A_log)).cuda()
    tdb = torch.from_numpy(np.asarray(dt_bias)).cuda()

    def make(s):
        return lambda: FLA["recur"](s["q"], s["k"], s["v"], g=s["g"], beta=s["beta"], initial_state=s["h0"],
                                    output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                    A_log=tal, dt_bias=tdb, use_beta_sigmoid_in_kernel=True, state_v_first=True)
    out = {}
    with torch.inference_mode():
        out["graph_us"] = fla_graph_us(make(sets[0]))
        fns = [make(sets[i % ns]) for i in range(max(ns, 16))]
        out["b2b_us"] = fla_b2b_us(fns)
        if n <= 8:              # the kernel's own device time, as ours (CUPTI sees torch's kernels too)
            out["kernel_us"] = device_kernel_us(lambda: [f() for f in fns], "fused_recurrent",
                                                lambda *_: torch.cuda.synchronize())
    del sets
    fla_free()
    return out


def device_total_us(run, calls, sync):
    """Device time per call (µs): all kernel events of run() (`calls` calls) summed, or None where there are none."""
    events = traced_events(run, sync)
    return sum(e.dur_ns for e in events) / 1e3 / calls if events else None


def device_kernel_us(run, name, sync):
    """Median device time (µs) of the kernels whose name holds `name` while run() runs, or None where there are
    none."""
    durs = [e.dur_ns for e in traced_events(run, sync) if name in e.name]
    return float(np.median(durs)) / 1e3 if durs else None


# ---------------------------------------------------------------------------------------------------------------


def main():
    dev = jax.devices()[0]
    RES["env"] = dict(jax=jax.__version__, device=str(dev), kind=dev.device_kind, commit=results_md.commit(),
                      host=platform.node(), python=platform.python_version(), command=ARGS.command_line,
                      time_limit=ARGS.time_limit)
    RES["ceilings"] = {}
    log("env", RES["env"])

    @section("fla_import", need=5)
    def _():
        if DRY:
            raise RuntimeError("dry run (CPU): no fla")
        fla_setup()

    @section("ceilings", need=10)
    def _():
        x = jax.random.normal(jax.random.key(0), (1 << (16 if DRY else 29),), jnp.float32)       # 2 GiB
        f = jax.jit(lambda x: x * 1.0001)
        y = f(x)
        y.block_until_ready()
        ts = []
        for _ in range(10):
            t0 = time.perf_counter()
            y = f(x)
            y.block_until_ready()
            ts.append(time.perf_counter() - t0)
        RES["ceilings"]["copy_TBps_jax"] = 2 * x.nbytes / np.median(ts) / 1e12
        del x, y
        if FLA:
            torch = FLA["torch"]
            a = torch.empty(1 << 30, device="cuda", dtype=torch.bfloat16).normal_()
            b = torch.empty_like(a)
            ms = FLA["do_bench"](lambda: b.copy_(a), warmup=10, rep=50, quantiles=[0.5, 0.2, 0.8])[0]
            RES["ceilings"]["copy_TBps_torch"] = 2 * a.numel() * 2 / (ms * 1e-3) / 1e12
            m = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
            ms = FLA["do_bench"](lambda: m @ m, warmup=10, rep=50, quantiles=[0.5, 0.2, 0.8])[0]
            RES["ceilings"]["matmul_TFLOPs"] = 2 * 8192 ** 3 / (ms * 1e-3) / 1e12
            del a, b, m
            fla_free()
        log("ceilings", RES["ceilings"])

    # ------------------------------------------------------------------ correctness of every variant
    prefill_variants = {c.name: c for c in [ks.CANDIDATE_PREFILL] + ks.prefill_sweep()}
    decode_variants = {c.name: c for c in ks.decode_sweep()}
    RES["valid"] = {"prefill": [], "decode": [], "conv_prefill": [], "conv_decode": []}

    RES["correct_prefill"], RES["correct_decode_conv"] = {}, {}
    CHECK = {}

    def prefill_checker():
        """The reference (fp32 token scan) of the prefill check problem, computed once."""
        if "prefill" in CHECK:
            return CHECK["prefill"]
        key = jax.random.key(1)
        lens = [100, 777, 65, 1] if not DRY else [40, 77, 65, 1]
        ends = np.cumsum(-(-np.array(lens) // 8) * 8)       # starts on 8-row boundaries (the Mosaic GPU scan's need)
        total = int(ends[-1])
        starts = jnp.array(np.concatenate([[0], ends[:-1]]), jnp.int32)
        q, k, v, a, b = gdn_inputs(key, total)
        A_log, dt_bias = gates_params(jax.random.fold_in(key, 5))
        pool = rand_pool(jax.random.fold_in(key, 6), 8)
        slots = jnp.array([5, 2, 7, 3], jnp.int32)
        use = jnp.array([True, True, False, True])
        tmax = max(lens)
        padded = [jnp.stack([jnp.pad(x[int(s0):int(s0) + ln].astype(jnp.float32),
                                     [(0, tmax - ln)] + [(0, 0)] * (x.ndim - 1))
                             for s0, ln in zip(np.asarray(starts), lens)]) for x in (q, k, v, a, b)]
        o_r, p_r = jax.jit(functools.partial(gdn_reference.gdn_prefill, method="scan"))(
            *padded, A_log, dt_bias, pool, slots, jnp.array(lens), use)
        CHECK["prefill"] = dict(
            lens=lens, q=q, k=k, v=v, a=a, b=b, A_log=A_log, dt_bias=dt_bias, pool=pool, slots=slots, use=use,
            ref_o=np.concatenate([np.asarray(o_r[i, :ln]) for i, ln in enumerate(lens)]),
            ref_s=np.stack([np.asarray(p_r[slots[i]]) for i in range(len(lens))]),
            rows=np.concatenate([np.arange(int(s0), int(s0) + ln) for s0, ln in zip(np.asarray(starts), lens)]),
            args=(q, k, v, a, b, A_log, dt_bias, pool, starts, jnp.array(lens), slots, use))
        return CHECK["prefill"]

    def check_prefill(variants):
        """GPU correctness of prefill variants (all in one program; one by one if that fails); updates
        RES["valid"]["prefill"]. A variant that fails is reported and never timed."""
        ck = prefill_checker()
        out = RES["correct_prefill"]
        untouched = jnp.array([0, 1, 4, 6])

        def check(name, o, p):
            o = np.asarray(o.astype(jnp.float32))
            r = dict(o_rel=rel(o[ck["rows"]], ck["ref_o"]), state_rel=rel(np.asarray(p[ck["slots"]]), ck["ref_s"]),
                     untouched_ok=bool(np.array_equal(np.asarray(p[untouched]), np.asarray(ck["pool"][untouched]))),
                     finite=bool(np.isfinite(o[ck["rows"]]).all()))
            r["ok"] = (r["o_rel"] <= PREFILL_BARS[0] and r["state_rel"] <= PREFILL_BARS[1] and r["untouched_ok"]
                       and r["finite"])
            out[name] = r
            log("prefill correctness", name, r)

        run = lambda cfg, *x: gdn.gdn_prefill_packed(*x, config=cfg, starts_aligned=True, **kernel_kw())

        def run_all(*x):
            """Every variant in one program."""
            return {nm: run(c, *x) for nm, c in variants.items()}

        try:   # all variants in one program
            outs = jax.jit(run_all)(*ck["args"])
            for nm, (o, p) in outs.items():
                check(nm, o, p)
        except Exception as e:  # noqa: BLE001
            log("combined prefill check failed, checking one by one:", repr(e)[:400])
            for nm, c in variants.items():
                if not have_time(f"correct_prefill {nm}", 8):
                    break
                try:
                    check(nm, *jax.jit(functools.partial(run, c))(*ck["args"]))
                except Exception as e2:  # noqa: BLE001
                    out[nm] = dict(ok=False, error=repr(e2)[:600])
                    log("prefill correctness", nm, "ERROR", repr(e2)[:600])
        for nm in variants:
            if out.get(nm, {}).get("ok"):
                RES["valid"]["prefill"].append(nm)
            else:
                RES["errors"][f"prefill variant {nm}"] = "failed or not checked: excluded from timing"

    def check_fla_prefill():
        ck = prefill_checker()
        torch = FLA["torch"]
        rows = ck["rows"]                                   # the sequences' rows, contiguous for fla's cu_seqlens
        tq, tk, tv = (torch.from_numpy(np.asarray(x[rows].astype(jnp.float32))).cuda().to(torch.bfloat16)[None]
                      for x in (ck["q"], ck["k"], ck["v"]))
        g_, beta_ = gdn_reference.gates(ck["a"][rows], ck["b"][rows], ck["A_log"], ck["dt_bias"])
        tg, tb = (torch.from_numpy(np.asarray(x)).cuda()[None] for x in (g_, beta_))
        h0 = torch.from_numpy(np.asarray(jnp.where(ck["use"][:, None, None, None], ck["pool"][ck["slots"]], 0))).cuda()
        cu = torch.tensor(np.cumsum([0] + ck["lens"]), device="cuda", dtype=torch.long)
        with torch.inference_mode():
            fo, fs = FLA["chunk"](tq, tk, tv, tg, tb, initial_state=h0, output_final_state=True,
                                  use_qk_l2norm_in_kernel=True, state_v_first=True, cu_seqlens=cu)
        fo = fo[0].float().cpu().numpy()
        RES["correct_prefill"]["fla"] = dict(o_rel=rel(fo, ck["ref_o"]),
                                             state_rel=rel(fs.cpu().numpy(), ck["ref_s"]))
        log("prefill correctness fla", RES["correct_prefill"]["fla"])

    def decode_checker():
        if "decode" in CHECK:
            return CHECK["decode"]
        key = jax.random.key(2)
        q, k, v, a, b = (x[:8] for x in gdn_inputs(key, 8))
        A_log, dt_bias = gates_params(key)
        pool = rand_pool(jax.random.fold_in(key, 1), 12)
        slots = jnp.array([3, 0, 7, 1, 0, 11, 5, 9], jnp.int32)
        o_r, p_r = gdn_reference.gdn_decode(q, k, v, a, b, A_log, dt_bias, pool, slots)
        CHECK["decode"] = dict(pool=pool, slots=slots, o_r=o_r, p_r=p_r, args=(q, k, v, a, b, A_log, dt_bias, pool,
                                                                               slots))
        return CHECK["decode"]

    def check_decode(variants):
        ck = decode_checker()
        out = RES["correct_decode_conv"]
        live = np.array([0, 2, 3, 5, 6, 7])
        untouched = jnp.array([2, 4, 6, 8, 10])
        slots, pool = ck["slots"], ck["pool"]

        def check(name, o, p):
            r = dict(state_rel=rel(p[slots[live]], ck["p_r"][slots[live]]),
                     o_rel=rel(np.asarray(o[live], np.float32), np.asarray(ck["o_r"][live], np.float32)),
                     untouched_ok=bool(np.array_equal(np.asarray(p[untouched]), np.asarray(pool[untouched]))))
            r["ok"] = r["state_rel"] <= DECODE_STATE_BAR and r["o_rel"] <= 1e-2 and r["untouched_ok"]
            out[name] = r
            log("decode correctness", name, r)

        run = lambda c, *x: gdn.gdn_decode(*x, config=c, **kernel_kw())
        try:
            for nm, (o, p) in jax.jit(lambda *x: {nm: run(c, *x) for nm, c in variants.items()})(*ck["args"]).items():
                check(nm, o, p)
        except Exception as e:  # noqa: BLE001
            log("combined decode check failed, checking one by one:", repr(e)[:400])
            for nm, c in variants.items():
                try:
                    check(nm, *jax.jit(functools.partial(run, c))(*ck["args"]))
                except Exception as e2:  # noqa: BLE001
                    out[nm] = dict(ok=False, error=repr(e2)[:600])
        for nm in variants:
            if out.get(nm, {}).get("ok"):
                RES["valid"]["decode"].append(nm)
            else:
                RES["errors"][f"decode variant {nm}"] = "failed: excluded from timing"

    def check_conv():
        key = jax.random.key(2)
        out = RES["correct_decode_conv"]
        x = jax.random.normal(key, (3, 300, CONV_CH), jnp.bfloat16)
        w = (0.3 * jax.random.normal(jax.random.fold_in(key, 2), (4, CONV_CH))).astype(jnp.bfloat16)
        cpool = jax.random.normal(jax.random.fold_in(key, 3), (6, 3, CONV_CH), jnp.bfloat16)
        cs, cl, cu = jnp.array([4, 1, 2]), jnp.array([300, 2, 130]), jnp.array([True, True, False])
        y_r, p_r = conv1d_reference.conv_prefill(x, w, cpool, cs, cl, cu)
        yd_r, pd_r = conv1d_reference.conv_decode(x[:, 0], w, cpool, jnp.array([4, 0, 2]))
        for c in ks.conv_prefill_sweep():
            nm = f"conv_prefill_{c.prefill_name}"
            try:
                y, p = jax.jit(functools.partial(conv1d.conv_prefill, config=c, **kernel_kw()))(x, w, cpool, cs, cl,
                                                                                               cu)
                ok = (np.array_equal(np.asarray(y, np.float32), np.asarray(y_r, np.float32))
                      and np.array_equal(np.asarray(p, np.float32), np.asarray(p_r, np.float32)))
                out[nm] = dict(ok=bool(ok))
            except Exception as e:  # noqa: BLE001
                out[nm] = dict(ok=False, error=repr(e)[:400])
            if out[nm]["ok"]:
                RES["valid"]["conv_prefill"].append(nm)
        # the model's call: the channels read in place from a wider input, q | k | v written as arrays of their own
        xw = jnp.concatenate([x, jnp.full((*x.shape[:-1], CONV_W - CONV_CH), 3.0, x.dtype)], axis=-1)
        try:
            parts, p = jax.jit(functools.partial(conv1d.conv_prefill, split=CONV_SPLIT, **kernel_kw()))(
                xw, w, cpool, cs, cl, cu)
            ok = (np.array_equal(np.asarray(jnp.concatenate(parts, -1), np.float32), np.asarray(y_r, np.float32))
                  and np.array_equal(np.asarray(p, np.float32), np.asarray(p_r, np.float32)))
            out["conv_prefill_split"] = dict(ok=bool(ok))
        except Exception as e:  # noqa: BLE001
            out["conv_prefill_split"] = dict(ok=False, error=repr(e)[:400])
        for c in ks.conv_decode_sweep():
            nm = f"conv_decode_{c.decode_name}"
            try:
                yd, pd = jax.jit(functools.partial(conv1d.conv_decode, config=c, **kernel_kw()))(
                    x[:, 0], w, cpool, jnp.array([4, 0, 2]))
                ok = (np.array_equal(np.asarray(yd[jnp.array([0, 2])], np.float32),
                                     np.asarray(yd_r[jnp.array([0, 2])], np.float32))
                      and np.array_equal(np.asarray(pd[jnp.array([1, 2, 3, 4, 5])], np.float32),
                                         np.asarray(pd_r[jnp.array([1, 2, 3, 4, 5])], np.float32)))
                out[nm] = dict(ok=bool(ok))
            except Exception as e:  # noqa: BLE001
                out[nm] = dict(ok=False, error=repr(e)[:400])
            if out[nm]["ok"]:
                RES["valid"]["conv_decode"].append(nm)
        for nm, r in out.items():
            if nm.startswith("conv") and not r.get("ok"):
                RES["errors"][f"variant {nm}"] = "failed: excluded from timing"
        log("conv correctness", {k_: v_ for k_, v_ in out.items() if k_.startswith("conv")})

    candidate_prefill = ks.CANDIDATE_PREFILL
    old_decode = gdn.DecodeConfig(bv=32, num_warps=2)          # the previous default
    first_prefill = {c.name: c for c in (gdn.DEFAULT_PREFILL, candidate_prefill)}
    first_decode = {c.name: c for c in (gdn.DEFAULT_DECODE, old_decode)}

    # phase 1: the defaults, the candidate prefill and the previous decode (what the headline times); phase 2 (below,
    # before the sweeps): every other variant. Nothing is timed before it passed its check.
    @section("correct_defaults", need=20)
    def _():
        check_prefill(first_prefill)
        check_decode(first_decode)

    valid_prefill = lambda: {nm: prefill_variants[nm] for nm in RES["valid"]["prefill"]}
    valid_decode = lambda: {nm: decode_variants[nm] for nm in RES["valid"]["decode"]}
    RES["prefill"] = {case: {} for case in PREFILL_CASES}
    RES["decode"] = {}
    problems = {}

    def problem(case):
        if case not in problems:
            problems.clear()                  # one problem's inputs on the device at a time
            problems[case] = PrefillProblem(PREFILL_CASES[case])
        return problems[case]

    def time_prefill(case, label, config):
        r = RES["prefill"][case]
        if label in r or not have_time(f"prefill {case} {label}", 10):
            return
        try:
            r[label] = dict(us=problem(case).full_us(config), config=config.name)
        except Exception as e:  # noqa: BLE001
            r[label] = dict(error=repr(e)[:400])
            RES["errors"][f"prefill {case} {label}"] = repr(e)[:400]
        if label == "wy_default" and "us" in r[label]:
            try:
                r[label]["device_us"] = problem(case).device_us(config)
            except Exception as e:  # noqa: BLE001
                RES["errors"][f"prefill {case} {label} device time"] = repr(e)[:400]
        log("prefill", case, label, r[label])
        save()

    def time_fla_prefill(case):
        r = RES["prefill"][case]
        if not FLA or "fla" in r or not have_time(f"fla prefill {case}", 10):
            return
        problems.clear()
        try:
            r["fla"] = fla_prefill(PREFILL_CASES[case])
        except Exception as e:  # noqa: BLE001
            RES["errors"][f"fla prefill {case}"] = repr(e)[:400]
        log("prefill", case, "fla", r.get("fla"))

    def time_decode(n, label, config):
        r = RES["decode"].setdefault(n, {})
        if label in r or not have_time(f"decode {n} {label}", 6):
            return
        try:
            pr = DecodeProblem(n)
            r[label] = dict(us=pr.us(config), config=config.name)
            if n <= 8 and not DRY:
                r[label]["kernel_us"] = pr.kernel_us(config)
        except Exception as e:  # noqa: BLE001
            r[label] = dict(error=repr(e)[:400])
            RES["errors"][f"decode {n} {label}"] = repr(e)[:400]
        log("decode", n, label, r[label])
        save()

    def time_fla_decode(n):
        r = RES["decode"].setdefault(n, {})
        if not FLA or "fla" in r or not have_time(f"fla decode {n}", 6):
            return
        try:
            A_log, dt_bias = gates_params(jax.random.key(4))
            r["fla"] = fla_decode(n, A_log, dt_bias)
        except Exception as e:  # noqa: BLE001
            RES["errors"][f"fla decode {n}"] = repr(e)[:400]
        log("decode", n, "fla", r.get("fla"))

    # ------------------------------------------------------------------ headline: the defaults vs the candidate vs fla
    @section("headline", need=30)
    def _():
        vp = RES["valid"]["prefill"]
        if gdn.DEFAULT_PREFILL.name in vp:
            time_prefill(SWEEP_CASE, "wy_default", gdn.DEFAULT_PREFILL)
        if candidate_prefill.name in vp:
            time_prefill(SWEEP_CASE, "candidate", candidate_prefill)
        vd = RES["valid"]["decode"]
        for n in (1, DECODE_BATCHES[-1]):
            for cfg in (gdn.DEFAULT_DECODE, old_decode):
                if cfg.name in vd:
                    time_decode(n, cfg.name, cfg)
        time_fla_prefill(SWEEP_CASE)          # fla last: its first call autotunes (seconds)
        for n in (1, DECODE_BATCHES[-1]):
            time_fla_decode(n)

    # ------------------------------------------------------------------ the other cases, defaults
    @section("prefill_cases", need=20)
    def _():
        for case in PREFILL_CASES:
            if gdn.DEFAULT_PREFILL.name in RES["valid"]["prefill"]:
                time_prefill(case, "wy_default", gdn.DEFAULT_PREFILL)
            if candidate_prefill.name in RES["valid"]["prefill"]:
                time_prefill(case, "candidate", candidate_prefill)
            time_fla_prefill(case)
            RES["prefill"][case]["floor_us"] = prefill_floor_us(sum(PREFILL_CASES[case]), len(PREFILL_CASES[case]))
        problems.clear()

    @section("decode_cases", need=15)
    def _():
        for n in DECODE_BATCHES:
            for cfg in (gdn.DEFAULT_DECODE, old_decode):
                if cfg.name in RES["valid"]["decode"]:
                    time_decode(n, cfg.name, cfg)
            time_fla_decode(n)

    # ------------------------------------------------------------------ phase 2 correctness: every other variant
    @section("correct_variants", need=20)
    def _():
        if FLA:
            check_fla_prefill()
        check_prefill({nm: c for nm, c in prefill_variants.items() if nm not in first_prefill})
        check_decode({nm: c for nm, c in decode_variants.items() if nm not in first_decode})
        check_conv()

    @section("correct_decode", need=10)          # the decode variants alone (a decode-only --only run)
    def _():
        check_decode({nm: c for nm, c in decode_variants.items() if nm not in first_decode
                      and nm not in RES["correct_decode_conv"]})

    # ------------------------------------------------------------------ prefill sweep at 1x8k
    @section("prefill_sweep", need=20)
    def _():
        for c in valid_prefill().values():     # every other configuration, whole (the default and the candidate:
            if c not in (gdn.DEFAULT_PREFILL, candidate_prefill):     # timed by the headline)
                time_prefill(SWEEP_CASE, c.name, c)

    def best_wy():
        """The fastest configuration timed whole at SWEEP_CASE (None: no sweep)."""
        r = RES["prefill"][SWEEP_CASE]
        label = {"wy_default": gdn.DEFAULT_PREFILL.name, "candidate": candidate_prefill.name}
        ok = {label.get(nm, nm): v["us"] for nm, v in r.items() if isinstance(v, dict) and v.get("us")
              and label.get(nm, nm) in prefill_variants}
        return prefill_variants[min(ok, key=ok.get)] if len(ok) > 2 else None

    # ------------------------------------------------------------------ the best WY configuration on every case
    @section("prefill_best", need=20)
    def _():
        best = best_wy()
        if best is None:
            return
        RES["prefill"]["best_config"] = best.name
        for case in PREFILL_CASES:
            if best != gdn.DEFAULT_PREFILL:
                time_prefill(case, "wy_best", best)
            time_fla_prefill(case)                              # fla beside it (skipped where already timed)
            RES["prefill"][case]["floor_us"] = prefill_floor_us(sum(PREFILL_CASES[case]), len(PREFILL_CASES[case]))
        problems.clear()

    # ------------------------------------------------------------------ decode sweep
    @section("decode_sweep", need=15)
    def _():
        for n in DECODE_BATCHES:
            for nm, cfg in valid_decode().items():
                time_decode(n, nm, cfg)

    # ------------------------------------------------------------------ conv
    RES["conv"] = {}

    @section("conv", need=15)
    def _():
        if not any(nm.startswith("conv") for nm in RES["correct_decode_conv"]):
            check_conv()          # an --only run without correct_variants: only checked kernels are timed
        key = jax.random.key(5)
        w = (0.3 * jax.random.normal(key, (4, CONV_CH))).astype(jnp.bfloat16)
        vdec = [c for c in ks.conv_decode_sweep()
                if f"conv_decode_{c.decode_name}" in RES["valid"]["conv_decode"]]
        vpre = [c for c in ks.conv_prefill_sweep()
                if f"conv_prefill_{c.prefill_name}" in RES["valid"]["conv_prefill"]]
        for n in ((1, 8) if DRY else (1, 64, 256)):
            r = RES["conv"].setdefault(f"decode_{n}", {})
            ns = n_sets(n * CONV_CH * 16, cap=64)
            sets = [(jax.random.normal(jax.random.fold_in(key, i), (n, CONV_CH), jnp.bfloat16),
                     1 + i * n + jnp.arange(n, dtype=jnp.int32)) for i in range(ns)]
            for cfg in vdec:
                nm = cfg.decode_name
                if not have_time(f"conv decode {n} {nm}", 4):
                    break
                call = lambda pool, x, s, cfg=cfg: conv1d.conv_decode(x, w, pool, s, config=cfg, **kernel_kw())[1]
                try:
                    r[nm], _ = time_calls(call, jax.random.normal(key, (ns * n + 1, 3, CONV_CH), jnp.bfloat16), sets,
                                          calls=(8, 72))
                except Exception as e:  # noqa: BLE001
                    RES["errors"][f"conv decode {n} {nm}"] = repr(e)[:400]
            r["bytes"] = n * CONV_CH * 2 * (1 + 1 + 3 + 3)
            if FLA and have_time(f"fla conv decode {n}", 4):
                torch = FLA["torch"]
                tx = torch.randn(n, CONV_CH, device="cuda", dtype=torch.bfloat16)
                cache = torch.randn(n, CONV_CH, 4, device="cuda", dtype=torch.bfloat16)
                tw = torch.randn(CONV_CH, 4, device="cuda", dtype=torch.bfloat16)
                with torch.inference_mode():
                    r["fla_us"] = fla_graph_us(lambda: FLA["conv_update"](tx, cache, weight=tw, activation="silu"))
                r["fla_bytes"] = n * CONV_CH * 2 * (1 + 1 + 4 + 4)
            log("conv decode", n, r)
            save()
        model_form = [c for c in vpre if c.prefill_name in CONV_MODEL_FORM]
        split_ok = RES["correct_decode_conv"].get("conv_prefill_split", {}).get("ok")
        for t in ((200,) if DRY else (8192, 32768)):
            r = RES["conv"].setdefault(f"prefill_{t}", {})
            x = jax.random.normal(key, (1, t, CONV_CH), jnp.bfloat16)
            # the model's form at 8k tokens: the conv channels read in place from the in_proj output (9B: 12352
            # columns), written whole ("wide_") or as q | k | v apart ("split_")
            xw = jax.random.normal(key, (1, t, CONV_W), jnp.bfloat16)
            forms = [("", x, None, vpre)]
            if t <= 8192:
                forms += [("wide_", xw, None, model_form)]
                forms += [("split_", xw, CONV_SPLIT, model_form)] if split_ok else []
            for form, xin, cuts, cfgs in forms:
                for cfg in cfgs:
                    nm = form + cfg.prefill_name
                    if not have_time(f"conv prefill {t} {nm}", 4):
                        break
                    call = lambda pool, x, cfg=cfg, cuts=cuts: conv1d.conv_prefill(
                        x, w, pool, jnp.array([1]), jnp.array([t]), jnp.array([True]), split=cuts, config=cfg,
                        **kernel_kw())[1]
                    try:
                        r[nm], _ = time_calls(call, jax.random.normal(key, (2, 3, CONV_CH), jnp.bfloat16), [(xin,)],
                                              calls=(4, 20))
                    except Exception as e:  # noqa: BLE001
                        RES["errors"][f"conv prefill {t} {nm}"] = repr(e)[:400]
            r["bytes"] = 2 * t * CONV_CH * 2
            if FLA and have_time(f"fla conv prefill {t}", 4):
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
                        RES["errors"][f"fla conv graph {t}"] = repr(e)[:300]
            log("conv prefill", t, r)
            save()

    # ------------------------------------------------------------------ whole model decode step (reserved slice)
    problems.clear()

    @section("model_step", need=20, reserve_model=False)
    def _():
        if not ARGS.model:
            return
        from qwen35_jax.model.config import ModelConfig, load_config
        from qwen35_jax.model.backends import KernelConfig, make_kernels
        from qwen35_jax.model.runner import ModelRunner, make_batch
        from qwen35_jax.model.sharding import Layout, make_mesh
        from qwen35_jax.model.weights import random_weights
        fla_free()
        if DRY:     # the tiny test fixture; the interpret-mode kernels stand in for "pallas"
            cfg = load_config(os.path.join(ROOT, "tests", "fixtures", "hf", "mm_tied_r2_g2"))
            backends, batches = ("pallas_interpret", "reference"), (2,)
        else:
            cfg = ModelConfig.from_hf(json.load(open(os.path.join(ROOT, "bench", "configs", "qwen3.5-9b.json"))))
            backends, batches = ("pallas", "reference"), ARGS.model_batches
        mesh = make_mesh(1)
        weights = random_weights(cfg, mesh, jnp.bfloat16)
        pos, page = (40, 16) if DRY else (512, 16)
        res = RES.setdefault("model_step", {})
        res["decode_config"], res["prefill_config"] = gdn.DEFAULT_DECODE.name, gdn.DEFAULT_PREFILL.name
        for n in batches:
            pp = -(-(pos + 16) // page)
            logits = {}
            for backend in backends:
                if not have_time(f"model step {n} {backend}", 15, reserve_model=False):
                    continue
                kernels = make_kernels(KernelConfig(backend=backend).resolved())
                runner = ModelRunner(cfg, mesh, Layout.build(cfg, 1), weights, jnp.bfloat16, kernels, num_slots=n,
                                     num_pages=1 + n * pp, page_size=page)
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
                for _ in range(2 if DRY else 8):
                    t0 = time.perf_counter()
                    runner.run(batch).block_until_ready()
                    ts.append(time.perf_counter() - t0)
                res[f"{n}_{backend}"] = dict(ms=float(np.median(ts)) * 1e3, first_call_s=compile_s)
                log("model step", n, backend, res[f"{n}_{backend}"])
                del runner, out
                save()
            if len(logits) == 2:
                a_, b_ = logits[backends[0]], logits[backends[1]]
                res[f"{n}_logit_maxdiff"] = float(np.abs(a_ - b_).max())
                res[f"{n}_logit_scale"] = float(np.abs(b_).max())
                res[f"{n}_top1_agree"] = float((a_.argmax(-1) == b_.argmax(-1)).mean())
                log("model logits", n, res[f"{n}_logit_maxdiff"], res[f"{n}_top1_agree"])
        del weights

    RES["model_step_done"] = True
    save()
    md = report()
    open(os.path.join(OUT, "RESULTS_section.md"), "w").write(md)
    if not ARGS.no_record:
        try:
            record(md)
        except Exception as e:  # noqa: BLE001
            log("recording into bench/runs/ failed:", repr(e))
    log(md)
    log(summary())


# ---------------------------------------------------------------------------------------------------------------
# Report.


def fmt(x, spec=".1f"):
    return "—" if x is None else format(x, spec)


def copy_rate():
    c = RES.get("ceilings", {})
    return c.get("copy_TBps_torch") or c.get("copy_TBps_jax")


def decode_best(r):
    ours = {k: v["us"] for k, v in r.items() if isinstance(v, dict) and v.get("us") and k != "fla"}
    return (min(ours, key=ours.get), ours[min(ours, key=ours.get)]) if ours else (None, None)


def report() -> str:
    env, ceil = RES.get("env", {}), RES.get("ceilings", {})
    cp = copy_rate()
    L = [f"Machine: {env.get('kind')}, jax {env.get('jax')}, torch {env.get('torch', '—')}, fla-core "
         f"{env.get('fla', 'not available')} (FLA_FLASH_QLA=0 FLA_TILELANG=0). Time limit {env.get('time_limit')} s; "
         f"the run took {elapsed():.0f} s.", "",
         "Timing: ours = slope of wall time over back-to-back dispatches of one compiled program of R rounds of "
         "calls (static loop count, no host round trip; inputs and slot groups rotate so L2 never holds the previous "
         "call's data; dispatch cancels; each prefill call waits for the previous one's output, since 2026-12-03). "
         "fla (a) = "
         "CUDA-graph replay of one call, `do_bench` median with L2 flushed (as shared/tools/fla_baseline.py); fla (b) "
         "= back-to-back calls in one CUDA graph over rotating inputs, time / calls (ours' method).",
         f"Ceilings measured in this run: copy {fmt(ceil.get('copy_TBps_torch'), '.2f')} TB/s (torch `copy_`), "
         f"{fmt(ceil.get('copy_TBps_jax'), '.2f')} TB/s (JAX `x*c`); bf16 matmul "
         f"{fmt(ceil.get('matmul_TFLOPs'), '.0f')} TFLOP/s. Variants: `prefill_*` = tiles of the chunked prefill "
         "(pallas_kernels/gdn.py), decode `bvN_wM` = V-rows per program and warps.", ""]
    cpf = RES.get("correct_prefill", {})
    if cpf:
        L += ["### GPU correctness (prefill: fp32 token scan reference, 4 packed sequences 100/777/65/1 (8-row-aligned "
              "starts), random initial states, one fresh; bars o <= 4e-3, state <= 3e-3)", "",
              "| variant | o rel-L2 | state rel-L2 | untouched slots | ok |", "|---|---|---|---|---|"]
        for k, v in cpf.items():
            L.append(f"| {k} | {fmt(v.get('o_rel'), '.2e')} | {fmt(v.get('state_rel'), '.2e')} | "
                     f"{v.get('untouched_ok', '—')} | "
                     f"{v.get('ok', '—') if 'error' not in v else 'ERROR ' + v['error'][:120]} |")
        L.append("")
    cd = RES.get("correct_decode_conv", {})
    if cd:
        L.append("Decode (8 rows, 2 padded on the null slot; bar state <= 1e-5) and conv (bit-exact) on GPU: "
                 + "; ".join(f"{k}: " + ", ".join(f"{kk}={vv:.1e}" if isinstance(vv, float) else f"{kk}={vv}"
                                                  for kk, vv in v.items()) for k, v in cd.items()))
        L.append("")
    L += ["### Prefill (GDN core incl. gates and l2norm, initial state read from the pool, final state written back)",
          "", "| case | best µs | default µs | candidate µs | fla µs (a) | best / fla | candidate / fla | floor µs "
          "| best / floor |", "|---|---|---|---|---|---|---|---|---|"]
    for case in PREFILL_CASES:
        r = RES.get("prefill", {}).get(case, {})
        us = lambda k: (r.get(k) or {}).get("us")
        best = min([x for x in (us("wy_best"), us("wy_best_bvauto"), us("wy_default")) if x] or [None],
                   key=lambda x: x or 1e30)
        f = r.get("fla") or {}
        fl = f.get("graph_us")
        extra = f" (varlen eager {fmt(f.get('varlen_eager_us'))})" if f.get("varlen_eager_us") else ""
        L.append(f"| {case} | {fmt(best)} | {fmt(us('wy_default'))} | {fmt(us('candidate'))} | {fmt(fl)}{extra} | "
                 f"{fmt(best / fl if best and fl else None, '.2f')} | "
                 f"{fmt(us('candidate') / fl if us('candidate') and fl else None, '.2f')} | {fmt(r.get('floor_us'))} | "
                 f"{fmt(best / r['floor_us'] if best and r.get('floor_us') else None, '.1f')} |")
    pf = RES.get("prefill", {})
    L.append("")
    L.append(f"Best configuration: `{pf.get('best_config', '—')}`; default: `{gdn.DEFAULT_PREFILL.name}`; candidate: "
             f"`{ks.CANDIDATE_PREFILL.name}` (timed beside the default: the next default if faster). "
             "8x2k: fla (a) runs it as B=8 x 2048.")
    dev = {case: ((pf.get(case, {}).get("wy_default") or {}).get("device_us"),
                  (pf.get(case, {}).get("fla") or {}).get("device_us")) for case in PREFILL_CASES}
    if any(o and f for o, f in dev.values()):
        L.append("Device time per call (µs; the profiler's kernel events of a few calls summed, XLA's glue and "
                 "torch's allocations included, no host launch and no gaps between kernels), default vs fla: "
                 + "; ".join(f"{case} {fmt(o)} vs {fmt(f)} ({fmt(o / f if o and f else None, '.2f')}x)"
                             for case, (o, f) in dev.items()) + ".")
    sw = pf.get(SWEEP_CASE, {}).get("sweep")
    if sw:
        L.append(f"Sweep {SWEEP_CASE}, WY scan kernel alone (µs): " + ", ".join(
            f"{k} {fmt(v.get('scan_us'))}" for k, v in sw.items()))
    prep = pf.get(SWEEP_CASE, {}).get("prep")
    if prep:
        L.append(f"Prep kernel alone {SWEEP_CASE} (µs), mode_warps: "
                 + ", ".join(f"{k} {fmt(v)}" for k, v in prep.items()))
    for prefix, what in (("v1_", "Previous kernels"), ("wy_", "T-form")):
        others = {k: v for k, v in pf.get(SWEEP_CASE, {}).items() if isinstance(v, dict) and k.startswith(prefix)
                  and v.get("us") and k not in ("wy_default", "wy_best", "wy_best_bvauto")}
        if others:
            L.append(f"{what}, other configurations, whole prefill {SWEEP_CASE} (µs): "
                     + ", ".join(f"{k} {fmt(v['us'])}" for k, v in others.items()))
    L += ["", "### Decode (one token per row, state read + written in place by slot; traffic = 2 x 2 MiB per row)", "",
          "| batch | best µs (config) | TB/s | % of copy | default µs | bv32_w2 µs | fla (a) µs | fla (b) µs "
          "| fla (b) TB/s |",
          "|---|---|---|---|---|---|---|---|---|"]
    for n, r in sorted(RES.get("decode", {}).items(), key=lambda kv: int(kv[0])):
        best, us = decode_best(r)
        byts = int(n) * 2 * STATE_BYTES
        f = r.get("fla") or {}
        L.append(f"| {n} | {fmt(us)} ({best}) | {fmt(byts / us / 1e6 if us else None, '.2f')} | "
                 f"{fmt(100 * byts / us / 1e6 / cp if us and cp else None, '.0f')}% | "
                 f"{fmt((r.get(gdn.DEFAULT_DECODE.name) or {}).get('us'))} | "
                 f"{fmt((r.get('bv32_w2') or {}).get('us'))} | "
                 f"{fmt(f.get('graph_us'))} | {fmt(f.get('b2b_us'))} | "
                 f"{fmt(byts / f['b2b_us'] / 1e6 if f.get('b2b_us') else None, '.2f')} |")
    dsw = {n: {k: v.get("us") for k, v in r.items() if isinstance(v, dict) and k != "fla"}
           for n, r in RES.get("decode", {}).items()}
    kus = {n: {k: v["kernel_us"] for k, v in r.items() if isinstance(v, dict) and v.get("kernel_us")}
           for n, r in RES.get("decode", {}).items()}
    if any(kus.values()):
        L += ["", "Decode kernel device time (µs; profiler kernel events, median over the input sets; no launch in "
              "it; at these batches the slope above is not a GPU time: the host launches each call of the timing "
              "loop): " + "; ".join(f"batch {n}: " + ", ".join(f"{k} {fmt(v)}" for k, v in r.items())
                                  for n, r in kus.items() if r)]
    if dsw:
        L.append("")
        L.append("Decode sweep (µs): " + "; ".join(f"{n}: " + ", ".join(f"{k} {fmt(v)}" for k, v in r.items())
                                                 for n, r in dsw.items()))
    L += ["", "### Conv (width 4, 8192 channels, bf16; decode bytes = x + y + 3-row state r/w; fla's cache has 4 rows)",
          "", "| case | ours µs (best) | ours TB/s | fla µs | fla TB/s |", "|---|---|---|---|---|"]
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
    sweep = {case: {k: v for k, v in r.items() if k.startswith(("bt", "split_", "wide_"))}
             for case, r in RES.get("conv", {}).items() if case.startswith("prefill")}
    if any(sweep.values()):
        L += ["", f"Conv prefill sweep (µs; default `{conv1d.ConvConfig().prefill_name}`; `wide_*`: the channels read "
              f"in place from a [T, {CONV_W}] in_proj output, `split_*`: the same with q | k | v written as three "
              "arrays (the model's call)): "
              + "; ".join(f"{case}: " + ", ".join(f"{k} {fmt(v)}" for k, v in r.items()) for case, r in sweep.items()
                          if r)]
    ms = RES.get("model_step")
    if ms:
        L += ["", "### Whole 9B-shaped model, one decode step (random weights, bf16, tp=1, position 512, wall time "
              "per jitted step incl. dispatch, median of 8)", "",
              f"Kernels: decode `{ms.get('decode_config')}`, prefill `{ms.get('prefill_config')}` (the defaults).", "",
              "| batch | pallas ms | reference ms | speed-up | max abs dlogit (max abs logit) | top-1 agree "
              "| first call s (pallas / reference) |",
              "|---|---|---|---|---|---|---|"]
        for n in sorted({int(k.split("_")[0]) for k in ms if k[0].isdigit()}):
            p = ms.get(f"{n}_pallas", ms.get(f"{n}_pallas_interpret", {}))
            r = ms.get(f"{n}_reference", {})
            L.append(f"| {n} | {fmt(p.get('ms'), '.2f')} | {fmt(r.get('ms'), '.2f')} | "
                     f"{fmt(r['ms'] / p['ms'] if p.get('ms') and r.get('ms') else None, '.2f')} | "
                     f"{fmt(ms.get(f'{n}_logit_maxdiff'), '.3f')} ({fmt(ms.get(f'{n}_logit_scale'), '.1f')}) | "
                     f"{fmt(ms.get(f'{n}_top1_agree'), '.2f')} | {fmt(p.get('first_call_s'), '.0f')} / "
                     f"{fmt(r.get('first_call_s'), '.0f')} |")
    if RES["notes"]:
        L += ["", "Notes: " + "; ".join(dict.fromkeys(RES["notes"]))]
    if RES["skipped"]:
        L += ["", "Skipped: " + "; ".join(RES["skipped"])]
    if RES["errors"]:
        L += ["", "Errors / excluded: " + "; ".join(f"{k}: {v}" for k, v in RES["errors"].items())]
    return "\n".join(L) + "\n"


def summary() -> str:
    """A short table against the issue's targets (printed last)."""
    rows = ["", "SUMMARY (issue 3 targets)", f"{'item':34s} {'ours':>12s} {'fla':>12s}  target / status"]
    pf = RES.get("prefill", {})
    for case in PREFILL_CASES:
        r = pf.get(case, {})
        us = [v.get("us") for k, v in r.items() if k.startswith("wy") and isinstance(v, dict) and v.get("us")]
        best = min(us) if us else None
        fl = (r.get("fla") or {}).get("graph_us")
        st = f"ratio {best / fl:.2f} (<= 0.8, aim 0.4)" if best and fl else "—"
        rows.append(f"{'prefill ' + case:34s} {fmt(best):>12s} {fmt(fl):>12s}  {st}")
        dev, fdev = (r.get("wy_default") or {}).get("device_us"), (r.get("fla") or {}).get("device_us")
        if dev and fdev:     # at ~100 µs per call the slope swings between runs: the kernels' summed device time
            rows.append(f"{'  default, device time':34s} {fmt(dev):>12s} {fmt(fdev):>12s}  ratio {dev / fdev:.2f}")
    cp = copy_rate()
    for n, r in sorted(RES.get("decode", {}).items(), key=lambda kv: int(kv[0])):
        best, us = decode_best(r)
        f = r.get("fla") or {}
        pct = 100 * int(n) * 2 * STATE_BYTES / us / 1e6 / cp if us and cp else None
        st = (f"{fmt(pct, '.0f')}% of copy (>= 90% at >= 64)" if int(n) >= 64 else
              f"fla(a) {fmt(f.get('graph_us'))} / fla(b) {fmt(f.get('b2b_us'))} (within 2 us at batch 1)")
        kd = (r.get(gdn.DEFAULT_DECODE.name) or {}).get("kernel_us")
        label = f"decode batch {n}" + (" (slope, best)" if kd else "")
        rows.append(f"{label:34s} {fmt(us):>12s} {fmt(f.get('graph_us')):>12s}  {st}")
        if kd:               # the slope is unreliable at a few µs per call: the kernels' own device times
            rows.append(f"{'  default, kernel device time':34s} {fmt(kd):>12s} {fmt(f.get('kernel_us')):>12s}  "
                        f"fla kernel device time; fla(a) {fmt(f.get('graph_us'))}")
    c = RES.get("conv", {}).get("decode_256", {})
    ours = {k: v for k, v in c.items() if k.startswith("bc") and v}
    if ours:
        us = min(ours.values())
        rows.append(f"{'conv decode 256 (TB/s)':34s} {c['bytes'] / us / 1e6:12.2f} {'':>12s}  >= 2 TB/s")
    ms = RES.get("model_step", {})
    for n in sorted({int(k.split("_")[0]) for k in ms if k[0].isdigit()}):
        p = ms.get(f"{n}_pallas", ms.get(f"{n}_pallas_interpret", {})).get("ms")
        r = ms.get(f"{n}_reference", {}).get("ms")
        label = f"model decode step batch {n} (ms)"
        rows.append(f"{label:34s} {fmt(p, '.2f'):>12s} {'ref ' + fmt(r, '.2f'):>12s}")
    bad = [k for k in RES.get("errors", {}) if "variant" in k]
    rows.append(f"variants excluded: {len(bad)}; skipped points: {len(RES['skipped'])}; errors: {len(RES['errors'])}")
    return "\n".join(rows)


def title():
    """The recorded run's title; a run of some sections only (--only) records under its own title."""
    return TITLE + (f": sections {' '.join(ARGS.only)}" if ARGS.only else "")


def record(md, quiet=False):
    """Record the run through bench/results.py (this process's earlier save of it is replaced, not repeated) and copy
    its JSON file to $OUT."""
    if quiet:
        import contextlib
        import io
        with contextlib.redirect_stdout(io.StringIO()):
            path = results_md.record(title(), md, command=ARGS.command_line)
    else:
        path = results_md.record(title(), md, command=ARGS.command_line)
    shutil.copy(path, os.path.join(OUT, os.path.basename(path)))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--time-limit", type=float, default=240.0, help="seconds; checked before every section and point")
    ap.add_argument("--model-reserve", type=float, default=None,
                    help="seconds held back for the model step (default: min(100, 0.4 x time limit))")
    ap.add_argument("--model-batches", type=int, nargs="+", default=[64, 1])
    ap.add_argument("--no-model", dest="model", action="store_false", help="skip the whole-model decode step")
    ap.add_argument("--no-record", action="store_true", help="do not record the run under bench/runs/")
    ap.add_argument("--decode-batches", type=int, nargs="+", help="decode batches to time (default: all five)")
    ap.add_argument("--only", nargs="+", default=[],
                    help="run only these sections (fla_import and ceilings always run), e.g. correct_defaults "
                         "correct_variants prefill_sweep prefill_best")
    ARGS = ap.parse_args()
    ARGS.no_record = ARGS.no_record or DRY           # a CPU smoke run never records under bench/runs/
    if ARGS.model_reserve is None:
        ARGS.model_reserve = min(100.0, 0.4 * ARGS.time_limit)
    ARGS.command_line = os.environ.get("BENCH_COMMAND", "python3 bench/kernels.py " + " ".join(sys.argv[1:]))
    if ARGS.decode_batches:
        DECODE_BATCHES = tuple(ARGS.decode_batches)
    main()
