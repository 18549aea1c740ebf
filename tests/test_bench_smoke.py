"""CPU smoke run of bench/tp.py, as on the GPU machine but on two simulated devices and the tiny fixture config: the
GPU runs of the benches are rare, so a bench that no longer matches the library's API must fail here first."""
import math
import os
import re
import subprocess
import sys

from conftest import fixture_dir
from server_proc import ROOT, server_env


def test_tp_bench_smoke():
    """tp=2 against tp=1: logits agree, per-device weights and GDN state halve, decode steps are timed (through
    bench/throughput.py's time_decode) and a profiler trace of the tp=2 steps is read."""
    cmd = [sys.executable, os.path.join(ROOT, "bench", "tp.py"), "--configs",
           os.path.join(fixture_dir("text_tied_r2_g1"), "config.json"), "--tp", "2", "--batches", "1",
           "--prompt-len", "16", "--max-num-seqs", "4", "--no-precompile"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=server_env(), timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = r.stdout
    assert "tp=2 vs tp=1: top-1 agreement 1.0000" in out
    assert "GDN recurrent state pool" in out and "(0.500×)" in out
    assert "collectives per decode step (batch 1," in out and "\n| 1 | " in out


def test_ab_decode_bench_smoke():
    """bench/ab_decode.py: two kernel variants, each its own engine in one process, timed in alternating rounds
    (the second also sampling at a temperature: the lean sampler's executable, not the greedy one's; and running
    its one row alone, decode_min_rows = 1, where the default pads it to two)."""
    variant = "gdn_decode.bv=32 gdn_decode.num_warps=2 decode_min_rows=1 temperature=0.7"
    cmd = [sys.executable, os.path.join(ROOT, "bench", "ab_decode.py"), "--config",
           os.path.join(fixture_dir("text_tied_r2_g1"), "config.json"), "--kernel-backend", "pallas_interpret",
           "--variants", "", variant, "--batches", "1", "--context", "40", "--rounds", "2", "--iters", "2"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=server_env(), timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "'variant': '(default)'" in r.stdout and f"'variant': '{variant}'" in r.stdout
    assert "'rounds faster': '" in r.stdout and "batch 1 round 1: " in r.stdout
    bad = subprocess.run(cmd[:2] + ["--variants", "", "gdn_decode.no_such_field=1"], capture_output=True, text=True,
                         env=server_env(), timeout=600)
    assert bad.returncode != 0 and "DecodeConfig has no field 'no_such_field'" in bad.stderr


def test_engine_check_bench_smoke():
    """bench/engine_check.py: the same requests through two backends (here the reference twice: the script's
    bookkeeping; the GPU run compares pallas with it), chunked prompts, compared along the common prefix."""
    cmd = [sys.executable, os.path.join(ROOT, "bench", "engine_check.py"), "--config",
           os.path.join(fixture_dir("bf16_gate"), "config.json"), "--backends", "reference", "reference",
           "--prompt-lens", "1,40,3", "--budget", "32", "--max-model-len", "96", "--output-len", "3"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=server_env(), timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "'identical leading tokens': '3 / 3'" in r.stdout
    assert ("top-1 agreement 1.0000 over 9 positions, mean |delta logprob| 0.0000 over 9; 0 parting(s), largest "
            "margin 0.0000: PASS") in r.stdout
    # the bars bite: no |delta| is below a negative bar
    bad = subprocess.run(cmd + ["--max-mean-delta", "-1"], capture_output=True, text=True, env=server_env(),
                         timeout=600)
    assert bad.returncode == 1 and ": FAIL (bars: mean |delta| <= -1.0" in bad.stdout


def test_prefill_parts_bench_smoke():
    """bench/prefill_parts.py's whole table (every WHOLE configuration against the fp32 token scan, timed) on the
    CPU's scaled-down case: each row within the issue's bars, none failed, each timed (a finite figure: the slope of
    single dry-run samples on a busy 2-core machine can come out negative, so its sign is not checked)."""
    cmd = [sys.executable, os.path.join(ROOT, "bench", "prefill_parts.py"), "--case", "1x1k", "--parts", "whole"]
    r = subprocess.run(cmd, capture_output=True, text=True, env={**server_env(), "BENCH_DRY": "1"}, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = [line.split(" | ") for line in r.stdout.splitlines() if line.startswith("| prefill_")]
    assert len(rows) >= 3 and "failed" not in r.stdout, r.stdout[-3000:]
    for row in rows:
        _, o, s, us = row
        assert float(o) <= 4e-3 and float(s) <= 3e-3 and math.isfinite(float(us.rstrip(" |"))), row


def test_kernels_bench_headline_smoke():
    """bench/kernels.py's headline sections (correctness of the defaults, the prefill cases) on the CPU's scaled-down
    shapes in interpret mode: both prefill configurations within the bars, every case timed (a finite figure, as
    above)."""
    cmd = [sys.executable, os.path.join(ROOT, "bench", "kernels.py"), "--time-limit", "400", "--no-model", "--only",
           "correct_defaults", "headline", "prefill_cases"]
    r = subprocess.run(cmd, capture_output=True, text=True, env={**server_env(), "BENCH_DRY": "1"}, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    checks = [line for line in r.stdout.splitlines() if line.startswith("| prefill_") and line.count("|") == 6]
    assert len(checks) == 2 and all(line.endswith("| True | True |") for line in checks), checks
    cases = [line.split(" | ") for line in r.stdout.splitlines() if line.startswith(("| 1x", "| 8x"))]
    assert len(cases) >= 4, cases
    for c in cases:
        assert math.isfinite(float(c[2])), c


def test_mgpu_precision_bench_smoke():
    """bench/mgpu_precision.py on two short sequences (one with a tail chunk; the padded length a multiple of 8, as
    the Mosaic scan needs): a row per configuration (the Mosaic scan, the solve2 prep), each within the issue's bars."""
    cmd = [sys.executable, os.path.join(ROOT, "bench", "mgpu_precision.py"), "--lens", "72,1", "--configs", "",
           "prep_mode=solve2"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=server_env(), timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = [line.split(" | ") for line in r.stdout.splitlines()
            if line.startswith(("| (default)", "| prep_mode=solve2"))]
    assert len(rows) == 2, r.stdout
    for row in rows:
        assert float(row[1]) <= 4e-3 and float(row[2].rstrip(" |")) <= 3e-3, row


def test_profile_bench_smoke(tmp_path):
    """bench/profile.py: `qwen35_jax.tools.profile`'s command line on the default model, one request decoding in
    the engine's bucket for it (two rows), the table recorded through bench/results.py into $QWEN35_RUNS_DIR (a
    temporary directory: tests never write into bench/runs/)."""
    from conftest import XLA_CACHE
    runs = tmp_path / "runs"
    cmd = [sys.executable, os.path.join(ROOT, "bench", "profile.py"), "--batch", "1", "--prompt-len", "16",
           "--decode-steps", "2", "--dtype", "float32", "--copy-mib", "16", "--out", str(tmp_path / "prof"),
           "--compilation-cache-dir", XLA_CACHE]
    r = subprocess.run(cmd, capture_output=True, text=True, env={**server_env(), "QWEN35_RUNS_DIR": str(runs)},
                       timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "roofline ratio" in r.stdout
    files = sorted(os.listdir(runs))
    assert len(files) == 2 and files[1] == "history.md" and files[0].endswith(".json"), files
    history = open(runs / "history.md").read()
    # one request decodes in the engine's smallest bucket, beside a padding row (KernelConfig.decode_min_rows)
    assert history.count("\n## Profile: tiny-qwen3.5-pydoc: batch 1 (decode bucket 2), prompt 16, 2 decode steps") == 1
    assert "- command: `python bench/profile.py --batch 1 --prompt-len 16" in history


def test_moe_bench_smoke(tmp_path):
    """bench/moe.py on a tiny MoE config with the interpret-mode kernels (the router kernel, the per-copy expert
    kernels at batch 1 and the sorted ones at batch 4, past copies_max): the counting engine reports the
    experts each step routes to, near the uniform expectation, and every batch is timed against its floor; a
    prompt's time to the first token beside its expert floor."""
    import ast
    import json
    raw = json.load(open(os.path.join(fixture_dir("moe_text_untied_e16_k4"), "config.json")))
    json.dump(dict(raw, moe_intermediate_size=32), open(tmp_path / "config.json", "w"))   # the kernel's tiles
    cmd = [sys.executable, os.path.join(ROOT, "bench", "moe.py"), "--config", str(tmp_path / "config.json"),
           "--batches", "1,4", "--context", "16", "--iters", "2", "--hf-tokens", "0",
           "--kernel-backend", "pallas_interpret", "--kernel-config", "expert_gemm.copies_max=8", "--ttft", "24"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=server_env(), timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = [ast.literal_eval(line) for line in r.stdout.splitlines() if line.startswith("{'batch'")]
    assert [row["batch"] for row in rows] == [1, 4]
    assert rows[0]["experts_touched_per_layer"] == 4.0        # k of one token's routing
    assert abs(rows[1]["experts_touched_per_layer"] - rows[1]["uniform_expectation"]) < 3
    assert all(row["floor_ms"] > 0 and row["step_ms"] > 0 for row in rows) and "No HF run." in r.stdout
    ttft = [ast.literal_eval(line.split("} ")[0] + "}") for line in r.stdout.splitlines()
            if line.startswith("{'prompt tokens'")]
    assert [t["prompt tokens"] for t in ttft] == [24] and ttft[0]["ttft ms"] > 0 < ttft[0]["expert floor ms"]


def test_gemv_and_lm_head_bench_smoke():
    """bench/gemv.py (the GEMV kernel in interpret mode against forward.project, exact on the same row, timed from
    a CPU trace) and
    bench/lm_head.py (the head's prefill forms) run and print their tables."""
    gemv = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "gemv.py"), "--shapes", "256x128", "--tiles",
                           "n64_k128_p264,n32_k256_p264", "--calls", "2"], capture_output=True, text=True,
                          env=server_env(), timeout=600)
    assert gemv.returncode == 0, gemv.stdout[-3000:] + gemv.stderr[-3000:]
    assert '"form": "n64_k128_p264"' in gemv.stdout and '"max_abs_err": 0.0' in gemv.stdout
    assert "| 256x128 [256, 128] |" in gemv.stdout
    assert re.search(r"\| n(64_k128|32_k256)_p264 \(\d+\.\d\dx\) \|", gemv.stdout)          # the best tile
    head = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "lm_head.py"), "--config",
                           os.path.join(fixture_dir("text_tied_r2_g1"), "config.json"), "--tokens", "16",
                           "--calls", "1,2"], capture_output=True, text=True, env=server_env(), timeout=600)
    assert head.returncode == 0, head.stdout[-3000:] + head.stderr[-3000:]
    assert "| barrier | 16 |" in head.stdout and "| decode | 1 |" in head.stdout


def test_ab_tree_leaves_out_runs_and_assets(tmp_path):
    """bench/ab_tree.sh: a commit's product and bench/ without bench/runs and the assets (the device's 64 MiB)."""
    out = tmp_path / "tree"
    r = subprocess.run(["bash", os.path.join(ROOT, "bench", "ab_tree.sh"), "HEAD", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert (out / "qwen35_jax" / "model" / "forward.py").exists() and (out / "bench" / "ab_commit.py").exists()
    assert not (out / "bench" / "runs").exists() and not (out / "qwen35_jax" / "assets").exists()
