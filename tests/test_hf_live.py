"""Live parity: build fresh random checkpoints with HF (new seed) and compare, when a torch Python is configured.

QWEN35_HF_PYTHON must name an interpreter with torch and transformers (>= 5.2); the JAX side runs here.
"""
import os
import subprocess

import numpy as np
import pytest

from conftest import engine_args
from qwen35_jax.llm import LLM
from qwen35_jax.engine.sampling_params import SamplingParams

HF_PYTHON = os.environ.get("QWEN35_HF_PYTHON")
pytestmark = pytest.mark.skipif(not HF_PYTHON, reason="QWEN35_HF_PYTHON (a Python with torch) is not set")
SCRIPT = os.path.join(os.path.dirname(__file__), "fixtures", "make_hf_fixtures.py")


@pytest.fixture(scope="module")
def live_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf_live")
    subprocess.run([HF_PYTHON, SCRIPT, "--out", str(out), "--seed", "1234",
                    "--cases", "mm_tied_r2_g2,text_untied_r1_g6,mm_untied_r3_g3"], check=True, capture_output=True)
    return out


@pytest.mark.parametrize("case", ["mm_tied_r2_g2", "text_untied_r1_g6", "mm_untied_r3_g3"])
def test_live_parity(live_dir, case):
    d = str(live_dir / case)
    ref = dict(np.load(os.path.join(d, "reference.npz")))
    for tp in (1, 2):
        llm = LLM(d, tensor_parallel_size=tp, skip_tokenizer_init=True, **engine_args(precompile=False))
        for n in (1, 7, 70):
            assert np.abs(llm.logits(ref[f"prompt_{n}"]) - ref[f"logits_{n}"]).max() <= 1e-3
        out = llm.generate([ref["prompt_7"].tolist()], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
        assert out[0].outputs[0].token_ids == ref["greedy_7"].tolist()
