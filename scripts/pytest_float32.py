"""pytest plugin for GPU runs of tests written for the CPU: ``dtype="auto"`` engines compute
in float32 (on a GPU "auto" is bfloat16, where a greedy reference built from
``prompt_logits`` -- the prefill path -- and the engine's decode path round differently and
part at near-ties; seen in session 36 with tests/engine/test_min_tokens.py).
Use: ``PYTHONPATH=.:scripts python3 -m pytest -p pytest_float32 ...``.
"""

import jax.numpy as jnp

from jaxinfer import engine, engine_config

_real = engine_config._resolve_dtype


def _float32_auto(name):
    return jnp.float32 if name == "auto" else _real(name)


engine_config._resolve_dtype = _float32_auto
engine._resolve_dtype = _float32_auto
