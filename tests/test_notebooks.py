"""The notebooks run top to bottom on the CPU (any cell error fails), and are committed without outputs."""
import json
import os

import nbclient
import nbformat
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = ["quickstart", "profiling", "tensor_parallel"]
CELL_TIMEOUT = 300


def path(name):
    return os.path.join(ROOT, "notebooks", f"{name}.ipynb")


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_is_stripped(name):
    with open(path(name)) as f:
        nb = json.load(f)
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] == "code":
            assert cell["outputs"] == [] and cell["execution_count"] is None, f"{name} cell {i} has outputs"


def run(name, tmp_path, monkeypatch):
    """Execute in a fresh kernel (cwd: a temp dir) on the CPU, with this checkout importable."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    nb = nbformat.read(path(name), as_version=4)
    client = nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()            # raises CellExecutionError on the first failing cell
    return nb


def outputs_text(cell) -> str:
    parts = []
    for out in cell.get("outputs", []):
        parts.append(out.get("text", ""))
        parts.extend(str(v) for v in out.get("data", {}).values())
    return "\n".join(parts)


def test_quickstart(tmp_path, monkeypatch):
    nb = run("quickstart", tmp_path, monkeypatch)
    code = [c for c in nb.cells if c.cell_type == "code"]
    load = next(c for c in code if "LLM(model=" in c.source)
    # The tqdm bars of weight loading and the precompile sweep render as notebook widgets (tqdm.auto).
    widgets = [o for o in load.outputs if "application/vnd.jupyter.widget-view+json" in o.get("data", {})]
    bars = " ".join(o["data"].get("text/plain", "") for o in widgets)
    assert "loading weights" in bars and "precompiling buckets" in bars, load.outputs
    stream = next(c for c in code if "async for out in llm.generate_async" in c.source)
    assert "tokens]" in outputs_text(stream)
    gathered = next(c for c in code if "asyncio.gather" in c.source)
    assert gathered.outputs and gathered.outputs[0]["output_type"] == "execute_result"
    mesh = next(c for c in code if "print(llm.mesh)" in c.source)
    shards = outputs_text(mesh)
    assert "'tp': 2" in shards and "cpu:1" in shards and "P('vocab'" not in shards
    assert "    cpu:0    [0:2048, :]" in shards and "    cpu:1    [2048:4096, :]" in shards     # the vocab-split embed


def test_profiling(tmp_path, monkeypatch):
    nb = run("profiling", tmp_path, monkeypatch)
    text = "\n".join(outputs_text(c) for c in nb.cells if c.cell_type == "code")
    assert "roofline ratio" in text and "gdn layer" in text
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if "image/png" in o.get("data", {})]
    assert len(images) == 2


def test_tensor_parallel(tmp_path, monkeypatch):
    nb = run("tensor_parallel", tmp_path, monkeypatch)
    text = "\n".join(outputs_text(c) for c in nb.cells if c.cell_type == "code")
    assert "DIFFERENT" not in text and text.count("same") == 4
    assert "cpu:3" in text and "tp=4 / tp=1" in text
