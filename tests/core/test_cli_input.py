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
