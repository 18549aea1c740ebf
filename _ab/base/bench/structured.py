"""Decode throughput with a JSON-schema constraint on every row against none, same engine, same run.

A constrained row costs a bitmask fill on the host before each sampler (the mask needs the previous token), the
mask's copy to the device and a split decode step (the model step, then the sampler). This measures what that leaves
of the decode step: `rows` requests, unconstrained then constrained (a JSON array of at least 128 typed records,
free strings or strings of at most 12 characters: `SCHEMAS`; no row can finish early), alternating for `--rounds`.
The step is the slope between a generate of `--tokens` and one of `--short` tokens per row, so the prefill phase
cancels (at 64 rows and 128 tokens it was nearly half of a generate's wall time); reported: the step, decode
tokens per second, the ratio, and where the engine thread's time per step went. At Qwen3.5's shapes (`--config`,
random weights) the model directory needs a tokenizer of the full vocabulary: bench/grammar_mask.py builds one
(`--tokenizer`).
"""
import argparse
import os
import shutil
import sys
import tempfile
import time

# the repo instead of bench/ (this script's directory), whose profile.py would shadow the standard library's: the
# tokenizer's transformers import reaches cProfile through torch where torch is installed
sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from bench import results  # noqa: E402
from qwen35_jax import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402

# "records": what structured-output clients send, typed fields of an object (strings, an integer, a boolean, an
# enum, a list); "strings": free string items, whose masks llguidance's precomputed token slices serve (~65 us per
# row at 248,320 tokens on the 2-core CPU machine); "short_strings": a maxLength defeats those slices and every
# string mask walks the whole token trie (~1.7 ms per row there): the expensive case. Each is an array with a
# minimum length no row reaches in --tokens, so no row finishes early (run() checks).
RECORD = {"type": "object", "additionalProperties": False,
          "properties": {"name": {"type": "string"}, "email": {"type": "string"}, "age": {"type": "integer"},
                         "active": {"type": "boolean"}, "role": {"enum": ["admin", "editor", "viewer", "guest"]},
                         "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "email", "age", "active", "role", "tags"]}
SCHEMAS = {"records": {"type": "array", "items": RECORD, "minItems": 128},
           "strings": {"type": "array", "items": {"type": "string"}, "minItems": 128},
           "short_strings": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 128}}


class MaskTimer:
    """Wraps the engine's Grammars.bitmask to add up the host time of the mask fills (the part of `sample_ms` that
    is llguidance's)."""

    def __init__(self, grammars):
        self.seconds, self._fill = 0.0, grammars.bitmask
        grammars.bitmask = self

    def __call__(self, matchers):
        t0 = time.perf_counter()
        try:
            return self._fill(matchers)
        finally:
            self.seconds += time.perf_counter() - t0


def model_dir(config: str | None, tokenizer: str | None) -> str | None:
    """None (the default model), or a directory holding `config` and the tokenizer (random weights)."""
    if config is None:
        return None
    d = tempfile.mkdtemp(prefix="qwen35-structured-")
    shutil.copy(config, os.path.join(d, "config.json"))
    for f in os.listdir(tokenizer):
        if f.startswith("tokenizer"):
            shutil.copy(os.path.join(tokenizer, f), d)
    return d


def run(llm, rows: int, tokens: int, schema: dict | None, masks: MaskTimer | None = None) -> dict:
    """One generate of `rows` requests of `tokens` tokens: its wall time, engine steps and the engine thread's time
    blocked reading results back (`wait`), in host work not hidden behind the device (`host`), and filling masks
    and dispatching the constrained sampler (`sample`, of which `mask` the fills), in seconds."""
    spec = StructuredOutputsParams(json=schema) if schema else None
    params = SamplingParams(max_tokens=tokens, temperature=1.0, seed=0, ignore_eos=spec is None,
                            structured_outputs=spec)
    st = llm.engine.stats
    now = lambda: (st.steps, st.wait_seconds, st.host_seconds, st.sample_seconds, masks.seconds if masks else 0.0)
    before, t0 = now(), time.perf_counter()
    outs = llm.generate([f"Row {i}: list some names as JSON." for i in range(rows)], params)
    wall, after = time.perf_counter() - t0, now()
    if any(len(o.outputs[0].token_ids) != tokens for o in outs):
        raise RuntimeError("a row finished early: the slope would mix phases")
    return dict(zip(("wall", "steps", "wait", "host", "sample", "mask"),
                    (wall, *(b - a for a, b in zip(before, after)))))


def decode_step(long: dict, short: dict) -> dict:
    """Per decode step, in ms: the difference of a long and a short generate over the difference of their steps,
    so the prefill phase (the same in both) cancels."""
    steps = long["steps"] - short["steps"]
    return {f"{k}_ms": 1e3 * (long[k] - short[k]) / steps for k in ("wall", "wait", "host", "sample", "mask")}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", help="a config.json at real shapes (random weights); default: the default model")
    ap.add_argument("--tokenizer", default="/tmp/qwen35-bench-tokenizer", help="directory of tokenizer.json")
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--schemas", nargs="+", default=list(SCHEMAS), choices=list(SCHEMAS))
    ap.add_argument("--tokens", type=int, default=192, help="the long generate's tokens per row")
    ap.add_argument("--short", type=int, default=64, help="the short generate's (the slope's other end)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--record", action="store_true", help="record the run (bench/results.py)")
    args = ap.parse_args()
    path = model_dir(args.config, args.tokenizer)
    kw = dict(load_format="dummy") if path else {}
    kw["precompile"] = False         # the warm-up runs compile the buckets they use (the whole sweep is not needed)
    rows_out, masks = [], None
    with LLM(path, max_num_seqs=max(args.rows), dtype=args.dtype, max_model_len=1024, **kw) as llm:
        for rows in args.rows:
            for name in args.schemas:
                schema = SCHEMAS[name]
                run(llm, rows, args.short, None), run(llm, rows, args.short, schema)      # warm: compiles
                masks = masks or MaskTimer(llm.engine._grammars)
                llm.engine.executor.wait_split()   # the split decode steps, compiled from the first constrained run
                free, masked = [], []
                for _ in range(args.rounds):
                    free.append(decode_step(run(llm, rows, args.tokens, None), run(llm, rows, args.short, None)))
                    masked.append(decode_step(run(llm, rows, args.tokens, schema, masks),
                                              run(llm, rows, args.short, schema, masks)))
                f, m = min(free, key=lambda x: x["wall_ms"]), min(masked, key=lambda x: x["wall_ms"])
                r = {"rows": rows, "schema": name, "decode_tok_s": 1e3 * rows / f["wall_ms"],
                     "constrained_decode_tok_s": 1e3 * rows / m["wall_ms"], "overhead": m["wall_ms"] / f["wall_ms"] - 1,
                     **{f"{k}_{kind}": v for kind, x in (("free", f), ("constrained", m)) for k, v in x.items()}}
                print(f"rows {rows:4d} {name}: decode step {f['wall_ms']:.2f} ms free, {m['wall_ms']:.2f} "
                      f"constrained, overhead {100 * r['overhead']:+.1f}%; waiting {f['wait_ms']:.2f} / "
                      f"{m['wait_ms']:.2f}, host {f['host_ms']:.2f} / {m['host_ms']:.2f}, masks and sampler "
                      f"{m['sample_ms']:.2f} (masks {m['mask_ms']:.2f})", flush=True)
                rows_out.append(r)
                body = results.table([{k: f"{v:.3f}" if isinstance(v, float) else v for k, v in x.items()}
                                      for x in rows_out], list(rows_out[0]))
                if args.record:      # after each case: a run cut short still leaves its record
                    results.record("Decode with a JSON-schema constraint on every row (bench/structured.py)", body,
                                   fields={"args": vars(args), "results": rows_out})
    print(body)


if __name__ == "__main__":
    main()
