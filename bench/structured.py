"""Decode throughput with a JSON-schema constraint on every row against none, same engine, same run.

A constrained row costs a bitmask fill on the host before each sampler (the mask needs the previous token), the
mask's copy to the device and a split decode step (the model step, then the sampler). This measures what that leaves
of decode throughput: `rows` requests of `--tokens` tokens, unconstrained then constrained (a JSON array of at least
64 typed records, free strings or strings of at most 12 characters: `SCHEMAS`; no row can finish early),
alternating for `--rounds`, reporting generated tokens per second, the ratio, and where the engine thread's time per
step went. At Qwen3.5's shapes (`--config`, random weights) the model directory needs a tokenizer of the full
vocabulary: bench/grammar_mask.py builds one (`--tokenizer`).
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
# minimum length no row reaches in --tokens, so no row finishes early.
RECORD = {"type": "object", "additionalProperties": False,
          "properties": {"name": {"type": "string"}, "email": {"type": "string"}, "age": {"type": "integer"},
                         "active": {"type": "boolean"}, "role": {"enum": ["admin", "editor", "viewer", "guest"]},
                         "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "email", "age", "active", "role", "tags"]}
SCHEMAS = {"records": {"type": "array", "items": RECORD, "minItems": 64},
           "strings": {"type": "array", "items": {"type": "string"}, "minItems": 64},
           "short_strings": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 64}}


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
    """Tokens per second, and the engine thread's time per step: blocked reading results back (`wait_ms`), in
    host work not hidden behind the device (`host_ms`), and filling masks and dispatching the constrained sampler
    (`sample_ms`, of which `mask_ms` the fills): a device-bound step from a host-bound one."""
    spec = StructuredOutputsParams(json=schema) if schema else None
    params = SamplingParams(max_tokens=tokens, temperature=1.0, seed=0, ignore_eos=spec is None,
                            structured_outputs=spec)
    st = llm.engine.stats
    before = (st.steps, st.wait_seconds, st.host_seconds, st.sample_seconds, masks.seconds if masks else 0.0)
    t0 = time.perf_counter()
    outs = llm.generate([f"Row {i}: list some names as JSON." for i in range(rows)], params)
    dt = time.perf_counter() - t0
    steps = max(1, st.steps - before[0])
    return {"tok_s": sum(len(o.outputs[0].token_ids) for o in outs) / dt, "step_ms": 1e3 * dt / steps,
            "wait_ms": 1e3 * (st.wait_seconds - before[1]) / steps,
            "host_ms": 1e3 * (st.host_seconds - before[2]) / steps,
            "sample_ms": 1e3 * (st.sample_seconds - before[3]) / steps,
            "mask_ms": 1e3 * ((masks.seconds if masks else 0.0) - before[4]) / steps}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", help="a config.json at real shapes (random weights); default: the default model")
    ap.add_argument("--tokenizer", default="/tmp/qwen35-bench-tokenizer", help="directory of tokenizer.json")
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--schemas", nargs="+", default=list(SCHEMAS), choices=list(SCHEMAS))
    ap.add_argument("--tokens", type=int, default=128)
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
                run(llm, rows, 8, None), run(llm, rows, 8, schema)       # warm: compiles, grammar cache
                masks = masks or MaskTimer(llm.engine._grammars)
                llm.engine.executor.wait_split()   # the split decode steps, compiled from the first constrained run
                free, masked = [], []
                for _ in range(args.rounds):
                    free.append(run(llm, rows, args.tokens, None))
                    masked.append(run(llm, rows, args.tokens, schema, masks))
                f, m = max(free, key=lambda x: x["tok_s"]), max(masked, key=lambda x: x["tok_s"])
                r = {"rows": rows, "schema": name, "tokens_per_s": f["tok_s"], "constrained_tokens_per_s": m["tok_s"],
                     "overhead": f["tok_s"] / m["tok_s"] - 1,
                     **{f"{k}_{kind}": v for kind, x in (("free", f), ("constrained", m))
                        for k, v in x.items() if k != "tok_s"}}
                print(f"rows {rows:4d} {name}: {r['tokens_per_s']:9.1f} tok/s free, "
                      f"{r['constrained_tokens_per_s']:9.1f} constrained, overhead {100 * r['overhead']:+.1f}%; per "
                      f"step free / constrained: {f['step_ms']:.2f} / {m['step_ms']:.2f} ms, waiting "
                      f"{f['wait_ms']:.2f} / {m['wait_ms']:.2f}, host {f['host_ms']:.2f} / {m['host_ms']:.2f}, masks "
                      f"and sampler {m['sample_ms']:.2f} (masks {m['mask_ms']:.2f})", flush=True)
                rows_out.append(r)
                body = results.table([{k: f"{v:.3f}" if isinstance(v, float) else v for k, v in x.items()}
                                      for x in rows_out], list(rows_out[0]))
                if args.record:      # after each case: a run cut short still leaves its record
                    results.record("Decode with a JSON-schema constraint on every row (bench/structured.py)", body,
                                   fields={"args": vars(args), "results": rows_out})
    print(body)


if __name__ == "__main__":
    main()
