"""Host-side outputs (jaxinfer.outputs): stop strings through incremental detokenization with
the real SmolLM2 tokenizer, hold-back while running, UTF-8 split across tokens, logprobs
entries, and per-token detokenization work that does not grow with the output."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from jaxinfer.outputs import (
    RequestState,
    find_stop_string,
    logprobs_entry,
    prompt_logprobs_from_logits,
)
from jaxinfer.sampling_params import SamplingParams

PROMPT = "Answer briefly:"


@pytest.fixture
def tok(smollm_tokenizer):
    return smollm_tokenizer


def _stream(tok, text: str, **params):
    """Feed the tokens of ``text`` one by one; returns (texts while running, index of the
    token that matched a stop string or None, final text, token ids)."""
    ids = tok.encode(text, add_special_tokens=False)
    st = RequestState(SamplingParams(**params), tok.encode(PROMPT), tok)
    texts, hit = [], None
    for i, t in enumerate(ids):
        if st.add_token(t):
            hit = i
            break
        texts.append(st.text(finished=False))
    return texts, hit, st.text(finished=True), ids


def _first_token_completing(tok, ids, stop: str) -> int | None:
    """Reference: the first token index whose prefix decodes to text containing ``stop``."""
    return next((j for j in range(len(ids)) if stop in tok.decode(ids[:j + 1])), None)


def _check_running_texts(texts, final, stop):
    for t in texts:  # what a client saw while running never shows the stop, never shrinks
        assert stop not in t and final.startswith(t) and "\ufffd" not in t, (t, final)
    assert all(a == b[:len(a)] for a, b in itertools.pairwise(texts))


@pytest.mark.parametrize("text, stop", [
    ("The capital of France is Paris. It is a big city.", "Paris. It"),  # three tokens
    ("The capital of France is Paris. It is a big city.", "The"),  # at the very start
    ("The capital of France is Paris. It is a big city.", "pital of Fr"),  # inside tokens
    ("Price: 日本語 🎉 done", "🎉"),  # a 4-byte character split over three tokens
    ("Price: 日本語 🎉 done", "本語"),
    ("line one\n\nline two\n\nthree", "\n\n"),
])
def test_stop_string_cuts_the_text_before_it(tok, text, stop):
    texts, hit, final, ids = _stream(tok, text, stop=[stop])
    assert hit == _first_token_completing(tok, ids, stop)
    assert final == text[:text.find(stop)]
    _check_running_texts(texts, final, stop)


def test_multibyte_split_over_tokens_is_held_until_complete(tok):
    text = "Price: 日本語 🎉 done"
    ids = tok.encode(text, add_special_tokens=False)
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # the case is really exercised
    texts, hit, final, _ = _stream(tok, text)
    assert hit is None and final == text
    assert all("\ufffd" not in t and text.startswith(t) for t in texts)


def test_include_stop_str_and_earliest_of_several(tok):
    text = "Price: 日本語 🎉 done"
    _, _, final, _ = _stream(tok, text, stop=["🎉"], include_stop_str_in_output=True)
    assert final == "Price: 日本語 🎉"
    _, _, final, _ = _stream(tok, text, stop=["done", "語", "Price: 日本語 🎉 do"])
    assert final == "Price: 日本"


def test_stop_strings_wait_for_min_tokens(tok):
    text = "a, b, c, d, e"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids[:2]) == "a,"  # the first comma is token 1
    _, hit, final, _ = _stream(tok, text, stop=[","], min_tokens=2, max_tokens=20)
    assert final == "a" and hit == 1  # the 2nd token: min_tokens reached, as for EOS
    _, hit, final, _ = _stream(tok, text, stop=[","], min_tokens=3, max_tokens=20)
    assert final == "a, b" and hit == 3  # the first comma came too early


def test_final_text_without_stops_is_the_full_decode(tok):
    text = ("Ünïcödé tëxt, 中文字符, emoji 🎉🚀, code `x = {'a': 1}`\n\tand spaces   end. "
            * 3)
    texts, hit, final, ids = _stream(tok, text, skip_special_tokens=True)
    assert hit is None and final == tok.decode(ids) == text
    assert texts[-1] == final or final.startswith(texts[-1])


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("skip_special", [False, True])
def test_stop_token_text_only_with_include_stop_str_in_output(tok, include, skip_special):
    """The token that ends a sequence (EOS, a stop token id) stays in token_ids; its text is
    left out unless include_stop_str_in_output (vLLM v1's IncrementalDetokenizer.update)."""
    ids = tok.encode(" Paris.", add_special_tokens=False) + [tok.encode("<|im_end|>",
                                                                      add_special_tokens=False)[0]]
    for stop_at in (len(ids) - 2, len(ids) - 1):  # "." as a stop id, then the EOS
        st = RequestState(SamplingParams(include_stop_str_in_output=include,
                                         skip_special_tokens=skip_special),
                          tok.encode(PROMPT), tok)
        for i, t in enumerate(ids[:stop_at + 1]):
            assert not st.add_token(t, stop_token=i == stop_at)
        shown = ids[:stop_at + 1] if include else ids[:stop_at]
        assert st.text(finished=True) == tok.decode(shown, skip_special_tokens=skip_special)
        assert st.completion(ids[:stop_at + 1], "stop", True).token_ids == ids[:stop_at + 1]
    assert tok.decode(ids[-1:], skip_special_tokens=False) == "<|im_end|>"


def test_detokenization_work_per_token_is_bounded(tok):
    # The engine used to decode the whole output every step (quadratic); RequestState decodes
    # a window of a few tokens per new token, whatever the output length.
    lengths = []
    real = tok.decode_ids

    def counting(ids, skip_special_tokens=True):
        lengths.append(len(ids))
        return real(ids, skip_special_tokens)

    tok.decode_ids = counting  # the detokenizer's path (Tokenizer.decode checks, then it)
    try:
        text = "The quick brown fox jumps over the lazy dog. 日本語 🎉 " * 40
        _, _, final, ids = _stream(tok, text, stop=["never there"], max_tokens=16)
    finally:
        del tok.decode_ids
    assert len(ids) > 400 and final == text
    assert max(lengths) <= 12, max(lengths)


def test_find_stop_string_searches_only_where_new_text_can_complete():
    assert find_stop_string("abcSTOPxyz", 3, ["STOP"]) is None  # complete before the new text
    assert find_stop_string("abcSTOPxyz", 4, ["STOP"]) == (3, "STOP")  # "P" is new
    assert find_stop_string("abcSTOP", 1, ["STOP", "c"]) == (3, "STOP")
    assert find_stop_string("aXbY", 4, ["Y", "X"]) == (1, "X")  # earliest wins
    assert find_stop_string("abc", 0, ["c"]) is None


def test_logprobs_entries_put_the_chosen_token_first():
    ids, vals = np.array([7, 3, 9]), np.array([-0.1, -2.0, -3.0])
    assert list(logprobs_entry(3, -2.0, ids, vals, 2).items()) == [(3, -2.0), (7, -0.1)]
    assert logprobs_entry(5, -4.0, ids, vals, 0) == {5: -4.0}
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((4, 30)) * 3
    prompt = [1, 4, 29, 0, 17]
    out = prompt_logprobs_from_logits(logits, prompt, 3)
    ref = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    assert out[0] is None and len(out) == 5
    for i in range(1, 5):
        top = np.argsort(-ref[i - 1])[:3]
        assert next(iter(out[i])) == prompt[i]
        assert set(out[i]) == {prompt[i], *top.tolist()}
        for t, v in out[i].items():
            assert v == pytest.approx(ref[i - 1, t], abs=1e-9)
    assert prompt_logprobs_from_logits(None, [5], 3) == [None]


def test_logprobs_accumulate():
    st = RequestState(SamplingParams(logprobs=1), [1, 2], None)
    st.add_token(4, {4: -0.5, 9: -0.2})
    st.add_token(9, {9: -1.0})
    c = st.completion([4, 9], None, False)
    assert c.logprobs == [{4: -0.5, 9: -0.2}, {9: -1.0}]
    assert c.cumulative_logprob == pytest.approx(-1.5) and c.text == ""
    assert RequestState(SamplingParams(), [1], None).completion([4], None, False).logprobs is None
