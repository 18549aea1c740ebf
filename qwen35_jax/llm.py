"""Offline Python API named like vLLM's: `LLM(model=...)`, `generate`, `chat`, plus `logits` for parity checks."""
from __future__ import annotations

import json
import logging
import os
import uuid

import jax
import jax.numpy as jnp
import numpy as np

from qwen35_jax.config import load_config
from qwen35_jax.outputs import CompletionOutput, RequestOutput
from qwen35_jax.runner import ModelRunner, make_batch
from qwen35_jax.sampling_params import SamplingParams
from qwen35_jax.sharding import Layout, make_mesh
from qwen35_jax.tokenizer import Tokenizer
from qwen35_jax.weights import load_weights, restore_converted, save_converted

log = logging.getLogger(__name__)
DTYPES = {"bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16, "float32": jnp.float32, "fp32": jnp.float32}


def resolve_dtype(dtype):
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        return DTYPES[dtype]
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        raise ValueError(f"dtype must be bfloat16 or float32, got {dtype}")
    return dtype


def _eos_ids(model_dir, cfg, tokenizer) -> set[int]:
    ids = set(cfg.eos_token_ids)
    gen = os.path.join(model_dir, "generation_config.json")
    if os.path.exists(gen):
        with open(gen) as f:
            e = json.load(f).get("eos_token_id")
        ids |= set(e if isinstance(e, list) else [] if e is None else [e])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


class LLM:
    """A Qwen3.5 model on a `tp` device mesh.

    model: a HF model directory (config.json, safetensors, tokenizer). dtype: "bfloat16" or "float32".
    converted_weights_dir: where the re-laid-out, sharded weights are saved with orbax after the first load
    and restored from on the next start (one directory per tp and dtype).
    """

    def __init__(self, model: str, tensor_parallel_size: int = 1, dtype="bfloat16", max_model_len: int | None = None,
                 max_num_seqs: int = 8, kernel_backend: str | None = None, page_size: int = 16,
                 converted_weights_dir: str | None = None, devices=None, seed: int = 0,
                 skip_tokenizer_init: bool = False):
        self.model_dir = model
        self.cfg = load_config(model)
        self.dtype = resolve_dtype(dtype)
        self.mesh = make_mesh(tensor_parallel_size, devices)
        self.layout = Layout.build(self.cfg, tensor_parallel_size)        # fails early on head counts tp can't split
        self.max_model_len = int(max_model_len or min(self.cfg.max_position_embeddings, 8192))
        if self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        self.tokenizer = None if skip_tokenizer_init else Tokenizer(model)
        self.eos_token_ids = _eos_ids(model, self.cfg, self.tokenizer)
        self.weights = self._load_weights(converted_weights_dir)
        self.pages_per_seq = -(-self.max_model_len // page_size)
        self.max_num_seqs = max_num_seqs
        self.runner = ModelRunner(self.cfg, self.mesh, self.weights, self.dtype, num_slots=max_num_seqs,
                                  num_pages=1 + max_num_seqs * self.pages_per_seq, page_size=page_size,
                                  kernel_backend=kernel_backend)
        self._rng = np.random.default_rng(seed)

    def _load_weights(self, converted_dir):
        if converted_dir:
            tag = f"tp{self.layout.tp}-{jnp.dtype(self.dtype).name}"
            path = os.path.abspath(os.path.join(converted_dir, tag))
            if os.path.exists(path):
                log.info("restoring converted weights from %s", path)
                return restore_converted(path, self.cfg, self.mesh, self.dtype)
            weights = load_weights(self.model_dir, self.cfg, self.mesh, self.dtype)
            save_converted(weights, path)
            return weights
        return load_weights(self.model_dir, self.cfg, self.mesh, self.dtype, progress=True)

    # ------------------------------------------------------------------------------------------------------------
    def _pages_of_slot(self, slot: int) -> np.ndarray:
        return 1 + (slot - 1) * self.pages_per_seq + np.arange(self.pages_per_seq)

    def _prefill(self, slot: int, ids: list[int], all_logits: bool):
        """Run the whole prompt through the model from a fresh state (start 0); one row padded to a power of two."""
        t = max(16, 1 << (len(ids) - 1).bit_length())
        tokens = np.zeros((1, t), np.int32)
        tokens[0, :len(ids)] = ids
        batch = make_batch(tokens, [0], [len(ids)], [slot], self._pages_of_slot(slot)[None])
        return self.runner.run(batch, all_logits)

    def _decode(self, slot: int, token: int, pos: int):
        batch = make_batch([[token]], [pos], [1], [slot], self._pages_of_slot(slot)[None])
        return self.runner.run(batch)

    def _check_prompt(self, ids):
        if not ids:
            raise ValueError("prompt is empty")
        if len(ids) > self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens, more than max_model_len={self.max_model_len}")
        bad = [t for t in ids if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {self.cfg.vocab_size})")

    def logits(self, token_ids) -> np.ndarray:
        """fp32 logits [len, vocab] at every position of one prompt."""
        ids = [int(t) for t in token_ids]
        self._check_prompt(ids)
        logits = self._prefill(1, ids, all_logits=True)
        return np.asarray(logits[0, :len(ids), :self.cfg.vocab_size], np.float32)

    # ------------------------------------------------------------------------------------------------------------
    def _prompt_ids(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this LLM was built without a tokenizer; pass token ids")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
            return self._prompt_ids(prompt["prompt"])
        return None, [int(t) for t in prompt]

    def _sample(self, logits: np.ndarray, params: SamplingParams, rng) -> int:
        if params.greedy:
            return int(np.argmax(logits))
        x = logits.astype(np.float64) / params.temperature
        if params.top_k:
            kth = np.partition(x, -params.top_k)[-params.top_k]
            x = np.where(x < kth, -np.inf, x)
        p = np.exp(x - x.max())
        p /= p.sum()
        if params.min_p:
            p = np.where(p < params.min_p * p.max(), 0.0, p)
        if params.top_p < 1:
            order = np.argsort(-p)
            keep = np.cumsum(p[order]) - p[order] < params.top_p
            mask = np.zeros_like(p, bool)
            mask[order[keep]] = True
            p = np.where(mask, p, 0.0)
        return int(rng.choice(len(p), p=p / p.sum()))

    def _generate_one(self, ids: list[int], params: SamplingParams, index: int) -> CompletionOutput:
        unsupported = [name for name, v, d in (("presence_penalty", params.presence_penalty, 0.0),
                                               ("frequency_penalty", params.frequency_penalty, 0.0),
                                               ("repetition_penalty", params.repetition_penalty, 1.0),
                                               ("logprobs", params.logprobs, None)) if v != d]
        if unsupported:
            raise ValueError(f"{', '.join(unsupported)} not supported by the sequential generator")
        rng = np.random.default_rng(None if params.seed is None else params.seed + index) \
            if params.seed is not None else self._rng
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)
        budget = self.max_model_len - len(ids)
        max_new = min(params.max_tokens or budget, budget)
        logits = self._prefill(1, ids, all_logits=False)
        out, reason, stop_reason, text = [], "length", None, ""
        pos = len(ids)
        while len(out) < max_new:
            tok = self._sample(np.asarray(logits[0, :self.cfg.vocab_size]), params, rng)
            out.append(tok)
            if tok in stop_ids and len(out) > params.min_tokens:
                reason, stop_reason = "stop", tok
                break
            if params.stop and self.tokenizer is not None:
                text = self.tokenizer.decode(out, params.skip_special_tokens)
                hit = min(((text.find(s), s) for s in params.stop if s in text), default=None)
                if hit:
                    reason, stop_reason, text = "stop", hit[1], text[:hit[0]]
                    break
            if len(out) >= max_new:
                break
            logits = self._decode(1, tok, pos)
            pos += 1
        if not (reason == "stop" and isinstance(stop_reason, str)) and self.tokenizer is not None:
            shown = out[:-1] if reason == "stop" and tok not in params.stop_token_ids and tok in stop_ids else out
            text = self.tokenizer.decode(shown, params.skip_special_tokens)
        return CompletionOutput(index=index, text=text, token_ids=out, finish_reason=reason, stop_reason=stop_reason)

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        single = isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                      and isinstance(prompts[0], int))
        prompts = [prompts] if single else list(prompts)
        params = sampling_params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling_params for {len(prompts)} prompts")
        parsed = [self._prompt_ids(p) for p in prompts]
        for _, ids in parsed:
            self._check_prompt(ids)
        results = []
        for (text, ids), sp in zip(parsed, params):
            outs = [self._generate_one(ids, sp, i) for i in range(sp.n)]
            results.append(RequestOutput(request_id=uuid.uuid4().hex, prompt=text, prompt_token_ids=ids,
                                         outputs=outs, finished=True))
        return results

    def chat(self, messages, sampling_params: SamplingParams | None = None, chat_template_kwargs: dict | None = None,
             use_tqdm: bool = False) -> list[RequestOutput]:
        """One conversation (a list of {role, content}) or a list of conversations."""
        if self.tokenizer is None:
            raise ValueError("this LLM was built without a tokenizer")
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        if not convs or any(not c for c in convs):
            raise ValueError("messages must be a non-empty list of {role, content} dicts")
        prompts = [{"prompt": self.tokenizer.apply_chat_template(c, **(chat_template_kwargs or {})),
                    "prompt_token_ids": None} for c in convs]
        prompts = [{"prompt": p["prompt"], "prompt_token_ids": self.tokenizer.encode(p["prompt"])} for p in prompts]
        return self.generate(prompts, sampling_params)
