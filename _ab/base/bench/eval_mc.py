"""Multiple-choice knowledge eval (MMLU / C-Eval style) over any OpenAI-compatible /v1/chat/completions.

    python bench/eval_mc.py --base-url http://127.0.0.1:8000 --dataset bench/data/mc_tiny.jsonl \\
        --dev bench/data/mc_tiny_dev.jsonl --k-shot 2 --concurrency 16 --max-tokens 2048 --thinking on \\
        --checkpoint runs/mc_tiny.jsonl --result-file runs/mc_tiny.result.json

Dataset: JSONL, one item a line: {"question": str, "choices": [str, ...] (2 to 10, lettered A, B, ...),
"answer": "B" (or the choice's 0-based index), optional "subject", optional "id" (default: the line number)}.

k-shot: the k examples come from --dev (same format; examples of the item's subject first); without --dev, the
first k items of the dataset are the examples and are not scored. They are sent as earlier user/assistant turns
answered "Answer: X".

Answer extraction reads the reply's content (not its reasoning_content): the last "Answer: X" / "answer is (X)" /
"**Answer:** X", else a bare letter ("B", "(B)", "B."), else a leading "B. ..." / "B) ..."; only letters of that
item's options count. Anything else is "unparsed" and scored wrong.

Checkpoint: a JSONL file whose first line holds the run's configuration and its fingerprint (a SHA-256 over the
dataset and dev files' bytes, k, model, sampling settings, prompt and extraction versions); then one line per
finished item, appended and fsynced as each finishes. Re-running with the same --checkpoint resumes: finished
items are not asked again, items that errored are retried. A different configuration is refused. When any request
of the run errored, no accuracy is reported (exit code 1): rerun to retry them.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import hashlib
import json
import os
import re
import sys
import time

LETTERS = "ABCDEFGHIJ"
PROMPT_VERSION = "chat-kshot-v1"
EXTRACT_VERSION = "last-answer-v1"
INSTRUCTION = "Answer with the letter of the correct option, in the form \"Answer: X\"."


# -- extraction --------------------------------------------------------------------------------------------------
def extract_answer(text: str | None, num_choices: int) -> str | None:
    """The chosen letter, or None when the reply names none of this item's options."""
    if not text:
        return None
    valid = LETTERS[:num_choices]
    letter = rf"[{valid}]"
    # "Answer: B", "answer is (B)", "The correct answer is **C**", "**Answer:** D", "Answer - B"
    explicit = re.findall(rf"(?i:answer)(?:\s+(?i:is))?\s*(?:\*\*)?\s*[:：\-]?\s*(?:\*\*)?\s*\(?({letter})\)?"
                          rf"(?![A-Za-z0-9])", text)
    if explicit:
        return explicit[-1]
    bare = re.fullmatch(rf"\s*(?:\*\*)?\(?({letter})\)?[.)]?(?:\*\*)?\s*", text)
    if bare:
        return bare.group(1)
    leading = re.match(rf"\s*\(?({letter})[.)]\s", text)
    return leading.group(1) if leading else None


# -- data and prompts --------------------------------------------------------------------------------------------
def load_items(path: str) -> list[dict]:
    items = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            it = json.loads(line)
            where = f"{path}:{n}"
            if not isinstance(it.get("question"), str) or not isinstance(it.get("choices"), list) \
                    or not 2 <= len(it["choices"]) <= len(LETTERS):
                raise ValueError(f"{where}: needs a question and 2 to {len(LETTERS)} choices")
            ans = it.get("answer")
            if isinstance(ans, int) and not isinstance(ans, bool):
                ans = LETTERS[ans] if 0 <= ans < len(it["choices"]) else None
            if not isinstance(ans, str) or ans not in LETTERS[:len(it["choices"])]:
                raise ValueError(f"{where}: answer must be one of the choice letters or a choice index")
            items.append({"id": str(it.get("id", f"L{n}")), "question": it["question"],
                          "choices": [str(c) for c in it["choices"]], "answer": ans,
                          "subject": it.get("subject")})
    ids = [it["id"] for it in items]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{path}: item ids are not unique")
    return items


def render(item: dict) -> str:
    lines = [item["question"]] + [f"{LETTERS[i]}. {c}" for i, c in enumerate(item["choices"])]
    return "\n".join(lines) + "\n\n" + INSTRUCTION


def messages(item: dict, shots: list[dict]) -> list[dict]:
    subject = item.get("subject")
    head = (f"The following are multiple choice questions about {subject.replace('_', ' ')}.\n\n"
            if subject else "")
    out = []
    for i, s in enumerate(shots):
        out += [{"role": "user", "content": (head if i == 0 else "") + render(s)},
                {"role": "assistant", "content": f"Answer: {s['answer']}"}]
    out.append({"role": "user", "content": (head if not shots else "") + render(item)})
    return out


def pick_shots(item: dict, pool: list[dict], k: int) -> list[dict]:
    """k examples, those of the item's subject first (pool order otherwise)."""
    same = [p for p in pool if p["subject"] == item["subject"] and p["id"] != item["id"]]
    other = [p for p in pool if p["subject"] != item["subject"] and p["id"] != item["id"]]
    return (same + other)[:k]


# -- checkpoint --------------------------------------------------------------------------------------------------
def file_sha256(path: str | None) -> str | None:
    if path is None:
        return None
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def fingerprint(config: dict) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]


class Checkpoint:
    """Header line {"fingerprint", "config"}, then one JSON line per finished item; appended and fsynced."""

    def __init__(self, path: str, config: dict):
        self.path, self.config, self.fp = path, config, fingerprint(config)
        self.done: dict[str, dict] = {}
        if os.path.exists(path) and os.path.getsize(path) > 0:
            self._load()
        else:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            with open(path, "w") as f:
                f.write(json.dumps({"fingerprint": self.fp, "config": config}) + "\n")
                f.flush()
                os.fsync(f.fileno())
        self.f = open(path, "a")

    def _load(self):
        with open(self.path, "rb") as f:
            raw = f.read()
        lines = raw.split(b"\n")
        if lines and lines[-1] == b"":
            lines.pop()
        good = len(raw)
        if not raw.endswith(b"\n"):     # a line cut short by a crash: drop it, that item is asked again
            good = raw.rfind(b"\n") + 1
            lines.pop()
            print(f"checkpoint {self.path}: dropping an incomplete last line", file=sys.stderr)
        header = json.loads(lines[0])
        if header.get("fingerprint") != self.fp:
            old = header.get("config", {})
            diff = sorted(k for k in set(old) | set(self.config) if old.get(k) != self.config.get(k))
            raise SystemExit(f"checkpoint {self.path} was written with a different configuration (fingerprint "
                             f"{header.get('fingerprint')} != {self.fp}; differs in {diff}); use another "
                             f"--checkpoint or the same settings")
        for line in lines[1:]:
            rec = json.loads(line)
            self.done[rec["id"]] = rec
        if good != len(raw):
            with open(self.path, "r+b") as f:
                f.truncate(good)

    def add(self, rec: dict):
        self.f.write(json.dumps(rec, ensure_ascii=False) + "\n")
        self.f.flush()
        os.fsync(self.f.fileno())
        self.done[rec["id"]] = rec

    def close(self):
        self.f.close()


# -- run ---------------------------------------------------------------------------------------------------------
async def ask(client, args, model: str, item: dict, shots: list[dict]) -> dict:
    body = {"model": model, "messages": messages(item, shots), "max_tokens": args.max_tokens,
            "temperature": args.temperature}
    if args.seed is not None:
        body["seed"] = args.seed
    if args.thinking != "default":
        body["chat_template_kwargs"] = {"enable_thinking": args.thinking == "on"}
    r = await client.post("/v1/chat/completions", json=body)
    if r.status_code != 200:
        try:
            msg = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            msg = r.text[:200]
        raise RuntimeError(f"HTTP {r.status_code}: {msg}")
    choice = r.json()["choices"][0]
    msg = choice["message"]
    content = msg.get("content") or ""
    pred = extract_answer(content, len(item["choices"]))
    return {"id": item["id"], "subject": item["subject"], "answer": item["answer"], "pred": pred,
            "correct": pred == item["answer"], "finish_reason": choice.get("finish_reason"),
            "content": content, "reasoning_content": msg.get("reasoning_content")}


def summarize(records: list[dict], errors: dict[str, str], skipped_shots: int) -> dict:
    by_subject = collections.defaultdict(lambda: [0, 0])
    for r in records:
        s = by_subject[r["subject"] or "-"]
        s[0] += r["correct"]
        s[1] += 1
    n = len(records)
    out = {"scored": n, "errors": len(errors), "error_examples": dict(list(errors.items())[:5]),
           "unparsed": sum(r["pred"] is None for r in records),
           "truncated": sum(r["finish_reason"] == "length" for r in records),
           "few_shot_items_not_scored": skipped_shots}
    if errors:
        out["accuracy"] = None
        out["by_subject"] = None
    else:
        out["accuracy"] = sum(r["correct"] for r in records) / n if n else None
        out["by_subject"] = {k: {"accuracy": c / t, "n": t} for k, (c, t) in sorted(by_subject.items())}
    return out


async def run(args) -> int:
    import httpx
    items = load_items(args.dataset)
    dev = load_items(args.dev) if args.dev else None
    if dev is None:
        pool, items, skipped = items[:args.k_shot], items[args.k_shot:], args.k_shot
    else:
        pool, skipped = dev, 0
    if len(pool) < args.k_shot:
        raise SystemExit(f"--k-shot {args.k_shot} needs that many examples; the pool holds {len(pool)}")
    if args.limit is not None:
        items = items[:args.limit]
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(base_url=args.base_url.rstrip("/"), headers=headers,
                                 timeout=httpx.Timeout(args.timeout)) as client:
        model = args.model
        if model is None:
            r = await client.get("/v1/models")
            r.raise_for_status()
            model = r.json()["data"][0]["id"]
        config = {"dataset_sha256": file_sha256(args.dataset), "dev_sha256": file_sha256(args.dev),
                  "k_shot": args.k_shot, "model": model, "max_tokens": args.max_tokens,
                  "temperature": args.temperature, "seed": args.seed, "thinking": args.thinking,
                  "prompt": PROMPT_VERSION, "extract": EXTRACT_VERSION}
        ckpt = Checkpoint(args.checkpoint, config) if args.checkpoint else None
        done = dict(ckpt.done) if ckpt else {}
        todo = [it for it in items if it["id"] not in done]
        print(f"{len(items)} items: {len(items) - len(todo)} from the checkpoint, {len(todo)} to ask "
              f"(model {model!r}, fingerprint {fingerprint(config)})", flush=True)
        errors: dict[str, str] = {}
        sem = asyncio.Semaphore(args.concurrency)
        t0 = time.perf_counter()

        async def one(item):
            async with sem:
                try:
                    rec = await ask(client, args, model, item, pick_shots(item, pool, args.k_shot))
                except Exception as e:     # counted, reported, retried on the next run; never scored
                    errors[item["id"]] = f"{type(e).__name__}: {e}"
                    return
                done[item["id"]] = rec
                if ckpt:
                    ckpt.add(rec)

        try:
            await asyncio.gather(*(one(it) for it in todo))
        finally:
            if ckpt:
                ckpt.close()
    records = [done[it["id"]] for it in items if it["id"] in done]
    result = summarize(records, errors, skipped)
    result |= {"model": model, "fingerprint": fingerprint(config), "config": config,
               "asked": len(todo), "seconds": time.perf_counter() - t0}
    if result["accuracy"] is None and errors:
        print(f"{len(errors)} of {len(todo)} requests failed (e.g. {next(iter(errors.values()))}); no accuracy is "
              f"reported. Rerun with the same --checkpoint to retry them.")
    else:
        print(f"accuracy {result['accuracy']:.4f} over {result['scored']} items ({result['unparsed']} unparsed, "
              f"{result['truncated']} truncated)")
        for subject, s in (result["by_subject"] or {}).items():
            print(f"  {subject}: {s['accuracy']:.4f} (n={s['n']})")
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump(result, f, indent=1)
    return 1 if errors else 0


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--api-key", default=os.environ.get("QWEN35_API_KEY") or os.environ.get("OPENAI_API_KEY"))
    ap.add_argument("--model", default=None, help="default: the server's first model")
    ap.add_argument("--dataset", required=True)
    ap.add_argument("--dev", default=None, help="few-shot examples (default: the dataset's first k items)")
    ap.add_argument("--k-shot", type=int, default=0)
    ap.add_argument("--limit", type=int, default=None, help="score only the first N items")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=1024)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--thinking", choices=["on", "off", "default"], default="default",
                    help="chat_template_kwargs.enable_thinking (default: the template's own default)")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per request")
    ap.add_argument("--checkpoint", default=None, help="JSONL of finished items; resumed when it exists")
    ap.add_argument("--result-file", default=None)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    return asyncio.run(run(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
