"""Sampling cost per decode step: the on-device sampler alone, jitted, on random logits.

    .venv/bin/python benchmarks/sampling_cost.py                 # vocab 128256, batch 1 and 256
    .venv/bin/python benchmarks/sampling_cost.py --smoke         # tiny shapes: checks it runs
    python benchmarks/sampling_cost.py --step-ms-b1 5.6 --step-ms-b256 12.0 --modes variant cond
    git show REV:jaxinfer/sampling.py > /tmp/old.py
    python benchmarks/sampling_cost.py --sampler-file /tmp/old.py   # A/B: an older sampler

Times ``jaxinfer.sampling.sample_rows`` (the engine's sampler program, which runs on the model
program's logits every sample step) for parameter mixes that take different paths: all greedy
(argmax only), temperature, top-k /
top-p, min-p, penalties (gather of [B, V] count rows), logit_bias (a full 300-entry table
per row, scattered into the logits; alone and with the penalties), bad_words (a full
128 x 16-token table per row, matched against the row's last outputs), logprobs (log-softmax and
top-20),
everything at once, and half greedy / half everything. The penalty state is donated as in the
engine. Columns, per (mode, mix, batch):

* device us: kernel time per call, from a JAX profiler trace of ``--trace-iters`` calls (the
  union of kernel intervals on the device's streams: ``benchmarks/profile_decode.py``'s
  ``summarise_trace``). This is what the sampler program adds to an engine step. XLA:CPU
  traces have no device: there the column repeats the wall time, marked ``*``.
* kernels: kernel launches per call (from the same trace).
* wall us: median of ``--iters`` standalone calls, each waited for: dispatch, the kernels, the
  host syncs of any ``lax.cond`` and the read-back; what a standalone call costs, not what the
  sampler adds to a step.
* host us: how long the call takes to return while a matmul of ``busy`` ms still runs ahead of
  it on the device. A program without host syncs returns at once; one with a ``lax.cond``
  returns only when the device reaches the cond (XLA:GPU copies the predicate to the host).
* sort/cond: sort and conditional instructions left in the compiled (optimised) program.
* % step: device us over ``--step-ms-b1`` (batch 1) or ``--step-ms-b256`` (batch 256).

Modes: ``variant`` (the program the runner runs: the batch's ``SamplerNeeds.of`` rounded up to
a variant of ``sampling.SAMPLER_VARIANTS``, named in the ``variant`` column; the mixes reach
every variant), ``host`` (``SamplerNeeds.of`` exactly, no rounding), ``cond`` (``needs=None``:
batch-wide ``lax.cond`` on the device, what the one-program step ran before the sampler got its
own programs), ``all`` (``SamplerNeeds()``: the all-True variant for every batch). None but
``cond`` has a conditional. ``--sampler-file`` times ``sample_rows`` of that file instead, called
with device-side conds as the runner called it before the split (mode ``file``).
One record per row in benchmarks/results/ (value: device us; config: the other columns).

Search configurations (``jaxinfer.sampling_filters``' and ``sampling_topk``'s tunables, set
before compiling):
``--search-pivots 3,7,15`` (thresholds per pass of a full-vocabulary search),
``--buffer-pivots 7,15`` (the same in the buffer of rows with a small top-k),
``--buffer-method search,sort,topk`` (how that buffer decides:
``sampling_filters.BUFFER_METHOD``; the pivots do not reach "sort" / "topk"), the cross
product, and ``--old`` adds the method of 76a6e80 (15 pivots, no buffer, top-20 logprobs by
TopK over the vocabulary). ``--search-impl jnp,pallas`` (``sampling_filters.SEARCH_IMPL``)
times each configuration with the jnp searches and with the Pallas kernel
(pallas_kernels/sampling, no XLA op between passes), named ``pallas`` (``pallasP`` with
``--pallas-pivots P,...``, the kernel's thresholds per pass; the jnp pivots do not reach it, so
it takes the first of each list); "auto" is the kernel on a GPU, jnp elsewhere. A case whose
compiled program is the same as one already timed (the tunable does not reach that mix) is not
timed again. ``--draw-method threefry,hash`` (``sampling.DRAW_METHOD``: the Gumbel noise) and
``--select-method topk,sort`` (``sampling_topk.SELECT_METHOD``: how chunks and the top-20
logprobs are ranked) and ``--nucleus-floor 0,1`` (``sampling_filters.NUCLEUS_FLOOR``: the
nucleus search starts at a floor known to pass) and ``--compact`` (``threshold_search.COMPACT``:
the nucleus kernel finishes on a copy of its bracket) add to the cross product.
``--breakdown MIX:B ...`` prints, for those cases, the device time per kernel name
(``profile_decode.format_summary`` of the same trace) and stores it in their records. A table
of device us per configuration is printed last.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import record  # noqa: E402
from benchmarks.profile_decode import format_summary, load_trace, summarise_trace  # noqa: E402

ALL = dict(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.1,
           presence_penalty=0.2, frequency_penalty=0.1, want_logprobs=True)
MIXES: dict[str, dict] = {
    "greedy": {},
    "temperature": dict(temperature=0.8),
    "top_k_top_p": dict(temperature=0.8, top_k=50, top_p=0.9),
    "top_p": dict(temperature=0.8, top_p=0.9),
    "min_p": dict(temperature=0.8, min_p=0.05),
    "penalties": dict(repetition_penalty=1.1, presence_penalty=0.2, frequency_penalty=0.1),
    # logit_bias: every row's slot holds a full table (300 ids; sampling_penalties.LogitBias)
    "logit_bias": dict(has_bias=True),
    "penalties_logit_bias": dict(repetition_penalty=1.1, presence_penalty=0.2,
                                 frequency_penalty=0.1, has_bias=True),
    # bad_words: every row's slot holds a full bad-words table (128 sequences of 16 tokens,
    # sampling_bad_words) beside an empty logit_bias one
    "bad_words": dict(has_bias=True, bad_words=True),
    "logprobs": dict(want_logprobs=True),
    "all": ALL,
    "half_greedy_half_all": {k: ("half", v) for k, v in ALL.items()},
}
MODES = ("variant", "host", "cond", "all")


def params(B: int, mix: dict):
    from jaxinfer.batch import SamplingArrays

    sa = SamplingArrays.neutral(B)
    sa.seeds[:] = np.stack([np.arange(B), np.zeros(B)], 1)
    sa.slots[:] = np.arange(B)
    for name, v in mix.items():
        if name == "bad_words":  # a table, not a SamplingArrays field (Case fills it)
            continue
        arr = getattr(sa, name)
        if isinstance(v, tuple):  # ("half", value): the odd rows only
            arr[1::2] = v[1]
        else:
            arr[:] = v
    return sa


def load_sampler(path: Path | None):
    """``sample_rows`` of jaxinfer.sampling, or of the Python file at ``path``."""
    if path is None:
        from jaxinfer.sampling import sample_rows

        return sample_rows
    spec = importlib.util.spec_from_file_location("sampler_under_test", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.sample_rows


class Case:
    """One compiled sampler with its inputs: ``calls`` distinct sample indices, prepared.

    Compiled programs are shared between cases with the same (mode, needs, batch) through
    ``cache`` (mode cond is one program per batch whatever the mix).
    """

    def __init__(self, sampler, mode: str, B: int, V: int, mix: dict, dtype: str, calls: int,
                 cache: dict, config: tuple = ()):
        import jax
        import jax.numpy as jnp

        from jaxinfer.batch import SamplingArrays
        from jaxinfer.sampling import SAMPLER_VARIANTS, SamplerNeeds, sampler_variant

        rng = np.random.default_rng(0)
        self.logits = jnp.asarray(rng.standard_normal((B, V)) * 3, dtype)
        host = params(B, mix)
        self.variant = sampler_variant(host, V)
        needs = {"variant": SAMPLER_VARIANTS[self.variant], "host": SamplerNeeds.of(host, V),
                 "all": SamplerNeeds()}.get(mode)
        self.sas = [SamplingArrays(*map(jnp.asarray, host._replace(
            sample_index=host.sample_index + i))) for i in range(calls)]
        self.counts = jnp.zeros((B + 1, V), jnp.int32).at[:B, : V // 8].set(1)  # history
        # A fresh callable per case: jit's trace cache would not see the tunables. Programs
        # are compiled once per lowered text (a tunable that does not reach a mix adds none).
        kw = {} if needs is None else {"needs": needs}
        if "has_bias" in mix:  # (an older --sampler-file has no bias argument)
            from jaxinfer.sampling_params import MAX_LOGIT_BIAS
            from jaxinfer.sampling_penalties import LogitBias

            bias = LogitBias.zeros(B + 1)
            if mix.get("bad_words"):
                kw["bias"] = bias._replace(
                    bad_ids=jnp.asarray(rng.integers(0, V, bias.bad_ids.shape), jnp.int32),
                    recent=jnp.asarray(rng.integers(0, V, bias.recent.shape), jnp.int32))
            else:
                ids = np.stack([rng.choice(V, MAX_LOGIT_BIAS, replace=False)
                                for _ in range(B + 1)])
                kw["bias"] = bias._replace(
                    ids=jnp.asarray(ids, jnp.int32),
                    values=jnp.asarray(rng.uniform(-5, 5, (B + 1, MAX_LOGIT_BIAS)),
                                       jnp.float32))
        # The tables are an argument, donated as in the engine's sampler program when the
        # sampler returns them (an older --sampler-file returns (out, counts) only).
        bias = kw.pop("bias", None)
        self.tables = {} if bias is None else {"bias": bias}
        fn = functools.partial(sampler, **kw)
        args = (self.logits, self.sas[0], self.counts)
        returns_bias = bool(self.tables) and len(jax.eval_shape(fn, *args, **self.tables)) > 2
        lowered = jax.jit(fn, donate_argnames=("counts",) + ("bias",) * returns_bias).lower(
            *args, **self.tables)
        key = (mode, B, hash(lowered.as_text()))
        if key not in cache:
            exe = lowered.compile()
            hlo = exe.as_text()
            cache[key] = (exe, len(re.findall(r"\bsort\(", hlo)),
                          len(re.findall(r"\bconditional\(", hlo)), hash(hlo))
        self.exe, self.sorts, self.conds, self.hlo_hash = cache[key]

    def call(self, i: int):
        out, self.counts, *rest = self.exe(self.logits, self.sas[i % len(self.sas)],
                                           self.counts, **self.tables)
        if rest and rest[0] is not None:  # donated: the next call takes the returned tables
            self.tables = {"bias": rest[0]}
        return out


def busy_op():
    """(jitted matmul chain, its input, its seconds): work queued ahead of the sampler."""
    import jax
    import jax.numpy as jnp

    n, dt = (8192, jnp.bfloat16) if jax.default_backend() == "gpu" else (640, jnp.float32)
    a = jnp.full((n, n), 1e-3, dt)
    f = jax.jit(lambda a: (a @ a) @ a)
    jax.block_until_ready(f(a))
    t0 = time.perf_counter()
    jax.block_until_ready(f(a))
    return f, a, time.perf_counter() - t0


def measure(case: Case, iters: int, trace_iters: int, busy) -> dict:
    """Wall, host-return, device and kernel figures of one case (microseconds)."""
    import jax

    for i in range(3):
        jax.block_until_ready(case.call(i))
    wall = []
    for i in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(case.call(i))
        wall.append(time.perf_counter() - t0)
    f, a, _ = busy
    ret = []
    for i in range(3):
        r = f(a)  # queued on the device ahead of the sampler
        t0 = time.perf_counter()
        out = case.call(i)
        ret.append(time.perf_counter() - t0)
        jax.block_until_ready((r, out))
    d = tempfile.mkdtemp(prefix="sampling_trace_")
    with jax.profiler.trace(d, create_perfetto_trace=True):
        for i in range(trace_iters):
            out = case.call(i)
        jax.block_until_ready(out)
    res = {"wall_us": 1e6 * float(np.median(wall)), "host_us": 1e6 * float(np.median(ret)),
           "sorts": case.sorts, "conds": case.conds}
    try:
        s = summarise_trace(load_trace(d), trace_iters)
        res.update(device_us=s["busy_us_per_step"], device_measured=True,
                   kernels=sum(k[3] for k in s["kernels"]), summary=s)
    except (ValueError, FileNotFoundError):  # XLA:CPU: no device in the trace
        res.update(device_us=res["wall_us"], device_measured=False, kernels=None, summary=None)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return res


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def search_configs(a) -> list[dict]:
    """The sampler tunables to time, one dict each (``name`` + module values)."""
    import jax

    from jaxinfer import sampling
    from jaxinfer import sampling_filters as sf
    from jaxinfer import sampling_topk as topk

    # Unset tunables take the module's value (the engine's configuration); a name is tagged
    # with a tunable only where it differs from that.
    methods = [m for m in (a.buffer_method or sf.BUFFER_METHOD).split(",") if m]
    for m in methods:
        if m not in sf.BUFFER_METHODS:
            raise SystemExit(f"--buffer-method {m!r}: one of {sf.BUFFER_METHODS}")
    impls = [m for m in (a.search_impl or sf.SEARCH_IMPL).split(",") if m]
    for m in impls:
        if m not in sf.SEARCH_IMPLS:
            raise SystemExit(f"--search-impl {m!r}: one of {sf.SEARCH_IMPLS}")
    tag = methods != [sf.BUFFER_METHOD]  # names stay p7/b15 / pallas for the default
    search_pivots, buffer_pivots = _ints(a.search_pivots), _ints(a.buffer_pivots)
    pallas_pivots = [p or None for p in _ints(a.pallas_pivots or "0")]  # 0: kernel default
    gpu = jax.default_backend() == "gpu"
    configs = []
    for impl in impls:
        base = dict(BUFFER_TOP_K=topk.TOPK_STAGED, CHUNKED_TOP_VALUES=True, SEARCH_IMPL=impl)
        if impl == "pallas" or (impl == "auto" and gpu):  # the kernel: no jnp pivots
            configs += [dict(name=f"pallas{pp or ''}" + (f"/{m}" if tag else ""),
                             PIVOTS=search_pivots[0], BUFFER_PIVOTS=buffer_pivots[0],
                             BUFFER_METHOD=m, PALLAS_PIVOTS=pp, **base)
                        for m in methods for pp in pallas_pivots]
            continue
        configs += [dict(name=f"p{p}/b{b}" + (f"/{m}" if tag else ""), PIVOTS=p,
                         BUFFER_PIVOTS=b, BUFFER_METHOD=m, PALLAS_PIVOTS=None, **base)
                    for m in methods for p in search_pivots
                    for b in (buffer_pivots if m == "search" else buffer_pivots[:1])]
    draws = (a.draw_method or sampling.DRAW_METHOD).split(",")
    selects = (a.select_method or topk.SELECT_METHOD).split(",")
    for m in draws:
        if m not in sampling.DRAW_METHODS:
            raise SystemExit(f"--draw-method {m!r}: one of {sampling.DRAW_METHODS}")
    for m in selects:
        if m not in topk.SELECT_METHODS:
            raise SystemExit(f"--select-method {m!r}: one of {topk.SELECT_METHODS}")
    floors = ([bool(int(v)) for v in a.nucleus_floor.split(",")] if a.nucleus_floor
              else [sf.NUCLEUS_FLOOR])
    chunks = _ints(a.reduce_chunks) if a.reduce_chunks else [sampling.REDUCE_CHUNKS]
    configs = [dict(c, name=c["name"] + (f"/{d}" if draws != [sampling.DRAW_METHOD] else "")
                    + (f"/{m}" if selects != [topk.SELECT_METHOD] else "")
                    + (f"/floor{int(f)}" if floors != [sf.NUCLEUS_FLOOR] else "")
                    + (f"/rc{r}" if chunks != [sampling.REDUCE_CHUNKS] else ""),
                    DRAW_METHOD=d, SELECT_METHOD=m, NUCLEUS_FLOOR=f, REDUCE_CHUNKS=r)
               for c in configs for d in draws for m in selects for f in floors
               for r in chunks]
    if a.compact:  # pallas_kernels.sampling.threshold_search.COMPACT (the kernel's bracket copy)
        configs = [dict(c, name=c["name"] + f"/c{n}", COMPACT=n)
                   for c in configs for n in _ints(a.compact)]
    if a.old:
        configs.append(dict(name="old", PIVOTS=15, BUFFER_PIVOTS=15, BUFFER_TOP_K=0,
                            CHUNKED_TOP_VALUES=False, BUFFER_METHOD="search",
                            SEARCH_IMPL="jnp", PALLAS_PIVOTS=None, DRAW_METHOD="threefry",
                            SELECT_METHOD="topk", NUCLEUS_FLOOR=False, REDUCE_CHUNKS=0))
    if a.configs:  # keep the named ones (a cross product is more than a run needs)
        configs = [c for c in configs if c["name"].endswith(tuple(a.configs.split(",")))]
    return configs


# The tunables timed as a cross product: (flag, module value it sets, its values).
_TUNABLE_FLAGS = (
    ("--buffer-method", "sampling_filters.BUFFER_METHOD", "search (threshold search), sort "
     "(one sort of the buffer), topk (TOPK_FAST-sized top_k stages over the buffer)"),
    ("--search-impl", "sampling_filters.SEARCH_IMPL",
     "jnp, pallas (the Pallas kernel; interpreted off a GPU), auto"),
    ("--draw-method", "sampling.DRAW_METHOD", "threefry, hash"),
    ("--select-method", "sampling_topk.SELECT_METHOD", "topk, sort"),
    ("--nucleus-floor", "sampling_filters.NUCLEUS_FLOOR", "0, 1"),
    ("--reduce-chunks", "sampling.REDUCE_CHUNKS",
     "0 (one-stage row reductions), e.g. 128 (two stages, jaxinfer.row_reduce)"),
    ("--compact", "threshold_search.COMPACT",
     "0 (the nucleus kernel reads the row every pass), 1 (it finishes on a copy of its "
     "bracket)"),
)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 256])
    ap.add_argument("--mixes", nargs="+", default=list(MIXES), choices=list(MIXES))
    ap.add_argument("--modes", nargs="+", default=None, choices=MODES,
                    help="default: variant (with --sampler-file: file, its device-side conds)")
    ap.add_argument("--sampler-file", type=Path, default=None,
                    help="time sample_rows from this file (mode 'file', or 'file-<mode>' for "
                         "each --modes given) instead of ours")
    ap.add_argument("--iters", type=int, default=20, help="wall-time calls per case")
    ap.add_argument("--trace-iters", type=int, default=10, help="profiled calls per case")
    ap.add_argument("--step-ms-b1", type=float, default=5.6,
                    help="8B decode step at batch 1 (ms), for the %% column")
    ap.add_argument("--step-ms-b256", type=float, default=12.0,
                    help="8B decode step at batch 256 (ms), for the %% column")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="logits dtype (the sampler computes in float32)")
    ap.add_argument("--smoke", action="store_true",
                    help="vocab 2048, batches 1 and 8, 3 iterations; no records written")
    ap.add_argument("--out", type=Path, default=None, help="results directory")
    ap.add_argument("--search-pivots", default=None,
                    help="comma list: thresholds per pass of the full-vocabulary search "
                         "(default: sampling_filters.PIVOTS)")
    ap.add_argument("--buffer-pivots", default=None,
                    help="comma list: thresholds per pass in the small-top-k buffer "
                         "(default: sampling_filters.BUFFER_PIVOTS)")
    for flag, name, values in _TUNABLE_FLAGS:
        ap.add_argument(flag, default=None, help=f"comma list of {name} values to time: "
                                                 f"{values} (default: the module's)")
    ap.add_argument("--pallas-pivots", default=None,
                    help="comma list: the kernel's thresholds per pass (0, the default: its "
                         "default_pivots by batch)")
    ap.add_argument("--configs", default=None,
                    help="comma list: time only the configurations of the cross product whose "
                         "names end so (e.g. threefry/topk,hash/sort)")
    ap.add_argument("--breakdown", nargs="*", default=[],
                    help="MIX:B cases whose device time per kernel is printed and recorded")
    ap.add_argument("--deadline-s", type=float, default=None,
                    help="stop starting cases after this many seconds (the table still prints)")
    ap.add_argument("--old", action="store_true",
                    help="also time the method of 76a6e80 (15 pivots, no buffer, full TopK)")
    a = ap.parse_args()
    if a.smoke:
        a.vocab, a.batches, a.iters, a.trace_iters = 2048, [1, 8], 3, 2
    import jax

    from jaxinfer import sampling
    from jaxinfer import sampling_filters as sf
    from jaxinfer import sampling_topk as topk
    from pallas_kernels.sampling import threshold_search

    a.search_pivots = a.search_pivots or str(sf.PIVOTS)
    a.buffer_pivots = a.buffer_pivots or str(sf.BUFFER_PIVOTS)
    configs = search_configs(a)
    sampler = load_sampler(a.sampler_file)
    # --sampler-file: mode "file" (device-side conds), or "file-<mode>" for each --modes
    # given (its programs chosen as that mode's: an A/B against the same modes of ours).
    modes = (a.modes or ["variant"]) if not a.sampler_file else (
        [f"file-{m}" for m in a.modes] if a.modes else ["file"])
    step_ms = {1: a.step_ms_b1, 256: a.step_ms_b256}
    busy = busy_op()
    print(f"device {jax.devices()[0].device_kind} ({jax.default_backend()}), vocab {a.vocab}, "
          f"logits {a.dtype}, busy {busy[2] * 1e3:.1f} ms"
          + (f", sampler {a.sampler_file}" if a.sampler_file else ""))
    print(f"{'mode':7} {'mix':21} {'variant':16} {'B':>4} {'device us':>10} {'kernels':>7} "
          f"{'wall us':>9} {'host us':>9} {'sort/cond':>9} {'% step':>7} config")
    cpu_note, cache, timed, table, breakdowns = False, {}, {}, {}, []
    t_start = time.perf_counter()
    for name, B, cfg, mode in ((n, b, c, m) for n in a.mixes for b in a.batches
                               for c in configs for m in modes):  # a case's configs together
        if a.deadline_s and time.perf_counter() - t_start > a.deadline_s:
            print(f"deadline {a.deadline_s:.0f} s reached: remaining cases skipped", flush=True)
            break
        for k, v in cfg.items():
            if k == "name":
                continue
            mod = (sampling if k in ("DRAW_METHOD", "REDUCE_CHUNKS")
                   else threshold_search if k == "COMPACT"
                   else topk if k in ("SELECT_METHOD", "CHUNKED_TOP_VALUES") else sf)
            if not hasattr(mod, k):  # set on the module that reads it, never on a copy
                raise SystemExit(f"{k} is not a tunable of {mod.__name__}")
            setattr(mod, k, v)
            if mod is sampling and k in sampler.__globals__:  # a --sampler-file's own copy
                sampler.__globals__[k] = v
        case = Case(sampler, "cond" if mode == "file" else mode.removeprefix("file-"), B, a.vocab,
                    MIXES[name], a.dtype, max(a.iters, a.trace_iters), cache,
                    tuple(sorted(cfg.items())))
        same = (mode, name, B, case.hlo_hash)
        if same not in timed:  # a tunable that does not reach this program
            timed[same] = measure(case, a.iters, a.trace_iters, busy)
        r = timed[same]
        table.setdefault((mode, name, B), {})[cfg["name"]] = r["device_us"]
        pct = (100 * r["device_us"] / (1e3 * step_ms[B])) if B in step_ms else None
        cpu_note |= not r["device_measured"]
        detail = f"{name}:{B}" in a.breakdown and r["summary"] is not None
        if detail:
            breakdowns.append(format_summary(f"{mode} {name} B={B} {cfg['name']}",
                                             r["summary"], r["wall_us"] / 1e3, top=15))
        print(f"{mode:7} {name:21} {case.variant:16} {B:>4} {r['device_us']:>9.1f}"
              f"{' ' if r['device_measured'] else '*'} "
              f"{'-' if r['kernels'] is None else str(round(r['kernels'])):>7} "
              f"{r['wall_us']:>9.1f} {r['host_us']:>9.1f} "
              f"{str(r['sorts']) + '/' + str(r['conds']):>9} "
              f"{'-' if pct is None else f'{pct:.1f}':>7} {cfg['name']}", flush=True)
        if not a.smoke:
            tag = "" if len(configs) == 1 else "_" + cfg["name"].replace("/", "")
            record(f"sampling_cost_{mode}_{name}_b{B}{tag}", r["device_us"], "us",
                   {"vocab": a.vocab, "batch": B, "mode": mode,
                    "variant": case.variant, "mix": MIXES[name] and
                    {k: str(v) for k, v in MIXES[name].items()}, "iters": a.iters,
                    "trace_iters": a.trace_iters, "logits_dtype": a.dtype,
                    "sampler_file": a.sampler_file and str(a.sampler_file),
                    "busy_ms": busy[2] * 1e3, "pct_of_step": pct,
                    "load_avg_1min": os.getloadavg()[0], "search_config": cfg,
                    "step_ms": step_ms.get(B), **{k: v for k, v in r.items() if k != "summary"},
                    "kernel_breakdown": r["summary"]["kernels"] if detail else None},
                   out_dir=a.out)
    if cpu_note:
        print("* no device in the trace (XLA:CPU): device us repeats the wall time")
    print(f"{len(cache)} programs compiled, {time.perf_counter() - t_start:.0f} s")
    for text in breakdowns:  # per-kernel device time (wall column: a standalone call)
        print("\n" + text)
    names = [c["name"] for c in configs]
    print(f"\ndevice us per call{' (* wall: no device trace)' if cpu_note else ''}")
    print("| mode | mix | B | " + " | ".join(names) + " |")
    print("|---|---|---:|" + "---:|" * len(names))
    for (mode, name, B), row in table.items():
        print(f"| {mode} | {name} | {B} | " + " | ".join(
            f"{row[n]:,.1f}" if n in row else "-" for n in names) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
