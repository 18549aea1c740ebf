"""The Qwen3.5-style tokenizer builder: exact size, Qwen's added tokens in order after the BPE vocabulary, which are
special, and the chat template's "Hello" test vector through transformers and the project's Tokenizer."""
import pytest

from qwen35_jax.tools import tokenizer_builder as tb

TEXT = ("Hello world\n\nThe user asks and the assistant answers\n\nPython is a programming language; "
        "it reads like English\n\nLists, tuples and dictionaries hold values\n\n") * 20
VOCAB = 256 + 40 + len(tb.ADDED_TOKENS)       # the 256 byte symbols, 40 merges, the added tokens


@pytest.fixture(scope="module")
def tok():
    return tb.train_tokenizer([TEXT], VOCAB)


@pytest.fixture(scope="module")
def model_dir(tok, tmp_path_factory):
    d = str(tmp_path_factory.mktemp("tok"))
    tb.write_tokenizer_files(tok, d, model_max_length=4096)
    return d


def test_size_and_added_token_ids(tok):
    assert tok.get_vocab_size() == VOCAB
    bpe = VOCAB - len(tb.ADDED_TOKENS)
    assert [tok.token_to_id(t) for t in tb.ADDED_TOKENS] == list(range(bpe, VOCAB))
    assert tok.id_to_token(bpe - 1) not in tb.ADDED_TOKENS
    added = {t.content: t for t in tok.get_added_tokens_decoder().values()}
    assert list(added) == tb.ADDED_TOKENS
    assert {t for t, a in added.items() if not a.special} == tb.NOT_SPECIAL == {
        "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"}


def test_too_little_text_is_an_error():
    with pytest.raises(ValueError, match="fewer than"):
        tb.train_tokenizer(["ab"], 1000)


@pytest.mark.parametrize("loader", ["transformers", "project"])
def test_hello_chat_vector(model_dir, loader):
    from qwen35_jax.engine.tokenizer import Tokenizer
    if loader == "transformers":
        from transformers import AutoTokenizer
        hf = AutoTokenizer.from_pretrained(model_dir)
        render = lambda m: hf.apply_chat_template(m, tokenize=False, add_generation_prompt=True,
                                                  enable_thinking=False)
        encode = lambda s: hf.encode(s, add_special_tokens=False)
        decode = lambda ids: hf.decode(ids, skip_special_tokens=True)
        eos = hf.eos_token_id
    else:
        t = Tokenizer(model_dir)
        hf = t.hf
        render = lambda m: t.apply_chat_template(m, enable_thinking=False)
        encode, decode, eos = t.encode, t.decode, t.eos_token_id
    text = render([{"role": "user", "content": "Hello"}])
    assert text == "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    sp = {t: hf.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>", "<think>", "</think>")}
    ids = encode(text)
    assert ids == ([sp["<|im_start|>"]] + encode("user") + encode("\n") + encode("Hello") + [sp["<|im_end|>"]]
                   + encode("\n") + [sp["<|im_start|>"]] + encode("assistant") + encode("\n") + [sp["<think>"]]
                   + encode("\n\n") + [sp["</think>"]] + encode("\n\n"))
    assert len(encode("\n\n")) == 1
    assert decode(ids) == "user\nHello\nassistant\n<think>\n\n</think>\n\n"
    assert eos == sp["<|im_end|>"] and hf.pad_token == "<|endoftext|>" and hf.bos_token is None
    assert decode(encode("<tool_call>x</tool_call><|endoftext|>")) == "<tool_call>x</tool_call>"
