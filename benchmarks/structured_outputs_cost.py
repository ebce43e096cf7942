"""What structured outputs cost a decode step (jaxinfer/structured_outputs.py).

    PYTHONPATH=. .venv/bin/python benchmarks/structured_outputs_cost.py            # CPU
    PYTHONPATH=. python3 benchmarks/structured_outputs_cost.py --parts program     # GPU

Three parts, each a JSON record under ``--out`` (default benchmarks/results/):

* ``mask``: llguidance's ``fill_next_token_bitmask`` for one row, µs (median over the
  positions of a JSON document fed token by token), with the real tokenizers of SmolLM2
  (49,152 tokens) and Gemma 3 (262,144); host only.
* ``program``: the compiled ``load_allowed_masks`` program that writes R rows' masks into
  the penalty state, µs a call (median of waited calls, arguments from the host as the
  engine passes them), R = 1, 8, 64, at both vocabularies, on the default backend.
* ``engine``: SmolLM2-135M-Instruct (``--model``; a ``dummy:`` model with
  ``--tokenizer-dir``), ``--rows`` greedy rows of ``--max-tokens`` tokens (EOS ignored):
  ms a token after the first (TPOT) with every row held to a regex vs the same rows
  without, engine defaults plus ``--engine-args`` (the structured batch runs one step a
  program, unpipelined), and the time of the two structured-output calls in a step call;
  the regex run twice: masks overlapping the model program (the engine's order) and
  loaded before it (the order before session 43's change).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from jaxinfer.bench.records import record

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "tags", "n"],
          "properties": {"name": {"type": "string"}, "n": {"type": "integer"},
                         "tags": {"type": "array", "items": {"type": "string"}}}}
# (llguidance keeps the properties in the schema's order)
DOC = json.dumps({"name": "Felicia the cat", "n": 12, "tags": ["small", "grey", "curious"]},
                 separators=(",", ":"))


def _median_us(fn, iters: int) -> float:
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


TEXT = "the quick brown fox jumps over the lazy dog, and then it sleeps."
FREE = "[a-z ,.]{1,400}"  # free text: most tokens fit, the costliest masks


class _Seq:  # what GrammarMatchers reads of a sequence
    def __init__(self, key, outputs):
        from jaxinfer.sampling_params import SamplingParams

        self.seq_id, self.key, self.output_token_ids = 0, key, list(outputs)
        self.sampling_params = SamplingParams()


def _tokenizer(source: str):
    """(vocab size, Tokenizer) of a model name, or of a directory ``Tokenizer.save`` wrote."""
    if Path(source).is_dir():
        from jaxinfer.tokenizer import Tokenizer

        tok = Tokenizer.from_pretrained(source)
        return len(tok.hf), tok
    from jaxinfer.loading import read_header

    cfg, tok = read_header(source)
    return cfg.vocab_size, tok


def mask_part(out: Path | None, command: str, sources: list[str]) -> None:
    """One row's mask as the engine meets it (the first fill after each token: a repeated
    fill of one state is cached by llguidance), then rows filled together, one by one vs on
    llguidance's threads."""
    import llguidance
    import llguidance.numpy as lnp

    from jaxinfer.structured_outputs import GrammarMatchers, StructuredOutputsParams

    for model in sources:
        vocab, tok = _tokenizer(model)
        model = Path(model).name
        gm = GrammarMatchers(tok, vocab, tok.eos_token_ids)
        for kind, so, text in (
                ("json", StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
                 DOC), ("free_text", StructuredOutputsParams(regex=FREE), TEXT)):
            grammar = gm.check(so)
            ids = tok.encode(text, add_special_tokens=False)
            m = llguidance.LLMatcher(gm.ll_tokenizer(), grammar, log_level=0)
            mask = lnp.allocate_token_bitmask(1, vocab)
            per = []
            for t in ids:
                t0 = time.perf_counter()
                lnp.fill_next_token_bitmask(m, mask, 0)
                per.append((time.perf_counter() - t0) * 1e6)
                assert m.consume_token(t), t
            record(f"structured_mask_fill_{model}_{kind}", statistics.median(per), "us",
                   {"vocab": vocab, "positions": len(ids), "max_us": max(per),
                    "what": "llguidance fill_next_token_bitmask, one row, first fill of "
                            "each state"}, out, command)
            print(f"mask fill {model:14s} {kind:9s} V={vocab:6d}: median "
                  f"{statistics.median(per):7.1f} us, max {max(per):7.1f} us over {len(ids)}")
        grammar = gm.check(StructuredOutputsParams(regex=FREE))
        words = TEXT.split()
        for rows in (8, 64):
            res = {}
            for threads in (1, None):
                g = GrammarMatchers(tok, vocab, tok.eos_token_ids, threads=threads)
                g._ll_tokenizer = gm.ll_tokenizer()
                g.add(0, grammar)
                seqs = [_Seq((0, i), tok.encode(" ".join(words[:1 + i % len(words)]),
                                                add_special_tokens=False))
                        for i in range(rows)]
                g.masks(seqs)  # the matchers made (and fed their outputs) outside the timing
                times = []
                for _ in range(5):  # each time from fresh states: advance every row
                    for s in seqs:
                        t = tok.encode(" a", add_special_tokens=False)[0]
                        assert g.accept(s, t) is None
                    t0 = time.perf_counter()
                    g.masks(seqs)
                    times.append((time.perf_counter() - t0) * 1e3)
                res[threads] = statistics.median(times)
                how = "threads" if threads is None else "one"
                record(f"structured_masks_{model}_R{rows}_{how}", res[threads], "ms",
                       {"vocab": vocab, "rows": rows, "threads": threads, "constraint": FREE,
                        "cpus": os.cpu_count()}, out, command)
            print(f"masks {model:14s} R={rows:3d}: one by one {res[1]:7.2f} ms, llguidance's "
                  f"threads {res[None]:7.2f} ms ({os.cpu_count()} CPUs)")


def program_part(out: Path | None, command: str, iters: int) -> None:
    import jax

    from jaxinfer.sampling_penalties import load_allowed_masks

    fn = jax.jit(load_allowed_masks, donate_argnums=(0,))
    rng = np.random.default_rng(0)
    for V in (49152, 262144):
        counts = jax.numpy.zeros((257, V), jax.numpy.int32)
        for R in (1, 8, 64):
            slots = rng.choice(256, R, replace=False).astype(np.int32)
            masks = rng.integers(-2**31, 2**31 - 1, (R, (V + 31) // 32), np.int64).astype(
                np.int32)
            counts = fn(counts, slots, masks)  # compile
            counts.block_until_ready()
            state = {"c": counts}

            def call() -> None:
                state["c"] = fn(state["c"], slots, masks)
                state["c"].block_until_ready()

            us = _median_us(call, iters)
            counts = state["c"]  # (the last call's output: its input was donated)
            record(f"structured_mask_program_V{V}_R{R}", us, "us",
                   {"vocab": V, "rows": R, "slots": 256, "iters": iters}, out, command)
            print(f"mask program V={V:6d} R={R:3d}: {us:8.1f} us")


def engine_part(out: Path | None, command: str, args: argparse.Namespace) -> None:
    from jaxinfer import LLM, SamplingParams
    from jaxinfer.structured_outputs import GrammarMatchers
    from jaxinfer.tokenizer import Tokenizer

    llm = LLM(args.model, max_model_len=512, block_size=16, max_num_seqs=args.rows,
              **json.loads(args.engine_args))
    eng = llm.engine
    if args.tokenizer_dir:  # a dummy model (no tokenizer) with a real model's tokenizer
        tok = Tokenizer.from_pretrained(args.tokenizer_dir)
        eng.tokenizer = tok
        eng.structured = GrammarMatchers(tok, eng.model_config.vocab_size, tok.eos_token_ids)
    prompts = [f"{p} {i}" for i in range(args.rows // 4 + 1)
               for p in ("The recipe calls for", "My favourite colour is", "In the morning I",
                         "The weather today is")][:args.rows]
    spent = {"masks": 0.0, "load": 0.0}

    def timed(name, fn):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[name] += time.perf_counter() - t0
        return wrapper

    eng.structured.masks = timed("masks", eng.structured.masks)
    eng.runner.load_allowed_masks = timed("load", eng.runner.load_allowed_masks)
    from jaxinfer import engine_slots

    overlapped = engine_slots.prepare_device

    def masks_first(engine, out):  # the order before session 43's overlap: masks, then
        load = overlapped(engine, out)  # the model program
        if load is not None:
            load()

    results = {}
    regex = {"regex": "[a-z ,.]{1,400}"}
    for name, so in (("plain", None), ("regex", regex), ("regex_masks_first", regex)):
        engine_slots.prepare_device = masks_first if name.endswith("first") else overlapped
        sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True,
                            structured_outputs=so)
        llm.generate(prompts, sp)  # compile / warm
        eng.multi_step_programs.wait_background()  # a k-step program building meanwhile
        llm.generate(prompts, sp)
        for k in spent:
            spent[k] = 0.0
        for p in prompts:
            eng.add_request(p, sp)
        steps = []
        while eng.has_unfinished_requests():
            t0 = time.perf_counter()
            eng.step()
            steps.append(time.perf_counter() - t0)
        # Per token, as TPOT: the calls after the prefill step over the tokens after the
        # first (a multi-step window's call returns several tokens at once)
        results[name] = sum(steps[1:]) / (args.max_tokens - 1) * 1e3
        calls = {k: v * 1e3 / max(1, len(steps)) for k, v in spent.items()}
        record(f"structured_engine_step_{name}", results[name], "ms",
               {"model": args.model, "tokenizer_dir": args.tokenizer_dir, "rows": args.rows,
                "max_tokens": args.max_tokens, "steps": len(steps),
                "engine_args": json.loads(args.engine_args),
                "structured_outputs": so, "masks_ms_per_step": calls["masks"],
                "load_ms_per_step": calls["load"],
                "async_scheduling": eng.config.async_scheduling,
                "num_scheduler_steps": eng.config.num_scheduler_steps,
                "masks": "loaded before the model program" if name.endswith("first")
                else "overlapping the model program"}, out, command)
        print(f"engine {name:17s}: {results[name]:.2f} ms a token ({len(steps)} step calls); "
              f"masks {calls['masks']:.3f} ms, load {calls['load']:.3f} ms a call")
    engine_slots.prepare_device = overlapped
    print(f"structured / plain time a token: {results['regex'] / results['plain']:.2f}x "
          f"(masks first: {results['regex_masks_first'] / results['plain']:.2f}x)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", nargs="+", default=["mask", "program", "engine"],
                    choices=["mask", "program", "engine"])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokenizer-dir", default=None,
                    help="attach this saved tokenizer (Tokenizer.save) to a dummy: model")
    ap.add_argument("--engine-args", default="{}", help="JSON of more LLM(...) options")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--mask-tokenizers", nargs="+", default=["smollm2-135m", "gemma3-270m"],
                    help="model names, or directories Tokenizer.save wrote")
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args(argv)
    command = " ".join(["python", *sys.argv])
    if "mask" in args.parts:
        mask_part(args.out, command, args.mask_tokenizers)
    if "program" in args.parts:
        program_part(args.out, command, args.iters)
    if "engine" in args.parts:
        engine_part(args.out, command, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
