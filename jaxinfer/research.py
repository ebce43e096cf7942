"""Research access to an engine's model over the paged engine path: the residual stream
(hidden states) of a prompt, and hooks that edit it — TransformerLens-style activation
patching and steering, for the models jaxinfer serves, without a second implementation.

    from jaxinfer import LLM
    from jaxinfer.research import prompt_hidden_states

    llm = LLM("smollm2-135m")
    trace = prompt_hidden_states(llm.engine, "The capital of France is")
    trace.hidden_states.shape  # [layers + 1, tokens, hidden], as HF's output_hidden_states
    steer = lambda layer, x: jnp.where(layer == 10, x + 4.0 * direction, x)
    steered = prompt_hidden_states(llm.engine, "The capital of France is", hook=steer)

The prompt runs as ``LLMEngine.prompt_logits`` runs it (jaxinfer/engine_logits.py): chunks
of at most ``max_num_batched_tokens`` prefilled into pages borrowed from the pool, returned
afterwards; the program is the engine's model with ``collect`` (and ``hook``) on
(models/transformer.py ``CausalLM.__call__``), compiled once per (engine, hook, bucket).
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple
from typing import Sequence as Seq

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxinfer.engine_logits import _prefilled

Hook = Callable[[Any, jax.Array], jax.Array]


class PromptTrace(NamedTuple):
    """What :func:`prompt_hidden_states` returns (numpy, float32).

    hidden_states: [L + 1, N, H] in HF transformers' ``output_hidden_states`` layout: the
      embeddings (times Gemma's embedding scale), the outputs of layers 0 .. L - 2, and the
      final norm of layer L - 1's output (the hook's output wherever a hook is given).
    layer_outputs: [L, N, H], every layer's output before the final norm (the last one is
      the only entry hidden_states does not hold).
    logits: [N, V], each position's next-token logits (with the hook's edits).
    """

    hidden_states: np.ndarray
    layer_outputs: np.ndarray
    logits: np.ndarray


_PROGRAMS: weakref.WeakKeyDictionary[Any, dict[Any, Any]] = weakref.WeakKeyDictionary()


def _hook_arity(hook: Hook) -> int:
    """How many arguments ``hook`` takes: 2 (layer, x), 3 (+ positions) or 4 (+ args).

    Raises:
      TypeError: ``hook`` is not callable, or takes another number of arguments.
    """
    if not callable(hook):
        raise TypeError(f"hook must be a function hook(layer, x[, positions[, args]]) -> x, "
                        f"got {type(hook).__name__}")
    try:
        params = inspect.signature(hook).parameters.values()
    except (TypeError, ValueError):  # no signature (some builtins): the plain form
        return 2
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return 4
    n = sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
            for p in params)
    if n not in (2, 3, 4):
        raise TypeError(f"hook takes {n} arguments; it must take (layer, x), (layer, x, "
                        f"positions) or (layer, x, positions, args)")
    return n


def _program(runner: Any, hook: Hook | None) -> Any:
    """The jitted research program of ``runner``'s model for ``hook`` (cached while the
    runner lives; by identity for an unhashable hook, kept alive with it): (weights, cache,
    token_ids [T], md, hook_args) -> (logits [T, V] float32, cache, states [L + 1, T, H],
    final hidden [T, H])."""
    programs = _PROGRAMS.setdefault(runner, {})
    key: Any = hook
    try:
        hash(hook)
    except TypeError:  # a dataclass instance, say (or its bound method: made anew each time)
        owner = getattr(hook, "__self__", None)
        key = ("id", id(hook)) if owner is None else ("method", id(owner), hook.__func__)
    if key not in programs:
        graphdef, tree, attention = runner.graphdef, runner.weights_tree, runner.attention
        arity = 0 if hook is None else _hook_arity(hook)

        def run(weights, cache, token_ids, md, hook_args):
            model = nnx.merge(graphdef, jax.tree.unflatten(tree, weights))
            positions = jnp.where(md.seq_ids >= 0, md.positions, -1)
            extra = (positions, hook_args)[:max(arity - 2, 0)]
            call = None if hook is None else lambda layer, x: _checked(hook(layer, x, *extra))
            hidden, cache, states = model(token_ids, cache, md, attention, hook=call,
                                          collect=True)
            return model.logits(hidden), cache, states, hidden

        programs[key] = (hook, jax.jit(run, donate_argnums=(1,)))
    return programs[key][1]


def _checked(y: Any) -> jax.Array:
    """A hook's return value as an array, or a ValueError that says what it was."""
    try:
        return jnp.asarray(y)
    except (TypeError, ValueError) as e:
        raise ValueError(f"hook returned {type(y).__name__}, not an array of the layer "
                         f"output's shape: {e}") from None


def prompt_hidden_states(engine: Any, prompt: str | Seq[int], hook: Hook | None = None,
                         hook_args: Any = None) -> PromptTrace:
    """Hidden states and logits of every position of ``prompt`` (text or token ids).

    Args:
      engine: an ``LLMEngine`` (``LLM(...).engine``; an ``LLM`` is taken too), between
        steps.
      prompt: one prompt: text, or a sequence of token ids (a list, numpy or jax array).
      hook: ``hook(layer, x) -> x'``, a jnp function applied to each layer's output x [T, H]
        (the residual stream after the layer) before the next layer reads it; ``layer`` is
        a Python int, or a traced int32 for a model built with ``scan_layers=True`` (so
        select with ``jnp.where(layer == i, ...)`` to work with both). x holds one chunk of
        at most ``max_num_batched_tokens`` prompt tokens, padded to the chunk's bucket: T is
        not the prompt's length and row i is not position i. A hook that takes a third
        argument gets ``positions`` [T] int32, each row's position in the prompt, -1 for
        padding rows: select positions with it (``jnp.where(positions[:, None] == 7, ...)``)
        and leave padding out of reductions (``x[positions >= 0]`` is not traceable; weigh
        by ``positions >= 0``). A fourth argument gets ``hook_args``.
        The hook is traced into a compiled program: no Python side effects per token, and
        values it reads from Python (a captured scale or array) are fixed when it is first
        traced: the same hook object reuses its compiled programs, a new one compiles again.
        Pass what changes between calls (a steering strength, a patch) as ``hook_args``.
        The hook must return an array of x's shape; it is cast to the activation dtype.
      hook_args: any pytree of arrays, the hook's fourth argument; a new value of the same
        shapes reuses the compiled program (a sweep over strengths compiles once).
    Returns:
      :class:`PromptTrace`, float32 numpy arrays.
    Raises:
      RequestError: as ``LLMEngine.prompt_logits`` (too long, empty, pages not free).
      TypeError: ``engine`` is not an engine; ``hook`` is not a function of 2-4 arguments,
        or ``hook_args`` are given to a hook of fewer than 4.
      ValueError: the hook returned something other than an array of x's shape.
    """
    from jaxinfer.runner import _metadata

    engine = getattr(engine, "engine", engine)  # an LLM: its engine
    runner = getattr(engine, "runner", None)
    if runner is None:
        raise TypeError(f"engine must be an LLMEngine (LLM(...).engine), got "
                        f"{type(engine).__name__}")
    if hook_args is not None and (hook is None or _hook_arity(hook) < 4):
        raise TypeError("hook_args are the hook's fourth argument: give a hook(layer, x, "
                        "positions, args)")
    program = _program(runner, hook)

    def run(inputs: Any, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        logits, runner.cache, states, hidden = program(runner.weights, runner.cache,
                                                       inputs.token_ids, _metadata(inputs),
                                                       hook_args)
        return (np.asarray(logits[:n], np.float32), np.asarray(states[:, :n], np.float32),
                np.asarray(hidden[:n], np.float32))

    with _prefilled(engine, prompt, "prompt_hidden_states", run) as (_, chunks):
        logits, states, final = (np.concatenate(parts, axis=a) for parts, a in
                                 zip(zip(*chunks), (0, 1, 0)))
    L = engine.model_config.num_layers
    hidden_states = np.concatenate([states[:L], final[None]])
    return PromptTrace(hidden_states, states[1:], logits)
