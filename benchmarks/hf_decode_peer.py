"""Peer: HF transformers greedy decode on the CPU (eager, float32), same model and lengths.

Runs in the reference venv (torch + transformers; scripts/setup_reference.sh), started by
benchmarks/cpu_decode.py so both engines are measured in the same run. Prints one JSON line.
Usage: .venv-ref/bin/python benchmarks/hf_decode_peer.py GGUF_DIR GGUF_NAME PROMPT_LEN NEW BATCH...
"""

import json
import sys
import time

import torch
from transformers import AutoModelForCausalLM


def main() -> None:
    d, name, prompt_len, new = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    batches = [int(b) for b in sys.argv[5:]]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32)
    model.eval()
    out = {"torch": torch.__version__}
    ids = torch.randint(100, 1000, (max(batches), prompt_len))
    # The peer gets its best thread count: on a busy 2-core machine torch's spinning OpenMP
    # threads can be far slower with 2 threads than with 1.
    for b in batches:
        x = ids[:b]
        best = None
        for threads in (1, torch.get_num_threads()) if torch.get_num_threads() > 1 else (1,):
            torch.set_num_threads(threads)
            with torch.inference_mode():
                model.generate(x, max_new_tokens=4, min_new_tokens=4, do_sample=False)  # warm
                t0 = time.perf_counter()
                model.generate(x, max_new_tokens=1, min_new_tokens=1, do_sample=False)
                t1 = time.perf_counter()
                model.generate(x, max_new_tokens=new, min_new_tokens=new, do_sample=False)
                t2 = time.perf_counter()
            decode_s = (t2 - t1) - (t1 - t0)  # remove the prefill (first token) time
            r = {"decode_tok_s": b * (new - 1) / decode_s, "ttft_s": t1 - t0,
                 "tpot_ms": 1000 * decode_s / (new - 1), "threads": threads}
            if best is None or r["decode_tok_s"] > best["decode_tok_s"]:
                best = r
        out[f"b{b}"] = best
    print(json.dumps(out))


if __name__ == "__main__":
    main()
