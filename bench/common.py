"""What the benchmarks share: engines over random weights at the shapes of a HF config, and the kernel flags."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from qwen35_jax.model.backends import BACKENDS, KernelConfig  # noqa: E402
from qwen35_jax.engine.engine import Engine, EngineArgs, build_engine  # noqa: E402


def config_dir(config: str | dict) -> str:
    """A fresh model directory holding only config.json (a path to a config file, or its parsed dict)."""
    raw = json.load(open(config)) if isinstance(config, str) else config
    path = tempfile.mkdtemp(prefix="qwen35-bench-")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(raw, f)
    return path


def random_engine(config: str | dict, args: EngineArgs, *, weights=None, devices=None) -> Engine:
    """An engine over random weights (args.seed) at the shapes of `config`, without a tokenizer: prompts are token
    ids. weights: reuse another engine's (same shapes, tp and dtype) instead of making new ones."""
    args = dataclasses.replace(args, load_format="dummy", skip_tokenizer_init=True)
    return build_engine(config_dir(config), args, weights=weights, devices=devices)


def add_kernel_args(ap: argparse.ArgumentParser):
    ap.add_argument("--kernel-backend", default=None, choices=BACKENDS,
                    help="default: pallas on GPU, reference elsewhere")
    ap.add_argument("--kernel-config", default="",
                    help="KernelConfig fields to change, e.g. 'decode_split_k=1 gdn_decode.bv=16'")


def kernel_config(args) -> KernelConfig:
    """The KernelConfig that add_kernel_args' flags name."""
    return KernelConfig.parse(args.kernel_config, KernelConfig(backend=args.kernel_backend))


def prompt_ttfts(engine: Engine, lens, chunk: int, reps: int) -> dict[int, list[float]]:
    """Seconds to the first token of one random prompt of each length in lens, `reps` times each (max_tokens=1,
    greedy); first one prompt per prefill bucket the lengths pass through (chunks of `chunk` tokens), so no timed
    request compiles."""
    import numpy as np

    from qwen35_jax.engine.sampling_params import SamplingParams
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    rng = np.random.default_rng(0)
    run = lambda n: engine.generate([rng.integers(0, engine.cfg.vocab_size, n).tolist()], [params])
    for n in sorted({min(lens), *(n % chunk for n in lens if n % chunk)}):
        run(n)
    out = {}
    for n in lens:
        out[n] = []
        for _ in range(reps):
            t0 = time.perf_counter()
            run(n)
            out[n].append(time.perf_counter() - t0)
    return out
