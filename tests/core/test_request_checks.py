"""``jaxinfer.request_checks``: a request's SamplingParams checked against the model before it
is queued (the engine-level behaviour is in tests/engine/test_bad_words_engine.py and
test_engine.py); here the functions alone, over a small vocabulary and a stand-in tokenizer."""

from __future__ import annotations

import pytest

from jaxinfer.prompts import RequestError
from jaxinfer.request_checks import checked_params, masked_stops, no_token_left
from jaxinfer.sampling_params import SamplingParams

V, EOS = 10, (2,)


class _Tok:
    """Encodes each character as its own id (a..j -> 0..9)."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) - ord("a") for c in text.strip()]


def test_checked_params_copies_and_encodes_bad_words():
    sp = SamplingParams(max_tokens=5, bad_words=["ab"])
    got = checked_params(sp, _Tok(), V, EOS)
    assert got is not sp and got == sp and sp.bad_words_token_ids is None
    assert [0, 1] in got.bad_words_token_ids
    sp.max_tokens = 9  # the caller's later edit changes neither the copy nor its checks
    assert got.max_tokens == 5
    assert checked_params(None, None, V, EOS) == SamplingParams()


@pytest.mark.parametrize("params, tokenizer, match", [
    ("temperature=2", _Tok(), "must be SamplingParams"),
    (SamplingParams(stop=["x"]), None, "stop strings need a tokenizer"),
    (SamplingParams(bad_words=["x"]), None, "bad_words need a tokenizer"),
    (SamplingParams(stop_token_ids=[3, 10, 11]), _Tok(), r"stop_token_ids \[10, 11\] are not"),
    (SamplingParams(allowed_token_ids=[12]), _Tok(), r"allowed_token_ids \[12\]"),
    (SamplingParams(logit_bias={10: 1.0}), _Tok(), r"logit_bias \[10\].*vocab size 10"),
    (SamplingParams(allowed_token_ids=[0, 1], bad_words=["a", "b"]), _Tok(),
     "bad_words ban allowed_token_ids"),
])
def test_checked_params_refuses_by_name(params, tokenizer, match):
    with pytest.raises(RequestError, match=match):
        checked_params(params, tokenizer, V, EOS)


def test_checked_params_refuses_a_field_broken_after_construction():
    sp = SamplingParams()
    sp.top_p = 3.0  # dataclass fields can be set later; the copy checks them again
    with pytest.raises(RequestError, match="sampling params: .*top_p"):
        checked_params(sp, None, V, EOS)


def test_masked_stops():
    assert masked_stops(SamplingParams(stop_token_ids=[4]), V, EOS) == set()  # no min_tokens
    sp = SamplingParams(min_tokens=2, stop_token_ids=[4, 10])  # 10 is outside the vocabulary
    assert masked_stops(sp, V, EOS) == {2, 4}
    sp = SamplingParams(min_tokens=2, stop_token_ids=[4], ignore_eos=True)
    assert masked_stops(sp, V, EOS) == {4}


def test_no_token_left():
    def why(bad_words=(), **kw):  # one-token words, as ids
        sp = SamplingParams(**kw)
        sp.bad_words_token_ids = [[t] for t in bad_words]
        return no_token_left(sp, V, EOS)

    assert why() is None
    assert why(bad_words=list(range(V))) == ("bad_words ban the whole vocabulary (10 ids), so "
                                            "no token could be sampled")
    assert why(bad_words=list(range(V - 1))) is None  # one token left
    assert why(allowed_token_ids=[2, 4], min_tokens=1, stop_token_ids=[4]).startswith(
        "min_tokens 1: EOS and stop_token_ids cover allowed_token_ids")
    assert "and bad_words cover" in why(allowed_token_ids=[2, 5], min_tokens=1, bad_words=[5])
    assert why(allowed_token_ids=[2, 5], min_tokens=1, ignore_eos=True) is None
    assert why(allowed_token_ids=[2, 5], bad_words=[5]) is None  # 2 is left (no min_tokens)
