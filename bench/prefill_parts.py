"""Where the GDN prefill's time goes at 1x8k (9B shapes, H200): each kernel of the default pipeline alone, the T
solve's variants, and ablations of the scan.

    python3 bench/prefill_parts.py --record

Parts (GPU time per call, host dispatch excluded: bench/kernels.py's time_calls over rotating input sets):
- solve: `gdn.wy_solve` (T = (I + A)^-1 per chunk and value head) in each configuration of SOLVES, each checked
  against the first one's T (rel-L2) on the same inputs and on repeated keys;
- tile: the W-form's `gdn.wy_prep` given T (W, U, P, f), in each (mode, warps) of TILES;
- scan: the W-form's `gdn.wy_scan` (on precomputed W, U, P, f) in each configuration of SCANS, and ablations of it
  (ABLATIONS: the same loop with parts removed, one sequence of whole chunks, plain loads), which tell whether the
  sequential chain's latency (chunk c + 1 waits for chunk c's state) or the per-chunk traffic and work bound it;
- pf: the T-form's prep (P and f only);
- whole: `gdn.gdn_prefill_packed` in each configuration of WHOLE;
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
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import kernels as kb  # noqa: E402
from bench import results  # noqa: E402
from pallas_kernels import gdn  # noqa: E402
from qwen35_jax import profile_trace  # noqa: E402

# (warps, precision of the merge dots, one program per value head): the default's is (1, "tf32x3", False); per value
# head, K K^T is computed twice but the sm_90 compile spills 40 B instead of 344 B. T is written as the default
# pipeline writes it (bf16 parts for the Mosaic GPU scan, WYConfig.t_parts). At 027d96e two warps took 178.6 / 308.2
# us at 1x8k / 8x2k against 106.8 / 197.8, the value heads' substitutions interleaved in one row loop 231.0 / 498.0
# (removed).
SOLVES = [(1, "tf32x3", False), (1, "tf32", False), (1, "tf32x3", True)]
TILES = [("solve", 4)]                             # (prep_mode, prep_warps)
SCANS = [dict(), dict(overlap=False)]              # on the W-form of the default
# whole prefill, on the default (the T-form, the Mosaic GPU scan where it applies, its output by TMA into o's rows, T
# and P as bf16 hi alone, the T solve in TF32 (per value head for few chunks: solve_grid "auto"), the P / f prep on 2
# warps, the scan's X, Vnew and fk Vnew in bf16): the previous default (gdn.PREVIOUS_PREFILL), the P / f prep on 4
# warps (74.8 against 45.2 us at 1x8k, 40df20e), the T solve's two grids (gdn.CANDIDATE_PREFILL is the value grid at
# every size; at 95822fc 328.0 vs 319.0 us at 1x8k, 70.9 vs 80.2 at 1x1k) and both preps of prep_mode "auto" (the
# fused T / P / f kernel, the T solve + P / f prep). Earlier, not repeated here: 8 warps for P / f (64.7 us at 1x8k);
# two warpgroups per scan program, slower at a1f01f0 and at 660dad0 (385.7 vs 370.8 us at 1x8k); at d61f829 (chunk
# tiles, T and P as hi + lo) 501.6 / 924.2 us at 1x8k / 8x2k; at ccc4f03 the deferred output store (mgpu_defer_o) no
# faster at 1x8k, slower at 1x32k; at c257dc4 the scan carrying the next chunk's K H (lookahead) 583.2 / 1191.1 us
# against 477.1 / 819.2 (both without the gather: those timings left it out). `--whole` / `--kernels` replace these
# lists for one run.
PREVIOUS = {f.name: getattr(gdn.PREVIOUS_PREFILL, f.name) for f in dataclasses.fields(gdn.WYConfig)
            if getattr(gdn.PREVIOUS_PREFILL, f.name) != getattr(gdn.DEFAULT_PREFILL, f.name)}
WHOLE = [dict(), PREVIOUS, dict(pf_warps=4),
         dict(solve_grid="key"), dict(solve_grid="value"), dict(prep_mode="fused"), dict(prep_mode="solve2")]
KERNELS = [dict(), dict(solve_grid="value")]   # the configurations the kernels part profiles
DEFAULT_PARTS = "solve,tile,scan,pf,whole"
# the headline's cases and two short prompts (a chunked prefill's pieces), where prep_mode "auto" picks the fused prep
CASES = {**kb.PREFILL_CASES, "1x256": [256], "1x512": [512]}
ABLATIONS = {
    "full": "the W-form scan's loop (all four dots, o stored)",
    "chain": "X = W H, Vnew, the state update only (no q H, no P Vnew, no o; q and P not loaded)",
    "nochain": "all four dots and o, but H never changes (the update accumulates into a separate tile)",
    "loads": "the loads of every tile, reduced to a scalar (no dots)",
}


def _ablation_kernel(q_ref, k_ref, w_ref, u_ref, p_ref, f_ref, h0_ref, o_ref, h_ref, *, ratio, bv, nch, mode,
                     interpret):
    hv, vb = pl.program_id(0), pl.program_id(1)
    kh = hv // ratio
    vcols = pl.ds(vb * bv, bv)
    mm = functools.partial(gdn._mm, interpret=interpret)
    h0 = h0_ref[hv, vcols, :].T

    def body(c, carry):
        h, acc = carry
        rows = pl.ds(c * gdn.CHUNK, gdn.CHUNK)
        qr, kr, w, u, p = q_ref[rows, kh, :], k_ref[rows, kh, :], w_ref[c, hv], u_ref[c, hv, :, vcols], p_ref[c, hv]
        fq, fk, fd = f_ref[c, hv, 0, :], f_ref[c, hv, 1, :], f_ref[c, hv, 2, :]
        if mode == "loads":
            s = (jnp.sum(qr.astype(jnp.float32)) + jnp.sum(kr.astype(jnp.float32)) + jnp.sum(w.astype(jnp.float32))
                 + jnp.sum(u) + jnp.sum(p) + jnp.sum(fq) + jnp.sum(fk) + jnp.sum(fd))
            return h, acc + s
        vnew = u - mm(w, h, (1, 0), "bf16")
        upd = mm(kr, vnew * fk[:, None], (0, 0), "bf16x2")
        if mode == "nochain":
            h_new, acc = h, jnp.max(fd) * acc + upd
        else:
            h_new = jnp.max(fd) * h + upd
        if mode != "chain":
            o = fq[:, None] * mm(qr, h, (1, 0), "bf16") + mm(p, vnew, (1, 0), "tf32")
            o_ref[rows, hv, vcols] = o.astype(o_ref.dtype)
        return h_new, acc

    h, acc = jax.lax.fori_loop(0, nch, body, (h0, jnp.zeros_like(h0)))
    h_ref[hv, vcols, :] = (h + acc).T


def scan_ablation(q, k, w, u, p, f, h0, *, mode, bv=32, num_warps=4, num_stages=2, interpret=False):
    """The ablated scan over the whole chunks of one sequence (rows [0, total // 64 * 64))."""
    total, hk, dk = q.shape
    hv, dv = u.shape[1], u.shape[-1]
    return pl.pallas_call(
        functools.partial(_ablation_kernel, ratio=hv // hk, bv=min(bv, dv), nch=total // gdn.CHUNK, mode=mode,
                          interpret=interpret),
        out_shape=(jax.ShapeDtypeStruct((total, hv, dv), q.dtype), jax.ShapeDtypeStruct(h0.shape, h0.dtype)),
        grid=(hv, dv // bv),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name=f"scan_ablation_{mode}",
    )(q, k, w, u, p, f, h0)


def variants(spec):
    """'prep_mode=fused,prep_warps=8;;v_parts=2' -> [{'prep_mode': 'fused', 'prep_warps': 8}, {}, {'v_parts': 2}]
    (values as the WYConfig field's type: int, bool or str; the field types are annotation strings)."""
    types = {f.name: f.type for f in dataclasses.fields(gdn.WYConfig)}
    cast = {"int": int, "bool": lambda x: x.lower() in ("1", "true"), "str": str}
    out = []
    for entry in spec.split(";"):
        kw = {}
        for item in filter(None, entry.split(",")):
            key, _, value = item.partition("=")
            if key not in types:
                raise argparse.ArgumentTypeError(f"WYConfig has no field {key!r}")
            kw[key] = cast.get(types[key].split()[0], str)(value)
        out.append(kw)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--record", action="store_true")
    ap.add_argument("--case", default="1x8k", choices=list(CASES))
    ap.add_argument("--parts", default=DEFAULT_PARTS,
                    help="comma-separated subset of solve, tile, scan, pf, whole, kernels, ablations")
    spec = "';'-separated WYConfig changes on the default, each ','-separated field=value ('' = the default)"
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
    precs = d.precisions(jnp.bfloat16)
    solve = lambda cfg, k, a, b, dtb: gdn.wy_solve(k, a, b, pr.A_log, dtb, row0, nvalid, prec="tf32",
                                                   num_warps=cfg[0], inv_prec=cfg[1], per_value_head=cfg[2],
                                                   split=d.t_parts if d.mgpu else 0, **kb.kernel_kw())
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

    if "tile" in parts:                       # the tile kernel given T
        ts = [jax.jit(functools.partial(solve, SOLVES[1]))(k, a, b, pr.dt_bias) for q, k, v, a, b, _ in pr.sets]
        sets_t = [(*s[:5], t) for s, t in zip(pr.sets, ts)]
        log("| tile kernel given T (mode, warps) | us |")
        log("|---|---|")
        for mode, warps in TILES:
            def tile_call(c, q, k, v, a, b, t, mode=mode, warps=warps):
                outs = gdn.wy_prep(q, k, v, a, b, pr.A_log, pr.dt_bias + c[0], row0, nvalid, w_dtype=jnp.bfloat16,
                                   prec=precs[3], num_warps=warps, mode=mode, t=t, **kb.kernel_kw())
                return c + 0.0 * outs[3][0, 0, 0, :1]
            try:
                us, _ = kb.time_calls(tile_call, zero(), sets_t, calls=(2, 10))
                log(f"| {mode}, {warps} | {us:.1f} |")
            except Exception as e:  # noqa: BLE001
                log(f"| {mode}, {warps} | failed: {repr(e)[:200]} |")
        log("")
        del ts, sets_t

    wform = dataclasses.replace(d, tform=False)
    preps = pr.prep_outputs(wform) if parts & {"scan", "ablations"} else None
    def config_table(title, base, variants, time_us):
        log(f"| {title} | us |")
        log("|---|---|")
        for kw in variants:
            c = dataclasses.replace(base, **kw)
            try:
                log(f"| {c.name} | {time_us(c):.1f} |")
            except Exception as e:  # noqa: BLE001
                log(f"| {c.name} | failed: {repr(e)[:200]} |")
        log("")

    if "scan" in parts:
        config_table("scan configuration", wform, SCANS, lambda c: pr.scan_us(c, preps))

    if "pf" in parts:
        def pf_call(c, q, k, v, a, b, slots):
            outs = gdn.wy_prep(q, k, v, a, b, pr.A_log, pr.dt_bias + c[0], row0, nvalid, w_dtype=jnp.bfloat16,
                               prec=precs[3], num_warps=d.prep_warps, mode=d.prep_mode, pf_only=True,
                               **kb.kernel_kw())
            return c + 0.0 * outs[1][0, 0, 0, :1]
        us, _ = kb.time_calls(pf_call, zero(), pr.sets, calls=(2, 10))
        log(f"prep of the T-form (P and f only, `wy_prep(pf_only=True, mode={d.prep_mode!r})`): {us:.1f} us")
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

    if "ablations" in parts and pr.n == 1:
        h0 = pr.pool()[1]
        sets_s = [(s[0], s[1], *pp) for s, pp in zip(pr.sets, preps)]
        log("| scan ablation | what runs | us |")
        log("|---|---|---|")
        for mode, what in ABLATIONS.items():
            try:
                def call(c, q, k, w, u, p, f, mode=mode):
                    _, h = scan_ablation(q, k, w, u, p, f, h0 + c[0], mode=mode, bv=d.bv or 32,
                                         num_warps=d.num_warps, num_stages=d.num_stages or 2, **kb.kernel_kw())
                    return c + 0.0 * h[0, 0, :1]
                us, _ = kb.time_calls(call, zero(), sets_s, calls=(2, 10))
                log(f"| {mode} | {what} | {us:.1f} |")
            except Exception as e:  # noqa: BLE001
                log(f"| {mode} | failed: {repr(e)[:200]} | |")
    if args.record:
        which = "" if args.parts == DEFAULT_PARTS else f", parts {args.parts}"
        results.record(f"GDN prefill by part at {args.case} (bench/prefill_parts.py{which})",
                       "\n".join(lines).rstrip() + "\n")


if __name__ == "__main__":
    main()
