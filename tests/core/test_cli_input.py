"""``jaxinfer generate`` input checked before the model loads."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("prompts", [[""], ["hi", "   "]])
def test_empty_chat_prompt_is_one_line_error_before_loading(monkeypatch, capsys, prompts):
    from jaxinfer import llm as llm_module
    from jaxinfer.cli import main

    def no_model(*args, **kw):
        raise AssertionError("the model was loaded before the prompt was checked")

    monkeypatch.setattr(llm_module.LLM, "__init__", no_model)
    assert main(["generate", "--model", "dummy:tiny-llama", "--chat", *prompts]) == 2
    index = len(prompts) - 1
    assert capsys.readouterr().err.strip().splitlines() == [
        f"jaxinfer: error: --chat: prompt {index} is empty (nothing to say)"]


def test_chat_and_token_ids_exclude_each_other(capsys):
    """``--chat --token-ids`` used to run, reading the prompt as chat text."""
    from jaxinfer.cli import main

    with pytest.raises(SystemExit) as e:
        main(["generate", "--model", "dummy:tiny-llama", "--chat", "--token-ids", "1 2"])
    assert e.value.code == 2
    assert "argument --token-ids: not allowed with argument --chat" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["-5", "nan", "inf", "soon"])
def test_serve_drain_timeout_must_be_seconds_at_least_zero(capsys, value):
    from jaxinfer.cli import main

    with pytest.raises(SystemExit) as e:
        main(["serve", "--model", "dummy:tiny-llama", "--drain-timeout", value])
    assert e.value.code == 2
    assert "argument --drain-timeout:" in capsys.readouterr().err
