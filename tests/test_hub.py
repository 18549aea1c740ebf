"""Models named by Hugging Face repo id, against a stand-in hub on a loopback port.

The stand-in answers what huggingface_hub's snapshot_download asks: the revision API
(/api/models/{repo}/revision/{rev}: sha, siblings), the tree API (/api/models/{repo}/tree/{sha}) and
/{repo}/resolve/{sha}/{file} (HEAD and GET, with X-Repo-Commit, ETag and Content-Length), and the Hub's error codes
(X-Error-Code RepoNotFound / RevisionNotFound). huggingface_hub reads HF_ENDPOINT, HF_HOME and HF_HUB_OFFLINE when
it is imported, so everything that downloads runs in a subprocess with those set.
"""
import hashlib
import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

import pytest

from conftest import engine_args
from qwen35_jax.model.hub import resolve_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = "test-org/tiny-qwen"
SHA = "0123456789abcdef0123456789abcdef01234567"
REFS = {"main": SHA, "v1": SHA, SHA: SHA}
EXTRA = {"README.md": b"# tiny\n", "pytorch_model.bin": b"not read by the engine"}   # not downloaded


class Hub(BaseHTTPRequestHandler):
    files: dict[str, bytes] = {}
    requests: list[str] = []

    def log_message(self, *args):
        pass

    def _send(self, status, body=b"", headers=None, send_body=True):
        self.send_response(status)
        for k, v in {"Content-Length": str(len(body)), **(headers or {})}.items():
            self.send_header(k, v)
        self.end_headers()
        if send_body:
            self.wfile.write(body)

    def _error(self, code, send_body=True):
        self._send(404, json.dumps({"error": code}).encode(), {"X-Error-Code": code,
                                                               "Content-Type": "application/json"}, send_body)

    def _route(self, send_body):
        path = unquote(urlsplit(self.path).path)
        type(self).requests.append(f"{self.command} {path}")
        parts = path.strip("/").split("/")
        api = parts[:2] == ["api", "models"]
        repo = "/".join(parts[2:4] if api else parts[0:2])
        kind, rev, name = (parts[4], parts[5], None) if api else (parts[2], parts[3], "/".join(parts[4:]))
        if repo != REPO:
            return self._error("RepoNotFound", send_body)
        if rev not in REFS:
            return self._error("RevisionNotFound", send_body)
        if api and kind == "revision":
            body = {"id": REPO, "sha": SHA, "siblings": [{"rfilename": f} for f in sorted(self.files)]}
        elif api and kind == "tree":
            body = [{"type": "file", "path": f, "size": len(b), "oid": hashlib.sha1(b).hexdigest()}
                    for f, b in sorted(self.files.items())]
        elif kind == "resolve" and name in self.files:
            data = self.files[name]
            return self._send(200, data, {"X-Repo-Commit": SHA, "ETag": f'"{hashlib.sha1(data).hexdigest()}"',
                                          "Content-Type": "application/octet-stream"}, send_body)
        else:
            return self._error("EntryNotFound", send_body)
        self._send(200, json.dumps(body).encode(), {"Content-Type": "application/json"}, send_body)

    def do_GET(self):
        self._route(True)

    def do_HEAD(self):
        self._route(False)


@pytest.fixture(scope="module")
def hub(tiny_model_dir):
    Hub.files = {f: open(os.path.join(tiny_model_dir, f), "rb").read() for f in os.listdir(tiny_model_dir)}
    Hub.files.update(EXTRA)
    Hub.requests = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), Hub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


# Runs in a fresh interpreter (huggingface_hub reads HF_* on import). argv: what to do, as JSON.
SCRIPT = r"""
import json, sys
job = json.loads(sys.argv[1])
from qwen35_jax.model.hub import resolve_model
out = {}
for key, (model, revision) in job["resolve"].items():
    try:
        out[key] = {"path": resolve_model(model, revision)}
    except Exception as e:
        out[key] = {"error": f"{type(e).__name__}: {e}"}
if "engine" in job:
    import numpy as np
    from qwen35_jax.llm import LLM
    from qwen35_jax.serve import main
    ids = list(range(3, 40))
    with LLM(job["repo"], **job["engine"]) as a, LLM(job["local"], **job["engine"]) as b:
        out["model_dir"] = a.engine.model_dir
        out["same_logits"] = bool(np.array_equal(a.logits(ids), b.logits(ids)))
        out["same_tokenizer"] = a.tokenizer.encode("Hello, world") == b.tokenizer.encode("Hello, world")
        out["same_eos"] = a.engine.eos_token_ids == b.engine.eos_token_ids
    try:
        main(["--model", job["repo"], "--revision", "no-such-branch", "--port", "0"])
    except Exception as e:
        out["serve_bad_revision"] = f"{type(e).__name__}: {e}"
print("RESULT " + json.dumps(out))
"""


def run(job: dict, **env) -> dict:
    e = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}      # only the HF_* settings given here
    e.update(JAX_PLATFORMS="cpu", HF_HUB_DISABLE_TELEMETRY="1", **env)
    e["PYTHONPATH"] = ROOT + os.pathsep + e.get("PYTHONPATH", "")
    p = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(job)], env=e, capture_output=True, text=True,
                       timeout=300)
    lines = [line for line in p.stdout.splitlines() if line.startswith("RESULT ")]
    assert p.returncode == 0 and lines, p.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


def test_repo_id_downloads_and_works_offline(hub, tiny_model_dir, tmp_path):
    hf_home = str(tmp_path / "hf")
    snapshot = os.path.join(hf_home, "hub", "models--test-org--tiny-qwen", "snapshots", SHA)
    kw = engine_args(precompile=False)          # the shared test XLA cache: compiled once per run
    out = run({"repo": REPO, "local": tiny_model_dir, "engine": kw,
               "resolve": {"main": [REPO, None], "v1": [REPO, "v1"], "unknown": ["test-org/no-such-model", None],
                           "bad_revision": [REPO, "no-such-branch"]}},
              HF_ENDPOINT=hub, HF_HOME=hf_home)
    # Downloaded into HF_HOME's hub cache: the files an engine reads, not the rest of the repo.
    assert out["main"] == {"path": snapshot} and out["v1"] == {"path": snapshot}, out
    assert sorted(os.listdir(snapshot)) == sorted(set(Hub.files) - set(EXTRA))
    assert not any("pytorch_model.bin" in r or "README" in r for r in Hub.requests if "/resolve/" in r)
    # The engine built from the repo id reads that snapshot and is the engine of the local directory.
    assert out["model_dir"] == snapshot
    assert out["same_logits"] and out["same_tokenizer"] and out["same_eos"], out
    # Errors say what is wrong, and nothing falls back to another model.
    assert out["unknown"]["error"].startswith("FileNotFoundError") and "no such repo" in out["unknown"]["error"]
    assert "revision 'no-such-branch' not found" in out["bad_revision"]["error"], out
    assert "revision 'no-such-branch' not found" in out["serve_bad_revision"], out

    # Offline: from the cache alone (HF_ENDPOINT points nowhere, and the stand-in hub sees no request).
    seen = len(Hub.requests)
    out = run({"resolve": {"main": [REPO, None], "v1": [REPO, "v1"], "unknown": ["test-org/no-such-model", None]}},
              HF_ENDPOINT="http://127.0.0.1:9", HF_HOME=hf_home, HF_HUB_OFFLINE="1")
    assert out["main"] == {"path": snapshot} and out["v1"] == {"path": snapshot}, out
    assert "HF_HUB_OFFLINE=1" in out["unknown"]["error"] and "not in the Hugging Face cache" in out["unknown"]["error"]
    assert len(Hub.requests) == seen
    # Not offline but unreachable, and not cached: said so, naming HF_HUB_OFFLINE.
    out = run({"resolve": {"unreachable": ["test-org/other", None]}},
              HF_ENDPOINT="http://127.0.0.1:9", HF_HOME=hf_home)
    assert "could not be reached" in out["unreachable"]["error"] and "HF_HUB_OFFLINE" in out["unreachable"]["error"]


def test_local_paths(tiny_model_dir, tmp_path):
    """A local directory is used as is, with no hub call; a local-looking path that does not exist is an error."""
    assert resolve_model(tiny_model_dir) == tiny_model_dir
    assert resolve_model(tiny_model_dir, "v1") == tiny_model_dir
    for missing in [str(tmp_path / "no-such-dir"), "./no-such-dir", "~/no/such/dir", "a/b/c"]:
        with pytest.raises(FileNotFoundError, match="no such directory"):
            resolve_model(missing)
    with pytest.raises(NotADirectoryError):
        resolve_model(os.path.join(tiny_model_dir, "config.json"))


def test_serve_flags():
    from qwen35_jax.serve import build_parser, engine_args as serve_engine_args
    args = build_parser().parse_args(["--model", REPO, "--revision", "v1"])
    assert serve_engine_args(args).revision == "v1"
