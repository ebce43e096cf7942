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


@pytest.mark.parametrize("modes", [",", " ", ""])
def test_compile_with_no_modes_is_refused_and_writes_no_cache(monkeypatch, capsys, tmp_path,
                                                              modes):
    """``--modes ,`` used to write a compile cache of 0 programs (exit 0), whose KV pool an
    engine started with it then adopted."""
    from jaxinfer import compile_cli
    from jaxinfer.cli import main

    monkeypatch.setattr(compile_cli, "model_config_of",
                        lambda *a: pytest.fail("the model config was read first"))
    cache = tmp_path / "cache"
    assert main(["compile", "--model", "dummy:tiny-llama", "--cache-dir", str(cache),
                 "--jobs", "1", "--modes", modes]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"jaxinfer: error: --modes names no program mode (got {modes!r}); use sample, logits"]
    assert not cache.exists()
