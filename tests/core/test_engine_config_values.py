"""EngineConfig refuses values of the wrong type or range by name (LLM(...) keyword
arguments and the CLI flags of the same names), before they reach numpy or the model."""

from __future__ import annotations

import pytest

from jaxinfer.config import ConfigError, EngineConfig


@pytest.mark.parametrize("seed", [-1, 2**63, 1.5, "x", True])
def test_seed_out_of_range_names_the_option(seed):
    """``seed=-1`` used to fail in numpy with "expected non-negative integer", no name."""
    with pytest.raises(ConfigError, match=r"seed must be an integer in \[0, 2\*\*63\), got "):
        EngineConfig(seed=seed)


@pytest.mark.parametrize("name", ["enable_prefix_caching", "async_scheduling", "scan_layers"])
@pytest.mark.parametrize("value", ["false", "no", 0, 1])
def test_flags_must_be_bool(name, value):
    """``scan_layers="false"`` used to turn scanning on (a non-empty string is true)."""
    with pytest.raises(ConfigError, match=f"{name} must be True or False, got {value!r}"):
        EngineConfig(**{name: value})


def test_flags_take_bools_and_scan_layers_none():
    ec = EngineConfig(enable_prefix_caching=False, async_scheduling=False, scan_layers=None,
                      seed=2**63 - 1)
    assert ec.scan_layers is None and ec.seed == 2**63 - 1


def test_cli_negative_seed_is_one_line_error_naming_seed(capsys):
    from jaxinfer.cli import main

    assert main(["generate", "--model", "dummy:tiny-llama", "--token-ids", "--seed", "-1",
                 "1 2 3"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "jaxinfer: error: seed must be an integer in [0, 2**63), got -1"]


@pytest.mark.parametrize("pages", [3.5, "64", True, 1])
def test_num_kv_pages_must_be_an_integer(pages):
    """``num_kv_pages=3.5`` used to reach jnp.zeros (a JAX TypeError on the pool's shape)."""
    with pytest.raises(ConfigError, match="num_kv_pages must be an integer of at least 2, got "):
        EngineConfig(num_kv_pages=pages)


def test_cli_num_kv_pages_beyond_memory_is_one_line_error(capsys):
    """``--num-kv-pages 10**12`` used to end in a RESOURCE_EXHAUSTED traceback (exit 1)."""
    from jaxinfer.cli import main

    assert main(["generate", "--model", "dummy:tiny-llama", "--token-ids", "--num-kv-pages",
                 str(10**12), "1 2 3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        "jaxinfer: error: num_kv_pages 1000000000000: the KV pool needs "), err
    assert "GiB of per-sequence state; lower num_kv_pages" in err[0]


def test_num_kv_pages_within_memory_is_kept(monkeypatch):
    from jaxinfer import kv_sizing
    from jaxinfer.config import ModelConfig

    mc = ModelConfig(family="llama", vocab_size=64, hidden_size=32, intermediate_size=64,
                     num_layers=2, num_heads=2, num_kv_heads=2, head_dim=16)
    ec = EngineConfig(max_model_len=64, num_kv_pages=10)
    page = kv_sizing.kv_page_bytes(mc, 16, "float32")
    slots = kv_sizing.slot_state_bytes(mc, ec)  # the runner's penalty counts come first
    assert slots == (8 + 1) * 64 * 4
    monkeypatch.setattr(kv_sizing, "host_available_bytes", lambda: 10 * page + slots)
    assert kv_sizing.size_for_engine(None, mc, ec, "float32").num_pages == 10
    monkeypatch.setattr(kv_sizing, "host_available_bytes", lambda: 10 * page + slots - 1)
    with pytest.raises(ConfigError, match="num_kv_pages 10: the KV pool needs"):
        kv_sizing.size_for_engine(None, mc, ec, "float32")


@pytest.mark.parametrize("model", [123, None, ["smollm2-135m"]])
def test_model_of_the_wrong_type_is_refused_before_loading(model, monkeypatch):
    """``LLM(123)`` / ``LLM(None)`` used to fail with an AttributeError deep in the engine."""
    from jaxinfer import loading
    from jaxinfer.llm import LLM

    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("loaded"))
    with pytest.raises(ConfigError, match="model must be a model name, a checkpoint path or "
                                          f"a LoadedModel, got {type(model).__name__}"):
        LLM(model)


def test_unknown_engine_option_is_refused_before_loading(monkeypatch):
    """``LLM(..., max_num_seq=4)`` used to load the model, then raise a bare TypeError."""
    from jaxinfer import loading
    from jaxinfer.llm import LLM

    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("loaded"))
    with pytest.raises(ConfigError, match=r"unknown engine option 'max_num_seq' \(did you "
                                          r"mean 'max_num_seqs'\?\)") as err:
        LLM("dummy:tiny-llama", max_num_seq=4)
    assert err.value.field == "max_num_seq"
    with pytest.raises(ConfigError, match=r"^unknown engine option 'foo_bar'$"):
        LLM("dummy:tiny-llama", foo_bar=1)


def test_path_models_and_known_options_pass_the_check():
    from pathlib import Path

    from jaxinfer.engine_config import check_engine_args

    check_engine_args(Path("/models/x"), {"max_num_seqs": 4, "seed": 1})
    check_engine_args("smollm2-135m", {})


def test_max_model_len_below_two_is_refused():
    """``serve --max-model-len 1`` started and then refused every prompt."""
    with pytest.raises(ConfigError, match=r"max_model_len must be at least 2 \(a prompt "
                                          r"token and a new one\), got 1"):
        EngineConfig(max_model_len=1)
    assert EngineConfig(max_model_len=2, block_size=2).max_model_len == 2
