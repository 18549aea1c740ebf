"""Train the default model: a small Qwen3.5 on the Python documentation, with its MTP head, written in HF layout.

    python -m qwen35_jax.tools.pydoc_corpus CORPUS          # once: download, clean and split the docs
    python -m qwen35_jax.tools.train_tiny CORPUS OUT         # tokenizer + model (GPU: a few minutes)

The model has every feature of the architecture at a small size: GDN and full-attention layers in the real 3:1
order, GQA (4 query heads on 2 KV heads), the output gate, GDN with twice as many value as key heads, a tied
embedding, and the multi-token-prediction head, trained (as Qwen3.5's own) to predict token t + 2 from the hidden
state at t and the embedding of token t + 1. Training runs the project's own forward (`forward.decoder`,
`forward.mtp`, the reference kernels, prefill attention walking every page so that it can be differentiated)
under `jax.grad`, seeded and deterministic (XLA's deterministic GPU ops), and records its loss curve. The
held-out split is evaluated on the checkpoint as written (bf16 weights, fp32 compute): perplexity, top-1 accuracy
of the main head and of the MTP head; `bench/perplexity.py` measures the same through the engine.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import shutil
import tempfile
import textwrap
import time

import numpy as np

from qwen35_jax.model.hub import DEFAULT_NAME, DEFAULT_SUMMARY
from qwen35_jax.tools import make_tiny_model

# The random test model's shape (same layer pattern, heads and head sizes), wider, with one MTP layer.
TEXT_CONFIG = dict(make_tiny_model.TEXT_CONFIG, hidden_size=256, intermediate_size=768, mtp_num_hidden_layers=1,
                   mtp_use_dedicated_embeddings=False)
FP32_KEYS = ("linear_attn.A_log", "linear_attn.norm.weight")     # stored F32, as in the released checkpoints


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    seq_len: int = 512
    batch: int = 32
    steps: int = 800
    lr: float = 3e-3
    warmup: int = 100
    weight_decay: float = 0.1
    mtp_weight: float = 0.3        # loss = main + mtp_weight * MTP (both mean cross-entropy per token)
    eval_every: int = 100
    eval_windows: int = 64         # held-out windows in the periodic evaluations (all of them at the end)
    page_size: int = 64
    vocab_size: int = 4096         # tokenizer and embedding rows
    seed: int = 0


# ----------------------------------------------------------------------------------------------------------------
# Data


def read_documents(path: str) -> list[str]:
    with open(path) as f:
        return [json.loads(line)["text"] for line in f if line.strip()]


def chat_examples(docs: list[str]) -> list[dict]:
    """Conversations made from the docs: a heading as the question, the paragraph under it as the answer. They
    teach the chat format (and to end a turn with <|im_end|>), so that chat requests get prose back."""
    out = []
    for doc in docs:
        paras = doc.split("\n\n")
        for head, body in zip(paras, paras[1:]):
            if 3 <= len(head) <= 60 and "\n" not in head and not head.endswith((".", ":")) and len(body) >= 80 \
                    and not body.endswith(":"):
                out.append([{"role": "user", "content": f"Tell me about {head}."},
                            {"role": "assistant", "content": body}])
    return out


def token_stream(tok, texts: list[str], eos: int) -> np.ndarray:
    """The texts tokenized and concatenated, each followed by <|endoftext|>."""
    ids = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eos)
    return np.asarray(ids, np.int32)


def heldout_windows(tok, heldout_path: str, seq_len: int, eos: int) -> np.ndarray:
    """The held-out evaluation set: the held-out documents' token stream cut into consecutive windows of seq_len
    tokens [n, seq_len] (the last partial window dropped). Each window is scored on its own: tokens 1..seq_len-1
    given the ones before, which is also what prompt logprobs through the engine score."""
    stream = token_stream(tok, read_documents(heldout_path), eos)
    n = len(stream) // seq_len
    return stream[:n * seq_len].reshape(n, seq_len)


# ----------------------------------------------------------------------------------------------------------------
# Model functions (per rank, inside shard_map over a one-device mesh)


def _model(cfg, page_size):
    import jax
    import jax.numpy as jnp

    from qwen35_jax.model import forward as fw
    from qwen35_jax.model.attention import paged_attention
    from qwen35_jax.model.backends import KernelConfig, make_kernels
    from qwen35_jax.model.sharding import Layout
    from qwen35_jax.model.state import abstract_state
    from qwen35_jax.model.weights import _leaf
    layout = Layout.build(cfg, 1)
    # prefill attention walks every page of the table (a static trip count: reverse-mode autodiff goes through it)
    kernels = dataclasses.replace(make_kernels(KernelConfig(backend="reference")),
                                  attention_prefill=lambda *a: paged_attention(*a, bounded=False))

    def heads(weights, tokens):
        """tokens [N, T + 2] -> (main logits [N, T, V] at 0..T-1, MTP logits [N, T, V] for the tokens at 2..T+1)."""
        n, t = tokens.shape[0], tokens.shape[1] - 2
        pages_per_row = -(-t // page_size)
        abstract = abstract_state(cfg, layout, n, n * pages_per_row + 1, page_size, jnp.float32)
        state = jax.tree.map(lambda p: jnp.zeros(p.shape, p.dtype), abstract, is_leaf=_leaf)
        batch = fw.Batch(tokens=tokens[:, :t], start=jnp.zeros(n, jnp.int32), lens=jnp.full(n, t, jnp.int32),
                         slots=jnp.arange(1, n + 1, dtype=jnp.int32),
                         pages=1 + jnp.arange(n * pages_per_row, dtype=jnp.int32).reshape(n, pages_per_row))
        hidden, _ = fw.decoder(cfg, layout, kernels, weights, state, batch)
        logits = fw.lm_head(cfg, weights, hidden)
        kp, vp = state.k_pages[0], state.v_pages[0]
        mtp_hidden, _, _ = fw.mtp(cfg, layout, kernels, weights, hidden, tokens[:, 1:t + 1], kp, vp, batch)
        mtp_logits = fw.lm_head(cfg, weights, mtp_hidden)
        return logits, mtp_logits

    return heads


def _ce(logits, targets):
    """(mean cross-entropy, mean top-1 accuracy) of fp32 logits [N, T, V] against targets [N, T]."""
    import jax
    import jax.numpy as jnp
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return nll.mean(), (jnp.argmax(logits, -1) == targets).mean()


@functools.lru_cache(maxsize=None)
def _eval_step(cfg, page_size: int):
    """(nll sum, top-1 hits, MTP top-1 hits) of a batch of windows [B, W], jitted once per model shape."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from qwen35_jax.model.sharding import make_mesh
    heads = _model(cfg, page_size)

    def body(weights, w):                      # two padding tokens make heads() run all W positions
        t = w.shape[1]
        logits, mtp_logits = heads(weights, jnp.pad(w, ((0, 0), (0, 2))))
        logp = jax.nn.log_softmax(logits[:, :t - 1], -1)
        nll = -jnp.take_along_axis(logp, w[:, 1:, None], -1)[..., 0].sum()
        top1 = (jnp.argmax(logits[:, :t - 1], -1) == w[:, 1:]).sum()
        mtp_top1 = (jnp.argmax(mtp_logits[:, :t - 2], -1) == w[:, 2:]).sum()
        return nll, top1, mtp_top1

    return jax.jit(jax.shard_map(body, mesh=make_mesh(1), in_specs=(P(), P()), out_specs=P(), check_vma=False))


def evaluate(cfg, weights, windows: np.ndarray, page_size: int = 64, batch: int = 16) -> dict:
    """Held-out metrics of `weights` over windows [n, W]: mean negative log-likelihood per scored token (tokens
    1..W-1 of each window) and its perplexity, top-1 accuracy of the main head, and the MTP head's top-1 accuracy
    (the token at p + 2 given the true token at p + 1, for p = 0..W-3)."""
    import jax.numpy as jnp
    n, w = windows.shape
    fn = _eval_step(cfg, page_size)
    sums = np.zeros(3)
    for i in range(0, n, batch):
        sums += np.array([float(x) for x in fn(weights, jnp.asarray(windows[i:i + batch]))])
    nll = sums[0] / (n * (w - 1))
    return dict(windows=int(n), window_tokens=int(w), nll=nll, perplexity=float(np.exp(nll)),
                top1=sums[1] / (n * (w - 1)), mtp_top1=sums[2] / (n * (w - 2)))


# ----------------------------------------------------------------------------------------------------------------
# Training


def train(corpus: str, out_dir: str, tc: TrainConfig, log=print, text_config: dict | None = None) -> dict:
    """Tokenizer, model, checkpoint: everything in out_dir (written to a temporary directory first).
    text_config: the model's shape (default TEXT_CONFIG)."""
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import PartitionSpec as P

    from qwen35_jax.model.checkpoint import write_safetensors
    from qwen35_jax.model.config import ModelConfig
    from qwen35_jax.model.sharding import make_mesh
    from qwen35_jax.model.weights import load_weights, random_weights, to_checkpoint
    from qwen35_jax.tools.tokenizer_builder import train_tokenizer, write_tokenizer_files

    t_start = time.perf_counter()
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=parent, prefix=".train-")
    train_docs = read_documents(os.path.join(corpus, "train.jsonl"))
    tok = train_tokenizer(train_docs, tc.vocab_size)
    write_tokenizer_files(tok, tmp, model_max_length=TEXT_CONFIG["max_position_embeddings"])
    from transformers import AutoTokenizer
    hf_tok = AutoTokenizer.from_pretrained(tmp)
    eos, im_end = tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")
    chats = [hf_tok.apply_chat_template(c, tokenize=False, enable_thinking=False) for c in chat_examples(train_docs)]
    stream = token_stream(tok, train_docs + chats, eos)
    windows = heldout_windows(tok, os.path.join(corpus, "heldout.jsonl"), tc.seq_len, eos)
    log(f"tokenizer: {tok.get_vocab_size()} tokens; train stream {len(stream):,} tokens ({len(chats)} chat "
        f"examples), held-out {windows.size:,} tokens in {len(windows)} windows of {tc.seq_len}")

    text = dict(text_config or TEXT_CONFIG, vocab_size=tc.vocab_size, eos_token_id=eos, bos_token_id=None,
                pad_token_id=None)
    cfg = ModelConfig.from_hf(dict(text, model_type="qwen3_5_text"))
    mesh = make_mesh(1)
    params = random_weights(cfg, mesh, jnp.float32, seed=tc.seed, mtp=True)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    heads = _model(cfg, tc.page_size)

    def loss_body(params, tokens):
        logits, mtp_logits = heads(params, tokens)
        t = tokens.shape[1] - 2
        main, acc = _ce(logits, tokens[:, 1:t + 1])
        extra, mtp_acc = _ce(mtp_logits, tokens[:, 2:])
        return main + tc.mtp_weight * extra, (main, extra, acc, mtp_acc)

    loss_fn = jax.shard_map(loss_body, mesh=mesh, in_specs=(P(), P()), out_specs=(P(), P()), check_vma=False)
    schedule = optax.warmup_cosine_decay_schedule(0.0, tc.lr, tc.warmup, tc.steps, end_value=tc.lr * 0.1)
    decay_mask = jax.tree.map(lambda x: x.ndim >= 2, params)
    opt = optax.chain(optax.clip_by_global_norm(1.0),
                      optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=tc.weight_decay, mask=decay_mask))
    opt_state = opt.init(params)

    @jax.jit
    def step(params, opt_state, tokens):
        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, tokens)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, aux

    rng = np.random.default_rng(tc.seed)
    curve, evals = [], []
    t0 = time.perf_counter()
    for i in range(1, tc.steps + 1):
        starts = rng.integers(0, len(stream) - tc.seq_len - 2, tc.batch)
        tokens = np.stack([stream[s:s + tc.seq_len + 2] for s in starts])
        params, opt_state, loss, (main, extra, acc, mtp_acc) = step(params, opt_state, jnp.asarray(tokens))
        if i % 25 == 0 or i == 1:
            row = dict(step=i, loss=float(loss), main=float(main), mtp=float(extra), top1=float(acc),
                       mtp_top1=float(mtp_acc), lr=float(schedule(i)), seconds=round(time.perf_counter() - t0, 2))
            curve.append(row)
            if i % 100 == 0 or i == 1:
                log(" ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))
        if i % tc.eval_every == 0 or i == tc.steps:
            ev = evaluate(cfg, params, windows[:tc.eval_windows], tc.page_size)
            evals.append(dict(step=i, **ev))
            log(f"held-out (first {len(windows[:tc.eval_windows])} windows) at step {i}: ppl {ev['perplexity']:.3f}"
                f" top1 {ev['top1']:.3f} mtp_top1 {ev['mtp_top1']:.3f}")
    train_seconds = time.perf_counter() - t0

    # The checkpoint: HF layout, multimodal qwen3_5 config, bf16 weights (A_log and the gated-norm weight F32).
    tensors = {}
    for key, x in to_checkpoint(params, cfg).items():
        name = key if key.startswith("mtp.") else "model.language_model." + key
        tensors[name] = x.astype(np.float32 if key.endswith(FP32_KEYS) else jnp.bfloat16)
    write_safetensors(os.path.join(tmp, "model.safetensors"), tensors, {"format": "pt"})
    config = dict(architectures=["Qwen3_5ForConditionalGeneration"], model_type="qwen3_5", text_config=text,
                  vision_config=dict(model_type="qwen3_5_vision", depth=1, hidden_size=32, intermediate_size=64,
                                     num_heads=2, out_hidden_size=text["hidden_size"]),
                  tie_word_embeddings=True, transformers_version="5.17.0")
    gen = dict(eos_token_id=[im_end, eos], pad_token_id=eos, do_sample=True, temperature=0.7, top_p=0.8, top_k=20)
    for name, obj in (("config.json", config), ("generation_config.json", gen)):
        with open(os.path.join(tmp, name), "w") as f:
            json.dump(obj, f, indent=1)

    # The evaluation of record: the checkpoint as written, read back (bf16 weights, fp32 compute).
    written = load_weights(tmp, ModelConfig.from_hf(config), mesh, jnp.float32, mtp=True)
    final = evaluate(cfg, written, windows, tc.page_size)
    log(f"held-out, checkpoint as written ({final['windows']} windows of {tc.seq_len}): nll {final['nll']:.4f} "
        f"ppl {final['perplexity']:.3f} top1 {final['top1']:.3f} mtp_top1 {final['mtp_top1']:.3f}")
    with open(os.path.join(corpus, "manifest.json")) as f:
        corpus_manifest = json.load(f)
    record = dict(description=DEFAULT_SUMMARY, train_config=dataclasses.asdict(tc), parameters=n_params,
                  train_tokens=int(len(stream)), heldout_tokens=int(windows.size),
                  train_seconds=round(train_seconds, 1),
                  total_seconds=round(time.perf_counter() - t_start, 1), device=str(jax.devices()[0].device_kind),
                  corpus=corpus_manifest, heldout=final, evals=evals, curve=curve)
    with open(os.path.join(tmp, "training_log.json"), "w") as f:
        json.dump(record, f, indent=1)
    shutil.copy(os.path.join(corpus, "heldout.jsonl"), os.path.join(tmp, "heldout.jsonl"))
    if os.path.exists(os.path.join(corpus, "copyright")):          # the documentation's licence (PSF-2.0)
        shutil.copy(os.path.join(corpus, "copyright"), os.path.join(tmp, "LICENSE-python-docs"))
    with open(os.path.join(tmp, "README.md"), "w") as f:
        f.write(model_card(record))
    if os.path.exists(out_dir):
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    return record


def model_card(r: dict) -> str:
    h, c, tc = r["heldout"], r["corpus"], r["train_config"]
    fill = lambda text, bullet=True: textwrap.fill(text, 116, initial_indent="- " if bullet else "",
                                                   subsequent_indent="  " if bullet else "")
    parts = [
        fill(f"{DEFAULT_SUMMARY[0].upper() + DEFAULT_SUMMARY[1:]}. It is the default model of qwen35_jax (`python -m "
             "qwen35_jax`, `LLM()`, `serve` without `--model`) and the instrument its tests and benchmarks measure "
             "with: held-out perplexity, and the MTP head's top-1 accuracy for speculative decoding.", bullet=False),
        fill(f"Architecture: Qwen3.5 (`qwen3_5`), hidden 256, 8 layers (3 Gated DeltaNet : 1 gated full attention), "
             f"GQA 4/2, GDN 4 key / 8 value heads, tied embedding, vocabulary {tc['vocab_size']}, one MTP layer "
             f"(`mtp.*`); {r['parameters']:,} parameters (MTP included)."),
        fill(f"Data: the Python documentation ({c.get('version', '')}) from Debian's `{c.get('package', '')}` "
             "package, cleaned to prose by `qwen35_jax/tools/pydoc_corpus.py`, plus conversations made from its "
             "headings and paragraphs; held-out split in `heldout.jsonl`. The documentation is under the PSF License "
             "Version 2 (its code examples Zero-Clause BSD): `LICENSE-python-docs`."),
        fill(f"Training: `python -m qwen35_jax.tools.train_tiny CORPUS OUT` (seed {tc['seed']}), {tc['steps']} steps "
             f"of {tc['batch']} x {tc['seq_len']} tokens, {r['train_seconds']} s on {r['device']}; loss curve in "
             f"`training_log.json`. Trained on windows of {tc['seq_len']} tokens: longer contexts run, but the model "
             "has not learned to use them."),
        fill(f"Held-out ({h['windows']} windows of {h['window_tokens']} tokens, this checkpoint in fp32): "
             f"perplexity {h['perplexity']:.3f}, top-1 {h['top1']:.3f}; MTP head top-1 (token t + 2 given the true "
             f"t + 1) {h['mtp_top1']:.3f}."),
    ]
    return f"# {DEFAULT_NAME}\n\n" + parts[0] + "\n\n" + "\n".join(parts[1:]) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("corpus", help="directory written by qwen35_jax.tools.pydoc_corpus")
    ap.add_argument("out_dir")
    for f in dataclasses.fields(TrainConfig):
        ap.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default)
    args = ap.parse_args()
    tc = TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})
    # Bitwise-reproducible runs on a GPU (scatter-adds in the embedding gradient are otherwise unordered).
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_deterministic_ops=true").strip()
    train(args.corpus, args.out_dir, tc, log=lambda s: print(s, flush=True))


if __name__ == "__main__":
    main()
