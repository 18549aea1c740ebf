"""Offline Python API named like vLLM's: `LLM(model=...)`, `generate`, `chat`, plus `logits` for parity checks."""
from __future__ import annotations

import json
import logging
import os

import jax.numpy as jnp
import numpy as np

from qwen35_jax.config import ModelConfig
from qwen35_jax.engine import Engine, EngineArgs
from qwen35_jax.outputs import RequestOutput
from qwen35_jax.runner import ModelRunner, make_batch
from qwen35_jax.sampling_params import SamplingParams
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


def load_model_weights(model_dir, cfg: ModelConfig, mesh, dtype, converted_dir: str | None = None):
    """Checkpoint -> sharded weights; with converted_dir, restore the re-laid-out shards saved by an earlier start
    (orbax), or save them there after this load."""
    if converted_dir:
        path = os.path.abspath(os.path.join(converted_dir, f"tp{mesh.shape['tp']}-{jnp.dtype(dtype).name}"))
        if os.path.exists(path):
            log.info("restoring converted weights from %s", path)
            return restore_converted(path, cfg, mesh, dtype)
        weights = load_weights(model_dir, cfg, mesh, dtype, progress=True)
        save_converted(weights, path)
        return weights
    return load_weights(model_dir, cfg, mesh, dtype, progress=True)


def eos_token_ids(model_dir, cfg: ModelConfig, tokenizer) -> set[int]:
    """EOS ids from config.json, generation_config.json and the tokenizer."""
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
    """A Qwen3.5 model served by the continuous-batching engine on a `tp` device mesh.

    model: a HF model directory (config.json, safetensors, tokenizer). dtype: "bfloat16" or "float32".
    converted_weights_dir: where the re-laid-out, sharded weights are saved with orbax after the first load and
    restored from on the next start. Other keyword arguments are EngineArgs (max_num_batched_tokens,
    decode_steps, page_size, num_kv_pages, compilation_cache_dir, ...).
    """

    def __init__(self, model: str, tensor_parallel_size: int = 1, dtype="bfloat16", max_model_len: int | None = None,
                 max_num_seqs: int = 16, kernel_backend: str | None = None, skip_tokenizer_init: bool = False,
                 converted_weights_dir: str | None = None, devices=None, seed: int = 0, **engine_args):
        from qwen35_jax.config import load_config
        from qwen35_jax.sharding import make_mesh
        args = EngineArgs(tensor_parallel_size=tensor_parallel_size, dtype=dtype, max_model_len=max_model_len,
                          max_num_seqs=max_num_seqs, kernel_backend=kernel_backend, seed=seed, **engine_args)
        args.validate()
        cfg = load_config(model)
        mesh = make_mesh(tensor_parallel_size, devices, args.data_parallel_size)
        from qwen35_jax.sharding import Layout
        Layout.build(cfg, tensor_parallel_size)                 # head counts tp cannot split fail before loading
        self.tokenizer = None if skip_tokenizer_init else Tokenizer(model)
        weights = load_model_weights(model, cfg, mesh, resolve_dtype(dtype), converted_weights_dir)
        self.engine = Engine(model, args, tokenizer=self.tokenizer, weights=weights, devices=devices)
        self.engine.eos_token_ids = eos_token_ids(model, cfg, self.tokenizer)
        self.cfg, self.mesh, self.weights = cfg, self.engine.mesh, weights
        self._runner = None

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    # ------------------------------------------------------------------------------------------------------------
    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """prompts: a string, a list of token ids, a {"prompt"/"prompt_token_ids": ...} dict, or a list of these."""
        single = isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                      and isinstance(prompts[0], (int, np.integer)))
        prompts = [prompts] if single else list(prompts)
        params = sampling_params or SamplingParams()
        params = list(params) if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling_params for {len(prompts)} prompts")
        return self.engine.generate(prompts, params, use_tqdm)

    async def generate_async(self, prompt, sampling_params: SamplingParams | None = None, request_id=None):
        """Stream one request: yields cumulative RequestOutputs as tokens arrive (usable inside Jupyter)."""
        async for out in self.engine.generate_async(prompt, sampling_params or SamplingParams(), request_id):
            yield out

    def chat(self, messages, sampling_params: SamplingParams | None = None, chat_template_kwargs: dict | None = None,
             use_tqdm: bool = False) -> list[RequestOutput]:
        """One conversation (a list of {role, content}) or a list of conversations."""
        if self.tokenizer is None:
            raise ValueError("this LLM was built with skip_tokenizer_init=True")
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        if not convs or any(not c for c in convs):
            raise ValueError("messages must be a non-empty list of {role, content} dicts")
        prompts = []
        for conv in convs:
            text = self.tokenizer.apply_chat_template(conv, **(chat_template_kwargs or {}))
            prompts.append({"prompt": text, "prompt_token_ids": self.tokenizer.encode(text)})
        return self.generate(prompts, sampling_params, use_tqdm)

    # ------------------------------------------------------------------------------------------------------------
    def logits(self, token_ids) -> np.ndarray:
        """fp32 logits [len, vocab] at every position of one prompt (a scratch state, not the engine's)."""
        ids = [int(t) for t in token_ids]
        if not ids:
            raise ValueError("prompt is empty")
        if len(ids) > self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens, more than max_model_len={self.max_model_len}")
        bad = [t for t in ids if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {self.cfg.vocab_size})")
        page_size = self.engine.args.page_size
        pages = -(-self.max_model_len // page_size)
        if self._runner is None:
            self._runner = ModelRunner(self.cfg, self.mesh, self.weights, self.engine.dtype, num_slots=1,
                                       num_pages=1 + pages, page_size=page_size,
                                       kernel_backend=self.engine.backend)
        t = max(16, 1 << (len(ids) - 1).bit_length())
        tokens = np.zeros((1, t), np.int32)
        tokens[0, :len(ids)] = ids
        batch = make_batch(tokens, [0], [len(ids)], [1], (1 + np.arange(pages))[None])
        logits = self._runner.run(batch, all_logits=True)
        return np.asarray(logits)[0, :len(ids), :self.cfg.vocab_size].astype(np.float32)

    def shutdown(self):
        """Stop the engine's loop thread (idempotent; also done at interpreter exit). `with LLM(...) as llm:` calls
        it on leaving the block."""
        self.engine.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
