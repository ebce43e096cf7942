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
