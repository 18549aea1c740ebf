"""A Qwen3.5-style tokenizer trained locally: byte-level BPE, Qwen3.5's added tokens and chat template.

Used by the random tiny model (make_tiny_model.py) and by the model trained on the Python documentation, so both
tokenize and render chats the way Qwen3.5 does: NFC normalisation, Qwen3.5's pre-tokenizer regex, byte-level BPE,
then Qwen's added tokens in Qwen's order right after the BPE vocabulary, and Qwen3.5's real chat template.
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterable

# Qwen's added tokens, in Qwen's order. The tool-call, tool-response and think tags are added but not special, so
# they survive decoding with skip_special_tokens (a reasoning or tool-call parser needs to see them).
ADDED_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>",
                "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
                "<tool_response>", "</tool_response>", "<think>", "</think>"]
NOT_SPECIAL = {"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"}
PRETOKENIZE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
CHAT_TEMPLATE_FILE = os.path.join(os.path.dirname(__file__), "qwen35_chat_template.jinja")
EOS_TOKEN, PAD_TOKEN = "<|im_end|>", "<|endoftext|>"


def chat_template() -> str:
    """Qwen3.5's chat template (XML tool calls, enable_thinking switch)."""
    with open(CHAT_TEMPLATE_FILE) as f:
        return f.read()


def train_tokenizer(texts: Iterable[str], vocab_size: int):
    """A tokenizers.Tokenizer trained on `texts` whose size, BPE vocabulary plus added tokens, is exactly
    vocab_size (a ValueError if the texts are too small to learn that many merges)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    bpe_size = vocab_size - len(ADDED_TOKENS)
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=bpe_size, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    if tok.get_vocab_size() != bpe_size:
        raise ValueError(f"the texts yield {tok.get_vocab_size()} BPE tokens, fewer than the {bpe_size} needed for "
                         f"vocab_size {vocab_size}: train on more text or ask for a smaller vocabulary")
    for t in ADDED_TOKENS:      # one at a time, so the ids follow the list whether special or not
        tok.add_tokens([AddedToken(t, special=t not in NOT_SPECIAL, normalized=False)])
    assert tok.get_vocab_size() == vocab_size and tok.token_to_id(ADDED_TOKENS[0]) == bpe_size
    return tok


def write_tokenizer_files(tok, out_dir: str, model_max_length: int) -> dict[str, int]:
    """tokenizer.json and tokenizer_config.json (eos <|im_end|>, pad <|endoftext|>, no bos, Qwen3.5's chat
    template) in out_dir, loadable by transformers' AutoTokenizer; returns the added tokens' ids."""
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    config = dict(tokenizer_class="PreTrainedTokenizerFast", eos_token=EOS_TOKEN, pad_token=PAD_TOKEN,
                  unk_token=None, bos_token=None, add_bos_token=False, add_prefix_space=False,
                  clean_up_tokenization_spaces=False, split_special_tokens=False, errors="replace",
                  model_max_length=model_max_length, chat_template=chat_template())
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return {t: tok.token_to_id(t) for t in ADDED_TOKENS}
