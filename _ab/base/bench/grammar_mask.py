"""Per-token cost of the token bitmask for grammar-constrained decoding, llguidance vs xgrammar.

JSON mode and tool calls need, before every sampled token, a bitmask over the whole vocabulary saying which
tokens keep the output inside the grammar. It is computed on the host CPU per sequence and per step, so it adds
to decode latency and bounds batch throughput. The real Qwen3.5 tokenizer is not available offline, so a
byte-level BPE with the same vocabulary size is trained on local Python sources and docs. Measured per engine:
tokenizer init, JSON-schema compile, per-token mask time along a seeded random constrained generation (later
engines replay the first engine's token trace; allowed-token counts are compared), batched mask fill, and which
JSON-schema features each engine accepts and enforces.
"""

import argparse
import glob
import hashlib
import importlib.metadata
import json
import os
import platform
import sys
import time
import types

import numpy as np

VOCAB = 248_320
WORDS = (VOCAB + 31) // 32
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<think>", "</think>"]
EOS = "<|im_end|>"
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")
CORPUS_GLOBS = ["/work/venv/lib/python3.12/site-packages", "/root/.pyenv/versions/*/lib/python3*"]
OBJ = {"type": "object", "additionalProperties": False}
STR, INT = {"type": "string"}, {"type": "integer"}
SCHEMAS = {
    "simple": {**OBJ, "required": ["name", "count", "kind"],
               "properties": {"name": STR, "count": INT, "kind": {"enum": ["alpha", "beta", "gamma"]}}},
    "nested": {**OBJ, "required": ["people"], "properties": {"people": {"type": "array", "items": {
        **OBJ, "required": ["name", "age", "emails"],
        "properties": {"name": STR, "age": INT, "emails": {"type": "array", "items": STR}}}}}},
    "any_object": {"type": "object"},
}
FEATURES = {  # name: (schema, valid instance, invalid instances)
    "$ref/$defs": ({"$defs": {"P": {"type": "object", "properties": {"x": INT}, "required": ["x"]}},
                    "type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}, "required": ["p"]},
                   {"p": {"x": 1}}, [{"p": {"x": "a"}}]),
    "anyOf": ({"anyOf": [INT, STR]}, "a", [True, [1]]),
    "oneOf": ({"oneOf": [{"type": "integer", "minimum": 5}, {"type": "integer", "maximum": 0}]}, 7, [3]),
    "allOf": ({"allOf": [{"type": "integer", "minimum": 5}, {"type": "integer", "maximum": 9}]}, 7, [3, 12]),
    "pattern": ({"type": "string", "pattern": "^[a-z]{3}-[0-9]{2}$"}, "abc-12", ["abcd-1", "ABC-12"]),
    "format:date-time": ({"type": "string", "format": "date-time"}, "2024-01-02T03:04:05Z", ["yesterday"]),
    "format:email": ({"type": "string", "format": "email"}, "a@b.com", ["not an email"]),
    "minItems/maxItems": ({"type": "array", "items": INT, "minItems": 2, "maxItems": 3}, [1, 2], [[1], [1, 2, 3, 4]]),
    "uniqueItems": ({"type": "array", "items": INT, "uniqueItems": True}, [1, 2], [[1, 1]]),
    "minLength/maxLength": ({"type": "string", "minLength": 3, "maxLength": 5}, "abcd", ["ab", "abcdef"]),
    "additionalProperties:false": ({"type": "object", "properties": {"a": INT}, "additionalProperties": False},
                                   {"a": 1}, [{"a": 1, "b": 2}]),
    "minProperties": ({"type": "object", "minProperties": 1}, {"a": 1}, [{}]),
    "const": ({"type": "object", "properties": {"v": {"const": 42}}, "required": ["v"]}, {"v": 42}, [{"v": 41}]),
    "number minimum/maximum": ({"type": "number", "minimum": 1.5, "maximum": 10}, 2.5, [0.5, -3, 11]),
    "multipleOf": ({"type": "integer", "multipleOf": 5}, 15, [7]),
    "not": ({"not": {"type": "string"}}, 1, ["a"]),
}


def _corpus(max_mb):
    """Deduplicated *.py/*.txt/*.rst/*.md text from local Python installs, capped at max_mb."""
    seen, total = set(), 0
    for root in sorted(p for g in CORPUS_GLOBS for p in glob.glob(g)):
        for dirpath, _, files in sorted(os.walk(root)):
            for f in sorted(x for x in files if x.endswith((".py", ".txt", ".rst", ".md"))):
                data = open(os.path.join(dirpath, f), "rb").read()
                if data and hashlib.sha1(data).digest() not in seen:
                    seen.add(hashlib.sha1(data).digest())
                    total += len(data)
                    yield data.decode("utf-8", "replace")
                if total > max_mb * 1e6:
                    return


def build_tokenizer(cache, corpus_mb):
    """Byte-level BPE (Qwen2 split regex) with exactly VOCAB ids, specials last; cached as tokenizer.json."""
    path = os.path.join(cache, "tokenizer.json")
    if os.path.exists(path):
        return path
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    n_bpe = VOCAB - len(SPECIALS)
    tok.train_from_iterator(_corpus(corpus_mb), trainers.BpeTrainer(
        vocab_size=n_bpe, min_frequency=2, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    d = json.loads(tok.to_str())
    vocab, merges = d["model"]["vocab"], d["model"]["merges"]
    top = sorted(vocab, key=vocab.get)[256:4096]  # corpus too small: pad with merges of early (frequent) tokens
    for a, b in ((a, b) for a in top for b in top if len(vocab) < n_bpe and a + b not in vocab):
        vocab[a + b] = len(vocab)
        merges.append([a, b])
    tok = Tokenizer.from_str(json.dumps(d))
    tok.add_special_tokens(SPECIALS)
    assert tok.get_vocab_size() == VOCAB, tok.get_vocab_size()
    os.makedirs(cache, exist_ok=True)
    tok.save(path)
    return path


def _import_xgrammar_without_torch():
    """xgrammar imports torch at module level only for tensor helpers; its C++ core takes any DLPack array."""
    import importlib.util
    if importlib.util.find_spec("torch") is not None:
        return False
    import transformers  # noqa: F401  (settles "no torch" before the stub exists)
    import tvm_ffi  # noqa: F401  (probes sys.modules["torch"] when imported)
    stub = types.ModuleType("torch")
    stub.int32, stub.tensor = np.int32, lambda v, dtype=None: np.array(v, dtype=dtype)
    stub.full = lambda shape, v, dtype=None: np.full(shape, v, dtype=dtype)
    stub.__getattr__ = lambda name: type(name, (), {})  # torch.Tensor etc. in annotations
    sys.modules["torch"] = stub
    try:
        import xgrammar  # noqa: F401
    finally:
        del sys.modules["torch"]
    return True


def load_llguidance(tok_path, eos, threads):
    import llguidance as llg
    import llguidance.numpy as lln
    t0 = time.perf_counter()
    tok = llg.LLTokenizer(open(tok_path).read(), n_vocab=VOCAB, eos_token=eos)
    init_s, ex = time.perf_counter() - t0, llg.LLExecutor(threads)

    def matcher(grammar):
        m = llg.LLMatcher(tok, grammar, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m
    return types.SimpleNamespace(
        name="llguidance", version=importlib.metadata.version("llguidance"), init_s=init_s, torch_stubbed=None,
        compile=llg.LLMatcher.grammar_from_json_schema, matcher=matcher, consume=lambda m, t: m.consume_token(t),
        fill=lambda m, mask: lln.fill_next_token_bitmask(m, mask),
        fill_batch=lambda ms, mask: lln.fill_next_token_bitmask_par(ex, [(m, i) for i, m in enumerate(ms)], mask))


def load_xgrammar(tok_path, eos, threads):
    stubbed = _import_xgrammar_without_torch()
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(PreTrainedTokenizerFast(tokenizer_file=tok_path, eos_token=EOS),
                                              vocab_size=VOCAB, stop_token_ids=[eos])
    compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
    init_s, batch = time.perf_counter() - t0, xgr.BatchGrammarMatcher(threads)
    return types.SimpleNamespace(  # strict_mode=False: standard JSON Schema defaults, as in llguidance
        name="xgrammar", version=importlib.metadata.version("xgrammar"), init_s=init_s, torch_stubbed=stubbed,
        compile=lambda s: compiler.compile_json_schema(s, strict_mode=False), matcher=xgr.GrammarMatcher,
        consume=lambda m, t: m.accept_token(t), fill=lambda m, mask: m.fill_next_token_bitmask(mask),
        fill_batch=lambda ms, mask: batch.batch_fill_next_token_bitmask(ms, mask))


def allowed(row):
    return np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")[:VOCAB])


def bit(row, t):
    return bool((row[t >> 5] >> (t & 31)) & 1)


def step(eng, m, tok, eos, strict=True):
    if tok == eos:
        m.reset()  # document done: start the next one
    elif not eng.consume(m, tok):
        if strict:
            raise RuntimeError(f"{eng.name} rejected token {tok}")
        return False
    return True


def timed_fill(fill, m, mask, out):
    t0 = time.perf_counter_ns()
    fill(m, mask)
    out.append((time.perf_counter_ns() - t0) / 1e3)


def generate(eng, grammar, n_tokens, cats, eos, seed, trace=None):
    """Random constrained generation of n_tokens steps (matcher reset after each EOS), timing every mask fill.
    EOS is taken as soon as it is allowed; otherwise whitespace-only tokens are avoided and tokens with JSON
    punctuation favoured so that documents progress and close. A given trace is replayed while it stays allowed."""
    rng, m, mask = np.random.default_rng(seed), eng.matcher(grammar), np.zeros((1, WORDS), np.int32)
    times, toks, counts, diverged, doc_len, rejected = [], [], [], None, 0, []
    for i in range(n_tokens):
        timed_fill(eng.fill, m, mask, times)
        ok = allowed(mask[0])
        counts.append(len(ok))
        if trace is not None and diverged is None and not bit(mask[0], trace[i]):
            diverged = i
        if trace is not None and diverged is None:
            tok = trace[i]
        elif bit(mask[0], eos):
            tok = eos
        else:
            ok = ok[~cats["ws"][ok]] if (~cats["ws"][ok]).any() else ok
            tok = int(rng.choice(ok))
            for cat, p in ((cats["closing"], 0.7 if doc_len > n_tokens // 2 else 0.15), (cats["structural"], 0.35)):
                if cat[ok].any() and rng.random() < p:
                    tok = int(rng.choice(ok[cat[ok]]))
                    break
        while not step(eng, m, tok, eos, strict=len(rejected) > 20):  # engine's mask allowed it, consume did not
            rejected.append(tok)
            tok = int(rng.choice(np.setdiff1d(ok, rejected)))
        toks.append(tok)
        doc_len = 0 if tok == eos else doc_len + 1
    return times, toks, counts, diverged, rejected


def batch_times(eng, grammar, toks, eos, b, steps):
    """Whole-batch mask fill time per step; row i follows the token trace from offset i*len/b (mixed states)."""
    ms, pos = [eng.matcher(grammar) for _ in range(b)], [i * len(toks) // b for i in range(b)]
    for m, p in zip(ms, pos):
        for t in toks[:p]:
            step(eng, m, t, eos)
    mask, times = np.zeros((b, WORDS), np.int32), []
    for _ in range(steps):
        timed_fill(eng.fill_batch, ms, mask, times)
        for i, m in enumerate(ms):
            step(eng, m, toks[pos[i]], eos)
            pos[i] = (pos[i] + 1) % len(toks)
            if pos[i] == 0:
                m.reset()
    return times


def accepts(eng, grammar, tok, instance, eos):
    m, mask = eng.matcher(grammar), np.zeros((1, WORDS), np.int32)
    if not all(eng.consume(m, t) for t in tok.encode(json.dumps(instance)).ids):
        return False
    eng.fill(m, mask)
    return bit(mask[0], eos)


def coverage(eng, tok, eos):
    out = {}
    for name, (schema, good, bads) in FEATURES.items():
        try:
            g = eng.compile(schema)
            eng.matcher(g)
        except Exception as e:
            out[name] = f"rejected: {str(e).strip().splitlines()[0][:90]}"
            continue
        ok, leaks = accepts(eng, g, tok, good, eos), [b for b in bads if accepts(eng, g, tok, b, eos)]
        out[name] = "enforced" if ok and not leaks else (f"accepted, lets through {leaks}" if ok else "REJECTS valid")
    return out


def stats(us):
    a = np.asarray(us)
    return {"mean_us": round(float(a.mean()), 1), "p50_us": round(float(np.percentile(a, 50)), 1),
            "p99_us": round(float(np.percentile(a, 99)), 1), "max_us": round(float(a.max()), 1), "n": len(a)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", default="llguidance,xgrammar")
    ap.add_argument("--cache", default="/tmp/qwen35-bench-tokenizer")
    ap.add_argument("--corpus-mb", type=float, default=150)
    ap.add_argument("--tokens", type=int, default=300, help="generation steps per schema")
    ap.add_argument("--batch-steps", type=int, default=50)
    ap.add_argument("--threads", type=int, default=2, help="threads for batch fill and grammar compile")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--note", default="", help="e.g. what else was running on the machine")
    ap.add_argument("--out")
    args = ap.parse_args()
    from tokenizers import Tokenizer
    tok_path = build_tokenizer(args.cache, args.corpus_mb)
    tok = Tokenizer.from_file(tok_path)
    eos = tok.token_to_id(EOS)
    texts = [s.strip() for s in tok.decode_batch([[i] for i in range(VOCAB)], skip_special_tokens=False)]
    cats = {k: np.array([f(s) for s in texts]) for k, f in (
        ("ws", lambda s: not s), ("closing", lambda s: bool(s) and set(s) <= set('"}],')),
        ("structural", lambda s: any(c in s for c in '"{}[],:')))}
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    rec = {"python": f"{platform.python_version()} ({sys.executable})", "nproc": os.cpu_count(), "cpu_model": cpu,
           "note": args.note, "loadavg_at_start": os.getloadavg(), "vocab": VOCAB, "tokenizer": tok_path,
           "args": vars(args), "engines": {}, "unavailable": {}}
    traces = {}
    for name in args.engines.split(","):
        try:
            eng = {"llguidance": load_llguidance, "xgrammar": load_xgrammar}[name](tok_path, eos, args.threads)
        except Exception as e:
            rec["unavailable"][name] = f"{type(e).__name__}: {e}"
            continue
        r = rec["engines"][name] = {"version": eng.version, "tokenizer_init_ms": round(eng.init_s * 1e3, 1),
                                    "torch_stubbed": eng.torch_stubbed, "schemas": {}}
        for sname, schema in SCHEMAS.items():
            t0 = time.perf_counter()
            g = eng.compile(schema)
            eng.matcher(g)
            compile_ms = (time.perf_counter() - t0) * 1e3
            ref = traces.get(sname)
            times, toks, counts, div, rejected = generate(eng, g, args.tokens, cats, eos, args.seed, ref and ref[0])
            ref = traces.setdefault(sname, (toks, counts))
            r["schemas"][sname] = s = {
                "compile_ms": round(compile_ms, 1), **stats(times), "docs_completed": toks.count(eos),
                "trace_diverged_at": div, "allowed_count_differs_steps": sum(map(int.__ne__, counts[:div], ref[1])),
                "allowed_but_rejected_tokens": [tok.id_to_token(t) for t in rejected]}
            for b in (16, 64):
                s[f"batch{b}_us_per_step"] = stats(batch_times(eng, g, toks, eos, b, args.batch_steps))["mean_us"]
        r["coverage"] = coverage(eng, tok, eos)
    cols = ["compile_ms", "mean_us", "p50_us", "p99_us", "batch16_us_per_step", "batch64_us_per_step"]
    print(f"{'engine / schema':24}{'tok_init_ms':>12}" + "".join(f"{c:>{len(c) + 2}}" for c in cols))
    for name, r in rec["engines"].items():
        for sname, s in r["schemas"].items():
            vals = "".join(f"{s[c]:{len(c) + 2}.1f}" for c in cols)
            print(f"{name + ' / ' + sname:24}{r['tokenizer_init_ms']:12.0f}{vals}")
        print(f"{name} {r['version']} coverage:", *(f"\n  {k:28} {v}" for k, v in r["coverage"].items()))
    for name, why in rec["unavailable"].items():
        print(f"{name}: unavailable ({why})")
    if args.out:
        json.dump(rec, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
