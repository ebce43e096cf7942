"""``--load-format dummy`` / ``dummy:<source>``: random weights at any model's shape."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from jaxinfer.cli import main, model_spec
from jaxinfer.loading import CheckpointError, dummy_header, load_model
from jaxinfer.models.params import param_shapes

TINY_HF = Path(__file__).resolve().parents[1] / "fixtures" / "tiny" / "llama"


def test_model_spec() -> None:
    assert model_spec("llama-3.1-8b", "dummy") == "dummy:llama-3.1-8b"
    assert model_spec("dummy:tiny-llama", "dummy") == "dummy:tiny-llama"
    assert model_spec("smollm2-135m", "auto") == "smollm2-135m"


def test_dummy_weights_at_an_hf_checkpoints_shape() -> None:
    real = load_model(str(TINY_HF), progress=False)
    fake = load_model(f"dummy:{TINY_HF}", dtype="bfloat16")
    assert fake.config == real.config and fake.source == f"dummy:{TINY_HF}"
    assert {k: v.shape for k, v in fake.params.items()} == param_shapes(real.config)
    assert all(str(v.dtype) == "bfloat16" for v in fake.params.values())
    assert not np.allclose(fake.params["layers.wq"].astype(np.float32), real.params["layers.wq"])
    assert dummy_header(str(TINY_HF))[0] == real.config


def test_dummy_at_a_named_models_shape_keeps_its_tokenizer() -> None:
    try:
        cfg, tok = dummy_header("smollm2-135m")  # GGUF header and vocabulary only
    except CheckpointError as e:
        pytest.skip(str(e))
    assert (cfg.num_layers, cfg.hidden_size, cfg.vocab_size) == (30, 576, 49152)
    assert tok is not None and tok.encode("Hello")


def test_unknown_dummy_source_names_the_shapes() -> None:
    with pytest.raises(CheckpointError, match=r"dummy:nope: not a dummy shape .*dummy:llama-3.1-8b"):
        load_model("dummy:nope")


def test_fp8_dummy_weights_are_made_as_fp8_per_channel() -> None:
    # No bf16 copy first (the 70B shape would need 141 GB of host memory): e4m3 projections
    # with per-output-channel scales, the layout quantization="fp8" makes, no NaN (e4m3fn
    # has no inf: an unclipped out-of-range cast would be NaN), std 1/sqrt(fan_in).
    from jaxinfer.models.params import FP8_PROJECTIONS, fp8_names

    lm = load_model(f"dummy:{TINY_HF}", dtype="bfloat16", quantization="fp8")
    assert lm.quantization == "fp8" and sorted(fp8_names(lm.params)) == sorted(FP8_PROJECTIONS)
    shapes = param_shapes(lm.config)
    for name in FP8_PROJECTIONS:
        q, s = lm.params[name], lm.params[name + "_scale"]
        assert str(q.dtype) == "float8_e4m3fn" and q.shape == shapes[name]
        assert s.dtype == np.float32 and s.shape == shapes[name][:-2] + shapes[name][-1:]
        w = q.astype(np.float32) * s[:, None, :]
        assert np.isfinite(w).all()
        assert abs(w.std() * np.sqrt(q.shape[-2]) - 1.0) < 0.1, name
    assert str(lm.params["embed"].dtype) == "bfloat16"  # the rest in the requested dtype


def test_cli_load_format_dummy_bf16_and_fp8(tmp_path: Path) -> None:
    # A named dummy shape through --load-format, FP8 projections, bf16 for the rest.
    rc = main(["bench", "offline", "--load-format", "dummy", "--model", "tiny-llama",
               "--dtype", "bfloat16", "--quantization", "fp8", "--max-model-len", "32",
               "--decode-buckets", "2", "--prefill-buckets", "32", "--max-num-batched-tokens",
               "32", "--max-prefill-seqs", "1", "--input-len", "8", "--output-len", "4",
               "--num-prompts", "2", "--out", str(tmp_path)])
    assert rc == 0
    [path] = tmp_path.glob("bench_offline-dummy-tiny-llama-8x4-*.json")
    recs = {r["name"]: r for r in json.loads(path.read_text())}
    cfg = recs["bench_offline.output_tokens"]["config"]
    assert (cfg["model"], cfg["dtype"], cfg["quantization"]) == ("dummy:tiny-llama", "bfloat16",
                                                                "fp8")
    assert recs["bench_offline.output_tokens"]["value"] == 2 * 4
    assert main(["compile", "--load-format", "dummy", "--model", "llama-3.1-70b", "--list",
                 "--max-model-len", "64"]) == 0  # config only: no 70B weights are built


def test_generate_token_ids_runs_a_model_without_tokenizer(
        capsys: pytest.CaptureFixture[str]) -> None:
    args = ["generate", "--model", "dummy:tiny-llama", "--max-tokens", "3", "--max-model-len",
            "32", "--max-num-seqs", "2", "--decode-buckets", "2", "--prefill-buckets", "16",
            "--max-num-batched-tokens", "16", "--max-prefill-seqs", "2"]
    assert main([*args, "--token-ids", "1 2 3", "4,5"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if not ln.startswith("###")]
    assert len(lines) == 2 and all(len(ln.split()) == 3 for ln in lines)  # 3 new ids each
    assert all(0 <= int(t) < 256 for ln in lines for t in ln.split())
    assert main([*args, "1 2 3"]) == 2  # a text prompt: no tokenizer, the error says why
    assert "--token-ids" in capsys.readouterr().err
    assert main([*args, "--token-ids", "1 x"]) == 2
    assert "is not a list of integers" in capsys.readouterr().err
