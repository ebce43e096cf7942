"""Roofline arithmetic against numbers worked out by hand (jaxinfer/bench/roofline.py)."""

from __future__ import annotations

import pytest

from jaxinfer.bench import roofline
from jaxinfer.loading.dummy import DUMMY_CONFIGS

L8 = DUMMY_CONFIGS["llama-3.1-8b"]
# Llama-3.1-8B by hand: per layer q 4096x4096, k and v 4096x1024, o 4096x4096, gate/up/down
# 3 x 4096x14336 = 218,103,808 projection parameters; 32 layers; embedding and LM head
# 128256 x 4096 = 525,336,576 each; norms 2 x 4096 per layer + 4096.
PROJ = 32 * (4096 * 4096 + 2 * 4096 * 1024 + 4096 * 4096 + 3 * 4096 * 14336)
EMB = 128256 * 4096
NORMS = 2 * 32 * 4096 + 4096


def test_hand_checked_parameter_counts() -> None:
    assert PROJ == 6_979_321_856 and EMB == 525_336_576
    assert PROJ + 2 * EMB + NORMS == 8_030_261_248  # the published 8B count


def test_llama8b_bf16_bytes() -> None:
    assert roofline.weight_bytes(L8, "bfloat16") == 16_060_522_496  # ~16.06e9, resident
    c = roofline.decode_step_cost(L8, 512, batch=1, dtype="bfloat16")
    # The embedding table is gathered from (one 4096-wide row), not read.
    assert c.weight_bytes == 16_060_522_496 - 2 * EMB + 2 * 4096 == 15_009_857_536
    # KV: 2 (K, V) x 32 layers x 8 heads x 128 x 2 bytes = 131,072 bytes per token.
    assert c.kv_read_bytes == 512 * 131_072
    assert c.kv_write_bytes == 131_072
    assert c.matmul_flops == 2 * (PROJ + EMB) == 15_009_316_864
    assert c.attention_flops == 4 * 32 * 128 * 512 * 32 == 268_435_456
    assert c.bytes == c.weight_bytes + c.kv_read_bytes + c.kv_write_bytes


def test_llama8b_fp8_bytes() -> None:
    # FP8 projections (1 byte) + float32 per-output-channel scales; embedding, LM head and
    # norms stay bf16. Output channels per layer: 4096 + 1024 + 1024 + 4096 + 3 x ... below.
    scales = 32 * (4096 + 1024 + 1024 + 4096 + 14336 + 14336 + 4096) * 4
    assert scales == 5_505_024
    want = PROJ + scales + 2 * EMB * 2 + NORMS * 2
    assert want == 9_086_705_664
    assert roofline.weight_bytes(L8, "bfloat16", "fp8") == want


def test_llama70b_bf16_bytes() -> None:
    assert roofline.weight_bytes(DUMMY_CONFIGS["llama-3.1-70b"], 2) == 2 * 70_553_706_496


def test_batch_scales_flops_and_kv_not_weights() -> None:
    one = roofline.decode_step_cost(L8, 1000, batch=1)
    many = roofline.decode_step_cost(L8, [1000] * 64)
    assert many == roofline.decode_step_cost(L8, 1000, batch=64)
    assert many.matmul_flops == 64 * one.matmul_flops
    assert many.kv_read_bytes == 64 * one.kv_read_bytes
    assert many.weight_bytes - one.weight_bytes == 63 * 4096 * 2  # only the gathered rows


def test_tied_embedding_is_read_as_lm_head_and_sliding_layers_read_the_window() -> None:
    g = DUMMY_CONFIGS["tiny-gemma3"]  # tied; 5 sliding layers (window 8) + 1 global
    c = roofline.decode_step_cost(g, 20, batch=1, dtype="float32")
    assert c.weight_bytes == roofline.weight_bytes(g, "float32")
    per_token_layer = 2 * 1 * 32 * 4  # K and V, 1 KV head of 32, float32
    assert c.kv_read_bytes == (5 * 8 + 20) * per_token_layer
    # per layer: wq 64x128, wk/wv 64x32, wo 128x64, gate/up 64x128, down 128x64; 6 layers;
    # the tied table 256x64 serves as LM head.
    per_layer = 64 * 128 + 2 * 64 * 32 + 128 * 64 + 3 * 64 * 128
    assert c.matmul_flops == 2 * (6 * per_layer + 256 * 64) == 573_440
    assert c.attention_flops == 4 * 4 * 32 * (5 * 8 + 20)


def test_roofline_fractions() -> None:
    cost = roofline.StepCost(weight_bytes=3_000, kv_read_bytes=900, kv_write_bytes=100,
                             matmul_flops=40, attention_flops=10)
    r = roofline.roofline(cost, step_s=2.0, copy_bytes_per_s=4_000.0, matmul_flops_per_s=100.0)
    assert r["achieved_bytes_per_s"] == 2_000.0 and r["bandwidth_frac"] == 0.5
    assert r["achieved_flops_per_s"] == 25.0 and r["matmul_frac"] == 0.25
    assert r["floor_s"] == 1.0  # max(4000 / 4000, 50 / 100)
    bare = roofline.roofline(cost, step_s=2.0)
    assert bare["bandwidth_frac"] is None and bare["floor_s"] is None


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="context >= 1"):
        roofline.decode_step_cost(L8, 0)
    with pytest.raises(ValueError, match="batch only"):
        roofline.decode_step_cost(L8, [5, 6], batch=2)
    with pytest.raises(ValueError, match="step time"):
        roofline.roofline(roofline.decode_step_cost(L8, 5), 0.0)


def test_fp8_projection_list_matches_the_model() -> None:
    from jaxinfer.models.transformer import FP8_PROJECTIONS

    assert roofline.FP8_PROJECTIONS == FP8_PROJECTIONS


def test_measured_ceilings_are_positive() -> None:
    c = roofline.measure_ceilings("float32", repeats=2)
    assert c["copy_bytes_per_s"] > 0 and c["matmul_flops_per_s"] > 0
