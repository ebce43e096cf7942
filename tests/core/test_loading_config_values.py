"""Config values a checkpoint may get wrong: each is refused with one error naming the file and
the field (HF ``config.json`` key, GGUF metadata key, ``model_config.json`` field), never loaded
into a model that computes NaN (break-test report 52, D1-D4). Damaged copies of the committed
tiny fixtures are built in ``tmp_path``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from safetensors.numpy import load_file

from jaxinfer.config import ConfigError, ModelConfig
from jaxinfer.loading import CheckpointError, load_model, read_header
from jaxinfer.loading.gguf_loader import read_gguf_header
from jaxinfer.loading.hf_loader import read_hf_header

TINY = Path(__file__).resolve().parents[1] / "fixtures" / "tiny"


@pytest.fixture(autouse=True)
def _ckpt_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JAXINFER_CHECKPOINT_DIR", str(tmp_path / "ckpt"))


# ------------------------------------------------------------------ helpers
def hf_copy(tmp_path: Path, family: str = "llama", edit: Any = None,
            gen_edit: Any = None) -> Path:
    """A copy of tests/fixtures/tiny/<family> whose config.json (generation_config.json) is
    passed through ``edit`` (``gen_edit``): a function mutating the dict, or a value to write."""
    d = tmp_path / f"{family}-copy"
    shutil.copytree(TINY / family, d)
    for name, fn in (("config.json", edit), ("generation_config.json", gen_edit)):
        if fn is None:
            continue
        if callable(fn):
            raw = json.loads((d / name).read_text())
            fn(raw)
        else:
            raw = fn
        (d / name).write_text(json.dumps(raw))
    return d


LLAMA_META: dict[str, Any] = {
    "llama.block_count": 2, "llama.context_length": 256, "llama.embedding_length": 64,
    "llama.feed_forward_length": 128, "llama.attention.head_count": 4,
    "llama.attention.head_count_kv": 2, "llama.rope.freq_base": 10000.0,
    "llama.attention.layer_norm_rms_epsilon": 1e-5, "llama.rope.dimension_count": 16}
GEMMA_META: dict[str, Any] = {
    "gemma3.block_count": 2, "gemma3.context_length": 256, "gemma3.embedding_length": 64,
    "gemma3.feed_forward_length": 128, "gemma3.attention.head_count": 4,
    "gemma3.attention.head_count_kv": 1, "gemma3.attention.key_length": 16,
    "gemma3.attention.value_length": 16, "gemma3.attention.sliding_window": 8}
GGUF_LEAF = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def tiny_llama_tensors() -> dict[str, np.ndarray]:
    """The tiny llama fixture's tensors under GGUF names (numpy [out, in], as ggml stores
    them; Q/K rows are not permuted, which matters only for logits, never checked here)."""
    w = load_file(str(TINY / "llama" / "model.safetensors"))
    out = {"token_embd.weight": w["model.embed_tokens.weight"],
           "output_norm.weight": w["model.norm.weight"], "output.weight": w["lm_head.weight"]}
    for i in range(2):
        for hf, leaf in GGUF_LEAF.items():
            out[f"blk.{i}.{leaf}.weight"] = w[f"model.layers.{i}.{hf}.weight"]
    return out


def write_gguf(path: Path, arch: str = "llama", meta: dict[str, Any] | None = None,
               tensors: dict[str, np.ndarray] | None = None) -> Path:
    """A GGUF of ``arch`` with the tiny model's metadata updated by ``meta`` (a value of None
    drops the key; int -> uint32, float -> float32, str -> string, list -> array) and
    ``tensors`` (default: the tiny llama fixture's; gemma3: its embedding only)."""
    kv = dict(LLAMA_META if arch == "llama" else GEMMA_META)
    kv.update(meta or {})
    if tensors is None:
        t = tiny_llama_tensors()
        tensors = t if arch == "llama" else {"token_embd.weight": t["token_embd.weight"]}
    wr = gguf.GGUFWriter(str(path), arch)
    for key, v in kv.items():
        if v is None:
            continue
        if isinstance(v, bool):
            wr.add_bool(key, v)
        elif isinstance(v, int):
            wr.add_uint32(key, v) if v >= 0 else wr.add_int32(key, v)
        elif isinstance(v, float):
            wr.add_float32(key, v)
        elif isinstance(v, str):
            wr.add_string(key, v)
        else:
            wr.add_array(key, v)
    for name, arr in tensors.items():
        if arr.dtype in (np.int8, np.int16, np.int32):
            raw = {np.int8: gguf.GGMLQuantizationType.I8, np.int16: gguf.GGMLQuantizationType.I16,
                   np.int32: gguf.GGMLQuantizationType.I32}[arr.dtype.type]
            wr.add_tensor(name, arr, raw_dtype=raw)
        else:
            wr.add_tensor(name, arr)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return path


def one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


# ------------------------------------------------------------------ D1: HF config.json
def _set(path: str, value: Any):
    def edit(raw: dict) -> None:
        *parents, leaf = path.split(".")
        d = raw
        for p in parents:
            d = d[p]
        d[leaf] = value
    return edit


@pytest.mark.parametrize("key, value", [
    ("rms_norm_eps", -1.0), ("rms_norm_eps", 0.0), ("rms_norm_eps", float("nan")),
    ("rope_parameters.rope_theta", -1.0), ("rope_parameters.rope_theta", float("inf")),
    ("rope_parameters.factor", 0.0), ("rope_parameters.low_freq_factor", -1.0),
    ("rope_parameters.original_max_position_embeddings", 0),
    ("max_position_embeddings", -5), ("max_position_embeddings", 0),
    ("vocab_size", -5), ("vocab_size", 0),  # (named, not an eos id "outside [0, -5)")
])
def test_hf_nonsense_numbers_are_refused_by_name(tmp_path: Path, key: str, value: Any) -> None:
    d = hf_copy(tmp_path, edit=_set(key, value))
    with pytest.raises(CheckpointError) as e:
        read_hf_header(d)
    msg = one_line(e)
    assert msg.startswith(str(d / "config.json")) and key in msg, msg
    assert "max_model_len" not in msg


@pytest.mark.parametrize("archs", [{"a": 1}, "LlamaForCausalLM"])
def test_hf_architectures_must_be_a_list(tmp_path: Path, archs: Any) -> None:
    d = hf_copy(tmp_path, edit=lambda raw: raw.update(architectures=archs))
    with pytest.raises(CheckpointError, match=r"config.json's architectures must be a list "
                                              r"of class names, got (dict|str)"):
        read_hf_header(d)


def test_hf_llama3_high_freq_factor_must_exceed_low(tmp_path: Path) -> None:
    d = hf_copy(tmp_path, edit=_set("rope_parameters.high_freq_factor", 1.0))
    with pytest.raises(CheckpointError, match=r"rope_parameters.high_freq_factor must be "
                                              r"greater than low_freq_factor"):
        read_hf_header(d)


def test_hf_old_style_rope_keys_are_named_as_written(tmp_path: Path) -> None:
    def old(theta: float, factor: float):
        def edit(raw: dict) -> None:
            raw.pop("rope_parameters")
            raw.update(rope_theta=theta, rope_scaling={"type": "linear", "factor": factor})
        return edit
    with pytest.raises(CheckpointError, match=r"config.json: rope_theta must be a positive "
                                              r"finite number, got -1.0"):
        read_hf_header(hf_copy(tmp_path / "a", edit=old(-1.0, 2.0)))
    with pytest.raises(CheckpointError, match=r"config.json: rope_scaling.factor must be a "
                                              r"positive finite number, got 0.0"):
        read_hf_header(hf_copy(tmp_path / "b", edit=old(1e4, 0.0)))


def test_hf_gemma3_query_pre_attn_scalar_and_local_theta(tmp_path: Path) -> None:
    d = hf_copy(tmp_path / "a", "gemma3", edit=_set("query_pre_attn_scalar", 0))
    with pytest.raises(CheckpointError, match=r"config.json: query_pre_attn_scalar must be a "
                                              "positive finite number, got 0"):
        read_hf_header(d)
    d = hf_copy(tmp_path / "b", "gemma3",
                edit=_set("rope_parameters.sliding_attention.rope_theta", -3.0))
    with pytest.raises(CheckpointError,
                       match=r"rope_parameters.sliding_attention.rope_theta must be"):
        read_hf_header(d)


def test_model_config_refuses_nonsense_numbers() -> None:
    base = dict(family="llama", vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1,
                num_heads=2, num_kv_heads=1, head_dim=4)
    ModelConfig(**base)
    for field, value in [("rms_norm_eps", -1.0), ("rope_theta", 0.0),
                         ("rope_theta", float("nan")), ("max_position_embeddings", -5),
                         ("embed_scale", float("inf")), ("rope_local_base_freq", -1.0),
                         ("query_pre_attn_scalar", 0.0), ("sliding_window", -4),
                         ("rope_scaling", {"rope_type": "linear", "factor": 0.0}),
                         ("rope_scaling", {"rope_type": "yarn", "factor": 2.0})]:
        with pytest.raises(ConfigError) as e:
            ModelConfig(**base, **{field: value})
        assert e.value.field is not None and e.value.field.startswith(field), (field, e.value)


def test_converted_model_config_json_with_bad_theta_is_refused(tmp_path: Path) -> None:
    from jaxinfer.loading import convert

    out = convert(str(TINY / "llama"), tmp_path / "conv", progress=False)
    mc = json.loads((out / "model_config.json").read_text())
    mc["rope_theta"] = -1.0
    (out / "model_config.json").write_text(json.dumps(mc))
    # As if written so (the manifest's size check would call an edited copy damaged first).
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["files"]["model_config.json"] = (out / "model_config.json").stat().st_size
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError) as e:
        read_header(str(out))
    msg = one_line(e)
    assert "model_config.json" in msg and "rope_theta must be a positive finite number" in msg


# ------------------------------------------------------------------ D1/D3/D4: GGUF metadata
@pytest.mark.parametrize("key, value, want", [
    ("llama.rope.freq_base", -5.0, "llama.rope.freq_base must be a positive finite number"),
    ("llama.attention.layer_norm_rms_epsilon", -1.0,
     "llama.attention.layer_norm_rms_epsilon must be a positive finite number"),
    ("llama.context_length", 0, "llama.context_length must be a positive integer, got 0"),
    ("llama.attention.head_count", 0, "llama.attention.head_count must be a positive integer"),
    ("llama.attention.head_count_kv", 0, "llama.attention.head_count_kv must be a positive"),
    ("llama.embedding_length", "sixty-four",
     "GGUF metadata llama.embedding_length is 'sixty-four', expected an integer"),
    ("llama.attention.layer_norm_rms_epsilon", "tiny",
     "llama.attention.layer_norm_rms_epsilon is 'tiny', expected a number"),
    ("llama.attention.head_count", 3,
     "llama.attention.head_count 3 does not divide llama.embedding_length 64"),
])
def test_gguf_bad_metadata_is_refused_by_key(tmp_path: Path, key: str, value: Any,
                                             want: str) -> None:
    p = write_gguf(tmp_path / "m.gguf", meta={key: value})
    with pytest.raises(CheckpointError) as e:
        read_gguf_header(p)
    msg = one_line(e)
    assert msg.startswith(str(p)) and want in msg, msg


def test_gguf_linear_rope_factor_zero_is_refused(tmp_path: Path) -> None:
    p = write_gguf(tmp_path / "m.gguf", meta={"llama.rope.scaling.type": "linear",
                                             "llama.rope.scaling.factor": 0.0})
    with pytest.raises(CheckpointError, match=r"llama.rope.scaling.factor must be a positive "
                                              r"finite number, got 0.0"):
        read_gguf_header(p)


@pytest.mark.parametrize("key, value, want", [
    ("gemma3.attention.sliding_window_pattern", 0,
     "gemma3.attention.sliding_window_pattern must be a positive integer, got 0"),
    ("gemma3.attention.sliding_window_pattern", [True, False, True],
     "gemma3.attention.sliding_window_pattern has 3 entries for 2 layers"),
    ("gemma3.attention.scale", 0.0,
     "gemma3.attention.scale must be a positive finite number, got 0.0"),
    ("gemma3.attention.sliding_window", 0,
     "gemma3.attention.sliding_window must be a positive integer, got 0"),
    ("gemma3.rope.freq_base_swa", -1.0, "gemma3.rope.freq_base_swa must be a positive"),
])
def test_gguf_gemma3_bad_metadata_is_refused_by_key(tmp_path: Path, key: str, value: Any,
                                                    want: str) -> None:
    p = write_gguf(tmp_path / "g.gguf", "gemma3", meta={key: value})
    with pytest.raises(CheckpointError) as e:
        read_gguf_header(p)
    assert want in one_line(e)


def test_gguf_tokens_without_merges_or_scores(tmp_path: Path) -> None:
    p = write_gguf(tmp_path / "t.gguf", meta={"tokenizer.ggml.model": "llama",
                                             "tokenizer.ggml.tokens": ["a", "b", "c"]})
    with pytest.raises(CheckpointError, match=r"t.gguf: GGUF has tokenizer.ggml.tokens but "
                                              r"neither tokenizer.ggml.merges nor "
                                              r"tokenizer.ggml.scores"):
        read_gguf_header(p)


# ------------------------------------------------------------------ D3/D4: HF JSON files
def test_hf_config_json_that_is_not_an_object(tmp_path: Path) -> None:
    d = hf_copy(tmp_path, edit=[1, 2])
    with pytest.raises(CheckpointError, match=r"config.json: expected a JSON object, got list"):
        load_model(str(d), progress=False)


@pytest.mark.parametrize("ids", [[2, "x"], [2, -1], [True]])
def test_generation_config_eos_that_is_not_a_token_id(tmp_path: Path, ids: list) -> None:
    d = hf_copy(tmp_path, gen_edit=_set("eos_token_id", ids))
    with pytest.raises(CheckpointError) as e:
        read_hf_header(d)
    msg = one_line(e)
    assert msg.startswith(str(d / "generation_config.json")) and "eos_token_id holds" in msg


@pytest.mark.parametrize("key, where", [("eos_token_id", "gen"), ("eos_token_id", "config"),
                                        ("bos_token_id", "config")])
def test_special_token_id_outside_the_vocabulary(tmp_path: Path, key: str, where: str) -> None:
    """An eos id the model cannot emit never stops a sequence: refused, naming the key."""
    big = 10**6
    d = (hf_copy(tmp_path, gen_edit=_set(key, [2, big])) if where == "gen"
         else hf_copy(tmp_path, edit=_set(key, big)))
    fname = "generation_config.json" if where == "gen" else "config.json"
    with pytest.raises(CheckpointError, match=rf"{d / fname}: {key} {big} is not in the "
                                              rf"vocabulary \[0, "):
        read_hf_header(d)


# ------------------------------------------------------------------ D2: sliding window scope
@pytest.mark.parametrize("family, edit, types, window", [
    # transformers' modeling_llama.py has no sliding window: the key is ignored ...
    ("llama", {"sliding_window": 6}, ("full_attention",) * 2, None),
    # ... unless layer_types marks layers sliding (as vLLM reads them)
    ("llama", {"sliding_window": 6, "layer_types": ["sliding_attention", "full_attention"]},
     ("sliding_attention", "full_attention"), 6),
    # Mistral: every layer, whatever layer_types says (modeling_mistral.py)
    ("mistral", {"sliding_window": 6}, ("sliding_attention",) * 2, 6),
    ("mistral", {"sliding_window": None}, ("full_attention",) * 2, None),
    # Qwen2: only with use_sliding_window, from layer max_window_layers on
    ("qwen2", {"sliding_window": 6, "layer_types": None}, ("full_attention",) * 3, None),
    ("qwen2", {"sliding_window": 6, "use_sliding_window": True, "max_window_layers": 1,
               "layer_types": None},
     ("full_attention", "sliding_attention", "sliding_attention"), 6),
    ("qwen3", {"sliding_window": 6, "layer_types": None}, ("full_attention",) * 2, None),
])
def test_sliding_window_applies_where_transformers_applies_it(
        tmp_path: Path, family: str, edit: dict, types: tuple, window: int | None) -> None:
    d = hf_copy(tmp_path, family, edit=lambda raw: raw.update(edit))
    cfg, _ = read_hf_header(d, with_tokenizer=False)
    assert (cfg.layer_types, cfg.sliding_window) == (types, window)


@pytest.mark.parametrize("family, edit", [
    ("mistral", {"sliding_window": -4}), ("mistral", {"sliding_window": 0}),
    ("gemma3", {"sliding_window": -4}),
    ("llama", {"sliding_window": 0, "layer_types": ["sliding_attention", "full_attention"]}),
])
def test_a_window_in_use_must_be_positive(tmp_path: Path, family: str, edit: dict) -> None:
    d = hf_copy(tmp_path, family, edit=lambda raw: raw.update(edit))
    with pytest.raises(CheckpointError) as e:
        read_hf_header(d, with_tokenizer=False)
    msg = one_line(e)
    assert msg.startswith(str(d / "config.json")), msg
    assert f"sliding_window must be a positive integer, got {edit['sliding_window']}" in msg


def test_transformers_validation_errors_come_as_one_line(tmp_path: Path) -> None:
    d = hf_copy(tmp_path, edit=_set("vocab_size", "256"))
    with pytest.raises(CheckpointError) as e:
        read_hf_header(d)
    msg = one_line(e)
    assert msg.startswith(f"{d / 'config.json'}: invalid for LlamaForCausalLM: ") and \
        "vocab_size" in msg, msg
