"""Offline Python API named like vLLM's: `LLM(model=...)`, `generate`, `chat`, plus `logits` for parity checks."""
from __future__ import annotations

import dataclasses
import logging
import weakref

import numpy as np

from qwen35_jax.engine.engine import EngineArgs, Observer, build_engine, token_ids as engine_token_ids
from qwen35_jax.engine.outputs import RequestOutput
from qwen35_jax.engine.sampling_params import SamplingParams
from qwen35_jax.model.runner import ModelRunner, make_batch

log = logging.getLogger(__name__)


class LLM:
    """A Qwen3.5 model served by the continuous-batching engine on a `tp` device mesh.

    model: a HF model directory (config.json, safetensors, tokenizer) or a Hugging Face repo id ("Qwen/Qwen3.5-9B",
    fetched into the HF cache at `revision`); None: the default model (model.hub.default_model_dir: a small model
    trained by tools/train_tiny on the Python docs, shipped in the package). Keyword arguments are EngineArgs
    fields (revision, tensor_parallel_size, dtype, max_model_len, max_num_seqs, max_num_batched_tokens, decode_steps,
    page_size, num_kv_pages, kernel_config, compilation_cache_dir, skip_tokenizer_init, converted_weights_dir, ...).
    devices: the mesh's devices (default: all); observer: engine hooks (e.g. metrics).
    """

    def __init__(self, model: str | None = None, *, devices=None, observer: Observer | None = None, **engine_args):
        if model is None:
            from qwen35_jax.model.hub import default_model_dir
            model = default_model_dir()
        self.engine = build_engine(model, EngineArgs(**engine_args), devices=devices, observer=observer)
        self.tokenizer = self.engine.tokenizer
        self.cfg, self.mesh, self.weights = self.engine.cfg, self.engine.mesh, self.engine.weights
        self._runner = None
        # Dropping the LLM stops the engine's loop thread, the one holder of the engine beyond this object, so that
        # its weights, state and executables are freed with it.
        self._stop = weakref.finalize(self, self.engine.shutdown)

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
             use_tqdm: bool = False, tools: list[dict] | None = None, tool_choice=None,
             parallel_tool_calls: bool = True) -> list[RequestOutput]:
        """One conversation (a list of {role, content}) or a list of conversations.

        tools: OpenAI function tools, rendered into the prompt by the chat template; history messages may carry
        assistant tool_calls (arguments as a JSON string or an object) and tool results. As vLLM's LLM.chat, the
        outputs are raw text: `qwen35_jax.server.tool_calls.parse_tool_calls(text, tools)` extracts the calls.
        tool_choice: as the server's ("auto", "none", "required" or {"type": "function", "function": {"name"}}):
        the last two constrain the output to calls (structured outputs). With thinking on, a constraint
        (sampling_params.structured_outputs or a forced call) applies after the reasoning block."""
        if self.tokenizer is None:
            raise ValueError("this LLM was built with skip_tokenizer_init=True")
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        if not convs or any(not c for c in convs):
            raise ValueError("messages must be a non-empty list of {role, content} dicts")
        from qwen35_jax.server.tool_calls import chat_grammar, check_tool_choice, check_tools, \
            history_arguments_as_objects
        tools = check_tools(tools) if tools else None
        must = check_tool_choice(tool_choice, tools)[1]
        params = sampling_params or SamplingParams()
        if must is not None and params.structured_outputs is not None:
            raise ValueError(f"tool_choice {must!r} and sampling_params.structured_outputs each fix the output")
        prompts, per_prompt = [], []
        for conv in convs:
            text = self.tokenizer.apply_chat_template(history_arguments_as_objects(conv),
                                                      **({"tools": tools} if tools else {}),
                                                      **(chat_template_kwargs or {}))
            ids = self.tokenizer.encode(text)
            prompts.append({"prompt": text, "prompt_token_ids": ids})
            spec = chat_grammar(self.tokenizer, ids, params.structured_outputs, tools, must, parallel_tool_calls)
            per_prompt.append(params if spec is params.structured_outputs else
                              dataclasses.replace(params, structured_outputs=spec))
        return self.generate(prompts, per_prompt, use_tqdm)

    def state(self):
        """The decoding state (GDN conv / recurrent pools, K / V pages) of an engine with no requests in flight, to
        look at its shapes and shardings: Engine.state (valid until the next request's first step)."""
        return self.engine.state()

    # ------------------------------------------------------------------------------------------------------------
    def logits(self, token_ids) -> np.ndarray:
        """fp32 logits [len, vocab] at every position of one prompt (a scratch state, not the engine's)."""
        ids = engine_token_ids(token_ids, self.cfg.vocab_size)
        if not ids:
            raise ValueError("prompt is empty")
        if len(ids) > self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens, more than max_model_len={self.max_model_len}")
        page_size = self.engine.args.page_size
        pages = -(-self.max_model_len // page_size)
        if self._runner is None:
            e = self.engine
            self._runner = ModelRunner(e.cfg, e.mesh, e.layout, e.weights, e.dtype, e.kernels, num_slots=1,
                                       num_pages=1 + pages, page_size=page_size)
        t = max(16, 1 << (len(ids) - 1).bit_length())
        tokens = np.zeros((1, t), np.int32)
        tokens[0, :len(ids)] = ids
        batch = make_batch(tokens, [0], [len(ids)], [1], (1 + np.arange(pages))[None])
        logits = self._runner.run(batch, all_logits=True)
        return np.asarray(logits)[0, :len(ids), :self.cfg.vocab_size].astype(np.float32)

    def shutdown(self):
        """Stop the engine's loop thread (idempotent; also done at interpreter exit). `with LLM(...) as llm:` calls
        it on leaving the block, and dropping the LLM does too."""
        self._stop()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
