"""``bad_words`` (jaxinfer.sampling_bad_words): the encoding of words as vLLM builds it, the
device mask against a numpy transcription of vLLM v1's ``apply_bad_words`` on fresh random
tables and outputs, the slots' last-output rows, and the sampler's use of both."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.batch import SamplingArrays
from jaxinfer.sampling import SamplerNeeds, sample_rows
from jaxinfer.sampling_bad_words import (
    MAX_BAD_WORD_SEQS,
    MAX_BAD_WORD_TOKENS,
    BadWordsError,
    bad_word_bans,
    bad_words_token_ids,
    encode_bad_words,
    fallback_tokens,
    mask_bad_words,
    push_recent,
    table_rows,
)
from jaxinfer.sampling_params import ParameterError, SamplingParams
from jaxinfer.sampling_penalties import LogitBias

L = MAX_BAD_WORD_TOKENS


def _vllm_banned(seqs: list[list[int]], outputs: list[int]) -> set[int]:
    """vLLM v1 ``apply_bad_words`` for one row: the tokens it sets to -inf."""
    banned = set()
    for w in seqs:
        if len(w) > len(outputs) + 1:
            continue
        prefix = outputs[len(outputs) - (len(w) - 1):] if len(w) > 1 else []
        if prefix == w[:-1]:
            banned.add(w[-1])
    return banned


def _fake_encode(text: str) -> list[int]:
    """A word-level stand-in: a word is one token (its length * 10 + a space flag) per
    character triple; a leading space makes a different first token."""
    space = text.startswith(" ")
    body = text.lstrip()
    ids = [100 + len(body[i:i + 3]) * 10 + (ord(body[i]) % 7) for i in range(0, len(body), 3)]
    if space and ids:
        ids[0] += 1000
    return ids


def test_words_encode_with_and_without_a_leading_space_as_vllm():
    seqs = bad_words_token_ids(["abc", "  abcdef", "abc"], _fake_encode)
    a, a_sp = _fake_encode("abc"), _fake_encode(" abc")
    b, b_sp = _fake_encode("abcdef"), _fake_encode(" abcdef")
    assert a != a_sp and len(b) == 2
    assert seqs == [a, a_sp, b, b_sp]  # the repeated word adds nothing

    def same_first(text: str) -> list[int]:  # a tokenizer where the space changes nothing
        return _fake_encode(text.lstrip())

    assert bad_words_token_ids(["abcd"], same_first) == [same_first("abcd")]

    def longer(text: str) -> list[int]:  # the spaced form has another length: dropped
        return [1, *_fake_encode(text.lstrip())] if text.startswith(" ") else _fake_encode(text)

    assert bad_words_token_ids(["xy"], longer) == [_fake_encode("xy")]


def test_words_that_do_not_fit_the_table_are_refused_by_name():
    with pytest.raises(BadWordsError, match=r"bad_words\[1\] 'q' encodes to no token"):
        bad_words_token_ids(["ok", "q"], lambda t: [] if "q" in t else [5])
    with pytest.raises(BadWordsError, match=rf"bad_words\[0\] .* is {L + 1} tokens; at most {L}"):
        bad_words_token_ids(["long"], lambda t: list(range(L + 1)))
    words = [f"w{i}" for i in range(MAX_BAD_WORD_SEQS // 2 + 1)]
    ids: dict[str, int] = {}  # one id per text (hash(t) % 10**6 collided in ~1 % of runs:
    #                            str hashes change with each process)
    with pytest.raises(BadWordsError, match=rf"encode to {MAX_BAD_WORD_SEQS + 2} token "
                                            rf"sequences .*; at most {MAX_BAD_WORD_SEQS}"):
        bad_words_token_ids(words, lambda t: [ids.setdefault(t, len(ids) + 1)])
    with pytest.raises(BadWordsError, match="need a tokenizer"):
        encode_bad_words(None, ["x"], 100)

    class Tok:
        def encode(self, text, add_special_tokens=True):
            assert not add_special_tokens
            return [150] if text.startswith(" ") else [7]

    with pytest.raises(BadWordsError, match=r"ids \[150\] outside the model's vocabulary"):
        encode_bad_words(Tok(), ["x"], 100)
    assert encode_bad_words(Tok(), ["x"], 200) == [[7], [150]]


def test_sampling_params_checks_bad_words():
    assert SamplingParams(bad_words="hello").bad_words == ["hello"]
    assert SamplingParams(bad_words=[]).bad_words is None
    assert SamplingParams(bad_words=("a", " b")).bad_words == ["a", " b"]
    for bad, where in ((["ok", "  "], r"bad_words\[1\]"), ([3], r"bad_words\[0\]")):
        with pytest.raises(ParameterError, match=rf"non-empty strings, got .* at {where}"):
            SamplingParams(bad_words=bad)
    with pytest.raises(ParameterError, match="bad_words must be None, a string or a list"):
        SamplingParams(bad_words={"a": 1})
    assert SamplingParams(stop=" ").stop == [" "]  # (a stop string may be a space)


def test_real_tokenizer_words_as_vllm(smollm_tokenizer):
    """SmolLM2's BPE: "hello" at the start of a text and " hello" inside it are different
    tokens, and both are banned; so are both forms of "hello world"; " unbelievably" is one
    token shorter than "unbelievably", so vLLM (and we) keep only the latter."""
    def enc(t):
        return smollm_tokenizer.encode(t, add_special_tokens=False)

    seqs = encode_bad_words(smollm_tokenizer, ["hello", " hello world", "unbelievably"], 49152)
    assert enc("hello") != enc(" hello") and len(enc("hello world")) == 2
    assert len(enc(" unbelievably")) != len(enc("unbelievably"))
    assert seqs == [enc("hello"), enc(" hello"), enc("hello world"), enc(" hello world"),
                    enc("unbelievably")]


def _random_case(rng, S: int, V: int):
    """Per row: sequences (some built to match the row's last outputs) and outputs."""
    rows = []
    for _ in range(S):
        outputs = [int(t) for t in rng.integers(0, 12, int(rng.integers(0, 20)))]
        seqs = []
        for _ in range(int(rng.integers(0, 9))):
            n = int(rng.integers(1, L + 1)) if rng.random() < 0.2 else int(rng.integers(1, 5))
            if outputs and rng.random() < 0.5 and n - 1 <= len(outputs):  # a matching prefix
                w = outputs[len(outputs) - (n - 1):] if n > 1 else []
                w = w + [int(rng.integers(0, V))]
            else:
                w = [int(t) for t in rng.integers(0, 12, n)]
            seqs.append(w)
        rows.append((seqs, outputs))
    return rows


def test_mask_equals_vllm_apply_bad_words_on_random_rows():
    rng = np.random.default_rng(7)
    V, S = 40, 24
    for _ in range(4):
        rows = _random_case(rng, S, V)
        tables = [table_rows(s, o) for s, o in rows]
        on = rng.random(S) < 0.8
        logits = rng.standard_normal((S, V)).astype(np.float32)
        bans = jax.jit(bad_word_bans, static_argnums=3)(
            jnp.asarray(np.stack([t[0] for t in tables])),
            jnp.asarray(np.stack([t[1] for t in tables])), jnp.asarray(on), V)
        got, before = map(np.asarray, jax.jit(mask_bad_words)(jnp.asarray(logits), bans))
        bans = np.asarray(bans)
        # the values before: the logits at the bans, -inf at the pads (V)
        np.testing.assert_array_equal(
            before, np.where(bans < V, np.take_along_axis(logits, np.minimum(bans, V - 1), 1),
                             -np.inf))
        fired = 0
        for r, (seqs, outputs) in enumerate(rows):
            want = logits[r].copy()
            if on[r]:
                banned = sorted(_vllm_banned(seqs, outputs))
                want[banned] = -np.inf
                fired += sum(len(w) > 1 for w in seqs if w[-1] in banned)
            np.testing.assert_array_equal(got[r], want, err_msg=str((r, seqs, outputs)))
        assert fired > 0  # multi-token words matched


def test_rows_the_bans_leave_empty_take_the_best_banned_token():
    """A row whose every finite logit is banned (allowed_token_ids all covered) takes the
    banned token with the largest logit before the bans, not the argmax of -infs (token
    0); rows with anything left, and rows that were all -inf before (no finite banned
    value), keep their token."""
    V = 12
    logits = np.full((4, V), -np.inf, np.float32)
    logits[0, [3, 5, 8]] = [1.0, 2.5, 0.5]  # all three banned below
    logits[1, [3, 5]] = [1.0, 2.0]  # 5 banned, 3 left
    logits[3] = np.arange(V)  # nothing banned
    bans = np.full((4, 4), V, np.int32)
    bans[0, :3], bans[1, 0] = [8, 5, 3], 5
    masked, before = jax.jit(mask_bad_words)(jnp.asarray(logits), jnp.asarray(bans))
    tokens = jnp.argmax(masked, axis=1)  # what the draw of greedy rows gives
    assert np.asarray(tokens).tolist() == [0, 3, 0, V - 1]  # row 0: a -inf token
    got = jax.jit(fallback_tokens)(tokens, masked, jnp.asarray(bans), before)
    assert np.asarray(got).tolist() == [5, 3, 0, V - 1]


def test_recent_rows_follow_the_outputs():
    rng = np.random.default_rng(3)
    N, S = 5, 4
    outputs = {s: [int(t) for t in rng.integers(0, 50, int(rng.integers(0, 4)))]
               for s in range(N)}
    recent = jnp.asarray(np.stack([table_rows([], outputs[s])[1] for s in range(N)]
                                  + [np.full(L - 1, -1, np.int32)]))
    push = jax.jit(push_recent)
    for step in range(L + 3):
        slots = rng.permutation(N + 1)[:S]  # distinct; N is scratch
        on = rng.random(S) < 0.7
        toks = rng.integers(0, 50, S)
        recent = push(recent, jnp.asarray(slots, jnp.int32), jnp.asarray(toks, jnp.int32),
                      jnp.asarray(on))
        for s, t, o in zip(slots, toks, on):
            if o and s < N:
                outputs[int(s)].append(int(t))
        for s in range(N):
            np.testing.assert_array_equal(np.asarray(recent[s]), table_rows([], outputs[s])[1])


def test_sampler_bans_on_rows_with_tables_and_appends_their_tokens():
    """Greedy rows: the argmax of the logits with vLLM's bans (rows with has_bias), the
    others untouched; ``recent`` gains each has_bias row's token; all-flags and the exact
    variant agree."""
    rng = np.random.default_rng(11)
    V, S, N = 40, 6, 8
    rows = _random_case(rng, N + 1, V)
    # Every row bans its own argmax through a two-token word matching its last output.
    logits = rng.standard_normal((S, V)).astype(np.float32)
    sa = SamplingArrays.neutral(S)
    sa.slots[:] = [4, 0, 7, 2, 5, 1]
    for r, s in enumerate(sa.slots):
        outs = rows[s][1] or [3]
        rows[s] = (rows[s][0] + [[outs[-1], int(np.argmax(logits[r]))]], outs)
    bad, recent = map(np.stack, zip(*(table_rows(s, o) for s, o in rows)))
    tables = LogitBias.zeros(N + 1)._replace(bad_ids=jnp.asarray(bad), recent=jnp.asarray(recent))
    sa.has_bias[:] = [True, True, False, True, True, False]
    counts = jnp.zeros((N + 1, V), jnp.int32)
    args = (jnp.asarray(logits), SamplingArrays(*map(jnp.asarray, sa)), counts)
    for needs in (SamplerNeeds.of(sa, V), SamplerNeeds()):
        out, _, new = jax.jit(sample_rows, static_argnums=3)(*args, needs, tables)
        for r in range(S):
            x = logits[r].copy()
            if sa.has_bias[r]:
                x[sorted(_vllm_banned(*rows[sa.slots[r]]))] = -np.inf
            assert int(out.tokens[r]) == int(np.argmax(x)), r
            assert (int(out.tokens[r]) != int(np.argmax(logits[r]))) == bool(sa.has_bias[r])
            s = sa.slots[r]
            want = table_rows([], rows[s][1] + [int(out.tokens[r])])[1] if sa.has_bias[r] \
                else recent[s]
            np.testing.assert_array_equal(np.asarray(new.recent[s]), want)
