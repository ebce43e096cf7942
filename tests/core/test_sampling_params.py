"""SamplingParams rejects values of the wrong type with a ParameterError naming the field
(plain Python; no engine)."""

from __future__ import annotations

import pytest

from jaxinfer.sampling_params import ParameterError, SamplingParams


@pytest.mark.parametrize("kw, needle", [
    (dict(stop=5), r"stop must be None, a string or a list of strings, got int 5"),
    (dict(stop={"a": 1}), r"stop must be .* got dict"),
    (dict(stop=b"end"), r"stop must be .* got bytes"),
    (dict(stop={"x"}), r"stop must be .* got set"),
    (dict(stop=["ok", None]), r"stop must hold non-empty strings, got None at stop\[1\]"),
    (dict(stop_token_ids=5), r"stop_token_ids must be a list of token ids .* got int 5"),
    (dict(stop_token_ids=None), r"stop_token_ids must be a list .* got NoneType"),
    (dict(stop_token_ids="12"), r"stop_token_ids must be a list .* got str '12'"),
    (dict(stop_token_ids={1, 2}), r"stop_token_ids must be a list .* got set"),
    (dict(stop_token_ids=[1, -3]), r"non-negative ints, got -3 at stop_token_ids\[1\]"),
    (dict(stop_token_ids=[1.0]), r"non-negative ints, got 1.0 at stop_token_ids\[0\]"),
    (dict(temperature=float("nan")), r"temperature must be finite, got nan"),
    # finite in float64 but inf in the sampler's float32: top_k / top_p were then ignored
    (dict(temperature=1e300), r"temperature must fit float32 \(\|x\| <= 3\.403e\+38\), "
                              r"got 1e\+300"),
    (dict(repetition_penalty=1e39), r"repetition_penalty must fit float32"),
    (dict(detokenize="no"), r"detokenize"),
    (dict(stop="x", detokenize=False), r"stop strings need detokenize=True"),
])
def test_wrong_types_are_parameter_errors_naming_the_field(kw: dict, needle: str) -> None:
    with pytest.raises(ParameterError, match=needle):
        SamplingParams(**kw)


def test_the_largest_float32_temperature_is_taken():
    assert SamplingParams(temperature=3e38).temperature == 3e38


def test_numpy_scalars_are_taken_and_stored_as_python_numbers():
    """np.int64 and friends (what a numpy pipeline hands over) are accepted like ints; bools
    and non-integral floats still are not."""
    import numpy as np

    sp = SamplingParams(
        max_tokens=np.int64(5), min_tokens=np.int32(1), seed=np.uint32(3), top_k=np.int16(4),
        n=np.int8(2), logprobs=np.int64(2), temperature=np.float32(0.5),
        top_p=np.float64(0.9), stop_token_ids=[np.int32(7)], ignore_eos=np.bool_(True))
    assert (sp.max_tokens, sp.min_tokens, sp.seed, sp.top_k, sp.n, sp.logprobs) == (5, 1, 3, 4,
                                                                                      2, 2)
    assert sp.stop_token_ids == [7] and sp.ignore_eos is True
    assert sp.temperature == 0.5 and sp.top_p == pytest.approx(0.9)
    for v in (sp.max_tokens, sp.min_tokens, sp.seed, sp.top_k, sp.n, sp.logprobs,
              *sp.stop_token_ids):
        assert type(v) is int
    assert type(sp.temperature) is float and type(sp.top_p) is float
    for kw, needle in [({"max_tokens": np.float64(5.0)}, "max_tokens must be an int"),
                       ({"max_tokens": np.bool_(True)}, "max_tokens must be an int"),
                       ({"seed": np.int64(-1)}, r"seed must be in \[0, 2\*\*63\)"),
                       ({"stop_token_ids": [np.int64(-2)]}, "stop_token_ids must hold")]:
        with pytest.raises(ParameterError, match=needle):
            SamplingParams(**kw)
