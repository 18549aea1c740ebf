"""The README's Python API example runs as written, on the embedded tiny model, in a fresh cache root."""
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
    assert re.search(r"\[\d+(, \d+){31}\]\n", r.stdout), r.stdout[-3000:]         # the 32 generated token ids
    assert os.path.exists(tmp_path / "cache" / "tiny-qwen3.5" / "model.safetensors")     # LLM() built the tiny model
