"""jaxinfer.row_reduce: the two-stage row max / argmax equal jnp's one-stage reductions bit
for bit on fresh random rows with ties, -inf, NaN and all-(-inf) rows; chunk choice."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.row_reduce import num_chunks, row_argmax, row_max


def test_num_chunks() -> None:
    assert num_chunks(128256, 0) == 1 and num_chunks(128256, 1) == 1
    c = num_chunks(128256, 128)
    assert 128256 % c == 0 and 128256 // c >= 512 and abs(c - 128) <= 8
    assert num_chunks(1021, 64) == 1  # prime: no split
    assert num_chunks(4096, 64) == 8  # chunks of at least 512


@pytest.mark.parametrize("chunks", [8, 64, 128])
def test_equal_to_one_stage(chunks: int) -> None:
    rng = np.random.default_rng()
    S, V = 7, 49152  # SmolLM2's vocabulary
    x = rng.standard_normal((S, V)).astype(np.float32)
    x[0, [5, 40000]] = 50.0  # a tie across chunks: the first index wins
    x[1, :] = -np.inf  # all -inf: index 0
    x[2, rng.integers(0, V, 4000)] = -np.inf
    x[3, [30000, 31000]] = np.nan  # NaN counts as the maximum, first NaN wins
    x[4, :] = np.float32(3.0)  # every element tied
    x[5, V - 1] = 99.0  # the last element
    xj = jnp.asarray(x)
    assert num_chunks(V, chunks) > 1
    np.testing.assert_array_equal(np.asarray(row_argmax(xj, chunks)),
                                  np.asarray(jnp.argmax(xj, axis=-1)))
    finite = [0, 1, 2, 4, 5, 6]  # XLA's max of a NaN row is the backend's (XLA:CPU drops NaN)
    np.testing.assert_array_equal(np.asarray(row_max(xj, chunks))[finite],
                                  np.asarray(jnp.max(xj, -1))[finite])
    assert row_argmax(xj, chunks).dtype == jnp.int32
    assert list(np.asarray(row_argmax(xj, chunks))[[0, 1, 3, 4, 5]]) == [5, 0, 30000, 0, V - 1]


def test_shape_error() -> None:
    with pytest.raises(ValueError, match=r"\[S, V\]"):
        row_argmax(jnp.zeros((2, 3, 4)), 8)
