"""``jaxinfer client`` refuses bad arguments itself, naming them, before any request is
sent (no server listens at the address used here)."""

from __future__ import annotations

import pytest

from jaxinfer.cli import main

NOWHERE = ["client", "--address", "127.0.0.1:9"]  # nothing is sent: no server needed


@pytest.mark.parametrize("ids, needle", [
    ("-5", "client --token-ids: token id -5 is not in [0, 2**32)"),
    (str(2**32), f"client --token-ids: token id {2**32} is not in [0, 2**32)"),
    ("1 x", "client --token-ids: '1 x' is not space-separated integers"),
])
def test_token_ids_that_do_not_fit_the_wire_are_named(ids, needle, capsys):
    """-5 used to print only protobuf's "Value out of range: -5"."""
    assert main([*NOWHERE, "--token-ids", "--", ids]) == 2
    assert capsys.readouterr().err.strip() == f"jaxinfer: error: {needle}"


@pytest.mark.parametrize("timeout", ["0", "-1", "nan", "inf", "1e300"])
def test_a_timeout_that_is_no_deadline_is_an_argument_error(timeout, capsys):
    """0, -1, nan and 1e300 used to reach gRPC and come back as DEADLINE_EXCEEDED."""
    with pytest.raises(SystemExit) as e:
        main([*NOWHERE, "--timeout", timeout, "hi"])
    assert e.value.code == 2 and "argument --timeout" in capsys.readouterr().err


def test_a_prompt_that_is_not_utf8_is_named(capsys):
    """Bytes in argv that are not UTF-8 (lone surrogates) used to print the codec's error."""
    assert main([*NOWHERE, "ab\udcff"]) == 2
    assert capsys.readouterr().err.strip() == (
        "jaxinfer: error: client: the prompt is not valid UTF-8 text: character 2 is the "
        "byte 0xff, not UTF-8")


def test_a_plain_string_stop_or_bad_word_is_one_string():
    """As SamplingParams takes them (protobuf alone would send a str's characters as a
    repeated field's entries: bad_words="Paris" banned "P", "a", ... not " Paris")."""
    from jaxinfer.serving.client import build_request

    req = build_request("hi", stop="end", bad_words="Paris", max_tokens=3)
    assert list(req.sampling.stop) == ["end"] and list(req.sampling.bad_words) == ["Paris"]
    req = build_request("hi", stop=["a", "b"], bad_words=("x",))
    assert list(req.sampling.stop) == ["a", "b"] and list(req.sampling.bad_words) == ["x"]
