"""``truncate_prompt_tokens`` (vLLM's left truncation of prompts): the tokenizer keeps its
special tokens as transformers' own ``truncation_side="left"`` does, token-id prompts and
chat renderings keep their last ids, the value is checked, and the engine, ``LLM.generate``
and ``LLM.chat`` run the truncated prompt."""

from __future__ import annotations

import numpy as np
import pytest
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from jaxinfer.llm import LLM
from jaxinfer.prompts import RequestError, encode_prompt, truncation
from jaxinfer.sampling_params import ParameterError, SamplingParams
from jaxinfer.tokenizer import Tokenizer, TokenizerError
from tests.conftest import tiny_loaded
from tests.core.test_tokenizer import _ROLE_TEMPLATE, _tiny_tokenizer


def _bos_eos_tokenizer(chat_template: str | None = None) -> Tokenizer:
    """Word-level, with a post-processor that wraps every text in <s> ... </s>."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4, "big": 5, "cat": 6}
    raw = RawTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.decoder = decoders.WordPiece()
    raw.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", 1), ("</s>", 2)])
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>",
                                 unk_token="<unk>", chat_template=chat_template)
    return Tokenizer(hf, source="bos-eos")


def _hf_left(tok: Tokenizer, text: str, k: int, special: bool = True) -> list[int]:
    """transformers' own left truncation (the reference)."""
    tok.hf.truncation_side = "left"
    try:
        return list(tok.hf(text, add_special_tokens=special, truncation=True,
                           max_length=k)["input_ids"])
    finally:
        tok.hf.truncation_side = "right"


@pytest.mark.parametrize("make", [_bos_eos_tokenizer, _tiny_tokenizer])
def test_encode_max_length_is_transformers_left_truncation(make):
    tok = make()
    text = "hello big world cat hello world big big cat"
    n = len(tok.encode(text))
    special = n - len(tok.encode(text, add_special_tokens=False))
    for k in range(special + 1, n + 3):
        for add in (True, False):
            got = tok.encode(text, add_special_tokens=add, max_length=k)
            assert got == _hf_left(tok, text, k, add), (k, add)
            assert len(got) == min(k, len(tok.encode(text, add_special_tokens=add)))
    if special:
        with pytest.raises(TokenizerError, match=f"leaves no room for the text after the "
                                                 f"{special} special token"):
            tok.encode(text, max_length=special)


def test_encode_max_length_on_the_real_smollm2_tokenizer(smollm_tokenizer):
    text = "The quick brown fox jumps over the lazy dog. " * 5
    full = smollm_tokenizer.encode(text)
    for k in (1, 7, len(full) - 1, len(full), len(full) + 5):
        got = smollm_tokenizer.encode(text, max_length=k)
        assert got == _hf_left(smollm_tokenizer, text, k)
        assert got == full[-k:]  # no special tokens added by this tokenizer


def test_truncation_values():
    assert truncation(None, 64) is None and truncation(-1, 64) == 64
    assert truncation(1, 64) == 1 and truncation(64, 64) == 64
    with pytest.raises(RequestError, match=r"truncate_prompt_tokens \(65\) is greater than "
                                           r"max_model_len \(64\)"):
        truncation(65, 64)
    for bad in (0, -2, 1.5, True, "3"):
        with pytest.raises(ParameterError, match="truncate_prompt_tokens"):
            SamplingParams(truncate_prompt_tokens=bad)
    assert SamplingParams(truncate_prompt_tokens=np.int64(3)).truncate_prompt_tokens == 3


def test_engine_level_values_are_checked_and_any_sequence_truncates():
    """encode_prompt / encode_chat take truncate_prompt_tokens without SamplingParams'
    checks: the same values are refused there (0 returned [] from a chat, 2.5 raised a raw
    TypeError); a deque (no slicing) truncates after it is read."""
    from collections import deque

    for bad in (0, -2, 2.5, True, "3"):
        with pytest.raises(RequestError, match="truncate_prompt_tokens must be None, -1"):
            truncation(bad, 64)
    assert truncation(np.int32(3), 64) == 3
    assert encode_prompt(None, deque(range(10, 90)), 64, 96, truncate=3) == [87, 88, 89]


def test_token_id_prompts_keep_their_last_ids():
    ids = list(range(10, 90))
    assert encode_prompt(None, ids, 64, 96, truncate=5) == ids[-5:]
    assert encode_prompt(None, range(10, 90), 64, 96, truncate=64) == ids[-64:]
    assert encode_prompt(None, np.arange(10, 90), 64, 96, truncate=3) == ids[-3:]
    assert encode_prompt(None, iter(ids), 64, 96, truncate=4) == ids[-4:]
    assert encode_prompt(None, ids[:3], 64, 96, truncate=5) == ids[:3]
    with pytest.raises(RequestError, match="prompt has 80 tokens; max_model_len is 64"):
        encode_prompt(None, ids, 64, 96)


def _llm(tokenizer=None) -> LLM:
    loaded = tiny_loaded("llama")
    loaded.tokenizer = tokenizer
    return LLM(loaded, max_model_len=64, block_size=4, max_num_seqs=4,
               max_num_batched_tokens=64)


def test_generate_and_chat_run_the_truncated_prompt():
    llm = _llm(_bos_eos_tokenizer(_ROLE_TEMPLATE))
    greedy = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    cut = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True,
                         truncate_prompt_tokens=20)
    long_ids = [int(x) for x in np.random.default_rng(0).integers(3, 96, 100)]
    got, want = llm.generate([long_ids, long_ids[:10]], [cut, cut]), llm.generate(
        [long_ids[-20:], long_ids[:10]], greedy)
    assert [o.prompt_token_ids for o in got] == [long_ids[-20:], long_ids[:10]]
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    # A text over max_model_len: its first words go, <s> and </s> stay (the tokenizer adds
    # them around every text).
    text = "hello world " * 40
    out = llm.generate(text, cut)[0]
    assert out.prompt_token_ids == [1] + [3, 4] * 9 + [2]
    with pytest.raises(RequestError, match="max_model_len is 64"):
        llm.generate(text, greedy)  # without truncation it is refused, as before
    # A chat: the rendering's last ids.
    conv = [{"role": "user", "content": "hello world " * 40}]
    full = llm.tokenizer.apply_chat_template(conv)
    out = llm.chat(conv, cut)[0]
    assert out.prompt_token_ids == full[-20:]
    # -1: max_model_len tokens, which leaves none to generate (vLLM refuses it too): refused,
    # saying how much truncation leaves room.
    with pytest.raises(RequestError, match=r"prompt has 64 tokens; max_model_len is 64 \(at "
                                           r"least one token must be generated\); "
                                           r"truncate_prompt_tokens -1 keeps too many: at most "
                                           r"63 leave room"):
        llm.generate([long_ids], SamplingParams(truncate_prompt_tokens=-1))
    with pytest.raises(RequestError, match=r"truncate_prompt_tokens \(65\) is greater"):
        llm.generate([long_ids], SamplingParams(truncate_prompt_tokens=65))
    assert not llm.engine.has_unfinished_requests()
