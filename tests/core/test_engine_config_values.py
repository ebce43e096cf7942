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
