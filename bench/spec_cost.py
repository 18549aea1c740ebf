"""The cost side of speculative decoding at real shapes: the decode step with k MTP drafts against a plain one.

    python bench/spec_cost.py --config bench/configs/qwen3.5-9b.json [--k 3] [--batches 1 16 64] [--record]

Random weights at the config's shapes, with an MTP head (mtp_num_hidden_layers = 1, as Qwen3.5's checkpoints
declare it). Random drafts are almost never accepted, so each speculative step here costs what any step costs:
verify k + 1 tokens, commit, draft k. Both steps are measured through `Engine.generate`, each as the slope between
a long and a short generate of `rows` token-id prompts (the prefill phase cancels), with the same weights. From the
two step times the decode tokens per second at an accept length L (mean tokens a row gains per step) is
L / spec step against 1 / plain step. The accept lengths projected at are Qwen3.5's published MTP accept lengths
(../shared/reference/serving-anchors.md) and the default model's own (bench/RESULTS.md, "Speculative decoding").
Each is labelled as what it is.

The parts of a step (`phase_ms`) are also timed alone, each its own jitted program on the same weights with
`--prompt` tokens of context per row: the plain model step (1 token per row, its logits), the verify pass (k + 1
tokens per row, `decoder(verify=True)` and the logits of every position), the commit of k + 1 tokens and the k
drafts. Sampling is in none of them. `exe_ms` times the engine's whole speculative step executable (sampling
included) dispatched back to back with nothing read back: the step's device time, where the host keeps ahead.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import numpy as np

# two engines of one model (plain and drafting, weights shared): 27B's 54 GB of weights and both engines' state
# do not fit in JAX's default 75% of an 80 GB card at 16 rows
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))     # the repo, not bench/
from bench import results  # noqa: E402
from bench.common import add_kernel_args, kernel_config, random_engine  # noqa: E402
from qwen35_jax.engine.engine import EngineArgs  # noqa: E402
from qwen35_jax.engine.sampling_params import SamplingParams  # noqa: E402
from qwen35_jax.model import forward as fw  # noqa: E402
from qwen35_jax.model.runner import make_batch  # noqa: E402
from qwen35_jax.model.state import abstract_state, init_state, state_specs  # noqa: E402
from qwen35_jax.model.weights import abstract_weights, weight_specs  # noqa: E402

ACCEPT_LENGTHS = {"published k=3, SGLang 397B batch 1": 3.12, "published k=3, small models": 2.7,
                  "default model k=3, greedy (CPU)": 2.166}


def with_mtp(config: str) -> dict:
    raw = json.load(open(config))
    text = raw.get("text_config", raw)
    text.update(mtp_num_hidden_layers=1, mtp_use_dedicated_embeddings=False)
    return raw


def step_ms(engine, rows: int, prompt: int, long: int, short: int, vocab: int, rounds: int) -> tuple[float, float]:
    """(ms per decode step, tokens a row gains per step): the median over rounds of the slope between a long and a
    short generate."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, vocab, prompt).tolist() for _ in range(rows)]
    st = engine.stats

    def run(tokens):
        steps, t0 = st.steps, time.perf_counter()
        engine.generate(prompts, [SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)] * rows, False)
        return time.perf_counter() - t0, st.steps - steps

    run(short)                                                    # compiles the buckets it uses
    slopes, verified, accepted = [], st.spec_steps, int(st.spec_accepted.sum())
    for _ in range(rounds):
        (wl, sl), (ws, ss) = run(long), run(short)
        slopes.append(1e3 * (wl - ws) / (sl - ss))
    rows_steps = st.spec_steps - verified
    gained = 1 + (int(st.spec_accepted.sum()) - accepted) / rows_steps if rows_steps else 1.0
    return float(np.median(slopes)), gained


def scope_profile(calls: dict, out_dir: str, n: int = 3) -> dict:
    """Device ms per scope ("gdn/in_proj", "attention/attention", "lm_head", ...) of each named call, traced n
    times under jax.profiler (each call in its own StepTraceAnnotation) and resolved against its executable's HLO
    (qwen35_jax.tools.profile_trace). calls: name -> (jitted fn, args) run as fn(*args), the state not donated
    (each traced call works on copies)."""
    import jax
    from qwen35_jax.tools import profile_trace as pt
    texts = {name: fn.lower(*args).compile().as_text() for name, (fn, args) in calls.items()}
    for fn, args in calls.values():
        jax.block_until_ready(fn(*args))
    with jax.profiler.trace(out_dir):
        for name, (fn, args) in calls.items():
            for i in range(n):
                with jax.profiler.StepTraceAnnotation(name, step_num=i):
                    jax.block_until_ready(fn(*args))
    trace = pt.load_trace(out_dir, list(calls), device=0)
    pt.assign(trace.events, trace.annotations)
    out = {}
    for name in calls:
        windows = [w for w in trace.annotations if w.name == name]
        events = [e for w in windows for e in pt.resolve(w.events, pt.HloIndex([texts[name]]))]
        out[name] = {scope: ms / len(windows) for scope, ms in sorted(pt.by_scope(events).items(),
                                                                      key=lambda kv: -kv[1])}
        out[name]["(device span)"] = sum(w.device_span_ms for w in windows) / len(windows)
    return out


def exe_ms(engine, rows: int, k: int, context: int, iters: int = 20) -> float:
    """ms per call of the engine's speculative step executable for `rows` greedy rows (slots 1..rows, set to
    position `context`), dispatched `iters` times back to back without reading anything back."""
    import jax
    from qwen35_jax.engine.executor import STOP_IDS
    from qwen35_jax.engine.sampler import host_batch_rows
    from qwen35_jax.tools.profile import decode_rows
    ex = engine.executor
    per_row = -(-(context + (iters + 2) * (k + 1) + 2 * k) // engine.args.page_size)
    b, slots, pages = decode_rows(ex, rows, per_row)      # the engine's bucket: padding rows on the null slot
    live = slots[:rows]
    ex.sstate = dataclasses.replace(ex.sstate, position=ex.sstate.position.at[live].set(context),
                                    sampled=ex.sstate.sampled.at[live].set(1))
    sp = host_batch_rows([None] * b)
    limits = (np.full(b, 1 << 30, np.int32), np.zeros(b, np.int32), np.full((b, STOP_IDS), -1, np.int32))
    for i in range(iters + 2):
        if i == 2:
            jax.block_until_ready(ex.state)
            t0 = time.perf_counter()
        out = ex.decode(b, slots, None, pages, sp, limits=limits)
    jax.block_until_ready(out)
    return 1e3 * (time.perf_counter() - t0) / iters


def phase_ms(engine, rows: int, k: int, context: int, iters: int = 20, profile: str | None = None) -> dict:
    """ms per call of each part of a speculative step and of the plain model step (see the module docstring), on a
    fresh state of `rows` slots whose rows sit at position `context`, in the engine's decode bucket for them. Each
    program donates the state it writes and is called `iters` times back to back after a warm-up; tp = 1 (every
    array whole on the one device)."""
    import jax
    from jax.sharding import PartitionSpec as P

    from qwen35_jax.tools.profile import decode_rows
    cfg, layout, mesh, kernels, dtype = engine.cfg, engine.layout, engine.mesh, engine.kernels, engine.dtype
    assert layout.tp == 1 and engine.dp == 1, "phase_ms runs on one device"
    ps = engine.args.page_size
    per_row = -(-(context + 2 * k + 1) // ps)
    # the engine's bucket for `rows` rows: padding rows on the null slot, at position 0, with no tokens
    b, slots, pages = decode_rows(engine.executor, rows, per_row)
    pages = pages[:, :per_row]
    live = slots > 0
    abstract = abstract_state(cfg, layout, rows, 1 + rows * per_row, ps, dtype, mtp=True)
    state = init_state(abstract, mesh)
    w_specs, s_specs = weight_specs(abstract_weights(cfg, layout, dtype, mtp=True)), state_specs(abstract)
    rng = np.random.default_rng(0)

    def batch(t):
        return make_batch(rng.integers(0, cfg.vocab_size, (b, t)), np.where(live, context, 0), live * t, slots,
                          pages)

    one, many = batch(1), batch(k + 1)
    accepted = jax.numpy.asarray(live * (k + 1), jax.numpy.int32)
    smap = lambda f, ins, outs: jax.shard_map(f, mesh=mesh, in_specs=ins, out_specs=outs, check_vma=False)

    plain = jax.jit(smap(lambda w, s, b: fw.forward(cfg, layout, kernels, w, s, b, all_logits=False),
                         (w_specs, s_specs, fw.BATCH_SPEC), (P(), s_specs)), donate_argnums=1)

    def verify_body(w, s, b):
        x, s, pending = fw.decoder(cfg, layout, kernels, w, s, b, verify=True)
        return fw.lm_head(cfg, w, x), x, s, pending

    verify = jax.jit(smap(verify_body, (w_specs, s_specs, fw.BATCH_SPEC), (P(), P(), s_specs, P())),
                     donate_argnums=1)
    commit = jax.jit(smap(lambda w, s, pend, sl, acc: fw.commit(cfg, kernels, w, s, pend, sl, acc),
                          (w_specs, s_specs, P(), P(), P()), s_specs), donate_argnums=1)

    def draft_body(w, s, x, b):
        drafts, kp, vp = fw.draft(cfg, layout, kernels, w, x, b.tokens, s.k_pages[-1], s.v_pages[-1], b, k)
        return drafts, dataclasses.replace(s, k_pages=s.k_pages[:-1] + [kp], v_pages=s.v_pages[:-1] + [vp])

    draft = jax.jit(smap(draft_body, (w_specs, s_specs, P(), fw.BATCH_SPEC), (P(), s_specs)), donate_argnums=1)
    w, out = engine.weights, {}

    def timed(name, call):
        nonlocal state
        for i in range(iters + 2):
            if i == 2:
                jax.block_until_ready(state)
                t0 = time.perf_counter()
            res, state = call()
        jax.block_until_ready((res, state))
        out[name] = 1e3 * (time.perf_counter() - t0) / iters
        return res

    timed("plain_ms", lambda: plain(w, state, one))
    logits, x, state, pending = verify(w, state, many)
    timed("verify_ms", lambda: (lambda r: ((r[0], r[1], r[3]), r[2]))(verify(w, state, many)))
    timed("commit_ms", lambda: (None, commit(w, state, pending, jax.numpy.asarray(slots, jax.numpy.int32),
                                             accepted)))
    timed("draft_ms", lambda: draft(w, state, x, many))
    out["verify_over_plain"] = out["verify_ms"] / out["plain_ms"]
    if profile:
        undonated = lambda f, outs: jax.jit(smap(f, (w_specs, s_specs, fw.BATCH_SPEC), outs))
        scopes = scope_profile({
            "plain": (undonated(lambda w, s, b: fw.forward(cfg, layout, kernels, w, s, b, all_logits=False),
                                (P(), s_specs)), (w, state, one)),
            "verify": (undonated(verify_body, (P(), P(), s_specs, P())), (w, state, many)),
            "commit": (jax.jit(smap(lambda w, s, pend, sl, acc: fw.commit(cfg, kernels, w, s, pend, sl, acc),
                                    (w_specs, s_specs, P(), P(), P()), s_specs)),
                       (w, state, pending, jax.numpy.asarray(slots, jax.numpy.int32), accepted)),
            "draft": (jax.jit(smap(draft_body, (w_specs, s_specs, P(), fw.BATCH_SPEC), (P(), s_specs))),
                      (w, state, x, many))}, profile)
        for name, table in scopes.items():
            print(f"batch {rows}, {name}: device ms per scope", {s_: round(v, 3) for s_, v in table.items()},
                  flush=True)
        out["profile"] = scopes
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--prompt", type=int, default=512, help="prompt tokens per row")
    ap.add_argument("--tokens", type=int, default=160, help="the long generate's tokens per row")
    ap.add_argument("--short", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--phase-iters", type=int, default=20, help="calls timed per part of the step (phase_ms)")
    ap.add_argument("--profile", default=None, help="trace the plain step and each part of the speculative one "
                    "here and print their device time per scope")
    ap.add_argument("--profile-batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--record", action="store_true")
    add_kernel_args(ap)
    args = ap.parse_args()
    raw = with_mtp(args.config)
    base = EngineArgs(max_model_len=args.prompt + args.tokens + 64, max_num_seqs=max(args.batches),
                      max_num_batched_tokens=max(1024, args.prompt), max_prefill_rows=1, dtype=args.dtype,
                      kernel_config=kernel_config(args), precompile=False, enable_prefix_caching=False,
                      num_kv_pages=1 + max(args.batches) * (-(-(args.prompt + args.tokens + 64 + 2 * args.k) // 16)))
    spec = random_engine(raw, dataclasses.replace(base, speculative_config={"method": "mtp",
                                                                            "num_speculative_tokens": args.k}))
    plain = random_engine(raw, base, weights=dataclasses.replace(spec.weights, mtp=None))
    vocab = spec.cfg.vocab_size
    rows, profiles = [], {}
    for b in args.batches:
        p_ms, _ = step_ms(plain, b, args.prompt, args.tokens, args.short, vocab, args.rounds)
        s_ms, gained = step_ms(spec, b, args.prompt, args.tokens, args.short, vocab, args.rounds)
        row = {"batch": b, "plain_step_ms": p_ms, "spec_step_ms": s_ms, "spec_over_plain": s_ms / p_ms,
               "tokens_per_step_here": gained}
        profile = os.path.join(args.profile, f"batch{b}") if args.profile and b in args.profile_batches else None
        row["spec_exe_ms"] = exe_ms(spec, b, args.k, args.prompt, args.phase_iters)
        parts = phase_ms(spec, b, args.k, args.prompt, args.phase_iters, profile)
        scopes = parts.pop("profile", None)
        row.update(parts)
        if scopes:
            profiles[b] = scopes
        row.update({f"tok_s_ratio_at_{L}": L * p_ms / s_ms for L in ACCEPT_LENGTHS.values()})
        print(row, flush=True)
        rows.append(row)
    fmt = lambda v: f"{v:.3f}" if isinstance(v, float) else v
    body = (f"Model `{os.path.basename(args.config)}` shapes with an MTP head, random {args.dtype} weights, "
            f"k = {args.k}, prompts of {args.prompt} tokens, greedy; steps are slopes between generates of "
            f"{args.tokens} and {args.short} tokens (median of {args.rounds}). tok_s_ratio_at_L: decode tokens/s "
            f"with speculation at accept length L over plain decoding, L from: "
            + "; ".join(f"{v} = {k}" for k, v in ACCEPT_LENGTHS.items()) + ". plain_ms / verify_ms / commit_ms / "
            f"draft_ms: each part alone (phase_ms, {args.phase_iters} calls, no sampling), verify of k + 1 tokens. "
            f"spec_exe_ms: the engine's whole speculative step, {args.phase_iters} calls back to back, nothing read "
            f"back."
            + "\n\n"
            + results.table([{c: fmt(v) for c, v in r.items()} for r in rows], list(rows[0])))
    print(body)
    if args.record:
        results.record("Speculative decoding: step cost at real shapes (bench/spec_cost.py)", body,
                       fields={"args": vars(args), "results": rows, "profiles": profiles})


if __name__ == "__main__":
    main()
