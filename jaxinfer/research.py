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

import weakref
from collections.abc import Callable
from typing import Any, NamedTuple
from typing import Sequence as Seq

import jax
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


def _program(runner: Any, hook: Hook | None) -> Any:
    """The jitted research program of ``runner``'s model for ``hook`` (cached while the
    runner lives): (weights, cache, token_ids [T], md) -> (logits [T, V] float32, cache,
    states [L + 1, T, H], final hidden [T, H])."""
    programs = _PROGRAMS.setdefault(runner, {})
    if hook not in programs:
        graphdef, tree, attention = runner.graphdef, runner.weights_tree, runner.attention

        def run(weights, cache, token_ids, md):
            model = nnx.merge(graphdef, jax.tree.unflatten(tree, weights))
            hidden, cache, states = model(token_ids, cache, md, attention, hook=hook,
                                          collect=True)
            return model.logits(hidden), cache, states, hidden

        programs[hook] = jax.jit(run, donate_argnums=(1,))
    return programs[hook]


def prompt_hidden_states(engine: Any, prompt: str | Seq[int], hook: Hook | None = None
                         ) -> PromptTrace:
    """Hidden states and logits of every position of ``prompt`` (text or token ids).

    Args:
      engine: an ``LLMEngine`` (``LLM(...).engine``), between steps.
      hook: ``hook(layer, x) -> x'``, a jnp function applied to each layer's output x [T, H]
        (the residual stream after the layer; T the chunk's padded tokens) before the next
        layer reads it; ``layer`` is a Python int, or a traced int32 for a model built with
        ``scan_layers=True`` (so select with ``jnp.where(layer == i, ...)`` to work with
        both). It is traced into a compiled program: no Python side effects per token.
        The hook must return the same shape; it is cast to the activation dtype. The same
        hook object reuses its compiled programs.
    Returns:
      :class:`PromptTrace`, float32 numpy arrays.
    Raises:
      RequestError: as ``LLMEngine.prompt_logits`` (too long, empty, pages not free).
      ValueError: the hook returned another shape.
    """
    from jaxinfer.runner import _metadata

    runner = engine.runner
    program = _program(runner, hook)

    def run(inputs: Any, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        logits, runner.cache, states, hidden = program(runner.weights, runner.cache,
                                                       inputs.token_ids, _metadata(inputs))
        return (np.asarray(logits[:n], np.float32), np.asarray(states[:, :n], np.float32),
                np.asarray(hidden[:n], np.float32))

    with _prefilled(engine, prompt, "prompt_hidden_states", run) as (_, chunks):
        logits, states, final = (np.concatenate(parts, axis=a) for parts, a in
                                 zip(zip(*chunks), (0, 1, 0)))
    L = engine.model_config.num_layers
    hidden_states = np.concatenate([states[:L], final[None]])
    return PromptTrace(hidden_states, states[1:], logits)
