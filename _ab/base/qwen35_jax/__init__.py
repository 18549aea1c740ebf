"""qwen35_jax: an inference engine for the Qwen3.5 model family in JAX.

    from qwen35_jax import LLM, SamplingParams

The public names are imported on first use, so `python -m qwen35_jax.<tool>` and `import qwen35_jax.env` stay light.
"""
import importlib

_EXPORTS = {
    "LLM": "qwen35_jax.llm",
    "SamplingParams": "qwen35_jax.engine.sampling_params",
    "StructuredOutputsParams": "qwen35_jax.engine.sampling_params",
    "RequestOutput": "qwen35_jax.engine.outputs",
    "CompletionOutput": "qwen35_jax.engine.outputs",
    "Logprob": "qwen35_jax.engine.outputs",
    "EngineArgs": "qwen35_jax.engine.engine",
    "KernelConfig": "qwen35_jax.model.backends",
    "build_engine": "qwen35_jax.engine.engine",
}
__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'qwen35_jax' has no attribute {name!r}")


def __dir__():
    return sorted(__all__)
