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


def _generate_sampling(argv: list[str]):
    from jaxinfer.cli import _sampling, build_parser

    return _sampling(build_parser().parse_args(["generate", "--model", "m", "p", *argv]))


def test_structured_output_flags_make_structured_outputs(tmp_path):
    from jaxinfer.structured_outputs import StructuredOutputsParams as SO

    schema = '{"type": "object", "required": ["a"]}'
    (tmp_path / "s.json").write_text(schema)
    assert _generate_sampling([]).structured_outputs is None
    assert _generate_sampling(["--json-schema", schema]).structured_outputs == SO(json=schema)
    assert (_generate_sampling(["--json-schema", f"@{tmp_path / 's.json'}"]).structured_outputs
            == SO(json=schema))
    assert _generate_sampling(["--regex", "[a-z]+"]).structured_outputs == SO(regex="[a-z]+")
    assert (_generate_sampling(["--choice", "yes", "--choice", "no"]).structured_outputs
            == SO(choice=["yes", "no"]))
    with pytest.raises(ValueError, match="give at most one of --json-schema, --regex, --choice"):
        _generate_sampling(["--regex", "a", "--choice", "b"])


@pytest.mark.parametrize("value, needle", [
    ("[1]", "must be a JSON schema (a JSON object), got list"),
    ("{bad", "must be a JSON schema (JSON text or @file)"),
    ("@/nonexistent/s.json", "cannot read the schema file '/nonexistent/s.json'"),
])
def test_bad_json_schema_flag_is_a_usage_error(capsys, value, needle):
    from jaxinfer.cli import main

    with pytest.raises(SystemExit) as e:
        main(["generate", "--model", "dummy:tiny-llama", "x", "--json-schema", value])
    assert e.value.code == 2
    assert needle in capsys.readouterr().err


def test_n_flag_sets_samples_and_chat_refuses_more_than_one(monkeypatch, capsys):
    from jaxinfer import engine as engine_module
    from jaxinfer.cli import main

    assert _generate_sampling(["--n", "3"]).n == 3
    assert _generate_sampling([]).n == 1

    def no_model(*args, **kw):
        raise AssertionError("the model was loaded before --n was checked")

    monkeypatch.setattr(engine_module.LLMEngine, "__init__", no_model)
    assert main(["chat", "--model", "dummy:tiny-llama", "--n", "2"]) == 2
    assert capsys.readouterr().err.strip() == (
        "jaxinfer: error: chat streams one reply a turn: --n must be 1, got 2")
