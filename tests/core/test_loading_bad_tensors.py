"""Tensors a checkpoint may get wrong: bad names, index entries, shapes and dtypes each give one
error naming the file and tensor (break-test report 52, D3-D5, D9). Damaged copies of the
committed tiny fixtures are built in ``tmp_path``."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxinfer.loading import CheckpointError, load_model
from tests.core.test_loading_config_values import hf_copy, one_line, tiny_llama_tensors, write_gguf

TINY = Path(__file__).resolve().parents[1] / "fixtures" / "tiny"
LAYER0 = "model.layers.0."


@pytest.fixture(autouse=True)
def _ckpt_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JAXINFER_CHECKPOINT_DIR", str(tmp_path / "ckpt"))


def hf_with(tmp_path: Path, change, edit=None) -> Path:
    """The tiny llama fixture with its tensors passed through ``change(dict)``."""
    d = hf_copy(tmp_path, "llama", edit=edit)
    w = load_file(str(d / "model.safetensors"))
    change(w)
    save_file(w, str(d / "model.safetensors"))
    return d


def refused(model: Path) -> str:
    with pytest.raises(CheckpointError) as e:
        load_model(str(model), progress=False, use_cache=False)
    return one_line(e)


# ------------------------------------------------------------------ D3/D4: names and index
def test_index_weight_map_with_a_non_string_file(tmp_path: Path) -> None:
    d = tmp_path / "qwen2"
    shutil.copytree(TINY / "qwen2", d)
    index = d / "model.safetensors.index.json"
    raw = json.loads(index.read_text())
    raw["weight_map"]["model.norm.weight"] = 5
    index.write_text(json.dumps(raw))
    msg = refused(d)
    assert msg == (f"{index}: weight_map gives 5 as the file of tensor 'model.norm.weight' "
                   "(expected a shard file name)")


@pytest.mark.parametrize("bad, want", [
    ("model.layers.x.input_layernorm.weight", "layer index 'x' is not an integer"),
    ("model.layers.0", "no parameter name after the layer index"),
    ("model.layers.-1.input_layernorm.weight", "layer index '-1' is not an integer"),
])
def test_hf_tensor_names_with_a_bad_layer_index(tmp_path: Path, bad: str, want: str) -> None:
    d = hf_with(tmp_path, lambda w: w.update({bad: w[LAYER0 + "input_layernorm.weight"]}))
    assert refused(d) == f"{d / 'model.safetensors'}: tensor {bad!r}: {want}" + (
        " (expected model.layers.0.<name>)" if bad == "model.layers.0" else "")


@pytest.mark.parametrize("shape_ok", [True, False])
def test_hf_tensor_for_a_layer_past_the_last(tmp_path: Path, shape_ok: bool) -> None:
    """The layer is named whatever the tensor's shape (a wrong shape used to be reported
    first, hiding the plainer fault)."""
    name = "model.layers.7.mlp.up_proj.weight"
    src = LAYER0 + "mlp.up_proj.weight"
    d = hf_with(tmp_path, lambda w: w.update({name: w[src] if shape_ok else w[src][:, :3]}))
    msg = refused(d)
    assert msg.endswith(f"tensor {name!r} is for layer 7, but the model has 2 layers"), msg


@pytest.mark.parametrize("bad, want", [
    ("blk.x.attn_norm.weight", "tensor 'blk.x.attn_norm.weight': layer index 'x' is not an "
                               "integer"),
    ("blk.0", "tensor 'blk.0': no parameter name after the layer index"),
])
def test_gguf_tensor_names_with_a_bad_layer_index(tmp_path: Path, bad: str, want: str) -> None:
    t = tiny_llama_tensors()
    t[bad] = t["blk.0.attn_norm.weight"]
    p = write_gguf(tmp_path / "m.gguf", tensors=t)
    msg = refused(p)
    assert msg.startswith(f"{p}: ") and want in msg, msg


# ------------------------------------------------------------------ D5: shapes as in the file
def test_hf_shape_error_quotes_the_files_layout(tmp_path: Path) -> None:
    # head_dim 8: k_proj should be (2 heads * 8, 64) = (16, 64) as HF stores it; it is (32, 64)
    d = hf_with(tmp_path / "a", lambda w: None, edit=lambda raw: raw.update(head_dim=8))
    msg = refused(d)
    assert re.search(r"tensor 'model.layers.0.self_attn.k_proj.weight' has shape \(32, 64\) "
                     r"\(\[out, in\] as stored\), expected \(16, 64\) for layers.wk", msg), msg
    # down_proj saved transposed: (128, 64) in the file, HF's layout is (64, 128)
    key = LAYER0 + "mlp.down_proj.weight"
    d = hf_with(tmp_path / "b", lambda w: w.update({key: np.ascontiguousarray(w[key].T)}))
    msg = refused(d)
    assert f"tensor {key!r} has shape (128, 64) ([out, in] as stored), expected (64, 128)" \
        in msg, msg


def test_gguf_shape_error_quotes_ggml_dims(tmp_path: Path) -> None:
    t = tiny_llama_tensors()
    t["blk.0.attn_k.weight"] = np.zeros((64, 64), np.float32)  # numpy [out, in]; wants (32, 64)
    t["blk.0.ffn_down.weight"] = np.ascontiguousarray(t["blk.0.ffn_down.weight"].T)
    p = write_gguf(tmp_path / "m.gguf", tensors=t)
    msg = refused(p)
    # gguf-dump lists ggml dims (ne), numpy's reversed: attn_k [64, 32], got [64, 64]
    assert ("tensor 'blk.0.attn_k.weight' has shape (64, 64) (ggml dims, as gguf-dump lists "
            "them), expected (64, 32) for layers.wk") in msg, msg
    del t["blk.0.attn_k.weight"]
    msg = refused(write_gguf(tmp_path / "n.gguf", tensors={
        **t, "blk.0.attn_k.weight": tiny_llama_tensors()["blk.0.attn_k.weight"]}))
    assert ("tensor 'blk.0.ffn_down.weight' has shape (64, 128) (ggml dims, as gguf-dump lists "
            "them), expected (128, 64) for layers.w_down") in msg, msg


# ------------------------------------------------------------------ D9: integer tensors
@pytest.mark.parametrize("key, dtype, st", [
    (LAYER0 + "self_attn.q_proj.weight", np.int8, "I8"),
    ("model.norm.weight", np.int32, "I32"),
    ("model.norm.weight", np.bool_, "BOOL"),
])
def test_hf_integer_tensors_are_refused(tmp_path: Path, key: str, dtype, st: str) -> None:
    d = hf_with(tmp_path, lambda w: w.update({key: np.ones(w[key].shape, dtype)}))
    msg = refused(d)
    assert msg.startswith(f"{d / 'model.safetensors'}: tensor {key!r} is stored as {st}, not "
                          "as floats: the checkpoint is probably quantized in a format "
                          "jaxinfer does not support"), msg


def test_gguf_integer_tensor_is_refused(tmp_path: Path) -> None:
    t = tiny_llama_tensors()
    t["blk.1.attn_q.weight"] = np.ones((64, 64), np.int8)
    p = write_gguf(tmp_path / "m.gguf", tensors=t)
    msg = refused(p)
    assert msg.startswith(f"{p}: tensor 'blk.1.attn_q.weight' is stored as I8"), msg
    assert "probably quantized in a format jaxinfer does not support" in msg
