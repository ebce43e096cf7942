"""Multi-step decode programs (``EngineConfig.num_scheduler_steps``): k decode steps of the
runner's model and sampler in one compiled program (the plan: multi_step.py).

Each step runs the model on the rows' input tokens, samples the rows' logits with the
sampler variant the host picked for the batch (``sampling.sampler_variant``, static, as the
one-step sampler programs), and feeds the sampled tokens to the next step; positions, KV
slots (``block_tables[row, pos // page] * page + pos % page``), sequence lengths and the
sampling index advance on the device. A decode bucket's token i is row i. Padding rows
(null pages, length 0) advance too and write into the null page, as padding always does.
The loop is ``lax.fori_loop`` with a static trip count, so XLA:GPU needs no host round trip
per step. The design was measured first by benchmarks/multistep_decode.py (8B FP8, batch 1,
H200: 3.31 ms a token with k = 16 when each call is waited for, vs 4.13 for the engine's
step then; records ``multistep_decode_h200_s12-20261202.json``).

Programs are keyed by (decode bucket, sampler variant, k). In a compile cache they are
programs of mode :data:`MULTI_STEP` whose bucket is :func:`multi_step_bucket`'s (the decode
bucket's shape, kind ``"<variant>.k<k>"``): ``jaxinfer compile --num-scheduler-steps k``
builds those of :func:`warm_variants` for every decode bucket and page bucket
(compile.enumerate_programs), a start with that cache loads them, and any other program
compiles at its first use.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import sys
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxinfer.batch import Bucket, SamplingArrays, StepInputs
from jaxinfer.compile_cache import KeyLocks
from jaxinfer.runner import ModelRunner, _metadata
from jaxinfer.sampling import SAMPLER_VARIANTS, SamplerNeeds, sample_rows, sampler_variant

log = logging.getLogger(__name__)

MULTI_STEP = "multistep"  # the programs' mode in a compile cache (compile_cache.Program)

# The sampler variants whose k-step programs `jaxinfer compile` and the server's warm-up
# build (with the model's default one: warm_variants): greedy requests and the OpenAI-style
# default (temperature only); other top-k / top-p / penalty batches build theirs at their
# first window: in the background while their windows run as one step when the one-step
# programs are built (engine_multi.py), else then.
MULTI_STEP_WARM_VARIANTS = ("greedy", "temperature")


def warm_variants(sampling_defaults: dict[str, Any], vocab_size: int) -> tuple[str, ...]:
    """:data:`MULTI_STEP_WARM_VARIANTS` and the variant of a batch of requests that set no
    sampling params (the model's generation-config defaults, jaxinfer.sampling_defaults:
    Llama 3.x Instruct's temperature 0.6 / top_p 0.9 is ``"top_p"``), so that `jaxinfer
    compile` and the warm-up build the k-step program those requests run."""
    from types import SimpleNamespace

    from jaxinfer.batch import _fill_row
    from jaxinfer.sampling_defaults import default_sampling_params

    sa = SamplingArrays.neutral(1)
    row = SimpleNamespace(sampling_params=default_sampling_params(sampling_defaults),
                          num_prompt_tokens=1)
    _fill_row(sa, 0, row, 1, 0, 0)  # as the engine fills a decode row (input_batch.py)
    return tuple(dict.fromkeys((*MULTI_STEP_WARM_VARIANTS,
                                sampler_variant(sa, vocab_size))))


# Python's switch interval while a k-step program builds on a background thread (the default
# is 5 ms). The build traces in Python and keeps the GIL until another thread asks for it
# and the interval runs out, so every call of the engine's step that releases the GIL (a
# launch, a device wait) then waits up to an interval to get it back: on an H100 the 8B FP8
# one-step windows beside a build took 80-1,400 ms instead of 6 (benchmarks/RESULTS.md
# "Multi-step decode: a new sampler variant after the warm-up"); a step that gives the GIL
# up 50 times beside a busy thread takes 265 ms at 5 ms, 40-45 ms at 0.5 ms (CPU,
# benchmarks/gil_handback.py). On the H100 (session 42, benchmarks/variant_stall.py, 4
# rounds) the longest window fell from 797-1,239 ms to 81-145 ms at 0.5 ms, the windows
# beside the tracing taking ~30 ms each, with no measurable cost to the build or the steps.
BACKGROUND_SWITCH_INTERVAL_S = 0.0005


def multi_step_bucket(bucket: Bucket, variant: str, k: int) -> Bucket:
    """The compile-cache bucket of the ``k``-step program of decode ``bucket`` sampling with
    ``variant``: the same shape, kind ``"<variant>.k<k>"``.

    Raises:
      ValueError: ``bucket`` is not a decode bucket, ``variant`` is unknown or ``k`` < 2.
    """
    if bucket.kind != "decode" or variant not in SAMPLER_VARIANTS or k < 2:
        raise ValueError(f"no multi-step program for {bucket}, variant {variant!r}, k={k}: "
                         f"needs a decode bucket, one of {sorted(SAMPLER_VARIANTS)} and k >= 2")
    return Bucket(f"{variant}.k{k}", bucket.num_tokens, bucket.num_seqs, bucket.max_pages)


def split_multi_step_bucket(bucket: Bucket) -> tuple[Bucket, str, int]:
    """Inverse of :func:`multi_step_bucket`: (decode bucket, variant, k).

    Raises:
      ValueError: ``bucket`` is not a multi-step program's bucket.
    """
    variant, _, k = bucket.kind.rpartition(".k")
    if variant not in SAMPLER_VARIANTS or not k.isdigit() or int(k) < 2:
        raise ValueError(f"{bucket} is not a multi-step program's bucket")
    return Bucket("decode", bucket.num_tokens, bucket.num_seqs, bucket.max_pages), variant, int(k)


def _multi_step(weights, cache, counts, bias, token_ids, md, *sa, graphdef, tree, attention,
                page_size: int, needs: SamplerNeeds, k: int):
    """k decode steps: -> ((tokens [k, S] int32, the last step's [S]), cache, counts, bias);
    see the module docstring."""
    model = nnx.merge(graphdef, jax.tree.unflatten(tree, weights))
    sa = SamplingArrays(*sa)
    rows = jnp.arange(token_ids.shape[0])

    def body(i, carry):
        cache, counts, bias, toks, md, index, out = carry
        hidden, cache = model(toks, cache, md, attention)
        so, counts, bias = sample_rows(model.logits(hidden[md.logits_indices]),
                                       sa._replace(sample_index=index), counts, needs, bias)
        pos = md.positions + 1
        md = dataclasses.replace(
            md, positions=pos, seq_lens=md.seq_lens + 1,
            slot_mapping=md.block_tables[rows, pos // page_size] * page_size + pos % page_size)
        return cache, counts, bias, so.tokens, md, index + 1, out.at[i].set(so.tokens)

    out = jnp.zeros((k, token_ids.shape[0]), jnp.int32)
    cache, counts, bias, last, _, _, out = jax.lax.fori_loop(
        0, k, body, (cache, counts, bias, token_ids, md, sa.sample_index, out))
    return (out, last), cache, counts, bias


class MultiStepPrograms:
    """The k-step programs of one ``ModelRunner`` (its weights, KV pool and penalty state)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self._programs: dict[tuple[Bucket, str, int], Any] = {}
        self._build_locks = KeyLocks()
        self._background: tuple[tuple[Bucket, str, int], threading.Thread] | None = None
        self._background_lock = threading.Lock()
        self.failed: dict[tuple[Bucket, str, int], BaseException] = {}  # background builds

    def variant(self, inputs: StepInputs) -> str:
        """The sampler variant a window of ``inputs`` runs (``sampling.sampler_variant``)."""
        return sampler_variant(inputs.sampling, self.runner.model_config.vocab_size)

    def ready(self, bucket: Bucket, variant: str, k: int) -> bool:
        """Whether the program is built (a window would build nothing)."""
        return (bucket, variant, k) in self._programs

    def building(self, bucket: Bucket, variant: str, k: int) -> bool:
        """Whether the background thread is building this program now."""
        bg = self._background
        return bg is not None and bg[0] == (bucket, variant, k) and bg[1].is_alive()

    def build_in_background(self, bucket: Bucket, variant: str, k: int) -> bool:
        """Start building the program on a background thread, one program at a time (so
        that exiting waits for one build at most; another key asks again at its next window).
        Returns whether this key is building now. A failed build is logged, kept in
        ``failed`` and not tried again (its windows run as one step)."""
        key = (bucket, variant, k)
        with self._background_lock:
            if self._background is not None and self._background[1].is_alive():
                return self._background[0] == key
            if key in self._programs or key in self.failed:
                return False
            thread = threading.Thread(target=self._build_logged, args=key, daemon=False,
                                      name=f"jaxinfer-{k}-step-{variant}-S{bucket.num_seqs}")
            self._background = (key, thread)
            thread.start()
            return True

    def _build_logged(self, bucket: Bucket, variant: str, k: int) -> None:
        before = sys.getswitchinterval()
        short = min(before, BACKGROUND_SWITCH_INTERVAL_S)
        sys.setswitchinterval(short)  # see BACKGROUND_SWITCH_INTERVAL_S
        try:
            self.executable(bucket, variant, k)
        except Exception as e:  # out of device memory, say: the windows stay one-step
            self.failed[bucket, variant, k] = e
            log.error("building the %d-step decode program %s (%s) in the background failed; "
                      "its windows run as one step: %s", k, bucket, variant, e)
        finally:
            if sys.getswitchinterval() == short:  # unless someone else changed it since
                sys.setswitchinterval(before)

    def wait_background(self, timeout: float | None = None) -> None:
        """Wait for the background build, if one runs (tests, shutdown)."""
        bg = self._background
        if bg is not None:
            bg[1].join(timeout)

    def lower(self, bucket: Bucket, variant: str, k: int) -> jax.stages.Lowered:
        """Trace and lower the ``k``-step program of decode ``bucket`` with ``variant`` from
        abstract shapes (works on an abstract runner: ``jaxinfer compile``)."""
        r = self.runner
        fn = jax.jit(functools.partial(
            _multi_step, graphdef=r.graphdef, tree=r.weights_tree, attention=r.attention,
            page_size=r.page_size, needs=SAMPLER_VARIANTS[variant], k=k),
            donate_argnums=(1, 2, 3))
        weights, cache, token_ids, md = r.abstract_args(bucket)
        sds = jax.ShapeDtypeStruct
        sa = [sds(a.shape, a.dtype) for a in SamplingArrays.neutral(bucket.num_seqs)]
        counts = sds(r.counts.shape, r.counts.dtype)
        bias = jax.tree.map(lambda a: sds(a.shape, a.dtype), r.logit_bias)
        return fn.lower(weights, cache, counts, bias, token_ids, md, *sa)

    def executable(self, bucket: Bucket, variant: str, k: int) -> Any:
        """The program of ``k`` steps of decode ``bucket`` sampling with ``variant``: loaded
        from the runner's compile cache (``program_store``) if it holds it, else compiled now
        (counted in the runner's ``num_compilations``); once per key."""
        exe = self._programs.get((bucket, variant, k))  # every window: no lock, no closure
        return exe if exe is not None else self._build_locks.get_or_build(
            self._programs, (bucket, variant, k), lambda: self.runner.load_or_compile(
                MULTI_STEP, multi_step_bucket(bucket, variant, k),
                lambda: self.lower(bucket, variant, k), stored=False,
                what=f"{k}-step decode {bucket} ({variant})"))

    def launch(self, inputs: StepInputs, k: int,
               token_ids: Any = None) -> tuple[jax.Array, jax.Array]:
        """Dispatch ``k`` decode steps from ``inputs`` (a decode step whose block tables hold
        the pages of all k tokens of every row) without waiting.

        Args:
          token_ids: [S] int32 on the device to feed instead of ``inputs.token_ids`` (a
            pipelined window: the tokens the window in flight samples last, gathered by
            ``ModelRunner.gather_tokens``).
        Returns:
          (tokens [k, S] int32: row i of step j, padding rows garbage; the last step's [S],
          to feed a pipelined window), on the device.
        Raises:
          ValueError: some row asks for logprobs (the program returns tokens only).
        """
        if bool(np.asarray(inputs.sampling.want_logprobs).any()):
            raise ValueError("multi-step decode returns no logprobs; run such rows one step "
                             "at a time")
        r = self.runner
        exe = self.executable(inputs.bucket, self.variant(inputs), k)
        out, r.cache, r.counts, r.logit_bias = exe(
            r.weights, r.cache, r.counts, r.logit_bias,
            inputs.token_ids if token_ids is None else token_ids, _metadata(inputs),
            *inputs.sampling)
        return out

    def run(self, inputs: StepInputs, k: int) -> np.ndarray:
        """:meth:`launch`, waited for: [k, S] int32 tokens on the host."""
        return np.asarray(self.launch(inputs, k)[0])
