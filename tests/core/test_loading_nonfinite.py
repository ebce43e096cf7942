"""Malformed checkpoints that used to load: tensors holding NaN or infinity (a flipped byte, a
diverged model; they generated token 0 for ever) and HF configs without a shape field (read as
transformers' defaults) now fail with the tensor's or field's name."""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from jaxinfer.loading import CheckpointError, LoadedModel, convert, load_model, orbax_store
from jaxinfer.loading.base import count_nonfinite
from tests.core.test_loading import hf_weights, llama_hf_config, save_hf, write_tiny_gguf


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16, ml_dtypes.bfloat16,
                                   ml_dtypes.float8_e4m3fn])
def test_count_nonfinite_matches_isfinite(dtype) -> None:
    rng = np.random.default_rng(0)
    a = (rng.standard_normal((37, 300)) * 50).astype(dtype)
    assert count_nonfinite(a) == 0
    flat = a.reshape(-1)
    idx = rng.choice(flat.size, 41, replace=False)
    special = [np.nan, -np.nan] + ([] if dtype == ml_dtypes.float8_e4m3fn else [np.inf, -np.inf])
    flat[idx] = np.array([special[i % len(special)] for i in range(41)]).astype(dtype)
    want = int(np.count_nonzero(~np.isfinite(a.astype(np.float32))))
    assert want == 41
    assert count_nonfinite(a) == want
    assert count_nonfinite(a, chunk=7) == want  # chunk boundaries inside the array
    assert count_nonfinite(a[:, ::2]) == int(np.count_nonzero(~np.isfinite(
        a[:, ::2].astype(np.float32))))  # a strided view
    assert count_nonfinite(np.arange(10)) == 0  # not a float: nothing to count


def test_hf_tensor_with_nan_is_named(tmp_path: Path) -> None:
    w = hf_weights()
    w["model.layers.1.mlp.down_proj.weight"][3, 5] = np.nan
    d = save_hf(tmp_path / "m", llama_hf_config(), w)
    with pytest.raises(CheckpointError, match=r"tensor 'model\.layers\.1\.mlp\.down_proj\.weight'"
                                              r" holds 1 NaN or infinite values"):
        load_model(str(d), progress=False)


def test_gguf_tensor_with_inf_is_named(tmp_path: Path) -> None:
    w = hf_weights()
    w["model.embed_tokens.weight"][0, :2] = np.inf
    path = write_tiny_gguf(tmp_path / "t.gguf", w)
    with pytest.raises(CheckpointError, match=r"tensor 'token_embd\.weight' holds 2 NaN or "
                                              r"infinite values"):
        load_model(str(path), progress=False, use_cache=False)


def test_converted_checkpoint_with_nan_is_refused(tmp_path: Path) -> None:
    d = save_hf(tmp_path / "m", llama_hf_config(), hf_weights())
    good = load_model(str(d), progress=False)
    params = dict(good.params)
    params["layers.wo"] = params["layers.wo"].copy()
    params["layers.wo"][0, 1, 2] = np.nan
    out = orbax_store.save_converted(tmp_path / "conv",
                                     LoadedModel(good.config, params, None, "x"))
    with pytest.raises(CheckpointError, match=r"tensor 'layers\.wo' holds 1 NaN"):
        load_model(str(out))


def test_converted_checkpoint_with_flipped_bytes_is_refused(tmp_path: Path) -> None:
    """The helper's report: 0xff bytes written over a converted checkpoint's data file; the
    load must fail (NaN weights, or data that does not restore), not generate token 0."""
    d = save_hf(tmp_path / "m", llama_hf_config(), hf_weights())
    out = convert(str(d), str(tmp_path / "conv"), progress=False)
    data = max((p for p in (out / "params").rglob("*") if p.is_file()),
               key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    mid = len(raw) // 2
    raw[mid:mid + 256] = b"\xff" * 256
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError):
        load_model(str(out))


@pytest.mark.parametrize("field", ["num_attention_heads", "vocab_size", "hidden_size"])
def test_hf_config_without_a_shape_field_is_named(tmp_path: Path, field: str) -> None:
    """Not transformers' class default (32 heads, vocab 32000, ...) and a shape error later."""
    raw = llama_hf_config().to_dict()
    del raw[field]
    d = save_hf(tmp_path / "m", None, hf_weights(), raw_config=raw)
    with pytest.raises(CheckpointError, match=rf"config\.json lacks {field} \(every "
                                              r"LlamaForCausalLM config gives the model's shape"):
        load_model(str(d), progress=False)
