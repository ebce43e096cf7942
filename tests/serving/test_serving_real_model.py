"""gRPC serving of the default real model (SmolLM2-135M-Instruct): text and chat prompts give the
offline engine's tokens and text, also with stop strings, logprobs and special tokens kept;
unary responses agree with streams; bad words are banned; tokenizer RPCs round-trip."""

from __future__ import annotations

import asyncio
import json
import re

import grpc
import numpy as np
import pytest

from jaxinfer.llm import LLM
from jaxinfer.outputs import RequestOutput
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.serving import jaxinfer_pb2 as pb
from jaxinfer.serving import jaxinfer_pb2_grpc as pb_grpc
from jaxinfer.serving.client import InferenceClient, build_request
from tests.serving.conftest import ServerThread

TEXTS = ["The capital of France is", "def fibonacci(n):"]
CHAT = [{"role": "user", "content": "What is 2+2?"}]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16)
CAT = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
       "properties": {"name": {"type": "string", "maxLength": 20},
                      "age": {"type": "integer", "minimum": 0, "maximum": 40}}}
# (name, input kwargs of build_request, sampling kwargs): served and run offline alike.
CASES = [
    ("stop_dot", {"prompt": TEXTS[0]}, {"stop": ["."], "max_tokens": 32}),
    # A multi-token stop string (its first tokens are streamed while it may still match).
    ("stop_multi", {"prompt": TEXTS[1]}, {"stop": ["return n"], "max_tokens": 32}),
    ("logprobs", {"prompt": TEXTS[0]}, {"logprobs": 3, "prompt_logprobs": 2, "max_tokens": 6}),
    ("logprobs_stop", {"prompt": TEXTS[0]},
     {"logprobs": 0, "stop_token_ids": [30], "max_tokens": 24}),  # 30: "." after " Paris"
    ("special_kept", {"messages": CHAT}, {"skip_special_tokens": False, "max_tokens": 48}),
    ("special_kept_eos", {"messages": CHAT}, {"skip_special_tokens": False, "max_tokens": 48,
                                              "include_stop_str_in_output": True}),
    ("special_skipped", {"messages": CHAT}, {"max_tokens": 48}),
    # Greedy says " Paris."; without Paris, " the capital of the French Republic."
    ("bad_words", {"prompt": TEXTS[0]}, {"bad_words": ["Paris", "French Republic"],
                                         "max_tokens": 16}),
    # Structured outputs (a dict: SamplingParams and the proto message both take it).
    ("json_schema", {"messages": [{"role": "user", "content": "Describe a cat as JSON."}]},
     {"structured_outputs": {"json": json.dumps(CAT), "disable_any_whitespace": True},
      "max_tokens": 64}),
    ("regex", {"prompt": TEXTS[0]},
     {"structured_outputs": {"regex": r" (Rome|London|Paris)\."}, "max_tokens": 8}),
]


def _offline(llm: LLM, inp: dict, sampling: dict) -> RequestOutput:
    sp = SamplingParams(temperature=0.0, **sampling)
    if "messages" in inp:
        return llm.chat(inp["messages"], sp)[0]
    return llm.generate([inp["prompt"]], sp)[0]


@pytest.fixture(scope="module")
def real_server():
    llm = LLM("smollm2-135m", max_model_len=256, block_size=16, max_num_seqs=4,
              decode_buckets=(4,), max_num_batched_tokens=64, prefill_buckets=(64,),
              max_prefill_seqs=2)
    ref = llm.generate(TEXTS, GREEDY) + llm.chat(CHAT, GREEDY)
    cases = {name: _offline(llm, inp, sampling) for name, inp, sampling in CASES}
    st = ServerThread(llm.engine).start()
    yield st, ref, cases
    st.stop()


async def _streams(target: str) -> list[tuple[list[int], str]]:
    async with grpc.aio.insecure_channel(target) as ch:
        stub = pb_grpc.InferenceStub(ch)
        kw = {"temperature": 0.0, "max_tokens": GREEDY.max_tokens}

        async def one(req):
            ids, text = [], ""
            async for r in stub.Generate(req, timeout=120):
                ids += r.token_ids
                text += r.text
            return ids, text

        reqs = [build_request(t, **kw) for t in TEXTS] + [build_request(messages=CHAT, **kw)]
        return await asyncio.gather(*(one(r) for r in reqs))


def test_text_and_chat_streams_equal_offline(real_server):
    st, ref, _ = real_server
    got = asyncio.run(_streams(st.target))
    for (ids, text), o in zip(got, ref):
        assert ids == o.outputs[0].token_ids
        assert text == o.outputs[0].text  # incremental detokenization == decoding at once
    assert got[0][1].startswith(" Paris")
    assert "4" in got[2][1]
    with InferenceClient(st.target, timeout=120) as c:
        r = c.generate(messages=CHAT, temperature=0.0, max_tokens=GREEDY.max_tokens)
        assert r.text == ref[2].outputs[0].text and r.usage.completion_tokens == len(r.token_ids)


def test_tokenizer_rpcs_and_info(real_server):
    st, _, _ = real_server
    tok = st.engine.tokenizer
    with InferenceClient(st.target, timeout=30) as c:
        ids = c.tokenize(TEXTS[0])
        assert ids == tok.encode(TEXTS[0])
        assert c.detokenize(ids) == TEXTS[0]
        assert c.tokenize(messages=CHAT) == tok.apply_chat_template(CHAT)
        info = c.model_info()
        assert info.has_tokenizer and info.has_chat_template and info.model == "smollm2-135m"
        assert set(info.eos_token_ids) >= set(tok.eos_token_ids)
        for bad, needle in (({"prompt": ""}, "empty"),
                            ({"messages": [{"role": "user", "content": ""}]}, "content"),
                            ({"prompt": "x", "structured_outputs": {"regex": "(a"}},
                             "structured_outputs.regex is not a valid regex for this model"),
                            ({"prompt": "x", "structured_outputs": {"json": "{"}},
                             "structured_outputs.json is not JSON text")):
            with pytest.raises(grpc.RpcError) as e:
                c.generate(**bad, max_tokens=4)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert needle in e.value.details()
        assert c.generate(prompt="x", max_tokens=2).usage.completion_tokens == 2  # serving


def _req(inp: dict, sampling: dict) -> pb.GenerateRequest:
    return build_request(inp.get("prompt"), messages=inp.get("messages"), temperature=0.0,
                         **sampling)


async def _stream_and_unary(target: str) -> dict[str, tuple[list, pb.GenerateResponse]]:
    async with grpc.aio.insecure_channel(target) as ch:
        stub = pb_grpc.InferenceStub(ch)

        async def one(inp, sampling):
            msgs = [r async for r in stub.Generate(_req(inp, sampling), timeout=120)]
            return msgs, await stub.GenerateUnary(_req(inp, sampling), timeout=120)

        # One at a time: each step then batches what the offline run batched, so logprobs
        # are the same floats (a different batch may round differently on the CPU).
        got = [await one(inp, sp) for _, inp, sp in CASES]
    return {name: g for (name, _, _), g in zip(CASES, got)}


def _check_logprobs(got, want: list[dict[int, float]], k: int) -> None:
    """TokenLogprob messages against the engine's {chosen: lp, k best...} entries."""
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.logprob == np.float32(w[g.token_id])
        best = sorted(w.items(), key=lambda kv: (-kv[1], kv[0]))[:k]
        assert [t.token_id for t in g.top] == [i for i, _ in best]
        assert [t.logprob for t in g.top] == [np.float32(v) for _, v in best]


@pytest.fixture(scope="module")
def served_cases(real_server):
    st, _, cases = real_server
    return asyncio.run(_stream_and_unary(st.target)), cases


def test_stop_strings_stream_equals_offline(served_cases):
    got, cases = served_cases
    for name, stop in (("stop_dot", "."), ("stop_multi", "return n")):
        o = cases[name].outputs[0]
        assert o.finish_reason == "stop" and o.stop_reason == stop, name  # the case is valid
        msgs, unary = got[name]
        text = "".join(m.text for m in msgs)
        assert text == o.text and stop not in text and text, name
        assert [t for m in msgs for t in m.token_ids] == o.token_ids
        last = msgs[-1]
        assert last.finish_reason == pb.FINISH_REASON_STOP and last.stop_str == stop, name
        assert all(m.finish_reason == pb.FINISH_REASON_UNSPECIFIED for m in msgs[:-1])
        assert (unary.text, list(unary.token_ids), unary.stop_str) == (text, o.token_ids, stop)
    # The held-back start of "return n" ("return 1" comes first) is released, not lost.
    assert "return 1" in cases["stop_multi"].outputs[0].text


def test_logprobs_equal_offline(served_cases):
    got, cases = served_cases
    o = cases["logprobs"]
    msgs, unary = got["logprobs"]
    c = o.outputs[0]
    for lps, plps, last in (([x for m in msgs for x in m.logprobs],
                             [x for m in msgs for x in m.prompt_logprobs], msgs[-1]),
                            (unary.logprobs, unary.prompt_logprobs, unary)):
        assert [x.token_id for x in lps] == c.token_ids
        _check_logprobs(lps, c.logprobs, 3)
        assert [x.token_id for x in plps] == o.prompt_token_ids[1:]
        _check_logprobs(plps, o.prompt_logprobs[1:], 2)
        assert last.HasField("cumulative_logprob")
        assert last.cumulative_logprob == pytest.approx(c.cumulative_logprob, abs=1e-9)
    assert msgs[0].prompt_logprobs and not any(m.prompt_logprobs for m in msgs[1:])
    assert all(len(m.logprobs) == len(m.token_ids) for m in msgs)
    # logprobs=0: only the chosen token's; a stop token id ends it and is reported.
    o = cases["logprobs_stop"].outputs[0]
    msgs, unary = got["logprobs_stop"]
    assert o.finish_reason == "stop" and o.stop_reason == 30
    assert o.token_ids[-1] == 30 and not o.text.endswith(".")  # its text left out (vLLM v1)
    for lps, last in (([x for m in msgs for x in m.logprobs], msgs[-1]), (unary.logprobs, unary)):
        _check_logprobs(lps, o.logprobs, 0)
        assert last.WhichOneof("stop_reason") == "stop_token_id" and last.stop_token_id == 30
    assert not unary.prompt_logprobs and not got["stop_dot"][1].logprobs


def test_skip_special_tokens_false_keeps_special_tokens(served_cases):
    """The EOS that ends the output is in token_ids; its text only with
    include_stop_str_in_output (vLLM v1), and then only with skip_special_tokens=False."""
    got, cases = served_cases
    kept, skipped = cases["special_kept"].outputs[0], cases["special_skipped"].outputs[0]
    eos = cases["special_kept_eos"].outputs[0]
    assert kept.finish_reason == eos.finish_reason == "stop"
    assert kept.token_ids == skipped.token_ids == eos.token_ids
    assert eos.text == kept.text + "<|im_end|>" and kept.text == skipped.text
    assert "<|im_end|>" not in skipped.text
    for name, o in (("special_kept", kept), ("special_kept_eos", eos),
                    ("special_skipped", skipped)):
        msgs, unary = got[name]
        assert "".join(m.text for m in msgs) == o.text == unary.text, name
        assert msgs[-1].WhichOneof("stop_reason") is None  # EOS is no stop string or id


def test_bad_words_stream_equals_offline(served_cases):
    """vLLM's bad_words: "Paris" (one token in either form) never comes; "French Republic"
    (" French", " Republic") bans " Republic" only after " French", which still comes."""
    got, cases = served_cases
    o = cases["bad_words"].outputs[0]
    msgs, unary = got["bad_words"]
    text = "".join(m.text for m in msgs)
    assert text == o.text == unary.text and [t for m in msgs for t in m.token_ids] == o.token_ids
    assert "Paris" not in text and " French" in text and "French Republic" not in text, text


def test_unary_agrees_with_stream(served_cases):
    got, _ = served_cases
    for name, (msgs, unary) in got.items():
        assert list(unary.token_ids) == [t for m in msgs for t in m.token_ids], name
        assert unary.text == "".join(m.text for m in msgs), name
        last = msgs[-1]
        for f in ("finish_reason", "usage", "cumulative_logprob", "stop_str", "stop_token_id"):
            assert getattr(unary, f) == getattr(last, f), (name, f)
        assert unary.usage.completion_tokens == len(unary.token_ids) > 0


def test_structured_outputs_stream_equals_offline(served_cases):
    got, cases = served_cases
    for name in ("json_schema", "regex"):
        o = cases[name].outputs[0]
        assert o.finish_reason == "stop", (name, o)  # the grammar ended it
        msgs, unary = got[name]
        text = "".join(m.text for m in msgs)
        assert text == o.text == unary.text and list(unary.token_ids) == o.token_ids, name
    cat = json.loads(cases["json_schema"].outputs[0].text)
    assert set(cat) == {"name", "age"} and isinstance(cat["name"], str), cat
    assert isinstance(cat["age"], int) and 0 <= cat["age"] <= 40, cat
    assert re.fullmatch(r" (Rome|London|Paris)\.", cases["regex"].outputs[0].text)


@pytest.mark.parametrize("flags, ok", [
    (["--choice", " yes", "--choice", " no"], lambda t: t in (" yes", " no")),
    (["--regex", r" [0-9]{4}\."], lambda t: re.fullmatch(r" [0-9]{4}\.", t) is not None),
    (["--json-schema", json.dumps(CAT)], lambda t: set(json.loads(t)) == {"name", "age"}),
])
def test_client_structured_output_flags(real_server, capsys, flags, ok):
    from jaxinfer.cli import main

    st, _, _ = real_server
    assert main(["client", "--address", st.target, "--unary", *flags, "--max-tokens", "48",
                 "The Eiffel Tower was built in"]) == 0
    text = capsys.readouterr().out.rstrip("\n")
    assert ok(text), text
