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
])
def test_wrong_types_are_parameter_errors_naming_the_field(kw: dict, needle: str) -> None:
    with pytest.raises(ParameterError, match=needle):
        SamplingParams(**kw)

