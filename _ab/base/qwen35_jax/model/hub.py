"""Models named as users name them: a local directory, or a Hugging Face repo id ("Qwen/Qwen3.5-9B").

A repo id is fetched with huggingface_hub into its usual cache, which reads its own settings: HF_HOME / HF_HUB_CACHE
(where), HF_ENDPOINT, HF_TOKEN (gated or private repos), HF_HUB_OFFLINE=1 (only what is cached, no network).
Only the files an engine reads are downloaded.
"""
from __future__ import annotations

import logging
import os
import re

log = logging.getLogger(__name__)

# Config, weights, tokenizer and chat template: what build_engine, the tokenizer and the server read.
ALLOW_PATTERNS = ["config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
                  "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                  "added_tokens.json", "chat_template.jinja", "chat_template.json"]
# "name" or "org/name" (huggingface_hub's own rule); anything else that does not exist is a missing local path.
REPO_ID = re.compile(r"(?:[\w\-.]{1,96}/)?[\w\-.]{1,96}")


PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_NAME = "tiny-qwen3.5-pydoc"
DEFAULT_MODEL = os.path.join(PACKAGE, "assets", DEFAULT_NAME)
DEFAULT_SUMMARY = ("a small Qwen3.5-architecture model (9M parameters) trained by this project on the Python "
                   "documentation to exercise the engine; not Qwen3.5's weights")     # tools/train_tiny, model card
DEFAULT_DESCRIPTION = f"{DEFAULT_NAME}, {DEFAULT_SUMMARY}"


def default_model_dir() -> str:
    """The default model (LLM(), `python -m qwen35_jax`, `serve` without --model): the checkpoint tools/train_tiny
    wrote, shipped in the package (qwen35_jax/assets/)."""
    if not os.path.exists(os.path.join(DEFAULT_MODEL, "model.safetensors")):
        raise FileNotFoundError(f"the default model is missing from {DEFAULT_MODEL} (an incomplete install?); pass a "
                                "model directory or a Hugging Face repo id")
    return DEFAULT_MODEL


def resolve_model(model: str, revision: str | None = None) -> str:
    """The local directory of `model`: an existing directory as is (revision ignored), else a repo id downloaded
    (at `revision`: a branch, tag or commit; default main) into the HF cache, whose snapshot directory is returned.
    Raises FileNotFoundError for a missing directory, an unknown repo or revision, or a repo that is neither cached
    nor reachable; never falls back to another model."""
    path = os.path.expanduser(model)
    if os.path.isdir(path):
        if revision is not None:
            log.warning("model %r is a local directory: revision %r is ignored", model, revision)
        return path
    if os.path.exists(path):
        raise NotADirectoryError(f"model {model!r} is a file; give a model directory or a Hugging Face repo id")
    if not REPO_ID.fullmatch(model) or model.startswith(".") or ".." in model:
        raise FileNotFoundError(f"model {model!r}: no such directory")
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

    where = f"{model!r} (revision {revision or 'main'})"
    try:
        local = snapshot_download(model, revision=revision, allow_patterns=ALLOW_PATTERNS)
    except RevisionNotFoundError as e:
        raise FileNotFoundError(f"model {model!r}: revision {revision!r} not found on {constants.ENDPOINT}") from e
    except RepositoryNotFoundError as e:
        raise FileNotFoundError(f"model {model!r}: no such local directory, and no such repo on {constants.ENDPOINT} "
                                "(or it is private or gated: set HF_TOKEN)") from e
    except LocalEntryNotFoundError as e:
        why = ("HF_HUB_OFFLINE=1 is set" if constants.HF_HUB_OFFLINE
               else f"{constants.ENDPOINT} could not be reached (HF_HUB_OFFLINE=1 uses only the cache)")
        raise FileNotFoundError(f"model {where}: no such local directory, not in the Hugging Face cache "
                                f"{constants.HF_HUB_CACHE}, and {why}") from e
    if not os.path.exists(os.path.join(local, "config.json")):
        raise FileNotFoundError(f"model {where} has no config.json: not a Hugging Face transformers checkpoint")
    return local
