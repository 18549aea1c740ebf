"""The README's Python API example runs as written, on the default model, in a fresh cache root."""
import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_readme_python_example(tmp_path):
    text = open(os.path.join(ROOT, "README.md")).read()
    section = text[text.index("## Python API"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert "asyncio.run(" in code and "from qwen35_jax import LLM, SamplingParams" in code
    env = dict(os.environ, JAX_PLATFORMS="cpu", QWEN35_JAX_CACHE=str(tmp_path / "cache"), PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path,
                       stdin=subprocess.DEVNULL, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    from qwen35_jax.model.hub import default_model_dir
    model = default_model_dir()
    # the generated token ids: 32, or fewer ending with an EOS id
    m = re.search(r"\[(\d+(?:, \d+)*)\]\n", r.stdout)
    assert m, r.stdout[-3000:]
    ids = [int(x) for x in m.group(1).split(", ")]
    eos = json.load(open(os.path.join(model, "generation_config.json")))["eos_token_id"]
    assert len(ids) == 32 or (len(ids) < 32 and ids[-1] in eos), (ids, eos)
    # the trained model writes words: its greedy continuation is mostly letters and spaces
    words = re.findall(r"[A-Za-z]{2,}", r.stdout[:m.start()])
    assert len(words) >= 8, r.stdout[-3000:]
