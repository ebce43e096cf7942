"""Structured outputs' parts without an engine: StructuredOutputsParams' checks, the bitmask
layout, the device loader of the masks (``sampling_penalties.load_allowed_masks``) against
numpy on fresh random state, and GrammarMatchers over SmolLM2's tokenizer (grammar errors,
masks, completion, rejection)."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from jaxinfer.sampling_params import ParameterError, SamplingParams
from jaxinfer.sampling_penalties import ALLOWED_FLAG, load_allowed_masks
from jaxinfer.structured_outputs import (
    GrammarError,
    GrammarMatchers,
    StructuredOutputsParams,
    token_bitmask,
    unpack_bitmask,
)


@pytest.mark.parametrize("kwargs, needle", [
    ({}, "exactly one of json, regex, choice, grammar, json_object; got none"),
    ({"regex": "a", "choice": ["a"]}, "got regex, choice"),
    ({"json": "{not json"}, "structured_outputs.json is not JSON text"),
    ({"json": "true"}, "structured_outputs.json must be a JSON schema object, got bool text"),
    ({"json": ["a"]}, "must be a JSON schema (a dict or its JSON text), got list"),
    ({"regex": ""}, "structured_outputs.regex must be a non-empty str"),
    ({"grammar": 5}, "structured_outputs.grammar must be a non-empty str"),
    ({"choice": []}, "structured_outputs.choice must be a non-empty list"),
    ({"choice": "yes"}, "structured_outputs.choice must be a non-empty list"),
    ({"choice": ["yes", ""]}, "structured_outputs.choice must be a non-empty list"),
    ({"json_object": False}, "structured_outputs.json_object must be True, got False"),
    ({"regex": "a", "disable_any_whitespace": 1}, "disable_any_whitespace must be a bool"),
])
def test_bad_params_name_the_field(kwargs, needle) -> None:
    with pytest.raises(ParameterError) as e:
        StructuredOutputsParams(**kwargs)
    assert needle in str(e.value)


def test_sampling_params_take_the_object_or_a_dict() -> None:
    so = StructuredOutputsParams(choice=("yes", "no"))
    assert so.choice == ["yes", "no"] and so.kind == "choice"
    assert SamplingParams(structured_outputs=so).structured_outputs is so
    sp = SamplingParams(structured_outputs={"regex": "[0-9]+"})
    assert sp.structured_outputs == StructuredOutputsParams(regex="[0-9]+")
    with pytest.raises(ParameterError, match="structured_outputs has no field 'regexp' "
                                             r"\(fields: json, regex, choice, grammar, "):
        SamplingParams(structured_outputs={"regexp": "a"})
    with pytest.raises(ParameterError, match="must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs="[0-9]+")
    with pytest.raises(ParameterError, match="got none"):
        SamplingParams(structured_outputs={})


def test_bitmask_layout_round_trips() -> None:
    rng = np.random.default_rng(0)
    V = 100  # not a multiple of 32
    ids = rng.choice(V, size=17, replace=False)
    mask = token_bitmask(ids, (V + 31) // 32)
    assert mask.dtype == np.int32 and mask.shape == (4,)
    assert sorted(np.flatnonzero(unpack_bitmask(mask, V))) == sorted(ids)
    for t in ids:  # llguidance's layout: bit t % 32 of word t // 32
        assert (int(mask[t // 32]) >> (t % 32)) & 1
    assert unpack_bitmask(token_bitmask([31], 1), 32)[31]  # the sign bit


@pytest.mark.parametrize("V, R", [(96, 1), (100, 4), (257, 3)])
def test_load_allowed_masks_against_numpy(V, R) -> None:
    rng = np.random.default_rng(V + R)
    N = 6  # slots; row N is the scratch row
    counts = rng.integers(0, 2**31 - 1, size=(N + 1, V), dtype=np.int64).astype(np.int32)
    W = (V + 31) // 32
    slots = rng.choice(N, size=R, replace=False)
    masks = rng.integers(-2**31, 2**31 - 1, size=(R, W), dtype=np.int64).astype(np.int32)
    pad = 2  # padding rows name the scratch row with empty masks
    slots_in = np.concatenate([slots, np.full(pad, N)]).astype(np.int32)
    masks_in = np.concatenate([masks, np.zeros((pad, W), np.int32)])
    out = np.asarray(jax.jit(load_allowed_masks)(counts, slots_in, masks_in))
    want = counts.copy()
    allowed = unpack_bitmask(masks, V)
    want[slots] = (counts[slots] & ~ALLOWED_FLAG) | np.where(allowed, ALLOWED_FLAG, 0)
    want[N] &= ~ALLOWED_FLAG
    np.testing.assert_array_equal(out, want)  # other rows and other bits unchanged


@pytest.fixture(scope="module")
def matchers(smollm_tokenizer) -> GrammarMatchers:
    return GrammarMatchers(smollm_tokenizer, 49152, smollm_tokenizer.eos_token_ids)


class _Seq:  # what GrammarMatchers reads of a sequence.Sequence
    def __init__(self, rid: int, outputs=(), allowed=None, index: int = 0):
        self.seq_id, self.key = rid, (rid, index)
        self.output_token_ids = list(outputs)
        self.sampling_params = SamplingParams(allowed_token_ids=allowed)


@pytest.mark.parametrize("so, needle", [
    (StructuredOutputsParams(regex="(yes|no"), "structured_outputs.regex is not a valid regex"),
    (StructuredOutputsParams(grammar="start: foo"), 'unknown name: "foo"'),
    (StructuredOutputsParams(grammar='root ::= "a" missing'),
     "structured_outputs.grammar: Failed to convert the grammar from GBNF to Lark: Rule "
     "'missing' not found"),
    (StructuredOutputsParams(json={"type": "object", "x": {1, 2}}),
     "structured_outputs.json: Value is not JSON serializable: {1, 2}"),
    (StructuredOutputsParams(json={"type": "objectx"}), "Invalid type: objectx"),
    # validation passes these; the first token's mask finds that nothing can match
    (StructuredOutputsParams(regex=r"[^\x00-\x{10FFFF}]"),
     "structured_outputs.regex: no output can match it (llguidance: NoExtensionBias)"),
])
def test_invalid_grammars_are_refused(matchers, so, needle) -> None:
    with pytest.raises(GrammarError) as e:
        matchers.check(so)
    assert needle in str(e.value)


def test_no_tokenizer_refuses() -> None:
    with pytest.raises(GrammarError, match="need a tokenizer; this model has none"):
        GrammarMatchers(None, 96, [1]).check(StructuredOutputsParams(regex="a"))


def _allowed(matchers, seq) -> set[int]:
    return set(np.flatnonzero(unpack_bitmask(matchers.masks([seq])[0], matchers.vocab_size)))


def test_choice_masks_complete_and_reject(matchers, smollm_tokenizer) -> None:
    tok = smollm_tokenizer
    choices = ["yes", "no", 'say "hi"']
    matchers.add(1, matchers.check(StructuredOutputsParams(choice=choices)))
    seq = _Seq(1)
    first = _allowed(matchers, seq)
    # Every allowed first token starts one of the choices, and each choice's first token
    # (as the tokenizer spells it) is allowed.
    for t in first:
        piece = tok.decode([t], skip_special_tokens=False)
        assert any(c.startswith(piece) for c in choices), piece
    for c in choices:
        assert tok.encode(c, add_special_tokens=False)[0] in first, c
    ids = tok.encode('say "hi"', add_special_tokens=False)
    for i, t in enumerate(ids):
        assert t in _allowed(matchers, seq)
        seq.output_token_ids.append(t)
        assert matchers.accept(seq, t) == ("stop" if i == len(ids) - 1 else None)
    # A sequence fed a token its grammar refuses: "rejected", and then every token allowed.
    other = _Seq(1, index=1)
    bad = tok.encode("maybe", add_special_tokens=False)[0]
    assert bad not in _allowed(matchers, other)
    assert matchers.accept(other, bad) == "rejected"
    assert len(_allowed(matchers, other)) == matchers.vocab_size
    matchers.forget_sequence(seq.key)
    matchers.forget_sequence(other.key)
    matchers.forget_request(1)
    assert not matchers.has(1) and not matchers._matchers


def test_matcher_replays_outputs_and_keeps_allowed_ids(matchers, smollm_tokenizer) -> None:
    tok = smollm_tokenizer
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    matchers.add(2, matchers.check(StructuredOutputsParams(json=json.dumps(schema),
                                                           disable_any_whitespace=True)))
    prefix = tok.encode('{"n":', add_special_tokens=False)
    resumed = _Seq(2, outputs=prefix)  # e.g. a sequence whose matcher was made after outputs
    digits = {tok.encode(d, add_special_tokens=False)[0] for d in "0123456789"}
    allowed = _allowed(matchers, resumed)
    assert digits <= allowed and tok.encode("}", add_special_tokens=False)[0] not in allowed
    only = sorted(digits)[:3] + [tok.encode("x", add_special_tokens=False)[0]]
    narrowed = _Seq(2, outputs=prefix, allowed=only, index=1)
    assert _allowed(matchers, narrowed) == set(sorted(digits)[:3])  # grammar AND allowed ids
    matchers.forget_request(2)


def test_rows_filled_in_parallel_equal_one_by_one(matchers, smollm_tokenizer) -> None:
    tok = smollm_tokenizer
    one_by_one = GrammarMatchers(tok, 49152, tok.eos_token_ids, threads=1)
    grammar = matchers.check(StructuredOutputsParams(regex=r"[a-z ]{1,40}\\.|[0-9]+"))
    for gm in (matchers, one_by_one):
        gm.add(3, grammar)
    prefixes = ["", "the", "the cat sat", "12", "the cat sat on the mat", "7 "]
    seqs = []
    for i, p in enumerate(prefixes):
        ids = tok.encode(p, add_special_tokens=False) if p else []
        seqs.append(_Seq(3, outputs=ids, index=i))
    par, seq_masks = matchers.masks(seqs), one_by_one.masks(seqs)
    np.testing.assert_array_equal(par, seq_masks)
    assert matchers._executor is not None and one_by_one._executor is None
    assert len({m.tobytes() for m in par}) >= 4  # the states differ
    # "7 " left the grammar when replayed: that row's matcher is in error, every token allowed
    assert matchers._matcher(seqs[-1]).is_error() and (par[-1] == -1).all()
    for gm in (matchers, one_by_one):
        for s in seqs:
            gm.forget_sequence(s.key)
        gm.forget_request(3)


def _walk(matchers, rid: int, text: str, tok) -> list[str | None]:
    """Feed ``text``'s tokens to a fresh sequence of request ``rid``: accept()'s answers."""
    seq = _Seq(rid)
    got = []
    for t in tok.encode(text, add_special_tokens=False):
        assert t in _allowed(matchers, seq), (text, t)
        seq.output_token_ids.append(t)
        got.append(matchers.accept(seq, t))
    matchers.forget_sequence(seq.key)
    return got


def test_choices_with_any_characters_and_long_lists(matchers, smollm_tokenizer) -> None:
    """Choices compile to one regex of literal characters (\\x{..} escapes): every
    character means itself; and a 5,000-item list (over llguidance's ~2,000 alternatives a
    grammar rule: it used to fail at the second token, finishing "abort") works."""
    tok = smollm_tokenizer
    special = ['a-b', 'x.y', 'q"uote', "back\\slash", 'sp ace', 'ü', '(paren)', 'a*', '[br]',
               '{c}', '^$', '#hash', "it's", "tab\there", "new\nline", "&amp", "日本"]
    matchers.add(4, matchers.check(StructuredOutputsParams(choice=special)))
    for c in special:
        got = _walk(matchers, 4, c, tok)
        assert got == [None] * (len(got) - 1) + ["stop"], (c, got)  # complete at its end
    many = [f"item-{i:05d}" for i in range(5000)]
    matchers.add(5, matchers.check(StructuredOutputsParams(choice=many)))
    for c in ("item-00000", "item-04999", "item-02345"):
        assert _walk(matchers, 5, c, tok)[-1] == "stop", c
    assert _walk(matchers, 5, "item-0", tok) == [None] * len(
        tok.encode("item-0", add_special_tokens=False))
    matchers.forget_request(4)
    matchers.forget_request(5)
