"""/v1/completions `echo` with prompt logprobs (how lm-eval computes log-likelihoods) and the `prompt_logprobs` extra
field, against log_softmax of the model's full-forward logits (LLM.logits) computed in the test process."""
import json
import os
import subprocess
import textwrap

import numpy as np
import openai
import pytest

from conftest import engine_args
from server_proc import ENGINE_FLAGS, ServerProcess, http

MODEL = "tiny"
PROMPT = "The capital of France is Paris. The capital of Italy is"
TOL = 1e-4


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    s = ServerProcess(["--model", tiny_model_dir, "--served-model-name", MODEL, *ENGINE_FLAGS])
    yield s
    s.stop()


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    from qwen35_jax.llm import LLM
    with LLM(tiny_model_dir, **engine_args(precompile=False)) as model:
        yield model


def post(server, body) -> dict:
    r = http().post(server.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def log_softmax(llm, ids) -> np.ndarray:
    """[len(ids), vocab] log-probabilities of the next token after each position (float64)."""
    x = llm.logits(ids).astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def check_offsets(lp, start=0):
    assert lp["text_offset"] == list(np.cumsum([start] + [len(t) for t in lp["tokens"]])[:-1])


# -- echo -----------------------------------------------------------------------------------------------------------
def test_echo_prompt_only(server, llm):
    ids = llm.tokenizer.encode(PROMPT)
    ref = log_softmax(llm, ids)
    body = {"prompt": PROMPT, "echo": True, "max_tokens": 0, "logprobs": 1, "temperature": 0}
    out = post(server, body)
    c = out["choices"][0]
    assert c["text"] == PROMPT and c["finish_reason"] == "length"
    assert out["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids),
                            "prompt_tokens_details": {"cached_tokens": 0}}
    lp = c["logprobs"]
    assert "".join(lp["tokens"]) == PROMPT and len(lp["tokens"]) == len(ids)
    check_offsets(lp)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    want = [ref[p - 1, ids[p]] for p in range(1, len(ids))]
    np.testing.assert_allclose(lp["token_logprobs"][1:], want, atol=TOL)
    for p in range(1, len(ids)):
        top = lp["top_logprobs"][p]
        assert lp["tokens"][p] in top and 1 <= len(top) <= 2
        assert max(top.values()) == pytest.approx(ref[p - 1].max(), abs=TOL)
    # the same prompt as token ids; the prompt_logprobs extra field (vLLM's layout)
    by_ids = post(server, {**body, "prompt": ids, "prompt_logprobs": 2})["choices"][0]
    assert by_ids["text"] == PROMPT and by_ids["logprobs"]["tokens"] == lp["tokens"]
    np.testing.assert_allclose(by_ids["logprobs"]["token_logprobs"][1:], lp["token_logprobs"][1:], atol=1e-6)
    plp = by_ids["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    for p in range(1, len(ids)):
        entry = plp[p][str(ids[p])]
        assert entry["logprob"] == pytest.approx(want[p - 1], abs=TOL)
        assert entry["decoded_token"] == lp["tokens"][p]
        ranks = sorted(e["rank"] for t, e in plp[p].items() if t != str(ids[p]) or e["rank"] <= 2)
        assert ranks == [1, 2]


def test_echo_with_generation(server, llm):
    ids = llm.tokenizer.encode(PROMPT)
    body = {"prompt": PROMPT, "max_tokens": 4, "logprobs": 2, "temperature": 0, "ignore_eos": True}
    plain = post(server, body)["choices"][0]
    echo = post(server, {**body, "echo": True})
    c = echo["choices"][0]
    assert c["text"] == PROMPT + plain["text"] and c["finish_reason"] == "length"
    assert echo["usage"]["completion_tokens"] == 4
    lp, gen = c["logprobs"], plain["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 4 and lp["tokens"][len(ids):] == gen["tokens"]
    assert "".join(lp["tokens"]) == c["text"]
    check_offsets(lp)
    np.testing.assert_allclose(lp["token_logprobs"][len(ids):], gen["token_logprobs"], atol=1e-6)
    assert lp["top_logprobs"][len(ids):] == gen["top_logprobs"]
    # the whole sequence's logprobs against one full forward
    full = ids + llm.tokenizer.encode(plain["text"])
    ref = log_softmax(llm, full)
    if len(full) == len(lp["tokens"]):           # the completion re-encodes to the same tokens
        np.testing.assert_allclose(lp["token_logprobs"][1:], [ref[p - 1, full[p]] for p in range(1, len(full))],
                                   atol=TOL)
    # no logprobs: only the text is echoed; n > 1 echoes on every choice
    two = post(server, {"prompt": PROMPT, "echo": True, "max_tokens": 3, "n": 2, "seed": 3})
    assert all(x["text"].startswith(PROMPT) and x["logprobs"] is None for x in two["choices"])


def stream(server, body) -> list[dict]:
    with http().stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def test_streaming_echo(server, llm):
    ids = llm.tokenizer.encode(PROMPT)
    body = {"prompt": PROMPT, "max_tokens": 5, "logprobs": 1, "temperature": 0, "ignore_eos": True, "echo": True}
    whole = post(server, body)["choices"][0]
    chunks = [ch["choices"][0] for ch in stream(server, body)]
    first = chunks[0]
    assert first["text"].startswith(PROMPT) and len(first["logprobs"]["tokens"]) >= len(ids)
    assert first["logprobs"]["token_logprobs"][0] is None
    assert "".join(c["text"] for c in chunks) == whole["text"] and chunks[-1]["finish_reason"] == "length"
    joined = {k: sum((c["logprobs"][k] for c in chunks), []) for k in ("tokens", "token_logprobs", "text_offset")}
    assert joined["tokens"] == whole["logprobs"]["tokens"]
    assert joined["text_offset"] == whole["logprobs"]["text_offset"]
    np.testing.assert_allclose(joined["token_logprobs"][1:], whole["logprobs"]["token_logprobs"][1:], atol=1e-6)
    # max_tokens 0: the prompt alone, then the finish
    only = [ch["choices"][0] for ch in stream(server, {**body, "max_tokens": 0})]
    assert "".join(c["text"] for c in only) == PROMPT and only[-1]["finish_reason"] == "length"
    assert sum(len(c["logprobs"]["tokens"]) for c in only) == len(ids)


def test_openai_sdk(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    out = client.completions.create(model=MODEL, prompt=PROMPT, echo=True, max_tokens=0, logprobs=1)
    c = out.choices[0]
    assert c.text == PROMPT and c.finish_reason == "length" and c.logprobs.token_logprobs[0] is None
    assert "".join(c.logprobs.tokens) == PROMPT and all(x is not None for x in c.logprobs.token_logprobs[1:])
    plp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, extra_body={"prompt_logprobs": 0})
    assert plp.choices[0].model_extra["prompt_logprobs"][0] is None


def test_chat_prompt_logprobs(server, llm):
    r = http().post(server.url + "/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "prompt_logprobs": 1,
        "return_token_ids": True})
    assert r.status_code == 200, r.text
    body = r.json()
    ids, plp = body["prompt_token_ids"], body["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None and all(str(t) in e for t, e in zip(ids[1:], plp[1:]))


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "Hi", "echo": True, "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "Hi", "prompt_logprobs": 21}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "Hi", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "Hi", "echo": 1}, "echo"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "echo": True}, "echo"),
])
def test_bad_requests(server, path, body, param):
    r = http().post(server.url + path, json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


# -- lm-eval's local-completions request shape -----------------------------------------------------------------------
MC = [("The capital of France is", [" Paris", " London", " Rome"]),
      ("def add(a, b):\n    return", [" a + b", " a - b"])]
DOC = ("The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. "
       "How vexingly quick daft zebras jump!")


def lm_eval_parse(choice, ctxlen):
    """lm_eval.models.openai_completions.LocalCompletionsAPI.parse_logprobs, for one choice."""
    lps, tops = choice["logprobs"]["token_logprobs"][ctxlen:-1], choice["logprobs"]["top_logprobs"][ctxlen:-1]
    return sum(lps), all(lp == max(top.values()) for lp, top in zip(lps, tops))


def reference(llm, ctx, cont):
    lp = log_softmax(llm, ctx + cont)
    rows = [lp[len(ctx) + j - 1] for j in range(len(cont))]
    return sum(r[t] for r, t in zip(rows, cont)), all(int(np.argmax(r)) == t for r, t in zip(rows, cont))


def encode_pair(tok, ctx: str, cont: str):
    """lm-eval's TemplateLM._encode_pair (no trailing space in these contexts)."""
    whole, ctx_ids = tok.encode(ctx + cont), tok.encode(ctx)
    return ctx_ids, whole[len(ctx_ids):]


def rolling_windows(ids, prefix, size):
    """Disjoint windows predicting every token once, each from up to `size` preceding tokens (prefix first)."""
    full, out = [prefix] + ids, []
    for s in range(1, len(full), size):
        e = min(s + size, len(full))
        lo = max(0, e - size - 1)
        out.append((full[lo:s], full[s:e]))
    return out


def test_lm_eval_request_shape(server, llm):
    tok = llm.tokenizer
    pairs = [encode_pair(tok, ctx, cont) for ctx, conts in MC for cont in conts]
    ctx0 = pairs[0][0]                       # a continuation that is greedy by construction
    greedy = [int(np.argmax(log_softmax(llm, ctx0)[-1]))]
    greedy.append(int(np.argmax(log_softmax(llm, ctx0 + greedy)[-1])))
    pairs.append((ctx0, greedy))
    windows = rolling_windows(tok.encode(DOC), tok.eos_token_id, 12)
    pairs += windows
    want = [reference(llm, c, x) for c, x in pairs]
    assert want[-len(windows) - 1][1] and len(windows) > 1           # the greedy pair; several windows

    lm_eval_body = {"model": MODEL, "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": True}
    out = post(server, {**lm_eval_body, "prompt": [c + x for c, x in pairs]})
    choices = sorted(out["choices"], key=lambda c: c["index"])
    got = [lm_eval_parse(ch, len(c)) for ch, (c, _) in zip(choices, pairs)]
    for (lp, is_greedy), (ref_lp, ref_greedy) in zip(got, want):
        assert lp == pytest.approx(ref_lp, abs=1e-3) and is_greedy == ref_greedy
    # max_tokens 0: nothing generated, so the continuation runs to the end
    zero = sorted(post(server, {**lm_eval_body, "max_tokens": 0, "prompt": [c + x for c, x in pairs]})["choices"],
                  key=lambda c: c["index"])
    for ch, (c, _), (ref_lp, _) in zip(zero, pairs, want):
        assert sum(ch["logprobs"]["token_logprobs"][len(c):]) == pytest.approx(ref_lp, abs=1e-3)
    # the same requests as strings (lm-eval's tokenized_requests=False) where the text re-encodes to the same ids
    texts = [tok.decode(c + x) for c, x in pairs]
    same = [i for i, t in enumerate(texts) if tok.encode(t) == pairs[i][0] + pairs[i][1]]
    assert same
    by_text = sorted(post(server, {**lm_eval_body, "prompt": [texts[i] for i in same]})["choices"],
                     key=lambda c: c["index"])
    for ch, i in zip(by_text, same):
        assert lm_eval_parse(ch, len(pairs[i][0])) == pytest.approx(got[i], abs=1e-5)


# -- the real lm_eval, in the HF venv (QWEN35_HF_PYTHON) --------------------------------------------------------------
LM_EVAL_SCRIPT = textwrap.dedent("""
    import json, sys
    from lm_eval import utils
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    url, model, tokenizer, mc, doc = json.loads(sys.argv[1])
    lm = LocalCompletionsAPI(base_url=url, model=model, tokenizer=tokenizer, tokenizer_backend="huggingface",
                             batch_size=4, max_length=14, max_retries=1)
    pairs = [(ctx, cont) for ctx, conts in mc for cont in conts]
    ll = lm.loglikelihood([Instance("loglikelihood", {}, p, i) for i, p in enumerate(pairs)], disable_tqdm=True)
    rolling = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (doc,), 0)], disable_tqdm=True)
    windows = list(map(utils.make_disjoint_window, utils.get_rolling_token_windows(
        token_list=lm.tok_encode(doc), prefix_token=lm.prefix_token_id, max_seq_len=lm.max_length - 1,
        context_len=1)))
    print("RESULT " + json.dumps({"encoded": [lm._encode_pair(*p) for p in pairs], "ll": ll, "rolling": rolling,
                                  "windows": windows}))
""")


def hf_python_with_lm_eval():
    py = os.environ.get("QWEN35_HF_PYTHON")
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('lm_eval') is None)"
    if not py or subprocess.run([py, "-c", probe], capture_output=True).returncode != 0:
        return None
    return py


@pytest.mark.skipif(hf_python_with_lm_eval() is None, reason="QWEN35_HF_PYTHON has no lm_eval")
def test_real_lm_eval(server, llm, tiny_model_dir):
    arg = json.dumps([server.url + "/v1/completions", MODEL, tiny_model_dir, MC, DOC])
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "JAX_PLATFORMS")}
    p = subprocess.run([hf_python_with_lm_eval(), "-c", LM_EVAL_SCRIPT, arg], capture_output=True, text=True,
                       timeout=300, env={**env, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and line, p.stderr[-3000:]
    res = json.loads(line[0][7:])
    for (ctx, cont), (lp, is_greedy) in zip(res["encoded"], res["ll"]):
        ref_lp, ref_greedy = reference(llm, ctx, cont)
        assert lp == pytest.approx(ref_lp, abs=1e-3) and is_greedy == ref_greedy
    assert len(res["windows"]) > 1
    want = sum(reference(llm, ctx, cont)[0] for ctx, cont in res["windows"])
    assert res["rolling"][0] == pytest.approx(want, abs=1e-3)
