"""GPTQ onto the e4m3 per-channel grid (jaxinfer.quantization_gptq) on random inputs, and its
whole-model driver on a tiny dummy model that the engine then runs."""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxinfer.quantization import FP8_MAX, QuantizationError, quantize_fp8_per_channel
from jaxinfer.quantization_gptq import (
    HessianAccumulator,
    gptq_fp8,
    output_error,
    quantize_model_gptq,
)

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)


def _layer(seed: int, K: int = 128, N: int = 48, M: int = 1024):
    """Inputs ``x [M, K]`` with correlated features of unequal size (as a transformer's
    normed hidden states: a few shared directions, a few loud channels), a weight [K, N]."""
    rng = np.random.default_rng(seed)
    mix = rng.standard_normal((K, K)) / np.sqrt(K) + np.eye(K)
    x = (rng.standard_normal((M, 8)) @ rng.standard_normal((8, K))
         + rng.standard_normal((M, K)) @ mix) * np.geomspace(0.2, 5.0, K)
    w = (rng.standard_normal((K, N)) / np.sqrt(K)).astype(np.float32)
    return x, w


def _hessian(x: np.ndarray) -> np.ndarray:
    acc = HessianAccumulator(x.shape[1])
    for part in np.array_split(x, 3):  # fed in batches
        acc.add(part)
    return acc.hessian()


@pytest.mark.parametrize("act_order", [True, False])
def test_gptq_output_error_below_round_to_nearest(act_order: bool) -> None:
    x, w = _layer(1)
    h = _hessian(x)
    np.testing.assert_allclose(h, 2 * x.T @ x / len(x), rtol=1e-12)
    q, s = gptq_fp8(w, h, act_order=act_order)
    rq, rs = quantize_fp8_per_channel(jnp.asarray(w))
    # the output error as defined, on the calibration inputs, and through the Hessian
    direct = (np.linalg.norm(x @ (w - q.astype(np.float64) * s))
              / np.linalg.norm(x @ w.astype(np.float64)))
    assert output_error(w, q, s, h) == pytest.approx(direct, rel=1e-9)
    gptq, rtn = output_error(w, q, s, h), output_error(w, rq, rs, h)
    assert gptq < 0.8 * rtn, (gptq, rtn)


def test_codes_are_e4m3_with_per_channel_scales() -> None:
    x, w = _layer(2)
    w[:, 3] *= 40.0  # a loud column: its own scale
    q, s = gptq_fp8(w, _hessian(x))
    rq, rs = quantize_fp8_per_channel(jnp.asarray(w))
    assert q.dtype == E4M3 and q.shape == w.shape
    assert s.dtype == np.float32 and s.shape == (w.shape[1],)
    np.testing.assert_array_equal(s, np.asarray(rs))  # the same scales, bit for bit
    codes = q.astype(np.float32)
    assert np.isfinite(codes).all() and np.abs(codes).max() <= FP8_MAX  # no NaN code
    # GPTQ moves codes, but only ever onto neighbouring grid points of nearby values
    assert (q.view(np.uint8) != np.asarray(rq).view(np.uint8)).mean() > 0.05
    assert np.abs(codes * s - w).max() <= 0.25 * np.abs(w).max()


def test_uncorrelated_inputs_give_round_to_nearest() -> None:
    """With H diagonal nothing is passed on: GPTQ is round-to-nearest, bit for bit."""
    _, w = _layer(3)
    h = np.diag(np.random.default_rng(3).uniform(0.5, 2.0, w.shape[0]))
    rq, _ = quantize_fp8_per_channel(jnp.asarray(w))
    for act_order in (True, False):
        q, _ = gptq_fp8(w, h, act_order=act_order)
        np.testing.assert_array_equal(q.view(np.uint8), np.asarray(rq).view(np.uint8))


def test_dead_inputs_keep_their_rounded_weights() -> None:
    x, w = _layer(4)
    x[:, :5] = 0.0  # never fire in calibration
    q, _ = gptq_fp8(w, _hessian(x))
    rq, _ = quantize_fp8_per_channel(jnp.asarray(w))
    np.testing.assert_array_equal(q[:5].view(np.uint8), np.asarray(rq)[:5].view(np.uint8))


def test_input_validation() -> None:
    x, w = _layer(5, K=32, N=8, M=64)
    h = _hessian(x)
    with pytest.raises(QuantizationError, match="weight must be 2-D"):
        gptq_fp8(w[0], h)
    with pytest.raises(QuantizationError, match="weight must be a bf16/f16/f32 array"):
        gptq_fp8(np.asarray(quantize_fp8_per_channel(jnp.asarray(w))[0]), h)
    with pytest.raises(QuantizationError, match=r"Hessian must be \[32, 32\]"):
        gptq_fp8(w, h[:16, :16])
    with pytest.raises(QuantizationError, match="finite"):
        gptq_fp8(np.where(np.eye(32, 8) > 0, np.nan, w), h)
    with pytest.raises(QuantizationError, match="damp"):
        gptq_fp8(w, h, damp=0.0)
    with pytest.raises(QuantizationError, match="block_size"):
        gptq_fp8(w, h, block_size=0)
    with pytest.raises(QuantizationError, match="positive definite"):
        gptq_fp8(w, -np.eye(32) + 0.5 * np.ones((32, 32)))
    acc = HessianAccumulator(32)
    with pytest.raises(QuantizationError, match="no calibration inputs"):
        acc.hessian()
    with pytest.raises(QuantizationError, match=r"\[\.\.\., 32\]"):
        acc.add(np.ones((4, 31)))
    with pytest.raises(QuantizationError, match="NaN"):
        acc.add(np.full((4, 32), np.inf))


def test_whole_model_driver_runs_in_the_engine() -> None:
    from jaxinfer import LLM, SamplingParams
    from jaxinfer.layers.norm import rms_norm
    from jaxinfer.loading import LoadedModel, load_model
    from jaxinfer.models import transformer
    from jaxinfer.models.params import FP8_PROJECTIONS, check_params
    from jaxinfer.quantization import quantize_params_fp8

    loaded = load_model("dummy:tiny-llama", progress=False)
    cfg = loaded.config
    rng = np.random.default_rng(6)
    calib = [rng.integers(3, cfg.vocab_size, 96).tolist() for _ in range(3)]
    proj, block = transformer._proj, transformer.CausalLM._block
    res = quantize_model_gptq(loaded, calib)
    assert transformer._proj is proj and transformer.CausalLM._block is block  # restored

    check_params(cfg, res.params)
    rtn = quantize_params_fp8(loaded.params, FP8_PROJECTIONS)
    assert set(res.params) == set(rtn)
    for k in FP8_PROJECTIONS:  # fp8-channel's layout and scales exactly
        assert res.params[k].dtype == E4M3 and res.params[k].shape == rtn[k].shape
        np.testing.assert_array_equal(res.params[k + "_scale"], rtn[k + "_scale"])
    for k in set(rtn) - {n for p in FP8_PROJECTIONS for n in (p, p + "_scale")}:
        assert res.params[k] is loaded.params[k]

    # layer 0's Q/K/V input is the normed embedding: its round-to-nearest error, recomputed
    x0 = rms_norm(jnp.asarray(loaded.params["embed"])[jnp.asarray(calib)],
                  jnp.asarray(loaded.params["layers.attn_norm"][0]), cfg.rms_norm_eps)
    h = _hessian(np.asarray(x0, np.float64).reshape(-1, cfg.hidden_size))
    w0 = np.concatenate([loaded.params[f"layers.{p}"][0] for p in ("wq", "wk", "wv")], -1)
    rq, rs = quantize_fp8_per_channel(jnp.asarray(w0))
    assert res.errors[0]["wqkv"][1] == pytest.approx(output_error(w0, rq, rs, h), rel=1e-4)
    assert len(res.errors) == cfg.num_layers
    for layer in res.errors:
        assert set(layer) == {"wqkv", "wo", "w_gate_up", "w_down"}
        assert all(g < r for g, r in layer.values()), layer

    model = LoadedModel(cfg, res.params, loaded.tokenizer, loaded.source)
    llm = LLM(model, max_model_len=128, max_num_seqs=2)
    out = llm.generate([calib[0][:16]], SamplingParams(temperature=0, max_tokens=4))
    assert len(out[0].outputs[0].token_ids) == 4
    logits = llm.engine.prompt_logits(calib[0][:32])
    assert logits.shape == (32, cfg.vocab_size) and np.isfinite(logits).all()


def test_driver_validation() -> None:
    from jaxinfer.loading import load_model

    loaded = load_model("dummy:tiny-llama", progress=False)
    V = loaded.config.vocab_size
    with pytest.raises(QuantizationError, match="no calibration"):
        quantize_model_gptq(loaded, [])
    with pytest.raises(QuantizationError, match="tokens, got 1"):
        quantize_model_gptq(loaded, [[5]])
    with pytest.raises(QuantizationError, match="token ids"):
        quantize_model_gptq(loaded, [[5, V]])
    fp8 = load_model("dummy:tiny-llama", progress=False, quantization="fp8")
    with pytest.raises(QuantizationError, match="already FP8"):
        quantize_model_gptq(fp8, [[5, 6, 7]])


def test_convert_with_calibration(tmp_path, monkeypatch) -> None:
    """``jaxinfer convert --quantization fp8 --calibration FILE``: fp8's format and scales,
    GPTQ's codes, the scheme in the manifest, and ``LLM(path)`` runs it."""
    import json

    from jaxinfer import LLM
    from jaxinfer.loading import CheckpointError, convert, load_model
    from tests.core.test_fp8_checkpoints import weights
    from tests.core.test_loading import _tiny_tokenizer, llama_hf_config, save_hf

    monkeypatch.setenv("JAXINFER_CHECKPOINT_DIR", str(tmp_path / "ckpt"))
    d = save_hf(tmp_path / "m", llama_hf_config(), weights())
    _tiny_tokenizer("{{ messages[0]['content'] }}").save(d)
    text = tmp_path / "calib.txt"
    text.write_text("hello world world hello hello world " * 60)
    with pytest.raises(CheckpointError, match=r"needs an output directory \(--output"):
        convert(str(d), progress=False, quantization="fp8", calibration=text)
    with pytest.raises(CheckpointError, match=r"needs quantization 'fp8' \(--quantization"):
        convert(str(d), str(tmp_path / "x"), progress=False, calibration=text)
    with pytest.raises(CheckpointError, match="calib.missing"):
        convert(str(d), str(tmp_path / "x"), progress=False, quantization="fp8",
                calibration=tmp_path / "calib.missing")
    with pytest.raises(CheckpointError, match="at least 2, got 1"):
        convert(str(d), str(tmp_path / "x"), progress=False, quantization="fp8",
                calibration=text, calibration_tokens=1)
    (tmp_path / "empty.txt").write_text(" \n")
    with pytest.raises(CheckpointError, match="empty.txt is empty"):
        convert(str(d), str(tmp_path / "x"), progress=False, quantization="fp8",
                calibration=tmp_path / "empty.txt")
    (tmp_path / "one.txt").write_text("hello")
    with pytest.raises(CheckpointError, match=r"1 token\(s\); GPTQ needs at least 2"):
        convert(str(d), str(tmp_path / "x"), progress=False, quantization="fp8",
                calibration=tmp_path / "one.txt")
    with pytest.raises(CheckpointError, match="calib.txt is not a directory"):
        convert(str(d), str(text / "sub"), progress=False, quantization="fp8",
                calibration=text)
    bare = save_hf(tmp_path / "no_tok", llama_hf_config(), weights())  # no tokenizer files
    with pytest.raises(CheckpointError, match=r"GPTQ needs a tokenizer to read the calibration "
                                              r"text; this checkpoint has none"):
        convert(str(bare), str(tmp_path / "x"), progress=False, quantization="fp8",
                calibration=text)
    assert not (tmp_path / "x").exists()  # nothing half-written by the failed calls

    out = convert(str(d), str(tmp_path / "gptq"), progress=False, quantization="fp8",
                  calibration=text, calibration_tokens=300)
    scheme = json.loads((out / "manifest.json").read_text())["quantization"]["scheme"]
    assert scheme["rounding"].startswith("GPTQ") and scheme["calibration"]["tokens"] == 300
    assert scheme["calibration"]["bytes_read"] == text.stat().st_size  # small: read whole
    back = load_model(str(out))
    rtn = load_model(str(d), progress=False, quantization="fp8")
    assert back.quantization == "fp8" and set(back.params) == set(rtn.params)
    moved = 0
    for k, v in rtn.params.items():
        assert back.params[k].dtype == v.dtype and back.params[k].shape == v.shape, k
        if k.endswith("_scale") or v.dtype != E4M3:
            np.testing.assert_array_equal(back.params[k], v)
        else:
            moved += int((back.params[k].view(np.uint8) != v.view(np.uint8)).sum())
    assert moved > 0  # GPTQ chose other codes than round-to-nearest
    llm = LLM(str(out), dtype="float32", max_model_len=32, max_num_seqs=1)
    logits = llm.engine.prompt_logits("hello world hello")
    assert np.isfinite(logits).all()


def test_calibration_reads_a_prefix_that_follows_the_tokens_asked(tmp_path) -> None:
    """Only a growing prefix of the calibration file is read and encoded (a multi-GB corpus
    used to be read and tokenized whole); the ids are the whole text's first tokens."""
    from jaxinfer.loading import CheckpointError, _calibration_ids, _read_calibration
    from tests.core.test_loading import _tiny_tokenizer

    tok = _tiny_tokenizer("{{ messages[0]['content'] }}")
    big = tmp_path / "big.txt"
    big.write_text("hello world " * 200_000)  # 2.4 MB
    encoded: list[int] = []
    real = tok.encode
    tok.encode = lambda text, *a, **k: encoded.append(len(text)) or real(text, *a, **k)
    ids, sha, n = _calibration_ids(_read_calibration(big), tok, 5_000)
    assert ids == real("hello world " * 3_000)[:5_000]
    assert n == 65_536 and max(encoded) <= 65_536  # 8 bytes a token wanted, >= 64 KiB
    import hashlib
    assert sha == hashlib.sha256(big.read_bytes()[:n]).hexdigest()
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"hello " * 20_000 + b"\xff\xfe")
    with pytest.raises(CheckpointError, match="bad.txt: 'utf-8' codec can't decode"):
        _calibration_ids(_read_calibration(bad), tok, 10**6)
