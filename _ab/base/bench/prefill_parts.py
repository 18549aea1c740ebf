"""Where the GDN prefill's time goes (9B shapes, H200): each kernel of the default pipeline alone, the T solve's
variants, and whole prefills.

    python3 bench/prefill_parts.py --record

Parts (GPU time per call, host dispatch excluded: bench/kernels.py's time_calls over rotating input sets):
- solve: `gdn.wy_solve` (T = (I + A)^-1 per chunk) in each configuration of SOLVES, each checked against the first
  one's T (rel-L2) on the same inputs and on repeated keys;
- pf: the P / f prep (`gdn.wy_prep`), and the fused T / P / f prep (`with_t=True`);
- whole: `gdn.gdn_prefill_packed` in each configuration of WHOLE, against the fp32 token scan;
- kernels: whole prefills (KERNELS) under the profiler, their device time by kernel (XLA's glue included).
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import os
import sys
import tempfile

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import kernels as kb  # noqa: E402
from bench import results  # noqa: E402
from pallas_kernels import gdn  # noqa: E402
from qwen35_jax.tools import profile_trace  # noqa: E402

# (warps, precision of the merge dots, one program per value head): the default's for bf16 inputs first
SOLVES = [(1, "tf32", False), (1, "tf32", True), (1, "tf32x3", False), (2, "tf32", False)]
PF_WARPS = (2, 4, 8)
# whole prefill, as changes of the default (gdn.DEFAULT_PREFILL): both preps of prep_mode "auto", both T-solve grids,
# the P / f prep on 4 warps, the Triton scan (the Mosaic scan's fallback). `--whole` / `--kernels` replace these lists
# for one run.
WHOLE = [dict(), dict(prep_mode="fused"), dict(prep_mode="solve2"), dict(solve_grid="key"), dict(solve_grid="value"),
         dict(pf_warps=4), dict(mgpu=False)]
KERNELS = [dict(), dict(solve_grid="value")]   # the configurations the kernels part profiles
DEFAULT_PARTS = "solve,pf,whole"
# the headline's cases and two short prompts (a chunked prefill's pieces), where prep_mode "auto" picks the fused prep
CASES = {**kb.PREFILL_CASES, "1x256": [256], "1x512": [512]}


def variants(spec):
    """'prep_mode=fused,prep_warps=8;;mgpu=false' -> [{'prep_mode': 'fused', 'prep_warps': 8}, {}, {'mgpu': False}]
    (values as the PrefillConfig field's type: int, bool or str; the field types are annotation strings)."""
    types = {f.name: f.type for f in dataclasses.fields(gdn.PrefillConfig)}
    cast = {"int": int, "bool": lambda x: x.lower() in ("1", "true"), "str": str}
    out = []
    for entry in spec.split(";"):
        kw = {}
        for item in filter(None, entry.split(",")):
            key, _, value = item.partition("=")
            if key not in types:
                raise argparse.ArgumentTypeError(f"PrefillConfig has no field {key!r}")
            kw[key] = cast.get(types[key].split()[0], str)(value)
        out.append(kw)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--record", action="store_true")
    ap.add_argument("--case", default="1x8k", choices=list(CASES))
    ap.add_argument("--parts", default=DEFAULT_PARTS,
                    help="comma-separated subset of solve, pf, whole, kernels")
    spec = "';'-separated PrefillConfig changes on the default, each ','-separated field=value ('' = the default)"
    ap.add_argument("--whole", type=variants, help=f"the whole part's configurations instead of WHOLE: {spec}")
    ap.add_argument("--kernels", type=variants, help=f"the kernels part's configurations instead of KERNELS: {spec}")
    args = ap.parse_args()
    kb.RES["ceilings"] = {}
    pr = kb.PrefillProblem(CASES[args.case])
    _, row0, nvalid = gdn.chunk_map(pr.starts, pr.lens_a, pr.mc)
    d = gdn.DEFAULT_PREFILL
    lines = [f"Case {args.case} ({pr.total} tokens, {pr.n} sequence(s)), 9B shapes; default `{d.name}`.", ""]

    def log(s):
        print(s, flush=True)
        lines.append(s)

    parts = set(args.parts.split(","))
    tiles = jnp.bfloat16 if d.mgpu else jnp.float32      # T and P as the default writes them for the Mosaic scan
    solve = lambda cfg, k, a, b, dtb: gdn.wy_solve(k, a, b, pr.A_log, dtb, row0, nvalid, prec="tf32",
                                                   num_warps=cfg[0], inv_prec=cfg[1], per_value_head=cfg[2],
                                                   dtype=tiles, **kb.kernel_kw())
    zero = lambda: jnp.zeros((1,), jnp.float32)       # a fresh carry per timing (time_calls donates it)

    if "solve" in parts:                      # the T solve
        q0, k0, v0, a0, b0, _ = pr.sets[0]
        used = jnp.nonzero(nvalid > 0)[0]              # chunk ids past the last chunk stay unwritten
        t_ref = jax.jit(functools.partial(solve, SOLVES[0]))(k0, a0, b0, pr.dt_bias)
        # a hard case for a product-form inverse: every key of the sequence equal, beta ~ 1, no decay (A's strictly
        # lower entries all ~1: its powers grow binomially while T stays small)
        hard = (jnp.broadcast_to(k0[:1], k0.shape), jnp.full_like(a0, -8.0), jnp.full_like(b0, 8.0), pr.dt_bias)
        t_hard = jax.jit(functools.partial(solve, SOLVES[0]))(*hard)
        log("| solve (warps, merge dots, per value head) | T rel-L2 vs the first | same, repeated keys | us |")
        log("|---|---|---|---|")
        for cfg in SOLVES:
            try:
                t = jax.jit(functools.partial(solve, cfg))(k0, a0, b0, pr.dt_bias)
                err = kb.rel(t[used], t_ref[used])
                err_hard = kb.rel(jax.jit(functools.partial(solve, cfg))(*hard)[used], t_hard[used])

                def call(c, q, k, v, a, b, slots, cfg=cfg):
                    return c + 0.0 * solve(cfg, k, a, b, pr.dt_bias + c[0]).reshape(-1)[:1].astype(jnp.float32)
                us, _ = kb.time_calls(call, zero(), pr.sets, calls=(2, 10))
                log(f"| {cfg} | {err:.1e} | {err_hard:.1e} | {us:.1f} |")
            except Exception as e:  # noqa: BLE001
                log(f"| {cfg} | failed: {repr(e)[:200]} | | |")
        log("")

    if "pf" in parts:
        log("| P / f prep (`wy_prep`) | us |")
        log("|---|---|")
        for warps, with_t in [(w, False) for w in PF_WARPS] + [(d.prep_warps, True)]:
            def pf_call(c, q, k, v, a, b, slots, warps=warps, with_t=with_t):
                outs = gdn.wy_prep(q, k, a, b, pr.A_log, pr.dt_bias + c[0], row0, nvalid, prec="tf32",
                                   num_warps=warps, with_t=with_t, dtype=tiles, **kb.kernel_kw())
                return c + 0.0 * outs[-1][0, 0, 0, :1]
            label = f"{'fused T / P / f' if with_t else 'P / f'}, {warps} warps"
            try:
                us, _ = kb.time_calls(pf_call, zero(), pr.sets, calls=(2, 10))
                log(f"| {label} | {us:.1f} |")
            except Exception as e:  # noqa: BLE001
                log(f"| {label} | failed: {repr(e)[:200]} |")
        log("")

    if "whole" in parts:          # each configuration's o and final states against the fp32 token scan's
        o_r, s_r = pr.reference()
        log("| whole prefill (`gdn_prefill_packed`) | o rel-L2 vs fp32 scan | state rel-L2 vs fp32 scan | us |")
        log("|---|---|---|---|")
        for kw in args.whole or WHOLE:
            c = dataclasses.replace(d, **kw)
            try:
                o, s = pr.outputs(c)
                log(f"| {c.name} | {kb.rel(o, o_r):.1e} | {kb.rel(s, s_r):.1e} | {pr.full_us(c):.1f} |")
            except Exception as e:  # noqa: BLE001
                log(f"| {c.name} | failed: {repr(e)[:200]} | | |")
        log("")

    # where the time goes, kernel by kernel (a trace of 5 calls)
    for kw in (args.kernels or KERNELS) if "kernels" in parts else ():
        calls, cfg = 5, dataclasses.replace(d, **kw)
        run = pr.prefill(cfg, donate_argnums=7)
        inputs = functools.partial(pr.args, pr.sets[0])
        o, pool = run(*inputs(pr.pool()))
        jax.block_until_ready(o)
        with tempfile.TemporaryDirectory() as tmp:
            with jax.profiler.trace(tmp):
                for _ in range(calls):
                    o, pool = run(*inputs(pool))
                jax.block_until_ready(o)
            events = profile_trace.load_trace(tmp).events
        us = collections.Counter()
        for e in events:
            us[e.name] += e.self_ns / 1e3 / calls
        log(f"| kernel of {cfg.name} (device time per call, {calls} calls traced) | us | share |")
        log("|---|---|---|")
        total = sum(us.values())
        for name, t in us.most_common(12):
            log(f"| {name[:90]} | {t:.1f} | {t / total:.0%} |")
        log(f"| all {len(us)} | {total:.1f} | |")
        log("")

    if args.record:
        which = "" if args.parts == DEFAULT_PARTS else f", parts {args.parts}"
        results.record(f"GDN prefill by part at {args.case} (bench/prefill_parts.py{which})",
                       "\n".join(lines).rstrip() + "\n")


if __name__ == "__main__":
    main()
