"""Jump-forward decoding of structured outputs (``EngineConfig.jump_forward``): output tokens
a second and engine steps, with and without, on the same engine and requests.

    PYTHONPATH=. .venv/bin/python benchmarks/jump_forward.py                  # CPU, SmolLM2
    PYTHONPATH=. python3 benchmarks/jump_forward.py --model dummy:llama-3.1-8b \\
        --tokenizer-dir smollm2-tok --engine-args '{"quantization": "fp8"}'     # GPU

``--rows`` greedy requests at once (each row count a separate batch), every one held to a
JSON schema of a person (six fields: free-text strings, an integer, an enum, an array), the
schema's grammar whitespace-flexible (vLLM's default) and compact
(``disable_any_whitespace``). Each batch runs once to build its programs, then timed: output
tokens / wall time from the first ``add_request`` to the last output, the engine's step
calls, the tokens appended without sampling (``num_jump_forward_tokens``), and whether the
texts equal the run without jumps (greedy text is the grammar's either way; a jump may
tokenize the forced text differently, which can change what the model writes after it).
The flag is flipped on one engine (a scheduling policy, read after each step), so both runs
share programs and weights. One JSON record per (rows, whitespace, jump) under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jaxinfer.bench.records import record  # noqa: E402

SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["name", "age", "city", "email", "occupation", "hobbies"],
          "properties": {"name": {"type": "string", "maxLength": 30},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "city": {"type": "string", "enum": ["Paris", "London", "Tokyo",
                                                             "New York"]},
                         "email": {"type": "string", "maxLength": 40},
                         "occupation": {"type": "string", "maxLength": 30},
                         "hobbies": {"type": "array", "items": {"type": "string",
                                                                "maxLength": 20},
                                     "maxItems": 3}}}
TOPICS = ["a chef", "a pilot", "a teacher", "a painter", "a doctor", "a farmer", "a poet",
          "an engineer", "a baker", "a sailor", "a nurse", "a writer", "a judge", "a tailor",
          "a miner", "a dancer"]


def run_batch(llm, prompts: list[str], sp) -> dict:
    eng = llm.engine
    jumped, steps = eng.num_jump_forward_tokens, 0
    for p in prompts:
        eng.add_request(p, sp)
    t0 = time.perf_counter()
    outs = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o.outputs[0]
        steps += 1
    wall = time.perf_counter() - t0
    done = [outs[k] for k in sorted(outs)]
    tokens = sum(len(c.token_ids) for c in done)
    return {"wall_s": wall, "tokens": tokens, "steps": steps,
            "jumped": eng.num_jump_forward_tokens - jumped, "texts": [c.text for c in done],
            "reasons": [c.finish_reason for c in done]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokenizer-dir", default=None,
                    help="attach this saved tokenizer (Tokenizer.save) to a dummy: model")
    ap.add_argument("--engine-args", default="{}", help="JSON of more LLM(...) options")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs each (median)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    command = " ".join(["python", *sys.argv])

    from jaxinfer import LLM, SamplingParams
    from jaxinfer.structured_outputs import GrammarMatchers
    from jaxinfer.structured_outputs import StructuredOutputsParams as SO
    from jaxinfer.tokenizer import Tokenizer

    llm = LLM(args.model, max_model_len=512, block_size=16, max_num_seqs=max(args.rows),
              **json.loads(args.engine_args))
    eng = llm.engine
    if args.tokenizer_dir:  # a dummy model (no tokenizer) with a real model's tokenizer
        tok = Tokenizer.from_pretrained(args.tokenizer_dir)
        eng.tokenizer = tok
        eng.structured = GrammarMatchers(tok, eng.model_config.vocab_size, tok.eos_token_ids)
    table = []
    for rows in args.rows:
        prompts = [f"Describe {TOPICS[i % len(TOPICS)]} named person {i} as JSON with the "
                   f"fields name, age, city, email, occupation and hobbies:\n"
                   for i in range(rows)]
        for compact in (False, True):
            sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                                structured_outputs=SO(json=SCHEMA,
                                                      disable_any_whitespace=compact))
            runs: dict[bool, list[dict]] = {False: [], True: []}
            for rep in range(args.repeats + 1):  # the first: build / warm the programs
                for jump in (False, True):  # alternating, so a slow spell hits both
                    object.__setattr__(eng.config, "jump_forward", jump)  # a policy flag
                    r = run_batch(llm, prompts, sp)
                    if rep:
                        runs[jump].append(r)
            res = {jump: sorted(rs, key=lambda r: r["wall_s"])[len(rs) // 2]  # median
                   for jump, rs in runs.items()}
            for jump, r in res.items():
                tps = r["tokens"] / r["wall_s"]
                same = sum(a == b for a, b in zip(r["texts"], res[False]["texts"]))
                valid = sum(_valid(t) for t in r["texts"])
                name = (f"jump_forward_tok_s_{'on' if jump else 'off'}_R{rows}_"
                        f"{'compact' if compact else 'flexible'}")
                record(name, tps, "output tok/s",
                       {"model": args.model, "tokenizer_dir": args.tokenizer_dir,
                        "rows": rows, "max_tokens": args.max_tokens, "jump_forward": jump,
                        "disable_any_whitespace": compact,
                        "engine_args": json.loads(args.engine_args),
                        "async_scheduling": eng.config.async_scheduling,
                        "wall_s": r["wall_s"], "output_tokens": r["tokens"],
                        "wall_s_all_runs": [x["wall_s"] for x in runs[jump]],
                        "ms_per_step": r["wall_s"] / r["steps"] * 1e3,
                        "step_calls": r["steps"], "jump_forward_tokens": r["jumped"],
                        "texts_equal_to_no_jump": same, "valid_json": valid,
                        "finish_reasons": r["reasons"], "texts": r["texts"]},
                       args.out, command)
                table.append((rows, "compact" if compact else "flexible", jump, tps,
                              r["tokens"], r["steps"], r["jumped"], same, valid))
    print(f"{'rows':>4} {'grammar':>8} {'jump':>4} {'tok/s':>7} {'tokens':>6} {'steps':>5} "
          f"{'jumped':>6} {'same':>4} {'valid':>5}")
    for rows, g, jump, tps, n, steps, jumped, same, valid in table:
        print(f"{rows:4d} {g:>8} {str(jump):>4} {tps:7.1f} {n:6d} {steps:5d} {jumped:6d} "
              f"{same:4d} {valid:5d}")
    return 0


def _valid(text: str) -> bool:
    try:
        obj = json.loads(text)
    except ValueError:
        return False
    return isinstance(obj, dict) and set(obj) == set(SCHEMA["required"])


if __name__ == "__main__":
    sys.exit(main())
