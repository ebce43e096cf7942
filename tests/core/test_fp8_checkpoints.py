"""FP8 weights on disk: HF checkpoints that carry them (vLLM/transformers "fp8",
compressed-tensors float-quantized) and `jaxinfer convert --quantization fp8`.

Synthetic checkpoints are written with safetensors' numpy API (float8_e4m3fn arrays from
ml_dtypes are stored as F8_E4M3); the reference is the same weights quantized and dequantized
by hand in numpy, loaded as a float checkpoint."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from jaxinfer import LLM
from jaxinfer.loading import CheckpointError, LoadedModel, convert, load_model, orbax_store
from jaxinfer.models.params import FP8_PROJECTIONS
from jaxinfer.quantization import fp8_scheme, quantize_params_fp8
from tests.core.test_loading import (
    F,
    H,
    L,
    hf_weights,
    llama_hf_config,
    save_hf,
    write_tiny_gguf,
)

E4M3 = ml_dtypes.float8_e4m3fn
PROMPT = [3, 17, 5, 60, 2, 9, 41, 88, 7, 12, 30, 4]
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(autouse=True)
def _ckpt_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = tmp_path / "ckpt"
    monkeypatch.setenv("JAXINFER_CHECKPOINT_DIR", str(d))
    return d


def weights(seed: int = 0) -> dict[str, np.ndarray]:
    """hf_weights with projections scaled by 1/sqrt(fan_in) and a few large outliers."""
    w = hf_weights(seed)
    for k, v in w.items():
        if k.endswith("_proj.weight"):
            v = v / np.sqrt(v.shape[1])
            v[0, :3] *= 20.0
            w[k] = v.astype(np.float32)
    return w


def quantize_hf(w: np.ndarray, layout: str, rng: np.random.Generator | None,
                scale_dtype=np.float32) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """By hand: (e4m3 [N, K], scale as stored in ``scale_dtype``, dequantized float32 [N, K])
    of HF weight ``w [N, K]``; block/group scales get random factors so they differ along K."""
    N, K = w.shape
    if layout == "tensor":
        stored = np.asarray(np.abs(w).max() / 448, np.float32)  # shape ()
    elif layout == "channel":
        stored = np.abs(w).max(1, keepdims=True) / 448  # [N, 1]
    elif layout in ("block", "block_uniform"):  # 32x32 blocks
        stored = np.abs(w).reshape(N // 32, 32, K // 32, 32).max((1, 3)) / 448
        if layout == "block_uniform":  # equal along K: reducible to per channel
            stored = np.broadcast_to(stored.max(1, keepdims=True), stored.shape)
        else:
            stored = stored * rng.uniform(1.0, 1.5, stored.shape)
    else:  # "group": 32 input columns per scale
        stored = np.abs(w).reshape(N, K // 32, 32).max(2) / 448 * rng.uniform(1.0, 1.5,
                                                                           (N, K // 32))
    stored = np.ascontiguousarray(stored).astype(scale_dtype)
    s = stored.astype(np.float32)
    full = (np.broadcast_to(s, w.shape) if layout in ("tensor", "channel")
            else np.repeat(np.repeat(s, 32, 0), 32, 1) if layout.startswith("block")
            else np.repeat(s, 32, 1))
    q = np.clip(w / full, -448, 448).astype(E4M3)
    return q, stored, q.astype(np.float32) * full


FORMATS = {  # name: (quantization_config, scale layout, scale tensor suffix, input_scale?)
    "fp8-per-tensor-static": ({"quant_method": "fp8", "activation_scheme": "static"},
                              "tensor", "weight_scale", True),
    "fp8-block": ({"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                   "weight_block_size": [32, 32]}, "block", "weight_scale_inv", False),
    "ct-channel": ({"quant_method": "compressed-tensors", "format": "float-quantized",
                    "config_groups": {"group_0": {
                        "targets": ["Linear"],
                        "weights": {"num_bits": 8, "type": "float", "symmetric": True,
                                    "strategy": "channel", "dynamic": False},
                        "input_activations": {"num_bits": 8, "type": "float",
                                              "strategy": "token", "dynamic": True}}},
                    "ignore": ["lm_head"]}, "channel", "weight_scale", False),
    "ct-tensor-static": ({"quant_method": "compressed-tensors", "format": "float-quantized",
                          "config_groups": {"group_0": {
                              "targets": ["Linear"],
                              "weights": {"num_bits": 8, "type": "float", "strategy": "tensor"},
                              "input_activations": {"num_bits": 8, "type": "float",
                                                    "strategy": "tensor", "dynamic": False}}}},
                         "tensor", "weight_scale", True),
    "ct-block-uniform": ({"quant_method": "compressed-tensors", "config_groups": {"g": {
                              "format": "float-quantized",
                              "weights": {"num_bits": 8, "type": "float", "strategy": "block",
                                          "block_structure": "32x32"}}}},
                         "block_uniform", "weight_scale", False),
    "ct-group": ({"quant_method": "compressed-tensors", "format": "float-quantized",
                  "config_groups": {"g": {"weights": {"num_bits": 8, "type": "float",
                                                      "group_size": 32}}}},
                 "group", "weight_scale", False),
}


def write_fp8_checkpoint(d: Path, fmt: str, w: dict[str, np.ndarray], *,
                         float_names: tuple[str, ...] = (), shards: int = 1,
                         scale_dtype=np.float32) -> dict[str, np.ndarray]:
    """An FP8 HF directory of format ``fmt``; returns the by-hand dequantized weights.
    Projections whose name contains one of ``float_names`` stay float32."""
    qc, layout, suffix, static = FORMATS[fmt]
    rng = np.random.default_rng(1)
    tensors, deq = {}, {}
    for k, v in w.items():
        if k.endswith("_proj.weight") and not any(f in k for f in float_names):
            q, s, deq[k] = quantize_hf(v, layout, rng, scale_dtype)
            tensors[k] = q
            tensors[k.removesuffix("weight") + suffix] = s
            if static:
                tensors[k.removesuffix("weight") + "input_scale"] = np.float32([0.05])
        else:
            tensors[k] = deq[k] = v
    raw = llama_hf_config().to_dict()
    raw["quantization_config"] = qc
    save_hf(d, None, tensors, shards=shards, raw_config=raw)
    return deq


def prompt_logits(model: LoadedModel | str) -> tuple[np.ndarray, LLM]:
    llm = LLM(model, dtype="float32", max_model_len=32, max_num_seqs=1,
              max_num_batched_tokens=16)
    return llm.engine.prompt_logits(PROMPT), llm


def float_model(deq: dict[str, np.ndarray], tmp: Path) -> LoadedModel:
    return load_model(str(save_hf(tmp, llama_hf_config(), deq)), progress=False)


# ------------------------------------------------------------------ HF FP8 formats
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_hf_fp8_checkpoint_matches_hand_dequantized_weights(tmp_path: Path, fmt: str) -> None:
    deq = write_fp8_checkpoint(tmp_path / "fp8", fmt, weights(),
                               shards=2 if "block" in fmt else 1,
                               scale_dtype=ml_dtypes.bfloat16 if fmt == "ct-channel"
                               else np.float32)
    m = load_model(str(tmp_path / "fp8"), progress=False)
    assert m.quantization == "fp8"
    ref = float_model(deq, tmp_path / "ref")
    for name in FP8_PROJECTIONS:
        assert m.params[name].dtype == E4M3
        scale = m.params[name + "_scale"]
        # block / group scales that differ along K stay per group; the rest per channel
        assert scale.ndim == (3 if fmt in ("fp8-block", "ct-group") else 2)
        q = m.params[name].astype(np.float32)
        full = scale[:, None, :] if scale.ndim == 2 else np.repeat(
            scale, q.shape[1] // scale.shape[1], axis=1)
        np.testing.assert_array_equal(q * full, ref.params[name])  # the file's bits and scales
    got, llm = prompt_logits(m)
    assert llm.engine.config.quantization == "fp8"
    want, _ = prompt_logits(ref)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert (got.argmax(-1) == want.argmax(-1)).all()


def test_engine_runs_an_fp8_directory_as_fp8(tmp_path: Path) -> None:
    write_fp8_checkpoint(tmp_path / "fp8", "ct-channel", weights())
    logits, llm = prompt_logits(str(tmp_path / "fp8"))
    assert llm.engine.config.quantization == "fp8"
    assert np.isfinite(logits).all()


def test_hf_fp8_ignored_and_mixed_projections(tmp_path: Path) -> None:
    w = weights()
    # down_proj left float (an "ignore" entry) stays float; k_proj float in its fused group
    # (q/k/v) makes q and v dequantized too; o_proj FP8 in layer 0 only is dequantized.
    deq = write_fp8_checkpoint(tmp_path / "a", "fp8-block", w,
                               float_names=("down_proj", "k_proj", "layers.1.self_attn.o_proj"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m = load_model(str(tmp_path / "a"), progress=False)
    msgs = " ".join(str(c.message) for c in caught)
    assert "layers.wo is FP8 in layers [0] only" in msgs
    assert "layers.wq, layers.wk, layers.wv mix FP8 and float" in msgs
    fp8 = {k for k in FP8_PROJECTIONS if m.params[k].dtype == E4M3}
    assert fp8 == {"layers.w_gate", "layers.w_up"}
    ref = float_model(deq, tmp_path / "ref")
    for k in ("layers.wq", "layers.wk", "layers.wo", "layers.w_down"):
        np.testing.assert_array_equal(m.params[k], ref.params[k])
    got, _ = prompt_logits(m)
    want, _ = prompt_logits(ref)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_hf_fp8_lm_head_is_dequantized(tmp_path: Path) -> None:
    w = weights()
    d = tmp_path / "head"
    write_fp8_checkpoint(d, "ct-channel", w)
    q, s, deq = quantize_hf(w["lm_head.weight"], "channel", None)
    _edit(d, {"lm_head.weight": q, "lm_head.weight_scale": s})
    m = load_model(str(d), progress=False)
    assert m.params["lm_head"].dtype == np.float32
    np.testing.assert_array_equal(m.params["lm_head"], deq.T)


def _read_all(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file, F8_E4M3 ones included."""
    from safetensors import safe_open

    from jaxinfer.loading.fp8_checkpoint import FP8_DTYPE, Fp8TensorReader

    reader, out = Fp8TensorReader(), {}
    with safe_open(str(path), framework="np") as f:
        for k in f.keys():  # noqa: SIM118 (safe_open handle, not a dict)
            fp8 = f.get_slice(k).get_dtype() == FP8_DTYPE
            out[k] = np.array(reader.read(path, k)) if fp8 else f.get_tensor(k)
    return out


def _edit(d: Path, changes: dict[str, np.ndarray | None]) -> None:
    """Replace (None: drop) tensors of ``d/model.safetensors``."""
    st = d / "model.safetensors"
    tensors = _read_all(st)
    for k, v in changes.items():
        if v is None:
            tensors.pop(k)
        else:
            tensors[k] = v
    save_file(tensors, str(st))


# ------------------------------------------------------------------ bad FP8 input
W = "model.layers.1.mlp.up_proj."


@pytest.mark.parametrize("change, pattern", [
    ({W + "weight_scale_inv": np.full((F // 32, H // 32), np.nan, np.float32)},
     (r"model\.safetensors: tensor 'model\.layers\.1\.mlp\.up_proj\.weight_scale_inv' must hold "
      r"finite positive values, has \[nan")),
    ({W + "weight_scale_inv": -np.ones((F // 32, H // 32), np.float32)},
     r"'model\.layers\.1\.mlp\.up_proj\.weight_scale_inv' must hold finite positive"),
    ({W + "weight_scale_inv": np.ones((F // 32, 3), np.float32)},
     (r"model\.safetensors: tensor 'model\.layers\.1\.mlp\.up_proj\.weight_scale_inv' has shape "
      r"\(4, 3\); the checkpoint's fp8 format expects \[4, 2\] \(blocks of 32x32\)")),
    ({W + "weight_scale_inv": None},
     (r"model\.safetensors: FP8 tensor 'model\.layers\.1\.mlp\.up_proj\.weight' has no "
      r".*weight_scale or .*weight_scale_inv")),
    ({"model.norm.weight_scale": np.ones((1,), np.float32)},
     r"model\.safetensors: scale tensor 'model\.norm\.weight_scale' belongs to no FP8 weight"),
    ({W + "weight_scale": np.ones((1,), np.float32)},
     (r"FP8 tensor 'model\.layers\.1\.mlp\.up_proj\.weight' has both .*weight_scale and "
      r".*weight_scale_inv")),
    ({W + "weight": np.full((F, H), np.nan, np.float32).astype(E4M3)},
     r"model\.safetensors: FP8 tensor 'model\.layers\.1\.mlp\.up_proj\.weight' holds NaN"),
    ({W + "weight": np.ones((F, H), ml_dtypes.float8_e5m2)},
     r"tensor 'model\.layers\.1\.mlp\.up_proj\.weight' is F8_E5M2; only F8_E4M3"),
    ({W + "weight": np.ones((F, H + 32), E4M3)},
     r"has shape \(4, 2\); .* for a weight of shape \[128, 96\]"),
])
def test_bad_fp8_tensors_name_file_and_tensor(tmp_path: Path, change: dict, pattern: str) -> None:
    d = tmp_path / "bad"
    write_fp8_checkpoint(d, "fp8-block", weights())
    _edit(d, change)
    with pytest.raises(CheckpointError, match=pattern):
        load_model(str(d), progress=False)


def test_bad_input_scale_and_ragged_blocks(tmp_path: Path) -> None:
    d = tmp_path / "static"
    write_fp8_checkpoint(d, "fp8-per-tensor-static", weights())
    _edit(d, {W + "input_scale": np.float32([0.1, 0.2])})
    with pytest.raises(CheckpointError, match=r"'model\.layers\.1\.mlp\.up_proj\.input_scale' "
                                              r"has shape \(2,\), expected one value"):
        load_model(str(d), progress=False)
    # 48-wide K blocks do not tile H = 64: only reducible (equal along K) scales are accepted
    d = tmp_path / "ragged"
    w = weights()
    tensors = {}
    for k, v in w.items():
        if k.endswith("_proj.weight"):
            N, K = v.shape
            s = np.linspace(0.01, 0.02, -(-N // 32) * -(-K // 48), dtype=np.float32)
            tensors[k] = np.clip(v / 0.01, -448, 448).astype(E4M3)
            tensors[k.removesuffix("weight") + "weight_scale_inv"] = s.reshape(-(-N // 32),
                                                                               -(-K // 48))
        else:
            tensors[k] = v
    raw = llama_hf_config().to_dict()
    raw["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                  "weight_block_size": [32, 48]}
    save_hf(d, None, tensors, raw_config=raw)
    with pytest.raises(CheckpointError, match=r"weight_scale_inv'?: blocks of 48 input "
                                              r"columns do not tile K=\d+"):
        load_model(str(d), progress=False)


@pytest.mark.parametrize("qc, pattern", [
    ({"quant_method": "gptq", "bits": 4}, r"quant_method 'gptq' is not supported"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, r"fmt 'e5m2' is not supported"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized",
      "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int"}}}},
     r"config_groups\.g: format 'pack-quantized' is not supported"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized",
      "config_groups": {"g": {"weights": {"num_bits": 8, "type": "int"}}}},
     r"config_groups\.g\.weights: 8-bit int weights are not supported"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized",
      "kv_cache_scheme": {"num_bits": 8, "type": "float"},
      "config_groups": {"g": {"weights": {"num_bits": 8, "type": "float"}}}},
     r"kv_cache_scheme .* is not supported"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized",
      "config_groups": {"g": {"weights": {"num_bits": 8, "type": "float",
                                          "symmetric": False}}}},
     r"asymmetric FP8 weights are not supported"),
])
def test_unsupported_quantization_configs(tmp_path: Path, qc: dict, pattern: str) -> None:
    raw = llama_hf_config().to_dict()
    raw["quantization_config"] = qc
    d = save_hf(tmp_path / "q", None, weights(), raw_config=raw)
    with pytest.raises(CheckpointError, match=r"config\.json quantization_config.*" + pattern):
        load_model(str(d), progress=False)


def test_fp8_tensor_without_quantization_config(tmp_path: Path) -> None:
    d = tmp_path / "noqc"
    write_fp8_checkpoint(d, "ct-channel", weights())
    raw = json.loads((d / "config.json").read_text())
    raw.pop("quantization_config")
    (d / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor "
                                              r"'model\.layers\.0\..*' is F8_E4M3 but .*config"
                                              r"\.json has no quantization_config"):
        load_model(str(d), progress=False)


# ------------------------------------------------------------------ convert --quantization fp8
def test_convert_fp8_stores_what_quantize_on_load_makes(tmp_path: Path) -> None:
    d = save_hf(tmp_path / "m", llama_hf_config(), weights())
    out = convert(str(d), str(tmp_path / "conv8"), progress=False, quantization="fp8")
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["quantization"]["scheme"] == fp8_scheme()
    assert manifest["quantization"]["scales"]["layers.wq_scale"] == [L, 64]
    back = load_model(str(out))
    assert back.quantization == "fp8"
    on_load = load_model(str(d), progress=False, quantization="fp8")
    by_hand = quantize_params_fp8(load_model(str(d), progress=False).params, FP8_PROJECTIONS)
    assert set(back.params) == set(on_load.params) == set(by_hand)
    for k, v in on_load.params.items():
        assert back.params[k].dtype == v.dtype == by_hand[k].dtype, k
        np.testing.assert_array_equal(back.params[k].view(np.uint8) if v.dtype == E4M3
                                      else back.params[k],
                                      v.view(np.uint8) if v.dtype == E4M3 else v)
        np.testing.assert_array_equal(np.asarray(by_hand[k], np.float32),
                                      np.asarray(v, np.float32))
    # the engine on the converted copy = the engine quantizing on load
    got, _ = prompt_logits(str(out))
    want = LLM(load_model(str(d), progress=False), quantization="fp8", dtype="float32",
               max_model_len=32, max_num_seqs=1,
               max_num_batched_tokens=16).engine.prompt_logits(PROMPT)
    np.testing.assert_array_equal(got, want)
    # bf16 engine dtype: FP8 tensors and scales unchanged, the rest cast
    bf = load_model(str(out), dtype="bfloat16")
    assert bf.params["layers.wq"].dtype == E4M3 and bf.params["layers.wq_scale"].dtype == np.float32
    assert bf.params["embed"].dtype == ml_dtypes.bfloat16
    # a float conversion of the same source records no quantization
    plain = convert(str(d), str(tmp_path / "conv"), progress=False)
    assert json.loads((plain / "manifest.json").read_text())["quantization"] is None
    assert load_model(str(plain)).quantization is None
    # an FP8 HF checkpoint converts as it is (its own scales, no scheme)
    write_fp8_checkpoint(tmp_path / "hf8", "fp8-block", weights())
    out8 = convert(str(tmp_path / "hf8"), str(tmp_path / "conv_hf8"), progress=False)
    q = json.loads((out8 / "manifest.json").read_text())["quantization"]
    assert q["scheme"] is None and q["scales"]["layers.w_down_scale"] == [L, F // 32, H]
    a, b = load_model(str(tmp_path / "hf8"), progress=False), load_model(str(out8))
    for k, v in a.params.items():
        np.testing.assert_array_equal(np.asarray(b.params[k], np.float32),
                                      np.asarray(v, np.float32))


def test_gguf_cache_keeps_float_and_fp8_copies_apart(tmp_path: Path) -> None:
    src = write_tiny_gguf(tmp_path / "tiny.gguf", weights())
    float_dir = convert(str(src), progress=False)
    fp8_dir = convert(str(src), progress=False, quantization="fp8")
    assert float_dir != fp8_dir and "-fp8-" in fp8_dir.name
    assert orbax_store.find_cached(src) == float_dir
    assert orbax_store.find_cached(src, scheme=fp8_scheme()) == fp8_dir
    assert load_model(str(src)).quantization is None
    m8 = load_model(str(src), quantization="fp8")
    assert m8.quantization == "fp8" and m8.source == str(fp8_dir)  # read from the FP8 copy
    fresh = load_model(str(src), quantization="fp8", use_cache=False)
    assert fresh.source != str(fp8_dir)
    for k, v in fresh.params.items():
        np.testing.assert_array_equal(np.asarray(m8.params[k], np.float32),
                                      np.asarray(v, np.float32))
    # a copy made under another scheme is not reused, nor a float one taken for FP8
    other = {**fp8_scheme(), "group_size": 64}
    assert orbax_store.find_cached(src, scheme=other) is None
    manifest = json.loads((fp8_dir / "manifest.json").read_text())
    manifest["quantization"]["scheme"] = other
    (fp8_dir / "manifest.json").write_text(json.dumps(manifest))
    assert orbax_store.find_cached(src, scheme=fp8_scheme()) is None
    assert load_model(str(src), quantization="fp8").source != str(fp8_dir)
    fm = json.loads((float_dir / "manifest.json").read_text())
    fm["quantization"] = {"method": "fp8", "scheme": fp8_scheme(), "scales": {}}
    (float_dir / "manifest.json").write_text(json.dumps(fm))
    assert orbax_store.find_cached(src) is None  # a float lookup never takes an FP8 claim


def test_converted_fp8_dir_with_tampered_manifest(tmp_path: Path) -> None:
    d = save_hf(tmp_path / "m", llama_hf_config(), weights())
    out = convert(str(d), str(tmp_path / "c"), progress=False, quantization="fp8")
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["quantization"] = None  # claims float: the FP8 scales are not restored
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError):
        load_model(str(out))


def test_quantization_value_checked() -> None:
    with pytest.raises(CheckpointError, match="quantization must be None or 'fp8'"):
        load_model("dummy:tiny-llama", quantization="int8")
    m = load_model("dummy:tiny-llama", quantization="fp8")
    assert m.quantization == "fp8" and m.params["layers.w_up_scale"].dtype == np.float32
