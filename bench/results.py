"""Write a benchmark's table into bench/RESULTS.md as a section that names its command, commit and machine.

A section is replaced when the same title is recorded again, so the file always holds each benchmark's latest run.
"""
from __future__ import annotations

import datetime
import os
import re
import shlex
import subprocess
import sys

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md")
HEADER = ("# Benchmark results\n\nEvery figure quoted anywhere in this project is here, with the command that made "
          "it, the commit and the machine. Ratios are measured side by side in one run.\n")


def commit() -> str:
    """$QWEN35_COMMIT when set (the GPU machine's copy of the repo may carry an older .git), else git's HEAD, marked
    +uncommitted when tracked files other than RESULTS.md differ from it."""
    if os.environ.get("QWEN35_COMMIT", "unknown") != "unknown":
        return os.environ["QWEN35_COMMIT"]
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=os.path.dirname(RESULTS), check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":!bench/RESULTS.md"],
                               capture_output=True, text=True, cwd=os.path.dirname(RESULTS)).stdout.strip()
        return sha + ("+uncommitted" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def machine() -> str:
    import jax
    dev = jax.devices()[0]
    desc = f"{len(jax.devices())}× {dev.device_kind} ({jax.default_backend()}), jax {jax.__version__}"
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        if smi.returncode == 0:
            desc += f"; nvidia-smi: {smi.stdout.strip().splitlines()[0]}"
    except (OSError, subprocess.TimeoutExpired):
        pass
    return desc + f"; {os.cpu_count()} CPU cores"


def record(title: str, body: str, command: str | None = None):
    command = command or "python " + " ".join(shlex.quote(a) for a in sys.argv)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    section = (f"## {title}\n\n- command: `{command}`\n- commit: `{commit()}`\n- machine: {machine()}\n"
               f"- date: {stamp}\n\n{body.rstrip()}\n")
    text = open(RESULTS).read() if os.path.exists(RESULTS) else HEADER
    pattern = re.compile(rf"^## {re.escape(title)}\n.*?(?=^## |\Z)", re.S | re.M)
    text = pattern.sub(lambda _: section + "\n", text) if pattern.search(text) else text.rstrip() + "\n\n" + section
    with open(RESULTS, "w") as f:
        f.write(text)
    print(f"recorded '{title}' in {RESULTS}")


def table(rows: list[dict], columns: list[str]) -> str:
    out = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        out.append("| " + " | ".join(str(r.get(c, "")) for c in columns) + " |")
    return "\n".join(out)


def sections(text: str) -> dict:
    """{title: section text} of a RESULTS.md text."""
    return {m.group(1): m.group(0) for m in re.finditer(r"^## ([^\n]*)\n.*?(?=^## |\Z)", text, re.S | re.M)}


def merge(paths: list[str]):
    """Take into bench/RESULTS.md every section of the given RESULTS.md files (copies the GPU machine sent back)
    that is new or dated later than ours: one call's sections never overwrite another call's newer ones."""
    text = open(RESULTS).read()
    date = lambda sec: (re.search(r"^- date: (.*)$", sec, re.M) or [None, ""])[1]
    for path in paths:
        ours = sections(text)
        for title, sec in sections(open(path).read()).items():
            if title not in ours:
                text = text.rstrip() + "\n\n" + sec.rstrip() + "\n"
            elif date(sec) > date(ours[title]):
                text = text.replace(ours[title], sec.rstrip() + "\n\n")
            else:
                continue
            print(f"merged '{title}' from {path}")
    with open(RESULTS, "w") as f:
        f.write(text.rstrip() + "\n")


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] != "merge":
        sys.exit("usage: python bench/results.py merge RESULTS.md...")
    merge(sys.argv[2:])
