"""benchmarks/fp8_accuracy.py on a tiny random model (CPU): the W8A16 and W8A8 variants run,
W8A8 really quantizes the activations, and the engine-plan mode follows fp8_engine_plan."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.fp8_accuracy import act_quant, compare, variant_model
from pallas_kernels.matmul import fp8_plan
from tests.conftest import tiny_loaded


def test_w8a16_and_w8a8_side_by_side() -> None:
    ids = np.random.default_rng(0).integers(2, 96, 64).tolist()
    real_plan = fp8_plan.fp8_engine_plan
    out = {v: r for v, _, r in compare(tiny_loaded("llama"), ids,
                                       ["fp8-channel", "w8a8-channel", "gpuplan-channel"], 32)}
    assert fp8_plan.fp8_engine_plan is real_plan  # the hook is undone
    assert all(r["positions"] == len(ids) for r in out.values())
    assert all(0.5 < r["top1_agreement"] <= 1 and r["mean_kl"] > 0 for r in out.values())
    # per-token activation quantization adds error on top of the same FP8 weights
    assert out["w8a8-channel"]["mean_kl"] != out["fp8-channel"]["mean_kl"]
    # 32-row prefill programs (<= FP8_DECODE_MAX_M): the engine's plan is W8A8 everywhere
    plan = out["gpuplan-channel"]["gemm_plan"]
    assert plan and set(plan.values()) == {"W8A8"} and all(k.startswith("32x") for k in plan)
    assert out["gpuplan-channel"]["mean_kl"] == out["w8a8-channel"]["mean_kl"]


def test_plan_mode_follows_the_engine_policy() -> None:
    log: dict[str, str] = {}
    with act_quant("plan", log):
        assert fp8_plan.fp8_engine_plan(512, 640, 1536) == ("xla", True)   # Mosaic kernel fits
        assert fp8_plan.fp8_engine_plan(512, 576, 960) == ("xla", False)   # K % 128: W8A16
        assert fp8_plan.fp8_engine_plan(256, 640, 1536) == ("xla", True)   # between: Mosaic W8A8
        assert fp8_plan.fp8_engine_plan(256, 576, 960) == ("xla", False)   # K % 128: W8A16
        assert fp8_plan.fp8_engine_plan(16, 576, 960) == ("xla", True)     # decode
    assert log == {"512x640x1536": "W8A8", "512x576x960": "W8A16", "256x640x1536": "W8A8",
                   "256x576x960": "W8A16", "16x576x960": "W8A8"}
    with act_quant("all", log):
        assert fp8_plan.fp8_engine_plan(256, 576, 960) == ("xla", True)


def test_w8a8_needs_per_channel_scales() -> None:
    with pytest.raises(ValueError, match="per-channel"):
        variant_model(tiny_loaded("llama"), "w8a8-g128")


def test_weight_error_fraction_variant() -> None:
    """fp8err-<f> moves each projection weight the fraction f of the way to its per-channel
    e4m3 value: f = 0 keeps the checkpoint, f = 1 is fp8-channel's dequantized weights, f = 1/2
    sits half way, in float32 (W8A16-free: the weights stay float)."""
    from jaxinfer.models.params import FP8_PROJECTIONS

    loaded = tiny_loaded("llama")
    k = FP8_PROJECTIONS[0]
    w = loaded.params[k]
    m0, dtype, base, act = variant_model(loaded, "fp8err-0")
    assert (dtype, base, act) == ("float32", "float32", None)
    np.testing.assert_array_equal(m0.params[k], w)
    fp8, *_ = variant_model(loaded, "fp8-channel")
    deq = fp8.params[k].astype(np.float32) * fp8.params[k + "_scale"][:, None, :]
    m1, *_ = variant_model(loaded, "fp8err-1")
    np.testing.assert_allclose(m1.params[k], deq, rtol=1e-6, atol=1e-7)
    assert not np.allclose(deq, w)  # the fraction moves something
    half, *_ = variant_model(loaded, "fp8err-0.5")
    np.testing.assert_allclose(half.params[k], (w + deq) / 2, rtol=1e-6, atol=1e-7)
    assert k + "_scale" not in half.params


def test_gptq_calibration_windows_are_disjoint_from_the_evaluated_tokens() -> None:
    from benchmarks.fp8_accuracy import calibration_windows

    starts = calibration_windows(list(range(10_000)), 1024, 512, 8)
    assert len(starts) == 8 and starts[0] == 1024 and starts[-1] == 10_000 - 512
    assert all(b - a >= 512 for a, b in zip(starts, starts[1:]))  # no overlap either
    with pytest.raises(ValueError, match="do not fit"):
        calibration_windows(list(range(3000)), 1024, 512, 8)
    with pytest.raises(ValueError, match="calibration"):  # fp8-gptq needs calibration text
        variant_model(tiny_loaded("llama"), "fp8-gptq")


def test_keep_variant_leaves_exactly_the_named_weights_at_checkpoint_precision() -> None:
    """fp8keep-<spec>: fp8err-1's dequantized e4m3 weights except the named projections /
    layers, which keep the checkpoint's values; the kept fraction is reported; a bad spec
    raises naming the part."""
    from benchmarks.fp8_accuracy import keep_spec

    loaded = tiny_loaded("llama")
    L = loaded.config.num_layers
    full, *_ = variant_model(loaded, "fp8err-1")
    info: dict = {}
    m, dtype, base, act = variant_model(loaded, f"fp8keep-w_down+L{L - 1}", info=info)
    assert (dtype, base, act) == ("float32", "float32", None)
    for k, w in loaded.params.items():
        if not k.startswith("layers.w") or k.endswith("_scale"):
            continue
        for i in range(L):
            want = w[i] if (k == "layers.w_down" and i == L - 1) else full.params[k][i]
            np.testing.assert_array_equal(m.params[k][i], want, err_msg=f"{k} layer {i}")
    down = loaded.params["layers.w_down"][L - 1].size
    total = sum(loaded.params[k].size for k in loaded.params
                if k.startswith("layers.w") and not k.endswith("_scale"))
    assert info["kept_weight_fraction"] == pytest.approx(down / total)
    assert keep_spec("L0:2", 4)("wo", 1) and not keep_spec("L0:2", 4)("wo", 2)
    assert keep_spec("L-1", 4)("wq", 3) and not keep_spec("wq", 4)("wk", 0)
    with pytest.raises(ValueError, match="'w_foo'"):
        keep_spec("w_foo", 4)
