"""bench/eval_mc.py (answer extraction; a run, resume, fingerprint and error handling against the real tiny server)
and a CPU smoke run of bench/serving.py (it starts its own server, then runs the same workload in-process)."""
import json
import os
import subprocess
import sys

import pytest

from server_proc import API_KEY, ENGINE_FLAGS, ROOT, ServerProcess, server_env

sys.path.insert(0, os.path.join(ROOT, "bench"))
from eval_mc import extract_answer, load_items, messages, pick_shots  # noqa: E402

DATA = os.path.join(ROOT, "bench", "data", "mc_tiny.jsonl")
DEV = os.path.join(ROOT, "bench", "data", "mc_tiny_dev.jsonl")


@pytest.mark.parametrize("text,n,want", [
    ("Answer: B", 4, "B"), ("The answer is (B)", 4, "B"), ("B", 4, "B"), ("(C)", 4, "C"), ("D.", 4, "D"),
    ("**Answer:** D", 4, "D"), ("The correct answer is **C**.", 4, "C"), ("answer: a", 4, None),
    ("Let me think. A seems wrong... Answer: C", 4, "C"), ("Answer: A. Wait, no. Answer: B", 4, "B"),
    ("Answer: Because of gravity", 4, None), ("Answer: E", 4, None), ("Answer: E", 5, "E"),
    ("B. Paris is the capital", 4, "B"), ("I think so.", 4, None), ("", 4, None), (None, 4, None),
    ("Answer - A", 4, "A"), ("answer is B", 4, "B"),
])
def test_extract_answer(text, n, want):
    assert extract_answer(text, n) == want


def test_k_shot_prompts():
    items, dev = load_items(DATA), load_items(DEV)
    math = items[6]
    shots = pick_shots(math, dev, 3)
    assert [s["id"] for s in shots] == ["dev-math", "dev-math-2", "dev-geo"]      # same subject first
    msgs = messages(math, shots)
    assert [m["role"] for m in msgs] == ["user", "assistant"] * 3 + ["user"]
    assert msgs[1]["content"] == "Answer: B" and msgs[0]["content"].startswith("The following are multiple choice")
    assert msgs[-1]["content"].startswith("What is 7 multiplied by 8?\nA. 54\nB. 56")
    assert "math" not in msgs[-1]["content"] and math["id"] not in [s["id"] for s in pick_shots(math, items, 9)]


def test_dataset_is_well_formed():
    items = load_items(DATA)
    assert len(items) == 10 and len({it["id"] for it in items}) == 10
    assert all(it["answer"] in "ABCD" and len(it["choices"]) == 4 for it in items)
    assert len(load_items(DEV)) == 4


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    s = ServerProcess(["--model", tiny_model_dir, "--served-model-name", "tiny", "--api-key", API_KEY,
                       *ENGINE_FLAGS])
    yield s
    s.stop()


def eval_mc(server, *args):
    cmd = [sys.executable, os.path.join(ROOT, "bench", "eval_mc.py"), "--base-url", server.url, "--api-key", API_KEY,
           "--max-tokens", "6", "--thinking", "off", "--concurrency", "4", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=server_env(), timeout=300)


def test_eval_run_resume_and_fingerprint(server, tmp_path):
    ckpt, res = str(tmp_path / "ckpt.jsonl"), str(tmp_path / "res.json")
    # (short runs: the tiny model's tokenizer is wordy and long prompts prefill slowly on a CPU)
    run = ["--dataset", DATA, "--limit", "4", "--checkpoint", ckpt, "--result-file", res]
    r = eval_mc(server, *run)
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.load(open(res))
    assert out["errors"] == 0 and out["scored"] == 4 and out["few_shot_items_not_scored"] == 0
    assert 0 <= out["accuracy"] <= 1 and out["asked"] == 4
    lines = open(ckpt).read().splitlines()
    assert json.loads(lines[0])["fingerprint"] == out["fingerprint"] and len(lines) == 5
    done = [json.loads(x) for x in lines[1:]]
    assert {d["id"] for d in done} == {it["id"] for it in load_items(DATA)[:4]}
    assert out["accuracy"] == pytest.approx(sum(d["correct"] for d in done) / 4)

    # a crash after 2 items, mid-way through writing the 3rd: resume asks only the missing 2
    with open(ckpt, "w") as f:
        f.write("\n".join(lines[:3]) + "\n" + lines[3][:20])
    r = eval_mc(server, *run)
    assert r.returncode == 0, r.stdout + r.stderr
    again = json.load(open(res))
    assert again["asked"] == 2 and again["scored"] == 4 and again["accuracy"] == pytest.approx(out["accuracy"])
    assert len(open(ckpt).read().splitlines()) == 5

    # another configuration is refused, and the checkpoint is left alone
    before = open(ckpt).read()
    r = eval_mc(server, "--dataset", DATA, "--k-shot", "1", "--checkpoint", ckpt)
    assert r.returncode != 0 and "different configuration" in r.stderr and "k_shot" in r.stderr
    assert open(ckpt).read() == before


def test_eval_dev_split_and_errors(server, tmp_path):
    """An item the server rejects (its prompt exceeds the context) is an error: no accuracy, not checkpointed;
    the others are kept for the rerun."""
    items = [json.loads(x) for x in open(DATA)]
    items[2]["question"] = "Why? " * 400
    data = tmp_path / "mc.jsonl"
    data.write_text("\n".join(json.dumps(it) for it in items) + "\n")
    ckpt, res = str(tmp_path / "ckpt.jsonl"), str(tmp_path / "res.json")
    r = eval_mc(server, "--dataset", str(data), "--dev", DEV, "--k-shot", "1", "--limit", "3", "--checkpoint", ckpt,
                "--result-file", res)
    assert r.returncode == 1 and "no accuracy" in r.stdout
    out = json.load(open(res))
    assert out["accuracy"] is None and out["errors"] == 1 and out["scored"] == 2
    assert out["few_shot_items_not_scored"] == 0
    assert "maximum context length" in out["error_examples"][items[2]["id"]]
    ids = [json.loads(x)["id"] for x in open(ckpt).read().splitlines()[1:]]
    assert set(ids) == {it["id"] for it in items[:2]}
    # an unknown model fails every request
    r = eval_mc(server, "--dataset", DATA, "--model", "no-such-model", "--limit", "2", "--result-file", res)
    assert r.returncode == 1 and json.load(open(res))["accuracy"] is None


def test_serving_benchmark_smoke(tiny_model_dir, tmp_path):
    """bench/serving.py --compare --config, as on the GPU (random weights, no tokenizer, token-id prompts): the
    in-process run, then a server it starts itself, the same workload through both; all requests complete."""
    out = tmp_path / "serving.json"
    cmd = [sys.executable, os.path.join(ROOT, "bench", "serving.py"), "--compare", "--num-prompts", "4",
           "--input-len", "20", "--output-len", "5", "--max-concurrency", "3", "--ignore-eos", "--num-warmups", "1",
           "--config", os.path.join(tiny_model_dir, "config.json"), "--result-file", str(out), "--", *ENGINE_FLAGS]
    r = subprocess.run(cmd, capture_output=True, text=True, env=server_env(), timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    for name in ("http", "in-process"):
        s = res[name]
        assert (s["completed"], s["failed"], s["total_output_tokens"]) == (4, 0, 20), s
        assert s["total_input_tokens"] == 80 and s["server"]["generation_tokens_total"] >= 20
        assert all(s[k]["p99"] >= s[k]["median"] > 0 for k in ("ttft_ms", "tpot_ms", "e2el_ms"))
    assert res["http_over_in_process_output_throughput"] > 0 and "meets_target" in res
    assert "HTTP / in-process output throughput" in r.stdout
    assert "--load-format dummy --skip-tokenizer-init" in " ".join(res["config"]["serve_args"])


def test_serving_benchmark_request_rate(server, tmp_path):
    """--base-url (an existing server, with its API key) and Poisson arrivals."""
    out = tmp_path / "rate.json"
    cmd = [sys.executable, os.path.join(ROOT, "bench", "serving.py"), "--base-url", server.url, "--api-key", API_KEY,
           "--vocab-size", "1024", "--num-prompts", "4", "--input-len", "12", "--output-len", "3",
           "--request-rate", "20", "--ignore-eos", "--num-warmups", "0", "--result-file", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=server_env(), timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert (res["http"]["completed"], res["http"]["failed"], res["http"]["total_output_tokens"]) == (4, 0, 12)
    assert res["config"]["request_rate"] == 20 and "in-process" not in res
