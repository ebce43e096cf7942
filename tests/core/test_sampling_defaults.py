"""The model's default sampling parameters from generation_config.json (vLLM's
``--generation-config auto``): parsing, errors, and the k-step variants they warm."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from jaxinfer.config import ModelConfig
from jaxinfer.loading.base import CheckpointError
from jaxinfer.loading.hf_loader import read_hf_header
from jaxinfer.sampling_defaults import (
    check_defaults,
    default_sampling_params,
    from_generation_config,
)
from jaxinfer.sampling_params import SamplingParams

TINY_LLAMA = Path(__file__).resolve().parents[1] / "fixtures" / "tiny" / "llama"
LLAMA3_INSTRUCT = {"bos_token_id": 128000, "do_sample": True, "eos_token_id": [128001, 128009],
                   "temperature": 0.6, "top_p": 0.9, "transformers_version": "4.42.3"}


def test_reads_vllm_keys_only():
    """The keys vLLM reads, max_new_tokens as max_tokens; nulls, do_sample and the token
    ids are not sampling defaults."""
    assert from_generation_config(LLAMA3_INSTRUCT) == {"temperature": 0.6, "top_p": 0.9}
    qwen3 = {"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95,
             "repetition_penalty": 1.05, "min_p": 0.0, "max_new_tokens": 256, "seed": None}
    assert from_generation_config(qwen3) == {
        "temperature": 0.6, "top_k": 20, "top_p": 0.95, "repetition_penalty": 1.05,
        "min_p": 0.0, "max_tokens": 256}
    assert from_generation_config({"temperature": None, "top_k": None}) == {}
    assert from_generation_config(None) == {} == from_generation_config({})
    # integral floats of the int keys are ints; past int32 they are capped (same meaning,
    # and the gRPC API's int32 fields hold them); other values are kept for check_defaults
    assert from_generation_config({"top_k": 50.0, "max_new_tokens": 2**40}) == {
        "top_k": 50, "max_tokens": 2**31 - 1}
    assert from_generation_config({"top_k": 1.5, "top_p": "x"}) == {"top_k": 1.5,
                                                                   "top_p": "x"}
    sp = default_sampling_params({"temperature": 0.6, "top_p": 0.9})
    assert (sp.temperature, sp.top_p, sp.max_tokens) == (0.6, 0.9, 16)
    assert default_sampling_params({}) == SamplingParams()


@pytest.mark.parametrize("gen, needle", [
    ({"top_p": 2.0}, r"^/m/generation_config.json: top_p 2.0 is not a default SamplingParams "
                     r"accepts: .*top_p"),
    ({"max_new_tokens": 0}, r"max_new_tokens \(the default max_tokens\) 0 is not a default "),
    ({"temperature": "hot"}, r"temperature 'hot' is not a default SamplingParams accepts"),
    ({"top_k": 1.5}, r"top_k 1.5 is not a default"),
])
def test_bad_value_names_the_file_and_key(gen, needle):
    with pytest.raises(ValueError, match=needle):
        check_defaults(from_generation_config(gen), "/m/generation_config.json")


def _checkpoint(tmp_path: Path, gen: dict) -> Path:
    d = tmp_path / "llama"
    shutil.copytree(TINY_LLAMA, d)
    (d / "generation_config.json").write_text(json.dumps(gen))
    return d


def test_hf_checkpoint_carries_its_defaults(tmp_path):
    """read_hf_header's ModelConfig holds the defaults; they survive the converted
    checkpoint's JSON; the committed tiny fixtures (no sampling keys) hold none."""
    assert read_hf_header(TINY_LLAMA, with_tokenizer=False)[0].sampling_defaults == {}
    d = _checkpoint(tmp_path, {**LLAMA3_INSTRUCT, "eos_token_id": 2, "max_new_tokens": 7})
    cfg = read_hf_header(d, with_tokenizer=False)[0]
    assert cfg.sampling_defaults == {"temperature": 0.6, "top_p": 0.9, "max_tokens": 7}
    assert ModelConfig.from_json(cfg.to_json()) == cfg


def test_hf_checkpoint_with_a_bad_default_is_refused_where_defaults_apply(tmp_path, capsys):
    """The engine ("auto") and `jaxinfer compile` refuse a bad default, naming the file and
    key; generation_config="vllm" and `jaxinfer generate` (explicit values) load the model."""
    from jaxinfer import cli
    from jaxinfer.engine import LLMEngine

    d = _checkpoint(tmp_path, {"eos_token_id": 2, "repetition_penalty": -1})
    assert read_hf_header(d, with_tokenizer=False)[0].sampling_defaults == {
        "repetition_penalty": -1}
    args = dict(max_model_len=64, block_size=4, max_num_seqs=2, max_num_batched_tokens=64)
    needle = rf"^{re.escape(str(d))}/generation_config.json: repetition_penalty -1 is not a default"
    with pytest.raises(CheckpointError, match=needle):
        LLMEngine(str(d), **args)
    assert LLMEngine(str(d), generation_config="vllm", **args).sampling_defaults == {}
    compile_argv = ["compile", "--model", str(d), "--max-num-seqs", "2", "--max-model-len",
                    "64", "--list"]
    assert cli.main(compile_argv) == 2  # the CLI's one-line error
    assert re.search(needle.replace("^", r"^jaxinfer: error: "), capsys.readouterr().err,
                     re.M)
    assert cli.main([*compile_argv, "--generation-config", "vllm"]) == 0
    ns = cli.build_parser().parse_args(["generate", "--model", str(d), "--token-ids", "5 6"])
    assert cli._engine_args(ns)["generation_config"] == "vllm"


@pytest.mark.parametrize("defaults, extra", [
    ({}, ()), ({"temperature": 0.6, "top_p": 0.9}, ("top_p",)),
    ({"temperature": 0.6, "top_k": 20, "top_p": 0.95}, ("top_k_top_p",)),
    ({"temperature": 0.0}, ()), ({"max_tokens": 128}, ())])
def test_warm_variants_add_the_default_requests_variant(defaults, extra):
    from jaxinfer.runner_multi import MULTI_STEP_WARM_VARIANTS, warm_variants

    assert warm_variants(defaults, 128256) == (*MULTI_STEP_WARM_VARIANTS, *extra)


def test_compile_lists_the_default_requests_k_step_programs(tmp_path, capsys):
    """`jaxinfer compile --num-scheduler-steps K` of a checkpoint whose generation config
    samples with top_p adds that variant's K-step program of every decode bucket."""
    from jaxinfer import cli

    d = _checkpoint(tmp_path, {"eos_token_id": 2, "temperature": 0.6, "top_p": 0.9})
    argv = ["compile", "--model", str(d), "--num-scheduler-steps", "4", "--decode-buckets",
            "1,2", "--max-num-seqs", "2", "--max-model-len", "64", "--list"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert ("greedy.k4 multistep 2, temperature.k4 multistep 2, top_p.k4 multistep 2)"
            in out)
    for change in (["--generation-config", "vllm"], []):
        if not change:
            (d / "generation_config.json").write_text('{"eos_token_id": 2}')
        assert cli.main([*argv, *change]) == 0
        out = capsys.readouterr().out
        assert "temperature.k4 multistep 2)" in out and "top_p.k4" not in out


def test_gguf_general_sampling_keys_are_the_defaults(tmp_path):
    """A GGUF's general.sampling.* metadata (llama.cpp's converter writes it from the
    generation config) gives the same defaults; llama.cpp's keys without a SamplingParams
    field are not read; a file without them has none; a value of the wrong type, or one
    SamplingParams refuses, is refused naming the file and key."""
    from jaxinfer.loading.gguf_loader import read_gguf_header
    from jaxinfer.sampling_defaults import check_sampling_defaults
    from tests.core.test_loading_config_values import write_gguf

    plain = write_gguf(tmp_path / "plain.gguf")
    assert read_gguf_header(plain)[1].sampling_defaults == {}
    p = write_gguf(tmp_path / "m.gguf", meta={
        "general.sampling.temp": 0.6, "general.sampling.top_k": 20,
        "general.sampling.top_p": 0.95, "general.sampling.min_p": 0.05,
        "general.sampling.penalty_repeat": 1.1, "general.sampling.penalty_last_n": 64,
        "general.sampling.mirostat": 0})
    cfg = read_gguf_header(p)[1]
    assert cfg.sampling_defaults == pytest.approx({
        "temperature": 0.6, "top_k": 20, "top_p": 0.95, "min_p": 0.05,
        "repetition_penalty": 1.1})
    assert isinstance(cfg.sampling_defaults["top_k"], int)
    check_sampling_defaults(cfg.sampling_defaults, str(p))  # all acceptable
    bad = write_gguf(tmp_path / "bad.gguf", meta={"general.sampling.top_p": 2.0})
    with pytest.raises(CheckpointError, match=rf"^{re.escape(str(bad))}: "
                       r"general.sampling.top_p \(the default top_p\) 2.0 is not a default"):
        check_sampling_defaults(read_gguf_header(bad)[1].sampling_defaults, str(bad))
    # Read as generation_config.json's values: an integral float top_k is an int; a value
    # of the wrong type loads (generation_config="vllm" ignores it) and is refused by name
    # where the defaults apply.
    typed = write_gguf(tmp_path / "typed.gguf", meta={"general.sampling.top_k": 40.0,
                                                      "general.sampling.temp": "hot"})
    got = read_gguf_header(typed)[1].sampling_defaults
    assert got == {"top_k": 40, "temperature": "hot"} and isinstance(got["top_k"], int)
    with pytest.raises(CheckpointError, match=r"general.sampling.temp \(the default "
                                              r"temperature\) 'hot' is not a default"):
        check_sampling_defaults(got, str(typed))


def test_gguf_defaults_from_the_converted_cache(tmp_path, monkeypatch, capsys):
    """A GGUF file's converted copy in the cache holds its defaults; a copy made before they
    were read (no manifest key) is stale and re-made from the file; a bad default read from
    the copy names the GGUF file and key, not the cache."""
    from jaxinfer.loading import load_model
    from jaxinfer.loading.orbax_store import GGUF_SAMPLING_READ, find_cached
    from jaxinfer.sampling_defaults import check_sampling_defaults
    from tests.core.test_loading_config_values import write_gguf

    monkeypatch.setenv("JAXINFER_CHECKPOINT_DIR", str(tmp_path / "ckpt"))
    p = write_gguf(tmp_path / "m.gguf", meta={"general.sampling.top_p": 0.0,
                                             "general.sampling.top_k": 7})
    want = {"top_p": 0.0, "top_k": 7}
    assert load_model(str(p), progress=False).config.sampling_defaults == want
    cached = find_cached(p)
    assert cached is not None
    again = load_model(str(p), progress=False)
    assert again.source == str(cached) and again.config.sampling_defaults == want
    with pytest.raises(CheckpointError, match=rf"^{re.escape(str(p))}: general.sampling.top_p "
                                              r"\(the default top_p\) 0.0 is not a default"):
        check_sampling_defaults(again.config.sampling_defaults, again.source)
    # An older version's copy: no manifest key, no defaults in its model_config.json
    manifest = json.loads((cached / "manifest.json").read_text())
    del manifest[GGUF_SAMPLING_READ]
    (cached / "manifest.json").write_text(json.dumps(manifest))
    cfg = json.loads((cached / "model_config.json").read_text())
    cfg["sampling_defaults"] = {}
    (cached / "model_config.json").write_text(json.dumps(cfg))
    assert find_cached(p) is None  # stale
    remade = load_model(str(p), progress=False)
    assert "is stale (it was made by a jaxinfer that did not read the file's " \
        "general.sampling.* default" in capsys.readouterr().err
    assert remade.config.sampling_defaults == want and find_cached(p) == cached
