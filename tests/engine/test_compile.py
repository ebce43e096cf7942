"""`jaxinfer compile`: the bucket set, the compile cache, and start-ups that compile nothing."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import cli
from jaxinfer.batch import build_step
from jaxinfer.compile import MODES, abstract_runner, enumerate_programs, kv_pool_bytes
from jaxinfer.compile_cache import (
    PROGRAM_SOURCES,
    CompileCacheError,
    CompileCacheWarning,
    ProgramStore,
    diff_fingerprints,
    xla_compilations,
)
from jaxinfer.config import EngineConfig
from jaxinfer.llm import LLM
from jaxinfer.loading import DUMMY_CONFIGS
from jaxinfer.runner import LOGITS, SAMPLE, SAMPLER
from jaxinfer.sampling import SAMPLER_VARIANTS, sampler_bucket, sampler_variant
from jaxinfer.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[2]
MODEL = "dummy:tiny-llama"
# Small bucket set: prefill T 16 x S {1, 2} x 4 pages (+ logits T 16), decode B {1, 2}, the
# page-copy program of n > 1 requests, the penalty-history and logit-bias programs, and the
# sampler variants for S {1, 2}.
# The synchronous engine, so that the programs a run loads are exactly counted below (async
# scheduling, the default, also loads token-gather programs: its own test below).
ENGINE = {"max_model_len": 64, "block_size": 16, "max_num_seqs": 2,
          "max_num_batched_tokens": 16, "max_prefill_seqs": 2, "async_scheduling": False}
NV = len(SAMPLER_VARIANTS)  # sampler programs per row count
CLI_ENGINE = ["--max-model-len", "64", "--block-size", "16", "--max-num-seqs", "2",
              "--max-num-batched-tokens", "16", "--max-prefill-seqs", "2"]
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26,
                             27, 28, 29, 30]]  # the second needs two prefill chunks
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
# Eight parameter sets that need different parts of the sampler (as keyword arguments).
EIGHT = [{}, {"temperature": 0.8}, {"temperature": 1.0, "top_p": 0.9},
         {"temperature": 0.7, "top_k": 5, "top_p": 0.8}, {"repetition_penalty": 1.3},
         {"temperature": 0.9, "min_p": 0.1, "frequency_penalty": 0.5}, {"logprobs": 2},
         {"temperature": 1.2, "top_k": 7, "presence_penalty": 0.3, "logprobs": 1}]

# A fresh process: no conftest, so no JAX persistent cache; only the compile cache can help.
RUN = textwrap.dedent("""
    import json, sys
    import numpy as np
    from jaxinfer.compile_cache import xla_compilations
    from jaxinfer.llm import LLM
    from jaxinfer.sampling_params import SamplingParams
    engine, prompts, cache = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
    params = [SamplingParams(max_tokens=6, ignore_eos=True, seed=i, **kw)
              for i, kw in enumerate(json.loads(sys.argv[4]))] if len(sys.argv) > 4 else (
              SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    llm = LLM("dummy:tiny-llama", compile_cache_dir=cache or None, compile_cache_strict=True,
              **engine)
    r = llm.engine.runner
    variants, sampler = set(), r.sampler

    def spy(S, variant):
        variants.add(variant)
        return sampler(S, variant)

    r.sampler = spy
    before = xla_compilations()
    outs = llm.generate(prompts, params)
    logits = llm.engine.prompt_logits(prompts[1])
    print(json.dumps({"tokens": [o.outputs[0].token_ids for o in outs],
                      "cumulative_logprobs": [o.outputs[0].cumulative_logprob for o in outs],
                      "logits_argmax": np.argmax(logits, -1).tolist(),
                      "variants": sorted(variants),
                      "compiled": r.num_compilations, "loaded": r.num_loaded,
                      "pipelined": llm.engine.num_pipelined_steps,
                      "multi_steps": llm.engine.num_multi_steps,
                      "xla_while_running": xla_compilations() - before}))
""")


def _fresh_process(cache: Path | str, prompts: list = PROMPTS,
                   params: list[dict] | None = None, engine: dict = ENGINE) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    extra = [json.dumps(params)] if params is not None else []
    out = subprocess.run([sys.executable, "-c", RUN, json.dumps(engine), json.dumps(prompts),
                          str(cache), *extra], capture_output=True, text=True, env=env,
                         cwd=ROOT, timeout=600, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("compile-cache")
    assert cli.main(["compile", "--model", MODEL, *CLI_ENGINE, "--cache-dir", str(d),
                     "--jobs", "1"]) == 0
    return d


def test_modes_are_the_runners():
    assert MODES == (SAMPLE, LOGITS)
    assert SAMPLER not in MODES  # sampler programs come with "sample"


def test_enumeration_holds_every_bucket_a_step_can_use():
    ec = EngineConfig(max_model_len=256, block_size=16, max_num_seqs=4,
                      max_num_batched_tokens=128, max_prefill_seqs=8)
    programs = enumerate_programs(ec)
    sample = {p.bucket for p in programs if p.mode == "sample"}
    logits = {p.bucket for p in programs if p.mode == "logits"}
    assert len(programs) == len(set(programs))
    assert all(b.num_seqs == 1 and b.kind == "prefill" for b in logits)
    assert {(b.num_tokens, b.max_pages) for b in logits} <= {
        (b.num_tokens, b.max_pages) for b in sample if b.kind == "prefill"}
    full = len(ec.prefill_buckets) * len(ec.prefill_seq_buckets) * len(ec.page_buckets)
    prefill = [b for b in sample if b.kind == "prefill"]
    assert len(prefill) < full, "unreachable buckets should be pruned"
    assert max(b.num_seqs for b in prefill) == 4  # rows beyond max_num_seqs never run

    samplers = {p.bucket for p in programs if p.mode == SAMPLER}
    assert samplers == {sampler_bucket(S, v) for S in {b.num_seqs for b in sample}
                        for v in SAMPLER_VARIANTS}
    rng = np.random.default_rng(0)
    seen, seen_samplers = set(), set()
    for _ in range(3000):
        decode = rng.random() < 0.3
        n_seq = int(rng.integers(1, ec.max_num_seqs + 1))
        if decode:
            sizes = [1] * n_seq
        else:  # n_tok tokens split into n_seq positive chunks
            n_tok = int(rng.integers(n_seq, ec.max_num_batched_tokens + 1))
            cuts = np.sort(rng.choice(np.arange(1, n_tok), n_seq - 1, replace=False))
            sizes = np.diff(np.concatenate([[0], cuts, [n_tok]])).astype(int).tolist()
        chunks = []
        for i, n in enumerate(sizes):
            end = int(rng.integers(n, ec.max_model_len + 1))
            params = SamplingParams(**EIGHT[int(rng.integers(len(EIGHT)))])
            seq = SimpleNamespace(seq_id=i, block_table=list(range(1, -(-end // 16) + 1)),
                                  all_token_ids=[3] * end, num_prompt_tokens=end,
                                  sampling_params=params)
            chunks.append(SimpleNamespace(seq=seq, start=end - n, num_tokens=n))
        step = build_step(chunks, is_prefill=not decode, page_size=ec.block_size,
                          token_buckets=ec.decode_buckets if decode else ec.prefill_buckets,
                          seq_buckets=ec.decode_buckets if decode else ec.prefill_seq_buckets,
                          page_buckets=ec.page_buckets, request_seeds={})
        assert step.bucket in sample, step.bucket
        seen.add(step.bucket)
        variant = sampler_variant(step.sampling, DUMMY_CONFIGS["tiny-llama"].vocab_size)
        assert sampler_bucket(step.bucket.num_seqs, variant) in samplers
        seen_samplers.add(sampler_bucket(step.bucket.num_seqs, variant))
    assert len(seen) > len(sample) // 2  # the random steps exercise much of the set
    assert len(seen_samplers) > len(samplers) // 2


def test_kv_pool_bytes_is_the_runners_pool():
    ec = EngineConfig(**ENGINE)
    runner = abstract_runner(DUMMY_CONFIGS["tiny-llama"], ec)
    pool = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(runner.cache))
    cfg = DUMMY_CONFIGS["tiny-llama"]
    assert kv_pool_bytes(cfg, ec, jnp.float32) == pool == (
        2 * cfg.num_layers * cfg.num_kv_heads * ec.total_kv_pages * 16 * cfg.head_dim * 4)
    fp8 = EngineConfig(**ENGINE, kv_cache_dtype="fp8")
    runner = abstract_runner(cfg, fp8)
    assert runner.cache.dtype == jnp.float8_e4m3fn
    pool8 = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(runner.cache))
    assert kv_pool_bytes(cfg, fp8, jnp.float32) == pool8 == pool // 4 + 2 * cfg.num_layers * 4


def test_list_prints_the_table_and_compiles_nothing(tmp_path, capsys):
    before = xla_compilations()
    assert cli.main(["compile", "--model", MODEL, *CLI_ENGINE, "--list",
                     "--cache-dir", str(tmp_path / "never")]) == 0
    out = capsys.readouterr().out
    assert xla_compilations() == before
    assert not (tmp_path / "never").exists()
    ec = EngineConfig(**ENGINE)
    kv = kv_pool_bytes(DUMMY_CONFIGS["tiny-llama"], ec, jnp.float32)
    assert f"= {kv:,} bytes" in out
    assert (f"programs: {12 + 2 * NV} (prefill sample 2, prefill logits 1, decode sample 2, "
            f"kv copy 1, history 1, bias 1, mask 2, gather 2, sampler {2 * NV})" in out)
    assert ("sampling variants x rows: " + ", ".join(f"{v} [1, 2]" for v in SAMPLER_VARIANTS)
            in out)
    rows = [ln.split() for ln in out.splitlines()
            if ln.startswith(("sample ", "logits ", "copy ", "history ", "bias ", "sampler "))]
    assert sorted((r[0], r[1], int(r[2]), int(r[3])) for r in rows) == sorted(
        [("sample", "prefill", 16, 1), ("sample", "prefill", 16, 2),
         ("logits", "prefill", 16, 1), ("sample", "decode", 1, 1), ("sample", "decode", 2, 2),
         ("copy", "kv", 2, 1), ("history", "history", 64, 1), ("bias", "bias", 300, 1)]
        + [("sampler", v, S, S) for v in SAMPLER_VARIANTS for S in (1, 2)])
    # the columns line up: every row's token count ends where the header's "tokens" does
    table = out[out.index("\nmode ") + 1:].splitlines()
    end = table[0].index("tokens") + len("tokens")
    assert all(ln[end - 1].isdigit() and ln[end] == " " for ln in table[1:] if ln.strip())


def test_compile_help_describes_its_output_and_offers_no_strict(capsys):
    with pytest.raises(SystemExit):
        cli.main(["compile", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "compile cache to write" in text and "--strict" not in text
    with pytest.raises(SystemExit):
        cli.main(["generate", "--help"])
    assert "--strict" in capsys.readouterr().out


def test_a_compile_that_fails_midway_says_what_the_cache_keeps(tmp_path, monkeypatch, capsys):
    from jaxinfer.compile_cache import ProgramStore

    real, calls = ProgramStore.save, []

    def second_fails(self, program, blob, seconds):
        calls.append(program)
        if len(calls) == 2:
            raise RuntimeError("disk full (simulated)")
        return real(self, program, blob, seconds)

    monkeypatch.setattr(ProgramStore, "save", second_fails)
    d = tmp_path / "cache"
    with pytest.raises(RuntimeError, match="simulated"):
        cli.main(["compile", "--model", MODEL, *CLI_ENGINE, "--cache-dir", str(d),
                  "--jobs", "1"])
    n = len(enumerate_programs(EngineConfig(**ENGINE), list(MODES)))
    assert f"compile stopped after 1 of {n} programs; the cache at {d}" in capsys.readouterr().err
    assert len(json.loads((d / "manifest.json").read_text())["programs"]) == 1


def test_xla_counter_excludes_persistent_cache_hits():
    # conftest turns JAX's persistent compilation cache on: a new program is a miss (compiled
    # by XLA), the same program after clearing the in-memory caches is a hit (not compiled).
    c = float(np.random.default_rng().integers(1 << 30))
    f = jax.jit(lambda x: x * c + 1.0)
    before = xla_compilations()
    f.lower(1.0).compile()
    assert xla_compilations() == before + 1
    jax.clear_caches()
    jax.jit(lambda x: x * c + 1.0).lower(1.0).compile()
    assert xla_compilations() == before + 1


def test_programs_from_jax_persistent_cache_are_never_stored():
    # jaxlib 0.11.2: an XLA:CPU executable loaded from JAX's persistent cache re-serializes
    # incomplete and fails when run, so _compile_program refuses one (conftest has that cache
    # on; compile_bucket_set then compiles in workers that turn it off, as cache_dir does).
    from jaxinfer.compile import _compile_program
    from jaxinfer.runner import COMPILER_OPTIONS

    runner = abstract_runner(DUMMY_CONFIGS["tiny-llama"], EngineConfig(**ENGINE))
    program = enumerate_programs(EngineConfig(**ENGINE))[0]
    # now in the persistent cache, under the key _compile_program's own compile will look up
    runner.lower(program.bucket, program.mode).compile(compiler_options=COMPILER_OPTIONS)
    jax.clear_caches()
    with pytest.raises(CompileCacheError, match="persistent compilation cache"):
        _compile_program(runner, program)


def test_fresh_process_loads_everything_and_compiles_nothing(cache_dir):
    manifest = json.loads((cache_dir / "manifest.json").read_text())
    assert len(manifest["programs"]) == 12 + 2 * NV  # with the gather and mask programs of
    #                                                     B 1, 2
    assert all(p["compile_seconds"] > 0 and (cache_dir / p["file"]).is_file()
               for p in manifest["programs"])
    fp = manifest["fingerprint"]
    assert fp["engine"]["block_size"] == 16 and fp["software"]["jax"] == jax.__version__
    assert fp["device"]["platform"] == "cpu"

    warm = _fresh_process(cache_dir)
    assert warm["compiled"] == 0 and warm["xla_while_running"] == 0
    # prefill S=1 and S=2, decode B=1 and B=2, logits (n = 1: no copy, no penalties: no
    # history), and with the first program of each S every sampler variant of it (NV x 2)
    assert warm["loaded"] == 5 + 2 * NV
    assert warm["variants"] == ["greedy"]

    ref = LLM(MODEL, **ENGINE)
    outs = ref.generate(PROMPTS, GREEDY)
    assert warm["tokens"] == [o.outputs[0].token_ids for o in outs]
    assert warm["logits_argmax"] == np.argmax(ref.engine.prompt_logits(PROMPTS[1]), -1).tolist()


def test_eight_parameter_sets_compile_nothing_in_a_fresh_process(cache_dir):
    """Eight requests, each with its own sampling parameters, run several sampler variants
    from the compile cache: nothing is compiled, and the tokens and logprobs equal those of
    an engine that compiled its programs itself."""
    rng = np.random.default_rng(3)
    prompts = [rng.integers(2, 200, int(rng.integers(3, 12))).tolist() for _ in EIGHT]
    warm = _fresh_process(cache_dir, prompts, EIGHT)
    assert warm["compiled"] == 0 and warm["xla_while_running"] == 0
    assert len(warm["variants"]) >= 3, warm["variants"]
    ref = LLM(MODEL, **ENGINE).generate(prompts, [
        SamplingParams(max_tokens=6, ignore_eos=True, seed=i, **kw) for i, kw in enumerate(EIGHT)])
    assert warm["tokens"] == [o.outputs[0].token_ids for o in ref]
    assert warm["cumulative_logprobs"] == [o.outputs[0].cumulative_logprob for o in ref]


def test_async_scheduling_compiles_nothing_in_a_fresh_process(cache_dir):
    """With async scheduling the pipelined steps' token-gather programs come from the compile
    cache too (built without the option: it is not in the fingerprint), and the tokens equal
    the synchronous engine's."""
    warm = _fresh_process(cache_dir, engine=dict(ENGINE, async_scheduling=True))
    assert warm["compiled"] == 0 and warm["xla_while_running"] == 0
    assert warm["pipelined"] > 0
    assert warm["loaded"] > 5 + 2 * NV  # + gather programs, loaded like the others
    ref = LLM(MODEL, **ENGINE).generate(PROMPTS, GREEDY)
    assert warm["tokens"] == [o.outputs[0].token_ids for o in ref]


def test_scheduling_policy_options_are_served_by_the_strict_cache(cache_dir):
    """Prefix caching, consecutive prefills and the queue length decide which requests run
    when, never a program: they are not in the fingerprint, so the strict cache serves them
    (it used to refuse) and nothing compiles; tokens equal the default engine's."""
    warm = _fresh_process(cache_dir, engine=dict(
        ENGINE, enable_prefix_caching=False, max_consecutive_prefills=3, max_queue_len=100))
    assert warm["compiled"] == 0 and warm["xla_while_running"] == 0 and warm["loaded"] > 0
    ref = LLM(MODEL, **ENGINE).generate(PROMPTS, GREEDY)
    assert warm["tokens"] == [o.outputs[0].token_ids for o in ref]


def test_multi_step_programs_come_from_the_compile_cache(cache_dir, tmp_path):
    """`jaxinfer compile --num-scheduler-steps 4` adds the k-step programs (greedy and
    temperature, every decode bucket) to a cache of the same fingerprint, compiling only
    those; a fresh process with k = 4 runs its multi-step windows from the cache, compiling
    nothing, with the one-step engine's tokens."""
    from jaxinfer.runner_multi import MULTI_STEP, MULTI_STEP_WARM_VARIANTS, multi_step_bucket

    d = tmp_path / "k4"
    shutil.copytree(cache_dir, d)
    before = {p["file"] for p in json.loads((d / "manifest.json").read_text())["programs"]}
    assert cli.main(["compile", "--model", MODEL, *CLI_ENGINE, "--num-scheduler-steps", "4",
                     "--cache-dir", str(d), "--jobs", "1"]) == 0
    added = [p for p in json.loads((d / "manifest.json").read_text())["programs"]
             if p["file"] not in before]
    ec = EngineConfig(**ENGINE)
    want = {multi_step_bucket(p.bucket, v, 4) for p in enumerate_programs(ec, ["sample"])
            if p.bucket.kind == "decode" for v in MULTI_STEP_WARM_VARIANTS}
    assert len(want) == 2 * len(ec.decode_buckets) * len(ec.page_buckets)
    assert {p["mode"] for p in added} == {MULTI_STEP}
    assert {(p["kind"], p["num_tokens"], p["num_seqs"], p["max_pages"]) for p in added} == {
        (b.kind, b.num_tokens, b.num_seqs, b.max_pages) for b in want}

    warm = _fresh_process(d, engine=dict(ENGINE, num_scheduler_steps=4))
    assert warm["multi_steps"] > 0
    assert warm["compiled"] == 0 and warm["xla_while_running"] == 0
    ref = LLM(MODEL, **ENGINE).generate(PROMPTS, GREEDY)
    assert warm["tokens"] == [o.outputs[0].token_ids for o in ref]


@pytest.mark.parametrize("change, expect", [
    ({"block_size": 8}, "engine.block_size: 16 -> 8"),
    ({"max_num_seqs": 1}, "engine.max_num_seqs: 2 -> 1"),
    ({"dtype": "bfloat16"}, "engine.dtype"),
    ({"kv_cache_dtype": "fp8"}, "engine.kv_cache_dtype"),  # f32-KV programs never run on fp8
])
def test_changed_configuration_is_reported(cache_dir, change, expect):
    args = dict(ENGINE, **change)
    with pytest.warns(CompileCacheWarning, match=expect.replace(".", r"\.")):
        llm = LLM(MODEL, compile_cache_dir=str(cache_dir), **args)
    assert llm.engine.runner.program_store is None  # nothing stale is ever loaded
    with pytest.raises(CompileCacheError, match="built for another configuration"):
        LLM(MODEL, compile_cache_dir=str(cache_dir), compile_cache_strict=True, **args)


def test_missing_and_corrupt_caches(cache_dir, tmp_path):
    with pytest.raises(CompileCacheError, match="unusable"):
        LLM(MODEL, compile_cache_dir=str(tmp_path / "none"), compile_cache_strict=True, **ENGINE)
    bad = tmp_path / "bad"
    shutil.copytree(cache_dir, bad)
    entry = json.loads((bad / "manifest.json").read_text())["programs"][0]
    blob = bytearray((bad / entry["file"]).read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    (bad / entry["file"]).write_bytes(bytes(blob))
    llm = LLM(MODEL, compile_cache_dir=str(bad), **ENGINE)
    store: ProgramStore = llm.engine.runner.program_store
    key = next(k for k, e in store.entries.items() if e is entry or e["file"] == entry["file"])
    with pytest.warns(CompileCacheWarning, match="checksum mismatch"):
        assert store.load(*key) is None
    store.strict = True
    with pytest.raises(CompileCacheError, match="checksum mismatch"):
        store.load(*key)


def test_diff_names_each_changed_leaf():
    a = {"engine": {"block_size": 16, "dtype": "auto"}, "software": {"sources": "x" * 64}}
    b = {"engine": {"block_size": 8, "dtype": "auto"}, "software": {"sources": "y" * 64}}
    assert diff_fingerprints(a, b) == ["engine.block_size: 16 -> 8",
                                       "software.sources: (...) -> (changed)"]
    assert diff_fingerprints(a, a) == []


def test_fingerprint_names_the_kernel_choices_read_from_the_environment(monkeypatch):
    """$JAXINFER_FP8_DECODE / $JAXINFER_FP8_DECODE_GEMM pick kernels at trace time: a cache
    built under other values must not be adopted."""
    from jaxinfer.compile_cache import fingerprint

    cfg = EngineConfig(**ENGINE)
    runner = abstract_runner(DUMMY_CONFIGS["tiny-llama"], cfg)
    monkeypatch.delenv("JAXINFER_FP8_DECODE_GEMM", raising=False)
    a = fingerprint(DUMMY_CONFIGS["tiny-llama"], cfg, runner)
    monkeypatch.setenv("JAXINFER_FP8_DECODE_GEMM", "mgpu")
    b = fingerprint(DUMMY_CONFIGS["tiny-llama"], cfg, runner)
    assert diff_fingerprints(a, b) == ['env.JAXINFER_FP8_DECODE_GEMM: "triton" -> "mgpu"']
    # a variable set to its default is the same program: the same fingerprint
    monkeypatch.setenv("JAXINFER_FP8_DECODE_GEMM", "triton")
    monkeypatch.setenv("JAXINFER_DECODE_MERGE", "auto")
    monkeypatch.setenv("JAXINFER_FP8_DECODE_DEEP_K", "off")
    assert diff_fingerprints(a, fingerprint(DUMMY_CONFIGS["tiny-llama"], cfg, runner)) == []


@pytest.mark.parametrize("var,value", [("JAXINFER_FP8_DECODE", "fastest"),
                                       ("JAXINFER_FP8_DECODE_GEMM", "cublas"),
                                       ("JAXINFER_FP8_MID_GEMM", "MGPU"),
                                       ("JAXINFER_DECODE_MERGE", "atomic"),
                                       ("JAXINFER_FP8_DECODE_FUSE", "yes"),
                                       ("JAXINFER_FP8_DECODE_DEEP_K", "1"),
                                       ("JAXINFER_FP8_DECODE_TILES", "wide"),
                                       ("JAXINFER_FP8_DECODE_FAST_ACCUM", "fast"),
                                       ("JAXINFER_FP8_DECODE_ROWS_AT_64", "256")])
def test_a_bad_kernel_switch_fails_at_engine_start_on_any_backend(monkeypatch, var, value):
    """Every kernel switch is checked when an engine starts, also where no Pallas kernel
    traces (the CPU's reference attention, a bf16 model): the error names the variable and
    the values it takes; KERNEL_ENV_VARS lists exactly the switches kernel_env resolves."""
    from jaxinfer.compile_cache import KERNEL_ENV_VARS, kernel_env
    from jaxinfer.config import ConfigError

    assert set(kernel_env()) == set(KERNEL_ENV_VARS)
    monkeypatch.setenv(var, value)
    with pytest.raises(ConfigError, match=rf"\${var}={value!r}: one of"):
        LLM("dummy:tiny-llama", **ENGINE)


def test_program_sources_cover_the_runners_imports():
    code = ("import sys, jaxinfer.runner, jaxinfer.runner_multi, jaxinfer.layers.pallas_attention\n"
            "print('\\n'.join(m.__file__ for n, m in sys.modules.items()\n"
            "      if n.split('.')[0] in ('jaxinfer', 'pallas_kernels') and m.__file__))")
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, cwd=ROOT, check=True).stdout.split()
    host_only = {"jaxinfer/__init__.py", "jaxinfer/compile_cache.py"}
    for f in out:
        rel = Path(f).resolve().relative_to(ROOT).as_posix()
        assert rel in host_only or any(rel == s or rel.startswith(s + "/")
                                       for s in PROGRAM_SOURCES), rel


@pytest.mark.slow
def test_parallel_compile_writes_loadable_programs(tmp_path):
    d = tmp_path / "jobs2"
    assert cli.main(["compile", "--model", MODEL, *CLI_ENGINE, "--modes", "sample",
                     "--cache-dir", str(d), "--jobs", "2"]) == 0
    manifest = json.loads((d / "manifest.json").read_text())
    assert sorted(p["file"] for p in manifest["programs"]) == sorted(
        p.file for p in enumerate_programs(EngineConfig(**ENGINE), ["sample"]))
    warm = _fresh_process_sample_only(d)
    assert warm["compiled"] == 1  # only the logits program was not cached
    assert warm["loaded"] == 4 + 2 * NV  # + the sampler variants of S 1 and 2


def _fresh_process_sample_only(cache: Path) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    code = RUN.replace("compile_cache_strict=True", "compile_cache_strict=False")
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code, json.dumps(ENGINE),
                          json.dumps(PROMPTS), str(cache)], capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=600, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])



def test_engine_adopts_the_compile_caches_kv_pool(tmp_path):
    """The pool shape enters every program, so a cache records it and an engine started with
    the cache and no num_kv_pages runs that pool (on a GPU it would otherwise size its own
    from free memory, a different shape): here 11 pages, not the engine's own 9."""
    from jaxinfer.compile import cached_num_kv_pages

    d = tmp_path / "cache"
    assert cli.main(["compile", "--model", MODEL, *CLI_ENGINE, "--num-kv-pages", "11",
                     "--cache-dir", str(d), "--jobs", "1"]) == 0
    assert cached_num_kv_pages(d) == 11
    warm = _fresh_process(d)  # ENGINE has no num_kv_pages
    assert warm["compiled"] == 0 and warm["xla_while_running"] == 0
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "manifest.json").write_text("{not json")
    assert cached_num_kv_pages(tmp_path / "bad") is None
    assert cached_num_kv_pages(tmp_path / "missing") is None


def test_model_config_of_reads_headers_not_weights(monkeypatch):
    """``jaxinfer compile`` / ``bench roofline`` read a checkpoint's config only (a 70B HF
    directory used to be loaded in full, in float32)."""
    from jaxinfer import compile as compile_module
    from jaxinfer import loading

    tiny = Path(__file__).resolve().parents[1] / "fixtures" / "tiny"
    models = [str(tiny / family) for family in ("llama", "gemma3")]
    loaded = [loading.load_model(m, progress=False).config for m in models]

    def no_weights(*args, **kw):
        raise AssertionError("weights were loaded")

    monkeypatch.setattr(loading, "load_model", no_weights)
    assert [compile_module.model_config_of(m) for m in models] == loaded


@pytest.mark.parametrize("manifest", ['{"format": 1, "source": "x.gguf", "files": ["a"]}',
                                      "{not json"])
def test_a_cache_dir_holding_another_manifest_is_refused_untouched(tmp_path, manifest):
    """--cache-dir pointed at a converted checkpoint (or any directory with another
    manifest.json) is refused; its manifest and files stay (they used to be replaced and
    deleted)."""
    (tmp_path / "manifest.json").write_text(manifest)
    (tmp_path / "a").write_bytes(b"weights")
    with pytest.raises(CompileCacheError, match="manifest.json"):
        ProgramStore.create(tmp_path, {"model": "m"})
    assert (tmp_path / "manifest.json").read_text() == manifest
    assert (tmp_path / "a").read_bytes() == b"weights"


def test_a_non_empty_cache_dir_without_a_manifest_is_refused_untouched(tmp_path):
    """``--cache-dir ~/Documents`` used to write programs and a manifest among the user's
    files; an empty folder (or a new one) is taken."""
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(CompileCacheError, match=rf"--cache-dir {tmp_path} is not empty and "
                                                r"holds no compile cache \(manifest.json\)"):
        ProgramStore.create(tmp_path, {"model": "m"})
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]
    (tmp_path / "empty").mkdir()
    for d in (tmp_path / "empty", tmp_path / "new"):
        assert ProgramStore.create(d, {"model": "m"}).entries == {}
        assert (d / "manifest.json").is_file()
        ProgramStore.create(d, {"model": "m"})  # and reopened, now that it holds a cache


def test_a_cache_dir_that_is_a_file_is_a_clear_error(tmp_path):
    """It used to surface as "[Errno 17] File exists"."""
    f = tmp_path / "cache"
    f.write_text("not a directory")
    with pytest.raises(CompileCacheError, match=rf"--cache-dir {f} is a file, not a directory"):
        ProgramStore.create(f, {"model": "m"})
    with pytest.raises(CompileCacheError, match=r"--cache-dir .*/cache/sub cannot be created"):
        ProgramStore.create(f / "sub", {"model": "m"})
    assert f.read_text() == "not a directory"
