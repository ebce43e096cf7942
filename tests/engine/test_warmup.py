"""Warm-up with a pool of threads (jaxinfer/warmup.py) and thread-safe program builds
(ModelRunner.executable, MultiStepPrograms.executable); the GPU defaults of the batch
limits (engine_config.engine_config_for)."""

from __future__ import annotations

import threading

import pytest

from jaxinfer.batch import Bucket
from jaxinfer.compile_cache import xla_compilations
from jaxinfer.config import ConfigError
from jaxinfer.llm import LLM
from jaxinfer.runner import COPY, SAMPLE
from jaxinfer.runner_slots import BIAS, BIAS_BUCKET, HISTORY, MASK, mask_bucket
from jaxinfer.sampling import SAMPLER_VARIANTS
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.warmup import warm_up, warm_up_builds
from tests.conftest import tiny_config, tiny_loaded
from tests.engine.test_async_scheduling import ENGINE


def _model_programs(eng) -> set:
    """Keys of the runner's built model / copy programs (sampler programs left out)."""
    return {k for k in eng.runner._executables if k[0] in (SAMPLE, COPY)}


@pytest.mark.parametrize("k", [1, 3])
def test_parallel_warm_up_builds_what_the_serial_one_builds_once_each(k):
    """Three threads build the same programs as one, each built once (compiled + loaded
    from JAX's persistent cache, which the tests turn on, equals the programs built: no
    program twice, none counted from a neighbour's thread), and a greedy / sampled workload
    afterwards builds only the prefill program of its batch."""
    loaded = tiny_loaded("llama")
    serial = LLM(loaded, **ENGINE, num_scheduler_steps=k).engine
    llm = LLM(loaded, **ENGINE, num_scheduler_steps=k)
    parallel = llm.engine
    warm_up(serial, jobs=1)
    before = xla_compilations()
    warm_up(parallel, jobs=3)
    assert _model_programs(parallel) == _model_programs(serial)
    assert {(b.num_seqs, 1) for m, b in _model_programs(parallel) if b.kind == "decode"} == {
        (b, 1) for b in ENGINE["decode_buckets"]}
    assert set(parallel.multi_step_programs._programs) == set(
        serial.multi_step_programs._programs)
    assert set(parallel.runner._executables) == set(serial.runner._executables)
    built = len(parallel.runner._executables) + len(parallel.multi_step_programs._programs)
    r = parallel.runner
    assert r.num_compilations + r.num_loaded == built
    assert r.num_compilations == xla_compilations() - before
    assert serial.runner.num_compilations + serial.runner.num_loaded == built
    n, warm = r.num_compilations + r.num_loaded, set(r._executables)
    outs = llm.generate([[5, 6, 7], [8, 9], [3]], [
        SamplingParams(max_tokens=9, ignore_eos=True),
        SamplingParams(max_tokens=9, temperature=0.8, seed=2, ignore_eos=True),
        SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)])
    assert [len(o.outputs[0].token_ids) for o in outs] == [9, 9, 4]
    new = set(r._executables) - warm
    # no decode, sampler or gather program: only the prefill of three prompts at once
    assert {(m, b.kind) for m, b in new} <= {(SAMPLE, "prefill")}, new
    assert r.num_compilations + r.num_loaded - n == len(new)


def test_threads_asking_for_one_program_build_it_once():
    """Four threads asking for the same decode program at once get one object, compiled
    once with its row count's sampler variants; another bucket builds beside it."""
    eng = LLM(tiny_loaded("llama"), **ENGINE).engine
    runner = eng.runner
    a, b = Bucket("decode", 4, 4, eng.config.page_buckets[0]), \
        Bucket("decode", 8, 8, eng.config.page_buckets[0])
    n0, got, errors = runner.num_compilations + runner.num_loaded, [], []
    start = threading.Barrier(5)

    def ask(bucket):
        try:
            start.wait()
            got.append((bucket, runner.executable(bucket)))
        except Exception as e:  # surfaced below: a thread's error must fail the test
            errors.append(e)

    threads = [threading.Thread(target=ask, args=(x,)) for x in (a, a, a, a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len({id(exe) for bucket, exe in got if bucket == a}) == 1
    assert runner.num_compilations + runner.num_loaded - n0 == 2 * (1 + len(SAMPLER_VARIANTS))


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_warm_up_refuses_bad_jobs(bad):
    eng = LLM(tiny_loaded("llama"), **ENGINE).engine
    with pytest.raises(ValueError, match="warm-up jobs must be an integer >= 1"):
        warm_up(eng, jobs=bad)
    assert eng.runner.num_compilations + eng.runner.num_loaded == 0  # refused before building


def test_warm_up_builds_largest_bucket_first_and_none_without_decode_buckets():
    eng = LLM(tiny_loaded("llama"), **ENGINE).engine
    assert warm_up_builds(eng, decode_buckets=False) == []
    builds = warm_up_builds(eng)
    rows = sorted(ENGINE["decode_buckets"], reverse=True)
    loaders = 3 + len(rows)  # copy, history, bias, a structured-outputs mask loader a bucket
    assert [(f.args[0].kind, f.args[0].num_seqs) for f in builds[:-loaders]] == [
        (kind, b) for b in rows for kind in ("decode", "gather")]
    assert [f.args for f in builds[-loaders:]] == [
        (eng.runner.copy_bucket, COPY),
        (Bucket(HISTORY, ENGINE["max_model_len"], 1, 0), HISTORY), (BIAS_BUCKET, BIAS),
        *((mask_bucket(b), MASK) for b in ENGINE["decode_buckets"])]
    sync = LLM(tiny_loaded("llama"), **ENGINE, async_scheduling=False).engine
    assert [f.args[0].kind for f in warm_up_builds(sync)[:-loaders]] == ["decode"] * len(rows)


def test_warm_up_with_prefill_buckets_leaves_nothing_to_compile():
    """prefill_buckets=True builds every reachable prefill program of the sample mode too
    (compile.enumerate_programs' set, here the jnp reference's grid of rows x widths), so a
    workload of mixed prompt lengths, batch sizes and sampling parameters (penalties,
    min_tokens, a logit_bias: the slot loaders are built too) builds nothing afterwards."""
    from jaxinfer.compile import enumerate_programs

    llm = LLM(tiny_loaded("llama"), **ENGINE, attention_backend="reference")
    eng = llm.engine
    warm_up(eng, jobs=2, prefill_buckets=True)
    r = eng.runner
    want = {(p.mode, p.bucket) for p in enumerate_programs(eng.config, ["sample"])
            if p.bucket.kind == "prefill"}
    assert want and want <= set(r._executables)
    n = r.num_compilations + r.num_loaded
    prompts = [[(7 * i + j) % 50 + 1 for j in range(L)] for i, L in enumerate(
        (3, 17, 30, 5, 9, 44, 2, 12, 25))]
    outs = llm.generate(prompts, [SamplingParams(
        max_tokens=6, temperature=0.7 * (i % 2), seed=i, ignore_eos=True,
        repetition_penalty=1.0 + 0.1 * (i % 3 == 1), min_tokens=2 * (i % 4 == 3),
        logit_bias={7: 2.0} if i % 3 == 2 else None) for i in range(len(prompts))])
    assert all(len(o.outputs[0].token_ids) == 6 for o in outs)
    assert r.num_compilations + r.num_loaded == n, set(r._executables)


def test_prefill_builds_follow_the_buckets_largest_first():
    """With one row count and table width (the Pallas kernels' set) one prefill program per
    token bucket, the largest first; none unless asked for."""
    narrow = LLM(tiny_loaded("llama"), **{**ENGINE, "page_buckets": (16,),
                                           "prefill_seq_buckets": (4,)}).engine
    builds = warm_up_builds(narrow, decode_buckets=False, prefill_buckets=True)
    assert [(f.args[0].num_tokens, f.args[0].num_seqs) for f in builds] == [(32, 4), (16, 4)]
    assert all(f.args[0].kind != "prefill" for f in warm_up_builds(narrow))


# ---------------------------------------------------------------- GPU defaults
@pytest.fixture
def on_gpu(monkeypatch):
    import jaxinfer.engine_config as ecm

    monkeypatch.setattr(ecm.jax, "default_backend", lambda: "gpu")


def _ec(**args):
    from jaxinfer.engine_config import engine_config_for

    return engine_config_for(tiny_config("llama"), {"attention_backend": "reference", **args})


def test_gpu_defaults_are_vllms_batch_limits(on_gpu):
    from jaxinfer.engine_config import GPU_DEFAULTS

    ec = _ec(max_model_len=64)
    assert (ec.max_num_seqs, ec.max_num_batched_tokens, ec.max_prefill_seqs) == (256, 8192, 64)
    assert GPU_DEFAULTS == {"max_num_seqs": 256, "max_num_batched_tokens": 8192,
                            "max_prefill_seqs": 64}
    assert ec.decode_buckets == (1, 2, 4, 8, 16, 32, 64, 128, 256)
    assert ec.prefill_buckets[-1] == 8192


def test_gpu_defaults_yield_to_what_is_given(on_gpu):
    ec = _ec(max_model_len=64, decode_buckets=(1, 4, 32), prefill_buckets=(16, 256))
    assert (ec.max_num_seqs, ec.max_num_batched_tokens, ec.max_prefill_seqs) == (32, 256, 32)
    ec = _ec(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=128, max_prefill_seqs=None)
    assert (ec.max_num_seqs, ec.max_num_batched_tokens, ec.max_prefill_seqs) == (4, 128, 4)
    assert ec.decode_buckets == (1, 2, 4)
    with pytest.raises(ConfigError, match="max_num_seqs must be a positive integer, got 0"):
        _ec(max_model_len=64, max_num_seqs=0)


def test_cpu_keeps_the_small_defaults_and_none_means_default(monkeypatch):
    import jaxinfer.engine_config as ecm

    monkeypatch.setattr(ecm.jax, "default_backend", lambda: "cpu")
    ec = _ec(max_model_len=64, max_num_seqs=None, max_num_batched_tokens=None)
    assert (ec.max_num_seqs, ec.max_num_batched_tokens, ec.max_prefill_seqs) == (8, 512, 8)


def test_cli_leaves_the_batch_limits_to_the_engine():
    import argparse

    from jaxinfer.cli import _add_engine_options, _engine_args

    p = argparse.ArgumentParser()
    _add_engine_options(p)
    args = _engine_args(p.parse_args([]))
    assert not {"max_num_seqs", "max_num_batched_tokens", "max_prefill_seqs"} & set(args)
    assert _engine_args(p.parse_args(["--max-num-seqs", "3"]))["max_num_seqs"] == 3
