"""benchmarks/profile_decode.summarise_trace on a synthetic trace (XLA:CPU traces have no
device process, so the GPU parser is checked on hand-made events)."""

import pytest

from benchmarks.profile_decode import classify, summarise_trace


def _meta(pid, name, tid=None, thread=None):
    if tid is None:
        return {"ph": "M", "pid": pid, "name": "process_name", "args": {"name": name}}
    return {"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": thread}}


def _x(pid, tid, ts, dur, name):
    return {"ph": "X", "pid": pid, "tid": tid, "ts": ts, "dur": dur, "name": name}


def test_summary_sums_per_name_and_class_and_merges_overlaps():
    ev = [_meta(1, "/host:CPU"), _meta(2, "/device:GPU:0"),
          _meta(2, "/device:GPU:0", 7, "Stream #7(Compute)"),
          _meta(2, "/device:GPU:0", 9, "XLA Ops"),
          _x(1, 1, 0, 500, "PjitFunction(step)"),          # host: ignored
          _x(2, 9, 0, 1000, "fusion.1"),                    # non-stream row: ignored
          _x(2, 7, 0, 10, "nvjet_tst_128x64_gemm"),
          _x(2, 7, 5, 10, "paged_decode_kernel"),           # overlaps the gemm by 5
          _x(2, 7, 30, 4, "loop_add_fusion"),
          _x(2, 7, 40, 10, "nvjet_tst_128x64_gemm")]
    s = summarise_trace(ev, steps=2)
    assert s["device_pids"] == [2]
    by = {n: (c, us, k) for n, c, us, k in s["kernels"]}
    assert by["nvjet_tst_128x64_gemm"] == ("gemm", 10.0, 1.0)
    assert by["paged_decode_kernel"] == ("attention", 5.0, 0.5)
    assert by["loop_add_fusion"][0] == "fusion"
    assert "fusion.1" not in by
    assert s["classes"] == pytest.approx({"gemm": 10.0, "attention": 5.0, "fusion": 2.0})
    # union of [0,15], [30,34], [40,50] = 15 + 4 + 10 = 29 us over 2 steps
    assert s["busy_us_per_step"] == pytest.approx(14.5)
    assert s["span_us_per_step"] == pytest.approx(25.0)
    assert s["kernels"][0][0] == "nvjet_tst_128x64_gemm"


def test_summary_without_device_process_raises():
    with pytest.raises(ValueError, match="no /device"):
        summarise_trace([_meta(1, "/host:CPU"), _x(1, 1, 0, 5, "op")], steps=1)


@pytest.mark.parametrize("name,cls", [("cutlass_80_tensorop_bf16_s16816gemm", "gemm"),
                                      ("ragged_paged_attention", "attention"),
                                      ("input_reduce_fusion_3", "fusion"),
                                      ("Memcpy DtoD", "copy"), ("rocm_mystery", "other")])
def test_classify(name, cls):
    assert classify(name) == cls


def test_by_position_splits_a_shared_name_by_its_place_in_the_layer():
    # 2 layers x 3 calls a step of one anonymous name (q, o, mlp), 2 steps; another name
    # called once a layer is not split (p = 1).
    ev = [_meta(2, "/device:GPU:0"), _meta(2, "/device:GPU:0", 7, "Stream #7(Compute)")]
    t = 0
    for _ in range(2):
        for _layer in range(2):
            for dur in (3, 5, 11):
                ev.append(_x(2, 7, t, dur, "anonymous_mosaic_gpu_kernel"))
                t += 20
            ev.append(_x(2, 7, t, 2, "paged_decode_kernel"))
            t += 20
    s = summarise_trace(ev, steps=2, layers=2)
    # position sums per step: 2 layers x (3, 5, 11)
    assert s["by_position"] == {"anonymous_mosaic_gpu_kernel": pytest.approx([6.0, 10.0, 22.0])}
    assert "by_position" not in summarise_trace(ev, steps=2)
    # a count that does not divide by the layers is not split
    assert summarise_trace(ev, steps=2, layers=4)["by_position"] == {}
