"""Record a benchmark run under bench/runs/: one JSON file per run and its markdown section appended to the log.

`record(title, body, command, fields)` writes `bench/runs/<UTC date>_<slug of title>.json` (title, command, commit,
machine, date, the body text and the caller's structured `fields`) and appends the same run as a markdown section
(`## title`, `- command:`, `- commit:`, `- machine:`, `- date:`, body) to `bench/runs/history.md`, the raw log of
every run. A title recorded again by the same process (a bench that saves as it goes) replaces its own section and
file; a later process appends a new one. bench/RESULTS.md is the hand-edited summary and is never written here.

$QWEN35_RUNS_DIR moves the runs directory (tests point it at a temporary one).
"""
from __future__ import annotations

import datetime
import glob
import json
import os
import re
import shlex
import shutil
import subprocess
import sys

BENCH = os.path.dirname(os.path.abspath(__file__))
HEADER = ("# Benchmark runs\n\nThe raw log: every recorded benchmark run, with the command that made it, the commit "
          "and the machine. The summary is bench/RESULTS.md.\n")
_written: dict[str, tuple[str, str]] = {}    # title -> (json path, section) recorded by this process


def runs_dir() -> str:
    return os.environ.get("QWEN35_RUNS_DIR") or os.path.join(BENCH, "runs")


def history_path() -> str:
    return os.path.join(runs_dir(), "history.md")


def commit() -> str:
    """$QWEN35_COMMIT when set (the GPU machine's copy of the repo may carry an older .git), else git's HEAD, marked
    +uncommitted when tracked files other than the results (bench/RESULTS.md, bench/runs/) differ from it."""
    if os.environ.get("QWEN35_COMMIT", "unknown") != "unknown":
        return os.environ["QWEN35_COMMIT"]
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=BENCH, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                                ":!bench/RESULTS.md", ":!bench/runs"],
                               capture_output=True, text=True, cwd=os.path.dirname(BENCH)).stdout.strip()
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


def slug(title: str, limit: int = 80) -> str:
    s = re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")
    return s[:limit].rstrip("-") or "run"


def record(title: str, body: str, command: str | None = None, fields: dict | None = None) -> str:
    """Record one run (see the module docstring); returns the JSON file's path."""
    command = command or "python " + " ".join(shlex.quote(a) for a in sys.argv)
    now = datetime.datetime.now(datetime.timezone.utc)
    stamp = now.strftime("%Y-%m-%d %H:%M UTC")
    sha, desc = commit(), machine()
    section = _section(title, command, sha, desc, stamp, body)
    os.makedirs(runs_dir(), exist_ok=True)
    if title in _written and os.path.exists(_written[title][0]):
        path, old = _written[title]
    else:
        base = os.path.join(runs_dir(), f"{now.strftime('%Y-%m-%d')}_{slug(title)}")
        path, n = base + ".json", 1
        while os.path.exists(path):                  # the same title on the same day: a file of its own
            n += 1
            path = f"{base}_{n}.json"
        old = None
    run = {"title": title, "command": command, "commit": sha, "machine": desc, "date": stamp, "body": body.rstrip()}
    if fields:
        run["fields"] = fields
    with open(path, "w") as f:
        json.dump(run, f, indent=1, default=str, ensure_ascii=False)
        f.write("\n")
    hist = history_path()
    text = open(hist).read() if os.path.exists(hist) else HEADER
    if old is not None and old in text:
        i = text.rindex(old)
        text = text[:i] + section + text[i + len(old):]
    else:
        text = text.rstrip() + "\n\n" + section
    with open(hist, "w") as f:
        f.write(text)
    _written[title] = (path, section)
    print(f"recorded '{title}' in {path} and {hist}")
    return path


def _section(title, command, sha, desc, stamp, body) -> str:
    """A run's section of history.md."""
    return (f"## {title}\n\n- command: `{command}`\n- commit: `{sha}`\n- machine: {desc}\n"
            f"- date: {stamp}\n\n{body.rstrip()}\n")


def table(rows: list[dict], columns: list[str]) -> str:
    out = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        out.append("| " + " | ".join(str(r.get(c, "")) for c in columns) + " |")
    return "\n".join(out)


def sections(text: str) -> list:
    """[((title, date), section text)] of a history.md text, in its order."""
    out = []
    for m in re.finditer(r"^## ([^\n]*)\n.*?(?=^## |\Z)", text, re.S | re.M):
        date = (re.search(r"^- date: (.*)$", m.group(0), re.M) or [None, ""])[1]
        out.append(((m.group(1), date), m.group(0)))
    return out


def merge(paths: list[str]):
    """Take into bench/runs/ the runs another copy of it recorded (what the GPU machine sent back): each given
    history.md's sections not in ours (the same text) are appended to ours; each given JSON file (or the JSON
    files of a given directory) not in bench/runs/ is copied there."""
    hist = history_path()
    os.makedirs(runs_dir(), exist_ok=True)
    text = open(hist).read() if os.path.exists(hist) else HEADER
    for path in paths:
        if os.path.isdir(path):
            files = sorted(glob.glob(os.path.join(path, "*.json")))
            hist_copy = os.path.join(path, "history.md")
            files += [hist_copy] if os.path.exists(hist_copy) else []
        else:
            files = [path]
        for p in files:
            if p.endswith(".json"):          # the run's file, under a name of its own, and its section
                run = json.load(open(p))
                base, n = os.path.join(runs_dir(), os.path.basename(p)[:-5]), 1
                dest = base + ".json"
                while os.path.exists(dest) and json.load(open(dest)) != run:
                    n += 1
                    dest = f"{base}_{n}.json"
                if not os.path.exists(dest):
                    shutil.copy(p, dest)
                    print(f"merged {os.path.basename(dest)}")
                sec = _section(run["title"], run["command"], run["commit"], run["machine"], run["date"], run["body"])
                if sec.rstrip() not in text:
                    text = text.rstrip() + "\n\n" + sec.rstrip() + "\n"
                continue
            for (title, date), sec in sections(open(p).read()):
                if sec.rstrip() not in text:
                    text = text.rstrip() + "\n\n" + sec.rstrip() + "\n"
                    print(f"merged '{title}' ({date}) from {p}")
    with open(hist, "w") as f:
        f.write(text.rstrip() + "\n")


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] != "merge":
        sys.exit("usage: python bench/results.py merge (history.md | RUN.json | RUNS_DIR)...")
    merge(sys.argv[2:])
