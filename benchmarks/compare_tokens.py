"""Greedy tokens of two gpu_decode.py runs (an A/B across processes), per backend and batch.

    python benchmarks/compare_tokens.py A/gpu_decode_summary.json B/gpu_decode_summary.json

Prints, for every backend and batch both runs timed, how many of the recorded requests'
greedy tokens are equal and where the first difference falls (token index) otherwise.
Random dummy weights leave near-ties, so a difference late in a sequence after a change of
accumulation order is expected; one at token 0 on every request is a broken kernel.
"""
import json
import sys


def first_diff(a: list[int], b: list[int]) -> int | None:
    """Index of the first unequal token (the shorter length if one is a prefix); None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(a: dict, b: dict) -> list[dict]:
    rows = []
    for backend, ra in a.items():
        rb = b.get(backend)
        if not (isinstance(ra, dict) and isinstance(rb, dict)):
            continue
        for key, xa in ra.items():
            xb = rb.get(key)
            if not (key.startswith("b") and isinstance(xa, dict) and isinstance(xb, dict)):
                continue
            ta, tb = xa.get("tokens", []), xb.get("tokens", [])
            diffs = [first_diff(s, t) for s, t in zip(ta, tb)]
            rows.append({"backend": backend, "batch": key, "requests": len(diffs),
                         "equal": sum(d is None for d in diffs),
                         "first_diff": [d for d in diffs if d is not None],
                         "length": [len(s) for s in ta]})
    return rows


def main() -> None:
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    a, b = (json.load(open(p)) for p in sys.argv[1:])
    for r in compare(a, b):
        print(json.dumps(r))


if __name__ == "__main__":
    main()
