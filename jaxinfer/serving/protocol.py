"""Protocol messages <-> engine objects: sampling parameters, prompts, chat messages.

Everything here runs on the server's event loop before a request reaches the engine thread, and
raises :class:`InvalidRequest` (mapped to gRPC ``INVALID_ARGUMENT``) with a message that names
the offending field.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxinfer.outputs import Logprobs
from jaxinfer.prompts import no_room_error
from jaxinfer.sampling_params import ParameterError, SamplingParams
from jaxinfer.serving import jaxinfer_pb2 as pb

FINISH_REASONS = {None: pb.FINISH_REASON_UNSPECIFIED, "stop": pb.FINISH_REASON_STOP,
                  "length": pb.FINISH_REASON_LENGTH, "abort": pb.FINISH_REASON_ABORT}


class InvalidRequest(ValueError):
    """A request is malformed or out of range; the message names the field."""


def unknown_fields(msg: Any, path: str = "") -> list[str]:
    """Paths of the fields in ``msg`` (and its set sub-messages) that this server's schema does
    not know, e.g. ``["sampling.#99"]``: what a newer client sent and this server would
    silently drop. ``#N`` is the field number (the name is unknown here).

    Source: protobuf's ``google.protobuf.unknown_fields.UnknownFieldSet``.
    """
    from google.protobuf.unknown_fields import UnknownFieldSet

    found = [f"{path}#{f.field_number}" for f in UnknownFieldSet(msg)
             if f.field_number not in msg.DESCRIPTOR.fields_by_number]
    for sub_path, sub in _set_submessages(msg, path):
        found += unknown_fields(sub, sub_path)
    return found


def _set_submessages(msg: Any, path: str) -> list[tuple[str, Any]]:
    """``(path, message)`` of every set sub-message of ``msg`` (repeated ones indexed)."""
    out = []
    for fd, value in msg.ListFields():
        if fd.message_type is None or fd.message_type.GetOptions().map_entry:
            continue
        repeated = getattr(fd, "is_repeated", None)
        if repeated is None:  # protobuf < 5.28: the label
            repeated = fd.label == fd.LABEL_REPEATED
        if repeated:
            out += [(f"{path}{fd.name}[{i}].", sub) for i, sub in enumerate(value)]
        else:
            out.append((f"{path}{fd.name}.", value))
    return out


def mistyped_fields(msg: Any, path: str = "") -> list[str]:
    """Paths of the fields in ``msg`` (and its set sub-messages) that this server's schema
    knows but that came with another wire type (e.g. ``sampling`` sent as a varint, not a
    message): protobuf keeps them as unknown fields, which :func:`unknown_fields` leaves out.
    Entries read ``name (#N)``."""
    from google.protobuf.unknown_fields import UnknownFieldSet

    by_number = msg.DESCRIPTOR.fields_by_number
    found = [f"{path}{by_number[f.field_number].name} (#{f.field_number})"
             for f in UnknownFieldSet(msg) if f.field_number in by_number]
    for sub_path, sub in _set_submessages(msg, path):
        found += mistyped_fields(sub, sub_path)
    return found


def sampling_params_from_proto(msg: pb.SamplingParameters,
                               defaults: dict[str, Any] | None = None) -> SamplingParams:
    """``SamplingParams`` from the set fields of ``msg``.

    Each set field is passed to ``SamplingParams`` under its own name (the proto uses vLLM's
    names), so fields added to ``SamplingParams`` later need no change here; a set field that
    ``SamplingParams`` does not have yet is rejected. Unset fields take ``defaults`` (the
    engine's ``sampling_defaults``: the model's generation-config defaults, as vLLM's OpenAI
    server), else SamplingParams' own (temperature 1.0, ...; the servicer then gives an
    unset max_tokens the room the prompt leaves, as vLLM's OpenAI server).

    Raises:
      InvalidRequest: unknown field for this engine version, or a value out of range
        (``ParameterError``'s message, which names the field).
    """
    known = {f.name for f in dataclasses.fields(SamplingParams)}
    kwargs: dict[str, Any] = dict(defaults or {})
    for field, value in msg.ListFields():  # only fields that are set / non-empty
        name = field.name
        if name not in known:
            raise InvalidRequest(f"sampling.{name} is not supported by this server version")
        if name == "structured_outputs":  # a message: its set fields, choice's list
            value = {f.name: list(v.choices) if f.name == "choice" else v
                     for f, v in value.ListFields()}
        elif field.message_type is not None and field.message_type.GetOptions().map_entry:
            value = dict(value)  # a map field's container (logit_bias)
        elif not isinstance(value, (str, bytes, bool, int, float)):
            value = list(value)  # a repeated field's container
        kwargs[name] = value
    try:
        return SamplingParams(**kwargs)
    except ParameterError as e:
        raise InvalidRequest(f"sampling: {e}") from e
    except TypeError as e:  # a proto type the dataclass rejects
        raise InvalidRequest(f"sampling: {e}") from e


def token_logprob(token: int, entry: Logprobs, k: int) -> pb.TokenLogprob:
    """One position's ``TokenLogprob`` from an engine logprobs entry.

    ``entry`` is vLLM's layout (``jaxinfer.outputs.logprobs_entry``): the token at that
    position first, then the ``k`` most likely tokens, most likely first, leaving out the
    token itself when it is among them. So ``top`` is the entries after the first when there
    are ``k + 1``; with ``k`` entries the token is one of the best ``k``, and all of them,
    ordered by logprob (ties: lower id first, as ``jaxinfer.outputs.top_k_ids``), are ``top``.
    """
    items = list(entry.items())
    if len(items) > k:
        top = items[1:k + 1]
    else:
        top = sorted(items, key=lambda kv: (-kv[1], kv[0]))
    return pb.TokenLogprob(token_id=int(token), logprob=entry[int(token)],
                           top=[pb.TopLogprob(token_id=i, logprob=v) for i, v in top])


def token_logprobs(tokens: list[int], entries: list[Logprobs], k: int) -> list[pb.TokenLogprob]:
    """``TokenLogprob`` per (token, entry) pair (see :func:`token_logprob`).

    Raises ValueError when the two lists differ in length (an engine/server mismatch).
    """
    if len(tokens) != len(entries):
        raise ValueError(f"logprobs: {len(entries)} entries for {len(tokens)} tokens")
    return [token_logprob(t, e, k) for t, e in zip(tokens, entries)]


def prompt_logprobs_proto(prompt_ids: list[int], entries: list[Logprobs | None],
                          k: int) -> list[pb.TokenLogprob]:
    """``GenerateResponse.prompt_logprobs`` from ``RequestOutput.prompt_logprobs``: one
    TokenLogprob per prompt token after the first (whose entry is None)."""
    rest = entries[1:]
    if any(e is None for e in rest):
        raise ValueError("prompt_logprobs: an entry after the first is None")
    return token_logprobs(list(prompt_ids[1:]), rest, k)  # type: ignore[arg-type]


def set_stop_reason(resp: pb.GenerateResponse, stop_reason: int | str | None) -> None:
    """Fill the ``stop_reason`` oneof (``stop_str`` or ``stop_token_id``); None leaves it unset."""
    if isinstance(stop_reason, str):
        resp.stop_str = stop_reason
    elif stop_reason is not None:
        resp.stop_token_id = int(stop_reason)


def chat_messages(msg: pb.ChatMessages) -> list[dict[str, str]]:
    """``[{"role", "content"}, ...]`` of a ChatMessages message.

    Raises InvalidRequest on no messages, or a message with an empty role or content.
    """
    if not msg.messages:
        raise InvalidRequest("chat.messages is empty")
    out = []
    for i, m in enumerate(msg.messages):
        if not m.role.strip():
            raise InvalidRequest(f"chat.messages[{i}].role is empty")
        if not m.content:
            raise InvalidRequest(f"chat.messages[{i}].content is empty")
        out.append({"role": m.role, "content": m.content})
    return out


def chat_options(msg: pb.ChatMessages) -> dict[str, Any]:
    """``LLMEngine.encode_chat``'s template keywords from a ``ChatMessages``:
    add_generation_prompt (default True, False with continue_final_message),
    continue_final_message, chat_template_kwargs (a Struct -> dict)."""
    from google.protobuf.json_format import MessageToDict

    cont = msg.continue_final_message
    add = msg.add_generation_prompt if msg.HasField("add_generation_prompt") else not cont
    opts: dict[str, Any] = {"add_generation_prompt": add, "continue_final_message": cont}
    if msg.HasField("chat_template_kwargs"):
        try:
            opts["chat_template_kwargs"] = _whole_numbers(
                MessageToDict(msg.chat_template_kwargs))
        except Exception as e:  # noqa: BLE001 - NaN / inf: json_format's SerializeToJsonError
            raise InvalidRequest(f"chat.chat_template_kwargs: {e}") from e
    return opts


def _whole_numbers(v: Any) -> Any:
    """``v`` (a Struct as a dict) with whole floats as ints: a Struct carries every number as
    a double, and a template's ``range(n)`` wants an int (JSON APIs keep 3 an int)."""
    if isinstance(v, dict):
        return {k: _whole_numbers(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_whole_numbers(x) for x in v]
    if isinstance(v, float) and v.is_integer() and abs(v) <= 2**53:
        return int(v)
    return v


def prompt_token_ids(engine: Any, req: pb.GenerateRequest,
                     truncate_prompt_tokens: int | None = None
                     ) -> tuple[list[int], str | None]:
    """Token ids of a request's input (text encoded, chat template applied) and its text.

    Args:
      engine: the ``LLMEngine`` (its tokenizer and config are read, nothing is changed).
      truncate_prompt_tokens: the request's ``SamplingParams.truncate_prompt_tokens``.
    Raises:
      InvalidRequest: no input, an empty prompt, ids out of the vocabulary, a model without
        tokenizer or chat template, malformed chat messages, or a prompt that leaves no room
        for one generated token within ``max_model_len``.
    """
    from jaxinfer.engine import RequestError
    from jaxinfer.tokenizer import TokenizerError

    kind = req.WhichOneof("input")
    text: str | None = None
    try:
        if kind is None:
            raise InvalidRequest("request has no input: set prompt, prompt_token_ids or chat")
        trunc = truncate_prompt_tokens
        if kind == "prompt":
            text = req.prompt
            ids = engine.encode_prompt(req.prompt, trunc)
        elif kind == "prompt_token_ids":
            ids = engine.encode_prompt(req.prompt_token_ids.ids, trunc)  # length checked first
        else:
            ids = engine.encode_chat(chat_messages(req.chat), truncate_prompt_tokens=trunc,
                                     **chat_options(req.chat))
    except (RequestError, TokenizerError) as e:
        raise InvalidRequest(f"{kind}: {e}") from e
    except InvalidRequest:
        raise
    except Exception as e:  # a chat template raising on odd roles (jinja2 errors)
        raise InvalidRequest(f"{kind}: {type(e).__name__}: {e}") from e
    limit = engine.config.max_model_len
    if len(ids) >= limit:
        raise InvalidRequest(f"{kind}: {no_room_error(len(ids), limit, truncate_prompt_tokens)}")
    return ids, text


def model_info(engine: Any) -> pb.ModelInfoResponse:
    """ModelInfoResponse of an ``LLMEngine``."""
    import jax.numpy as jnp

    mc, ec, tok = engine.model_config, engine.config, engine.tokenizer
    eos = set(mc.eos_token_ids) | (set(tok.eos_token_ids) if tok is not None else set())
    return pb.ModelInfoResponse(
        model=str(engine.model_name), family=mc.family, vocab_size=mc.vocab_size,
        max_model_len=ec.max_model_len, max_position_embeddings=mc.max_position_embeddings,
        block_size=ec.block_size, num_kv_pages=engine.runner.num_pages,  # as sized
        max_num_seqs=ec.max_num_seqs, max_num_batched_tokens=ec.max_num_batched_tokens,
        decode_buckets=ec.decode_buckets, prefill_buckets=ec.prefill_buckets,
        page_buckets=ec.page_buckets, eos_token_ids=sorted(eos),
        has_tokenizer=tok is not None,
        has_chat_template=tok is not None and tok.chat_template is not None,
        dtype=jnp.dtype(engine.dtype).name,
        default_sampling=pb.SamplingParameters(**engine.sampling_defaults))
