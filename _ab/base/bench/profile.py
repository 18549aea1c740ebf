"""Profile a prefill and N decode steps (`qwen35_jax.tools.profile`) and record the table through bench/results.py:
a JSON file under bench/runs/ and a section of bench/runs/history.md, with command, commit (git, else
$QWEN35_COMMIT) and machine.

Takes the arguments of `python -m qwen35_jax.tools.profile` (prints the same table), plus --no-record:

    python bench/profile.py --config bench/configs/qwen3.5-9b.json --random-weights --batch 64 --prompt-len 1024 \
        --decode-steps 8 --out /tmp/prof --greedy

`qwen35_jax` is imported from sys.path as it stands (e.g. PYTHONPATH naming an older tree to profile beside this
one); bench/results.py always from this directory.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
if sys.path and os.path.abspath(sys.path[0] or os.getcwd()) == HERE:
    sys.path.pop(0)                          # this directory would shadow the standard library's `profile`
sys.path.append(os.path.dirname(HERE))       # the repository, after anything PYTHONPATH names


def _results():
    """bench/results.py of this directory, loaded once (whatever `bench` sys.path would find first)."""
    if "_bench_results" not in sys.modules:
        spec = importlib.util.spec_from_file_location("_bench_results", os.path.join(HERE, "results.py"))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        sys.modules["_bench_results"] = mod
    return sys.modules["_bench_results"]


def record(report, command: str, top_unattributed: int = 8) -> str:
    """Record a `qwen35_jax.tools.profile.ProfileReport`'s table; returns the run's JSON file."""
    from qwen35_jax.tools import profile as qp
    table = qp.format_report(report, top_unattributed)
    fields = {"floor_ms": report.floor_ms, "decode_wall_ms": report.decode_wall_ms, "decode_ms": report.decode_ms,
              "roofline_ratio": report.roofline_ratio, "copy_bandwidth": report.copy_bandwidth,
              "floor_bytes": report.floor_bytes}
    return _results().record(f"Profile: {report.title}", "```text\n" + table + "\n```", command, fields)


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--no-record", action="store_true")
    ap.add_argument("--top-unattributed", type=int, default=8)
    own, _ = ap.parse_known_args(argv)
    from qwen35_jax.tools import profile as qp
    report = qp.main([a for a in argv if a != "--no-record"])
    if not own.no_record:
        record(report, "python bench/profile.py " + " ".join(shlex.quote(a) for a in argv), own.top_unattributed)
    return report


if __name__ == "__main__":
    main()
