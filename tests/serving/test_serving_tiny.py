"""gRPC serving over real loopback sockets, tiny random llama (token-id prompts)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import threading
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from jaxinfer.sampling_params import SamplingParams
from jaxinfer.serving import jaxinfer_pb2 as pb
from jaxinfer.serving import jaxinfer_pb2_grpc as pb_grpc
from jaxinfer.serving.client import InferenceClient, build_request
from jaxinfer.serving.engine_thread import EngineThread
from jaxinfer.serving.server import set_max_queue_len
from tests.serving.conftest import wait_until

SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "max_tokens", "min_tokens", "ignore_eos",
                   "stop_token_ids", "seed")


def _sampling(sp: SamplingParams) -> dict:
    return {k: getattr(sp, k) for k in SAMPLING_FIELDS if getattr(sp, k) is not None}


async def _stream_all(target: str, prompts, params) -> list[tuple[list[int], int, pb.Usage]]:
    async with grpc.aio.insecure_channel(target) as ch:
        stub = pb_grpc.InferenceStub(ch)

        async def one(i: int):
            ids, reason, usage = [], None, None
            req = build_request(token_ids=prompts[i], request_id=f"r{i}",
                                **_sampling(params[i]))
            async for r in stub.Generate(req, timeout=120):
                assert r.request_id == f"r{i}"
                assert reason is None, "a message after the final one"
                ids += r.token_ids
                if r.finish_reason:
                    reason, usage = r.finish_reason, r.usage
            return ids, reason, usage

        return await asyncio.gather(*(one(i) for i in range(len(prompts))))


def _free(st) -> int:
    return st.engine.scheduler.block_manager.num_free_pages


def _all_free(st) -> bool:
    bm = st.engine.scheduler.block_manager
    return bm.num_free_pages == bm.num_usable_pages and not st.engine.has_unfinished_requests()


def _slow_steps(st, seconds: float):
    """Make every engine step take at least ``seconds`` (set in the engine thread)."""
    engine = st.engine
    step = type(engine).step

    def slow(self=engine):
        time.sleep(seconds)
        return step(self)

    done = threading.Event()
    st.et.call(lambda e: (setattr(e, "step", slow), done.set()))
    done.wait(5)

    def restore():
        undone = threading.Event()
        st.et.call(lambda e: (e.__dict__.pop("step", None), undone.set()))
        undone.wait(5)

    return restore


def test_200_concurrent_streams_equal_offline(tiny_server):
    st, prompts, params, ref = tiny_server
    t0 = time.perf_counter()
    got = asyncio.run(_stream_all(st.target, prompts, params))
    dt = time.perf_counter() - t0
    want = [o.outputs[0].token_ids for o in ref]
    assert len({tuple(w) for w in want}) > 150, "outputs must differ to detect crossed streams"
    for i, ((ids, reason, usage), o) in enumerate(zip(got, ref)):
        assert ids == o.outputs[0].token_ids, f"stream {i}"
        assert pb.FinishReason.Name(reason) == f"FINISH_REASON_{o.outputs[0].finish_reason}" \
            .upper(), f"stream {i}"
        assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompts[i]), len(ids))
    wait_until(lambda: _all_free(st))
    # Prometheus counters saw the same requests and tokens.
    text = urllib.request.urlopen(f"http://127.0.0.1:{st.server.metrics_port}/metrics",
                                  timeout=10).read().decode()
    metrics = {ln.split(" ")[0]: float(ln.split(" ")[1]) for ln in text.splitlines()
               if ln and not ln.startswith("#")}
    assert metrics["jaxinfer_generation_tokens_total"] >= sum(len(g[0]) for g in got)
    assert metrics["jaxinfer_time_to_first_token_seconds_count"] >= 200
    assert metrics["jaxinfer_kv_pages_in_use"] == 0
    runner = st.engine.runner
    assert metrics["jaxinfer_num_compilations"] == runner.num_compilations
    assert metrics["jaxinfer_num_programs_loaded"] == getattr(runner, "num_loaded", 0)
    assert metrics["jaxinfer_num_compilations"] + metrics["jaxinfer_num_programs_loaded"] > 0
    assert "jaxinfer_inter_token_latency_seconds_bucket{le=\"0.1\"}" in metrics
    assert (metrics["jaxinfer_num_preemptions_total"]
            == st.engine.scheduler.num_preemptions_total)
    print(f"200 streams in {dt:.2f} s")


def test_unary_and_model_info(tiny_server):
    st, prompts, params, ref = tiny_server
    with InferenceClient(st.target, timeout=60) as c:
        r = c.generate(token_ids=prompts[3], **_sampling(params[3]))
        assert list(r.token_ids) == ref[3].outputs[0].token_ids
        assert r.usage.completion_tokens == len(r.token_ids) and r.finish_reason
        info = c.model_info()
        assert (info.max_model_len, info.block_size, info.vocab_size) == (128, 8, 96)
        assert list(info.decode_buckets) == [32] and list(info.prefill_buckets) == [64]
        assert not info.has_tokenizer
        # the pool as sized (null page included; the metric kv_pages_total leaves it out)
        bm = st.engine.scheduler.block_manager
        assert info.num_kv_pages == st.engine.runner.num_pages == bm.num_usable_pages + 1
        with pytest.raises(grpc.RpcError) as e:
            c.tokenize("hello")
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_cancel_mid_stream_frees_pages(tiny_server):
    st = tiny_server[0]
    wait_until(lambda: _all_free(st))
    aborts_before = st.server.metrics.requests.labels("abort")._value.get()
    restore = _slow_steps(st, 0.02)
    try:
        with InferenceClient(st.target, timeout=60) as c:
            stream = c.generate_stream(token_ids=list(range(2, 40)), max_tokens=80,
                                       ignore_eos=True, temperature=0.0)
            got = [next(stream) for _ in range(3)]
            assert all(len(r.token_ids) >= 1 and not r.finish_reason for r in got)
            in_use = st.engine.scheduler.block_manager.num_usable_pages - _free(st)
            assert in_use >= 5  # 38 prompt tokens + outputs in 8-token pages
            stream.cancel()
            freed_in = wait_until(lambda: _all_free(st), timeout=5)
    finally:
        restore()
    # Freed at the next step boundary: far sooner than the ~77 remaining 20 ms steps.
    assert freed_in < 0.5, f"pages freed {freed_in:.3f} s after cancel"
    assert st.server.metrics.requests.labels("abort")._value.get() == aborts_before + 1
    # The gauges follow the abort on an idle server (they used to keep the cancelled
    # request's running count and pages until the next request's step).
    m = st.server.metrics
    wait_until(lambda: (m.running._value.get(), m.pages_used._value.get()) == (0, 0),
               timeout=2)


def test_deadline_aborts_and_frees_pages(tiny_server):
    st = tiny_server[0]
    wait_until(lambda: _all_free(st))
    restore = _slow_steps(st, 0.02)
    try:
        with InferenceClient(st.target) as c:
            n = 0
            with pytest.raises(grpc.RpcError) as e:
                for r in c.generate_stream(token_ids=[5, 6, 7], max_tokens=100, ignore_eos=True,
                                           temperature=0.0, timeout=0.5):
                    n += len(r.token_ids)
            assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert 0 < n < 100
            t = wait_until(lambda: _all_free(st), timeout=5)
    finally:
        restore()
    assert t < 0.5


def _bad_requests() -> list[tuple[str, pb.GenerateRequest, str]]:
    ok = {"max_tokens": 4, "temperature": 0.0}
    cases = [
        ("no input", pb.GenerateRequest(), "no input"),
        ("empty ids", build_request(token_ids=[], **ok), "empty"),
        ("id out of vocab", build_request(token_ids=[5, 500], **ok), "500"),
        ("too long prompt", build_request(token_ids=[5] * 128, **ok), "max_model_len"),
        ("prompt+max_tokens", build_request(token_ids=[5] * 100, max_tokens=50),
         "prompt (100 tokens) + max_tokens (50) = 150 exceeds max_model_len (128)"),
        ("temperature", build_request(token_ids=[5], temperature=-1.0), "temperature"),
        ("top_p", build_request(token_ids=[5], top_p=0.0), "top_p"),
        ("top_k", build_request(token_ids=[5], top_k=-7), "top_k"),
        ("max_tokens", build_request(token_ids=[5], max_tokens=0), "max_tokens"),
        ("min_tokens", build_request(token_ids=[5], max_tokens=2, min_tokens=3), "min_tokens"),
        ("seed", build_request(token_ids=[5], seed=2**63), "seed"),
        ("n", build_request(token_ids=[5], n=0), "n must be in [1, 64]"),
        ("n > max_num_seqs", build_request(token_ids=[5], n=33), "max_num_seqs = 32"),
        ("logprobs", build_request(token_ids=[5], logprobs=21), "logprobs"),
        ("prompt_logprobs", build_request(token_ids=[5], prompt_logprobs=-1), "prompt_logprobs"),
        ("stop without tokenizer", build_request(token_ids=[5], stop=["x"]), "stop"),
        ("bad_words without tokenizer", build_request(token_ids=[5], bad_words=["x"], **ok),
         "bad_words need a tokenizer"),
        ("blank bad word", build_request(token_ids=[5], bad_words=["ok", " "], **ok),
         r"bad_words must hold non-empty strings, got ' ' at bad_words[1]"),
        ("stop id out of vocab", build_request(token_ids=[5], stop_token_ids=[7, 500], **ok),
         "stop_token_ids [500] are not in the vocabulary: ids must be in [0, 96)"),
        ("text without tokenizer", build_request("hello", **ok), "tokenizer"),
        ("structured outputs without tokenizer", build_request(
            token_ids=[5], structured_outputs=pb.StructuredOutputs(regex="[a-z]+"), **ok),
         "structured_outputs need a tokenizer; this model has none"),
        ("structured outputs, none set", build_request(
            token_ids=[5], structured_outputs=pb.StructuredOutputs(), **ok),
         "structured_outputs must set exactly one of json, regex, choice, grammar, "
         "json_object; got none"),
        ("structured outputs, json_object false", build_request(
            token_ids=[5], structured_outputs={"json_object": False}, **ok),
         "structured_outputs.json_object must be True, got False"),
        ("empty chat", build_request(messages=[], **ok), "chat.messages is empty"),
        ("chat without role", build_request(messages=[{"role": "", "content": "hi"}], **ok),
         "role is empty"),
        ("chat without content", build_request(messages=[{"role": "user", "content": ""}],
                                                **ok), "content is empty"),
    ]
    known = {f.name for f in dataclasses.fields(SamplingParams)}
    unknown = [f for f in ("min_p", "repetition_penalty", "logprobs") if f not in known]
    if unknown:  # a field the proto reserves but this engine does not accept yet
        req = build_request(token_ids=[5], **ok)
        setattr(req.sampling, unknown[0], 1)
        cases.append((unknown[0], req, f"sampling.{unknown[0]} is not supported"))
    return cases


@pytest.mark.parametrize("rpc", ["Generate", "GenerateUnary"])
def test_bad_requests_get_invalid_argument_and_server_keeps_serving(tiny_server, rpc):
    st, prompts, params, ref = tiny_server
    with grpc.insecure_channel(st.target) as ch:
        call = getattr(pb_grpc.InferenceStub(ch), rpc)
        for name, req, needle in _bad_requests():
            with pytest.raises(grpc.RpcError) as e:
                r = call(req, timeout=30)
                if rpc == "Generate":
                    list(r)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
            assert needle in e.value.details(), (name, e.value.details())
            # no engine-internal request number (the client's request_id is a string)
            assert not re.match(r"request \d+:", e.value.details()), (name, e.value.details())
        good = call(build_request(token_ids=prompts[0], **_sampling(params[0])), timeout=30)
        ids = [t for m in good for t in m.token_ids] if rpc == "Generate" else good.token_ids
        assert list(ids) == ref[0].outputs[0].token_ids
    wait_until(lambda: _all_free(st))


def _metrics(st) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{st.server.metrics_port}/metrics",
                                  timeout=10).read().decode()
    return {ln.split(" ")[0]: float(ln.split(" ")[1]) for ln in text.splitlines()
            if ln and not ln.startswith("#")}


@pytest.mark.parametrize("rpc", ["Generate", "GenerateUnary", "Tokenize"])
def test_request_that_does_not_parse_gets_invalid_argument(tiny_server, rpc):
    """Bytes that are not a valid message (a string field holding bad UTF-8) get
    INVALID_ARGUMENT naming the message, are counted as such, and the server keeps serving."""
    st, prompts, params, ref = tiny_server
    cls = pb.TokenizeRequest if rpc == "Tokenize" else pb.GenerateRequest
    good = cls(text="hellx") if rpc == "Tokenize" else cls(prompt="hellx")
    raw = good.SerializeToString().replace(b"hellx", b"\xff\xfe\xfd\xfc\xfb")
    with pytest.raises(Exception, match="UTF-8|utf-8"):
        cls.FromString(raw)  # what the server receives: it does not parse
    key = 'jaxinfer_requests_total{outcome="invalid_argument"}'
    before = _metrics(st).get(key, 0.0)
    with grpc.insecure_channel(st.target) as ch:
        streaming = rpc == "Generate"
        call = (ch.unary_stream if streaming else ch.unary_unary)(
            f"/jaxinfer.v1.Inference/{rpc}", request_serializer=None,
            response_deserializer=None)
        with pytest.raises(grpc.RpcError) as e:
            r = call(raw, timeout=30)
            if streaming:
                list(r)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"the {cls.DESCRIPTOR.name} does not parse" in e.value.details()
        ok = pb_grpc.InferenceStub(ch).GenerateUnary(
            build_request(token_ids=prompts[0], **_sampling(params[0])), timeout=30)
        assert list(ok.token_ids) == ref[0].outputs[0].token_ids
    assert _metrics(st).get(key, 0.0) == before + 1


def _varint(n: int) -> bytes:
    out = b""
    while True:
        low, n = n & 0x7F, n >> 7
        if not n:
            return out + bytes([low])
        out += bytes([low | 0x80])


def _raw_unary_refused(ch: grpc.Channel, raw: bytes) -> str:
    """Send ``raw`` bytes as a GenerateUnary request; assert INVALID_ARGUMENT, return the
    details."""
    call = ch.unary_unary("/jaxinfer.v1.Inference/GenerateUnary", request_serializer=None,
                          response_deserializer=None)
    with pytest.raises(grpc.RpcError) as e:
        call(raw, timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    return e.value.details()


@pytest.mark.parametrize("where", ["request", "sampling"])
def test_unknown_fields_get_invalid_argument(tiny_server, where):
    """A field this server's schema lacks (a newer client's, here number 99) is refused with
    INVALID_ARGUMENT naming where it sits, not dropped; the server keeps serving."""
    st, prompts, params, ref = tiny_server
    unknown = _varint(99 << 3) + _varint(5)  # field 99, varint 5
    req = build_request(token_ids=prompts[0], **_sampling(params[0]))
    if where == "sampling":
        sampling = req.sampling.SerializeToString() + unknown
        req.ClearField("sampling")  # field 2 re-added by hand, unknown field inside
        field = pb.GenerateRequest.DESCRIPTOR.fields_by_name["sampling"].number
        raw = req.SerializeToString() + _varint(field << 3 | 2) + _varint(len(sampling)) + sampling
    else:
        raw = req.SerializeToString() + unknown
    assert pb.GenerateRequest.FromString(raw)  # it parses: protobuf keeps unknown fields
    with grpc.insecure_channel(st.target) as ch:
        details = _raw_unary_refused(ch, raw)
        path = "sampling.#99" if where == "sampling" else "#99"
        assert f"fields this server does not know: {path} " in details
        ok = pb_grpc.InferenceStub(ch).GenerateUnary(req if where == "request" else
                                                     build_request(token_ids=prompts[0],
                                                                   **_sampling(params[0])),
                                                     timeout=30)
        assert list(ok.token_ids) == ref[0].outputs[0].token_ids


def test_tokenizing_a_prompt_does_not_hold_up_the_server(tiny_server, monkeypatch):
    """A prompt is encoded off the event loop: while one encode is under way, the health
    check and another request are answered (both return before the encode ends)."""
    from tests.core.test_tokenizer import _tiny_tokenizer

    st, prompts, params, ref = tiny_server
    tok = _tiny_tokenizer()
    encode, started, finished = tok.encode, threading.Event(), threading.Event()

    def slow_encode(*args, **kw):
        started.set()
        time.sleep(8.0)
        finished.set()
        return encode(*args, **kw)

    monkeypatch.setattr(tok, "encode", slow_encode)
    monkeypatch.setattr(st.engine, "tokenizer", tok)
    with grpc.insecure_channel(st.target) as ch:
        stub = pb_grpc.InferenceStub(ch)
        slow = stub.GenerateUnary.future(build_request("hello world", max_tokens=2,
                                                       temperature=0.0), timeout=60)
        assert started.wait(10)
        with InferenceClient(st.target, timeout=10) as c:
            assert c.health() == "SERVING"
        ok = stub.GenerateUnary(build_request(token_ids=prompts[0], **_sampling(params[0])),
                                timeout=30)
        assert not finished.is_set(), "health and the request waited for the encode"
        assert list(ok.token_ids) == ref[0].outputs[0].token_ids
        assert len(slow.result().token_ids) == 2


def test_chat_with_an_unknown_role_gets_invalid_argument(tiny_server, monkeypatch):
    from tests.core.test_tokenizer import _ROLE_TEMPLATE, _tiny_tokenizer

    st, prompts, params, ref = tiny_server
    with grpc.insecure_channel(st.target) as ch:
        stub = pb_grpc.InferenceStub(ch)
        with monkeypatch.context() as m:  # a chat template for the server's check only: the
            m.setattr(st.engine, "tokenizer", _tiny_tokenizer(_ROLE_TEMPLATE))  # request
            with pytest.raises(grpc.RpcError) as e:  # fails before reaching the engine
                stub.GenerateUnary(build_request(messages=[{"role": "robot", "content": "hi"}],
                                                 max_tokens=2), timeout=30)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert ("chat: messages[0].role must be one of system, user, assistant, tool; got "
                "'robot'") in e.value.details()
        good = stub.GenerateUnary(build_request(token_ids=prompts[0], **_sampling(params[0])),
                                  timeout=30)
        assert list(good.token_ids) == ref[0].outputs[0].token_ids


def test_oversized_chat_is_refused_before_rendering(tiny_server, monkeypatch):
    from tests.core.test_tokenizer import _ROLE_TEMPLATE, _tiny_tokenizer

    st, prompts, params, ref = tiny_server
    tok = _tiny_tokenizer(_ROLE_TEMPLATE)

    def render(*args, **kw):
        raise AssertionError("the oversized conversation was rendered")

    monkeypatch.setattr(tok, "render_chat", render)
    monkeypatch.setattr(st.engine, "tokenizer", tok)
    limit = st.engine.config.max_model_len
    half = "hello " * (limit * tok.max_token_chars)  # two of them: > 4 x longest x limit chars
    with grpc.insecure_channel(st.target) as ch:
        with pytest.raises(grpc.RpcError) as e:
            pb_grpc.InferenceStub(ch).GenerateUnary(build_request(
                messages=[{"role": "user", "content": half}, {"role": "user", "content": half}],
                max_tokens=2), timeout=30)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (f"chat: prompt has {2 * len(half)} characters, so at least "
                f"{tok.min_tokens(half, half)} tokens; max_model_len is {limit}"
                in e.value.details())
        tokenize = pb_grpc.InferenceStub(ch).Tokenize  # as vLLM's /tokenize: refused too
        two = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=half)] * 2)
        for req in [pb.TokenizeRequest(text=2 * half), pb.TokenizeRequest(chat=two)]:
            with pytest.raises(grpc.RpcError) as e:
                tokenize(req, timeout=30)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert (f"prompt has {2 * len(half)} characters, so at least "
                    f"{tok.min_tokens(half, half)} "
                    f"tokens; max_model_len is {limit}" in e.value.details())


def test_tokenize_refuses_a_text_over_max_model_len_after_encoding(tiny_server, monkeypatch):
    """A text short enough in characters to pass the lower bound but encoding to more than
    max_model_len tokens is refused too (counted after encoding); a request with no input
    says so without a kind prefix."""
    from tests.core.test_tokenizer import _ROLE_TEMPLATE, _tiny_tokenizer

    st = tiny_server[0]
    tok = _tiny_tokenizer(_ROLE_TEMPLATE)
    monkeypatch.setattr(st.engine, "tokenizer", tok)
    limit = st.engine.config.max_model_len
    text = "hello " * (limit + 5)
    n = len(tok.encode(text))
    assert n > limit and tok.min_tokens(text) <= limit  # passes the character bound
    with grpc.insecure_channel(st.target) as ch:
        tokenize = pb_grpc.InferenceStub(ch).Tokenize
        with pytest.raises(grpc.RpcError) as e:
            tokenize(pb.TokenizeRequest(text=text), timeout=30)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.details() == f"text: the text is {n} tokens; max_model_len is {limit}"
        with pytest.raises(grpc.RpcError) as e:
            tokenize(pb.TokenizeRequest(), timeout=30)
        assert e.value.details() == "request has no input: set text or chat"
        fits = "hello " * (limit // 4)
        assert list(tokenize(pb.TokenizeRequest(text=fits), timeout=30).token_ids) == (
            tok.encode(fits))
        # A conversation is held to the same limit (it came back whole, over it).
        chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=text)])
        n_chat = len(st.engine.encode_chat([{"role": "user", "content": text}]))
        assert n_chat > limit
        with pytest.raises(grpc.RpcError) as e:
            tokenize(pb.TokenizeRequest(chat=chat), timeout=30)
        assert e.value.details() == (f"chat: the conversation is {n_chat} tokens; "
                                     f"max_model_len is {limit}")
        short = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hello")])
        assert list(tokenize(pb.TokenizeRequest(chat=short), timeout=30).token_ids) == (
            st.engine.encode_chat([{"role": "user", "content": "hello"}]))


def test_full_queue_gives_resource_exhausted(tiny_server):
    """max_queue_len 2: of max_num_seqs + 5 requests at once, the max_num_seqs places take
    as many, 2 wait for a place, 3 are refused."""
    st = tiny_server[0]
    wait_until(lambda: _all_free(st))
    gate, paused = threading.Event(), threading.Event()
    st.et.call(lambda e: (set_max_queue_len(e, 2), paused.set(), gate.wait(30)))
    assert paused.wait(10)
    places = st.engine.config.max_num_seqs
    n = places + 5
    results: list = [None] * n

    def one(i: int) -> None:
        with InferenceClient(st.target, timeout=60) as c:
            try:
                results[i] = c.generate(token_ids=[3 + i % 90, 4], max_tokens=3,
                                        temperature=0.0)
            except grpc.RpcError as e:
                results[i] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    try:
        for t in threads:
            t.start()
        # All wait in the inbox; the engine admits them in one go once released.
        wait_until(lambda: st.et._inbox.qsize() >= n)
    finally:
        gate.set()
        for t in threads:
            t.join(60)
        st.et.call(lambda e: set_max_queue_len(e, None))
    errs = [r for r in results if isinstance(r, grpc.RpcError)]
    oks = [r for r in results if isinstance(r, pb.GenerateResponse)]
    assert len(oks) == places + 2 and len(errs) == 3
    assert all(e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for e in errs)
    assert all("max_queue_len" in e.details() for e in errs)
    wait_until(lambda: _all_free(st))


def test_fault_in_one_request_fails_only_that_request(tiny_server, monkeypatch):
    st, prompts, params, ref = tiny_server
    items = EngineThread._items

    def faulty(self, h, out, now):
        if h.prompt_ids[0] == 95 and h.num_sent[0] >= 2:
            raise RuntimeError("injected fault")
        return items(self, h, out, now)

    monkeypatch.setattr(EngineThread, "_items", faulty)
    bad = [95] + prompts[1]
    sub = list(range(8))
    reqs = [prompts[i] for i in sub] + [bad]
    sps = [params[i] for i in sub] + [SamplingParams(temperature=0.0, max_tokens=20,
                                                     ignore_eos=True)]

    async def run():
        async with grpc.aio.insecure_channel(st.target) as ch:
            stub = pb_grpc.InferenceStub(ch)

            async def one(p, sp):
                try:
                    return await stub.GenerateUnary(build_request(token_ids=p, **_sampling(sp)),
                                                    timeout=60)
                except grpc.aio.AioRpcError as e:
                    return e

            return await asyncio.gather(*(one(p, sp) for p, sp in zip(reqs, sps)))

    out = asyncio.run(run())
    assert isinstance(out[-1], grpc.aio.AioRpcError)
    assert out[-1].code() == grpc.StatusCode.INTERNAL and "injected" in out[-1].details()
    for r, i in zip(out[:-1], sub):
        assert list(r.token_ids) == ref[i].outputs[0].token_ids
    wait_until(lambda: _all_free(st))  # the failed request's pages are back too

    # A fault in a whole step (here the device program) fails the requests running in it;
    # the next request is served.
    monkeypatch.setattr(EngineThread, "_items", items)
    calls = {"n": 0}
    runner = st.engine.runner
    # Every step's device programs are dispatched by runner.launch (runner.execute calls it;
    # async scheduling calls it directly).
    launch = type(runner).launch

    def broken(*a, **kw):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("device fell over")
        return launch(runner, *a, **kw)

    st.et.call(lambda e: setattr(e.runner, "launch", broken))
    try:
        with InferenceClient(st.target, timeout=60) as c:
            with pytest.raises(grpc.RpcError) as e:
                c.generate(token_ids=prompts[2], **_sampling(params[2]))
            assert e.value.code() == grpc.StatusCode.INTERNAL
            assert "device fell over" in e.value.details()
            r = c.generate(token_ids=prompts[2], **_sampling(params[2]))
            assert list(r.token_ids) == ref[2].outputs[0].token_ids
    finally:
        st.et.call(lambda e: e.runner.__dict__.pop("launch", None))
    wait_until(lambda: _all_free(st))


def test_health_and_reflection(tiny_server):
    st = tiny_server[0]
    with InferenceClient(st.target, timeout=10) as c:
        assert c.health() == "SERVING"
        assert c.health("jaxinfer.v1.Inference") == "SERVING"
        with grpc.insecure_channel(st.target) as ch:
            stub = reflection_pb2_grpc.ServerReflectionStub(ch)
            reqs = [reflection_pb2.ServerReflectionRequest(list_services=""),
                    reflection_pb2.ServerReflectionRequest(
                        file_containing_symbol="jaxinfer.v1.Inference")]
            resps = list(stub.ServerReflectionInfo(iter(reqs), timeout=10))
        names = {s.name for s in resps[0].list_services_response.service}
        assert {"jaxinfer.v1.Inference", "grpc.health.v1.Health"} <= names
        assert resps[1].file_descriptor_response.file_descriptor_proto
    assert health_pb2.HealthCheckResponse.SERVING == 1


def test_client_cli(tiny_server, capsys):
    from jaxinfer.cli import main

    st, prompts, params, ref = tiny_server
    ids = " ".join(map(str, prompts[4]))
    args = ["client", "--address", st.target, "--token-ids", "--show-ids", "--max-tokens",
            str(params[4].max_tokens)] + (["--ignore-eos"] if params[4].ignore_eos else [])
    assert main(args + [ids]) == 0
    assert f'"token_ids": {ref[4].outputs[0].token_ids}' in capsys.readouterr().out
    assert main(["client", "--address", st.target, "--info"]) == 0
    assert '"health": "SERVING"' in capsys.readouterr().out
    assert main(["client", "--address", st.target, "--token-ids", "5 999"]) == 2
    assert "INVALID_ARGUMENT" in capsys.readouterr().err
    # refused in the client, each naming what is wrong (a protobuf "Value out of range: -3",
    # an int() literal error before)
    assert main(["client", "--address", st.target, "--seed", "-3", "hi"]) == 2
    assert "sampling parameter seed=-3 does not fit the request" in capsys.readouterr().err
    assert main(["client", "--address", st.target, "--token-ids", "1 x"]) == 2
    assert "client --token-ids: '1 x' is not space-separated integers" in \
        capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["client", "--address", st.target, "--chat", "--token-ids", "1"])
    assert "not allowed with argument --chat" in capsys.readouterr().err
    # stop ids, min_tokens and truncation reach the server: the same tokens as the Python
    # client sends with them
    long_ids = [int(3 + (i * 11) % 90) for i in range(200)]
    with InferenceClient(st.target, timeout=60) as c:
        want = c.generate(token_ids=long_ids[-30:], max_tokens=6, temperature=0,
                          min_tokens=4, stop_token_ids=[7, 9])
    assert main(["client", "--address", st.target, "--token-ids", "--show-ids",
                 "--max-tokens", "6", "--min-tokens", "4", "--stop-token-ids", "7, 9",
                 "--truncate-prompt-tokens", "30", " ".join(map(str, long_ids))]) == 0
    assert f'"token_ids": {list(want.token_ids)}' in capsys.readouterr().out
    assert main(["client", "--address", st.target, "--token-ids", "--show-ids",
                 "--max-tokens", "6", "--ignore-eos", "--allowed-token-ids", "4,8,15",
                 " ".join(map(str, long_ids[:5]))]) == 0
    shown = capsys.readouterr().out
    ids = json.loads(shown[shown.index('{'):])["token_ids"]
    assert len(ids) == 6 and set(ids) <= {4, 8, 15}
    with pytest.raises(SystemExit):
        main(["client", "--address", st.target, "--stop-token-ids", "7,x", "hi"])
    assert "must be comma-separated integers, got '7,x'" in capsys.readouterr().err
    assert main(["client", "--address", st.target, "--token-ids", "--show-ids",
                 "--max-tokens", "3", "--ignore-eos", "--logit-bias", '{"15": 100}',
                 " ".join(map(str, long_ids[:5]))]) == 0
    shown = capsys.readouterr().out
    assert json.loads(shown[shown.index('{'):])["token_ids"] == [15, 15, 15]
    # --n 2: each sample under its header, as the Python client's unary samples (a seed
    # makes them reproducible), from a stream and from a unary call
    with InferenceClient(st.target, timeout=60) as c:
        want = c.generate(token_ids=long_ids[:5], max_tokens=4, temperature=1.0, seed=7, n=2,
                          ignore_eos=True).samples
    assert len(want) == 2 and want[0].token_ids != want[1].token_ids
    for unary in ([], ["--unary"]):
        assert main(["client", "--address", st.target, "--token-ids", "--show-ids", *unary,
                     "--max-tokens", "4", "--temperature", "1", "--seed", "7", "--n", "2",
                     "--ignore-eos", " ".join(map(str, long_ids[:5]))]) == 0
        blocks = capsys.readouterr().out.split("--- sample ")
        assert blocks[0] == "" and len(blocks) == 3, blocks
        for i, b in enumerate(blocks[1:]):
            assert b.startswith(f"{i}\n"), b
            assert f'"token_ids": {list(want[i].token_ids)}' in b, (unary, b)
    for bad, msg in (('{"x": 1}', "keys must be token ids"), ("[1]", "must be a JSON object"),
                     ('{"13": 1, "013": 2}', "token 13 is given twice"),
                     ('{"3": "a"}', "the bias of token 3 must be a number")):
        with pytest.raises(SystemExit):
            main(["client", "--address", st.target, "--logit-bias", bad, "hi"])
        assert msg in capsys.readouterr().err


def test_build_request_fields_and_errors():
    r = build_request("hi", seed=3, stop="a", stop_token_ids=[1, 2], temperature=0.5)
    assert (r.prompt, r.sampling.seed, list(r.sampling.stop)) == ("hi", 3, ["a"])
    assert list(r.sampling.stop_token_ids) == [1, 2] and r.sampling.temperature == 0.5
    assert not r.sampling.HasField("top_k")  # unset stays unset (the server's default)
    with pytest.raises(ValueError, match=r"sampling parameter bogus=1 does not fit the "
                                         r"request: .*no \"bogus\" field"):
        build_request("hi", bogus=1)
    with pytest.raises(ValueError, match=r"stop_token_ids=\[-1\] does not fit the request"):
        build_request("hi", stop_token_ids=[-1])
    with pytest.raises(ValueError, match="exactly one of prompt, token_ids, messages"):
        build_request("hi", token_ids=[1])
    r = build_request("hi", logit_bias={5: -100.0, 7: 2.5})  # a map field
    assert dict(r.sampling.logit_bias) == {5: -100.0, 7: 2.5}
    with pytest.raises(ValueError, match=r"logit_bias\[5\]=1e\+39 does not fit the request: "
                                         r"it is past float32's range"):
        build_request("hi", logit_bias={5: 1e39})  # (protobuf would send inf)


def test_health_is_not_serving_during_warmup(monkeypatch):
    from jaxinfer.engine import LLMEngine
    from jaxinfer.serving import server as server_mod
    from tests.conftest import tiny_loaded
    from tests.serving.conftest import TINY_ARGS, ServerThread

    gate = threading.Event()
    real = server_mod.warm_up

    def gated(engine, *a, **kw):
        assert gate.wait(60)
        return real(engine, *a, **kw)

    monkeypatch.setattr(server_mod, "warm_up", gated)
    st = ServerThread(LLMEngine(tiny_loaded("llama"), **TINY_ARGS))
    st._thread.start()
    try:
        wait_until(lambda: st.server is not None and st.server.port != 0, timeout=60)
        with InferenceClient(st.target, timeout=10) as c:
            wait_until(lambda: c.health() == "NOT_SERVING", timeout=10)
            assert c.health("jaxinfer.v1.Inference") == "NOT_SERVING"
            gate.set()
            assert st._ready.wait(120) and st.error is None
            assert c.health() == "SERVING"
            assert st.engine.runner.num_compilations + getattr(st.engine.runner, "num_loaded",
                                                               0) > 0
    finally:
        gate.set()
        st.stop()


# ---------------------------------------------------------------- n > 1 samples


def _stream_samples(target: str, req: pb.GenerateRequest) -> tuple[list[pb.GenerateResponse],
                                                                    dict[int, list[int]]]:
    with InferenceClient(target, timeout=60) as c:
        msgs = list(c.stub.Generate(req, timeout=60))
    ids: dict[int, list[int]] = {}
    finished: set[int] = set()
    for m in msgs:
        assert m.index not in finished, "a message after the sample's final one"
        ids.setdefault(m.index, []).extend(m.token_ids)
        if m.finish_reason:
            finished.add(m.index)
            assert (m.usage.prompt_tokens, m.usage.completion_tokens) == (
                len(req.prompt_token_ids.ids), len(ids[m.index]))
    assert finished == set(ids), "every sample ends with its finish_reason"
    return msgs, ids


def test_samples_stream_by_index_and_match_unary(tiny_server):
    st, prompts, params, ref = tiny_server
    runner = st.engine.runner
    programs = (runner.num_compilations, runner.num_loaded)  # the copy program: at warm-up
    # Greedy: three copies of the offline n = 1 output.
    greedy = build_request(token_ids=prompts[5], n=3, **_sampling(params[5]))
    _, ids = _stream_samples(st.target, greedy)
    assert ids == {i: ref[5].outputs[0].token_ids for i in range(3)}
    # Seeded sampling: the stream and the unary response carry the same samples.
    req = build_request(token_ids=prompts[7], n=4, seed=123, temperature=1.0, max_tokens=12,
                        ignore_eos=True)
    msgs, ids = _stream_samples(st.target, req)
    assert sorted(ids) == [0, 1, 2, 3] and len({tuple(t) for t in ids.values()}) == 4
    assert len({m.index for m in msgs[:8]}) > 1, "the samples' messages interleave"
    with InferenceClient(st.target, timeout=60) as c:
        unary = c.stub.GenerateUnary(req, timeout=60)
    assert [s.index for s in unary.samples] == [0, 1, 2, 3]
    assert [list(s.token_ids) for s in unary.samples] == [ids[i] for i in range(4)]
    top = pb.GenerateResponse()
    top.CopyFrom(unary)
    top.ClearField("samples")
    assert top == unary.samples[0]  # the top level repeats sample 0
    assert all(s.usage.completion_tokens == 12 and s.finish_reason == pb.FINISH_REASON_LENGTH
               for s in unary.samples)
    wait_until(lambda: _all_free(st))
    assert (runner.num_compilations, runner.num_loaded) == programs


def test_cancel_mid_stream_frees_every_sample(tiny_server):
    st = tiny_server[0]
    wait_until(lambda: _all_free(st))
    restore = _slow_steps(st, 0.02)
    try:
        with InferenceClient(st.target, timeout=60) as c:
            stream = c.generate_stream(token_ids=list(range(2, 40)), max_tokens=80, n=4,
                                       ignore_eos=True, temperature=1.0)
            got = [next(stream) for _ in range(6)]
            assert len({r.index for r in got}) > 1 and not any(r.finish_reason for r in got)
            stream.cancel()
            wait_until(lambda: _all_free(st), timeout=5)
    finally:
        restore()


def test_a_known_field_of_the_wrong_wire_type_is_named_as_such(tiny_server):
    """``sampling`` (field 5, a message) sent as a varint was reported as a field "this
    server does not know: #5"."""
    st, prompts, params, ref = tiny_server
    field = pb.GenerateRequest.DESCRIPTOR.fields_by_name["sampling"].number
    raw = build_request(token_ids=[5, 6]).SerializeToString() + _varint(field << 3) + _varint(1)
    with grpc.insecure_channel(st.target) as ch:
        assert _raw_unary_refused(ch, raw) == (
            f"GenerateRequest has fields of the wrong wire type: sampling (#{field}) (a "
            f"client built from another schema?)")


def test_truncate_prompt_tokens_over_the_wire(tiny_server):
    """A token-id prompt over max_model_len runs as its last k ids (usage counts k); a k
    above max_model_len is INVALID_ARGUMENT, named; the server keeps serving."""
    st = tiny_server[0]
    ids = [int(3 + (i * 7) % 90) for i in range(300)]  # max_model_len 128
    with InferenceClient(st.target, timeout=60) as c:
        got = c.generate(token_ids=ids, max_tokens=4, temperature=0, ignore_eos=True,
                         truncate_prompt_tokens=20)
        want = c.generate(token_ids=ids[-20:], max_tokens=4, temperature=0, ignore_eos=True)
        assert list(got.token_ids) == list(want.token_ids) and got.usage.prompt_tokens == 20
        with pytest.raises(grpc.RpcError) as e:
            c.generate(token_ids=ids, max_tokens=4, truncate_prompt_tokens=200)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "truncate_prompt_tokens (200) is greater than max_model_len (128)" in (
            e.value.details())
        assert c.generate(token_ids=ids[:5], max_tokens=2).usage.completion_tokens >= 1
    wait_until(lambda: _all_free(st))


def test_chat_options_over_the_wire(tiny_server, monkeypatch):
    """ChatMessages' add_generation_prompt, continue_final_message (add_generation_prompt then
    defaults to false) and chat_template_kwargs render as the tokenizer does with them, in
    Tokenize and in Generate; both set at once is INVALID_ARGUMENT."""
    from tests.core.test_tokenizer import _GEN_TEMPLATE, _tiny_tokenizer

    st = tiny_server[0]
    tok = _tiny_tokenizer("{% if greet %}hello {% endif %}" + _GEN_TEMPLATE)
    monkeypatch.setattr(st.engine, "tokenizer", tok)
    conv = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "world"}]
    cases = [({}, {}),
             ({"add_generation_prompt": False}, {"add_generation_prompt": False}),
             ({"continue_final_message": True},
              {"add_generation_prompt": False, "continue_final_message": True}),
             ({"chat_template_kwargs": {"greet": True}}, {"chat_template_kwargs": {"greet": True}})]
    with InferenceClient(st.target, timeout=60) as c:
        for wire, local in cases:
            want = tok.apply_chat_template(conv, **local)
            assert c.tokenize(messages=conv, chat_options=wire) == want, wire
            r = c.generate(messages=conv, chat_options=wire, max_tokens=2, temperature=0,
                           ignore_eos=True)
            assert r.usage.prompt_tokens == len(want), wire
        with pytest.raises(grpc.RpcError) as e:
            c.generate(messages=conv, chat_options={"add_generation_prompt": True,
                                                    "continue_final_message": True})
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "continue_final_message and add_generation_prompt cannot both" in e.value.details()
    with pytest.raises(ValueError, match=r"unknown chat option\(s\) \['chat_template'\]"):
        build_request(messages=conv, chat_options={"chat_template": "x"})
    wait_until(lambda: _all_free(st))


def test_chat_options_are_checked_where_they_are_built():
    """Struct numbers come back whole where they are (a template's range(n) wants an int);
    NaN names the field; the client refuses options it cannot send (non-bools, options
    without messages, kwargs a Struct cannot hold) by name."""
    from jaxinfer.serving.protocol import InvalidRequest, chat_options

    msg = pb.ChatMessages()
    msg.chat_template_kwargs.update({"n": 3, "x": 2.5, "deep": {"m": [1, 2.0, "a"]},
                                     "flag": False})
    assert chat_options(msg) == {"add_generation_prompt": True, "continue_final_message": False,
                                 "chat_template_kwargs": {"n": 3, "x": 2.5, "flag": False,
                                                          "deep": {"m": [1, 2, "a"]}}}
    nan = pb.ChatMessages()
    nan.chat_template_kwargs.update({"v": float("nan")})
    with pytest.raises(InvalidRequest, match="chat.chat_template_kwargs: "):
        chat_options(nan)
    conv = [{"role": "user", "content": "hello"}]
    with pytest.raises(ValueError, match="chat_options apply to messages only"):
        build_request("hi", chat_options={"continue_final_message": True})
    with pytest.raises(ValueError, match="chat option add_generation_prompt must be a bool, "
                                         "got 'false'"):
        build_request(messages=conv, chat_options={"add_generation_prompt": "false"})
    with pytest.raises(ValueError, match="chat option chat_template_kwargs must be a JSON-like"):
        build_request(messages=conv, chat_options={"chat_template_kwargs": {1: 2}})


def test_allowed_token_ids_over_the_wire(tiny_server):
    """allowed_token_ids reach the engine (every token inside the set); an id outside the
    vocabulary is INVALID_ARGUMENT, named."""
    st, prompts = tiny_server[0], tiny_server[1]
    allowed = [4, 8, 15, 16, 23, 42]
    with InferenceClient(st.target, timeout=60) as c:
        r = c.generate(token_ids=prompts[0], max_tokens=12, temperature=1.0, seed=3,
                       ignore_eos=True, allowed_token_ids=allowed)
        assert len(r.token_ids) == 12 and set(r.token_ids) <= set(allowed)
        with pytest.raises(grpc.RpcError) as e:
            c.generate(token_ids=prompts[0], max_tokens=2, allowed_token_ids=[4, 500])
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "allowed_token_ids [500] are not in the vocabulary" in e.value.details()
    wait_until(lambda: _all_free(st))


def test_logit_bias_over_the_wire(tiny_server):
    """logit_bias reaches the engine as a map: +100 on one token makes every greedy token
    that token, -100 on the unbiased greedy first token changes it; a key outside the
    vocabulary and a non-finite bias are INVALID_ARGUMENT, named; the CLI client takes
    OpenAI's JSON form."""
    st, prompts = tiny_server[0], tiny_server[1]
    with InferenceClient(st.target, timeout=60) as c:
        plain = c.generate(token_ids=prompts[0], max_tokens=4, temperature=0, ignore_eos=True)
        forced = c.generate(token_ids=prompts[0], max_tokens=4, temperature=0,
                            ignore_eos=True, logit_bias={42: 100.0})
        assert list(forced.token_ids) == [42] * 4
        banned = c.generate(token_ids=prompts[0], max_tokens=1, temperature=0,
                            ignore_eos=True, logit_bias={plain.token_ids[0]: -100.0})
        assert banned.token_ids[0] != plain.token_ids[0]
        for bias, msg in (({4: 1.0, 500: 2.0}, "logit_bias [500] are not in the vocabulary"),
                          ({4: float("inf")}, "logit_bias[4] must be finite")):
            with pytest.raises(grpc.RpcError) as e:
                c.generate(token_ids=prompts[0], max_tokens=2, logit_bias=bias)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert msg in e.value.details()
    wait_until(lambda: _all_free(st))


def test_warmup_prefill_builds_every_prefill_program_before_serving():
    """``serve --warmup-prefill`` (InferenceServer warmup="prefill"): every reachable prefill
    program is built before SERVING, so requests of several prompt lengths then build none;
    a warmup value other than True / False / "prefill" is refused by name."""
    from jaxinfer.compile import enumerate_programs
    from jaxinfer.config import ConfigError
    from jaxinfer.engine import LLMEngine
    from jaxinfer.serving.cli import add_serve_parser
    from jaxinfer.serving.server import InferenceServer
    from tests.conftest import tiny_loaded
    from tests.serving.conftest import TINY_ARGS, ServerThread

    engine = LLMEngine(tiny_loaded("llama"), **{**TINY_ARGS, "prefill_buckets": (16, 64)})
    with pytest.raises(ConfigError, match="warmup must be True, False, 'prefill' or 'auto'"):
        InferenceServer(engine, port=0, warmup="yes")
    st = ServerThread(engine, warmup="prefill").start()
    try:
        r = engine.runner
        prefills = {(p.mode, p.bucket) for p in enumerate_programs(engine.config, ["sample"])
                    if p.bucket.kind == "prefill"}
        assert len(prefills) > 2 and prefills <= set(r._executables)
        n = r.num_compilations + r.num_loaded
        with InferenceClient(st.target, timeout=60) as c:
            for length in (3, 20, 50):
                out = c.generate(token_ids=list(range(1, length + 1)), max_tokens=3,
                                 ignore_eos=True)
                assert len(out.token_ids) == 3
        assert r.num_compilations + r.num_loaded == n
    finally:
        st.stop()
    import argparse

    p = argparse.ArgumentParser()
    add_serve_parser(p.add_subparsers())
    assert p.parse_args(["serve", "--warmup-prefill"]).warmup_prefill is True


def test_serving_freezes_the_gc_heap_and_a_stopped_server_lets_its_engine_go():
    """After its warm-up a server freezes the garbage collector's heap (warmup.freeze_gc_heap,
    as vLLM), so collections skip the start-up's objects; ``stop`` unfreezes it (frozen
    cycles would never be collected), and nothing of the server keeps the engine alive."""
    import gc
    import weakref

    from jaxinfer.engine import LLMEngine
    from tests.conftest import tiny_loaded
    from tests.serving.conftest import TINY_ARGS, ServerThread

    engine = LLMEngine(tiny_loaded("llama"), **TINY_ARGS)
    st = ServerThread(engine, warmup=False).start()
    try:
        assert gc.get_freeze_count() > 1000
        with InferenceClient(st.target, timeout=60) as c:
            assert len(c.generate(token_ids=[1, 2, 3], max_tokens=2,
                                  ignore_eos=True).token_ids) == 2
    finally:
        st.stop()
    assert gc.get_freeze_count() == 0
    ref = weakref.ref(engine)
    del engine, st
    gc.collect()
    assert ref() is None


@pytest.mark.parametrize("argv, backend, want", [
    ([], "cpu", True), ([], "gpu", "prefill"), (["--warmup-prefill"], "cpu", "prefill"),
    (["--no-warmup-prefill"], "gpu", True), (["--no-warmup"], "gpu", False),
    (["--no-warmup", "--warmup-prefill"], "cpu", False)])
def test_serve_warms_the_prefill_programs_by_default_on_a_gpu(monkeypatch, argv, backend, want):
    """``serve``'s flags and ``InferenceServer``'s default ("auto") resolve alike: the
    prefill programs too on a GPU backend, the decode ones only on the CPU."""
    import argparse

    import jax

    from jaxinfer.engine import LLMEngine
    from jaxinfer.serving.cli import _warmup_mode, add_serve_parser
    from jaxinfer.serving.server import InferenceServer
    from jaxinfer.warmup import resolve_warmup
    from tests.conftest import tiny_loaded
    from tests.serving.conftest import TINY_ARGS

    engine = LLMEngine(tiny_loaded("llama"), **TINY_ARGS) if not argv else None
    p = argparse.ArgumentParser()
    add_serve_parser(p.add_subparsers())
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    assert resolve_warmup(_warmup_mode(p.parse_args(["serve", *argv]))) == want
    if engine is not None:  # the Python API's default is the CLI's
        assert InferenceServer(engine, port=0).warmup == want


def test_unset_sampling_fields_take_the_models_generation_defaults(tiny_server, monkeypatch):
    """A request's unset sampling fields take the engine's ``sampling_defaults`` (the
    checkpoint's generation_config.json, as vLLM's OpenAI server); set fields win."""
    st, prompts, params, ref = tiny_server
    monkeypatch.setattr(st.engine, "sampling_defaults", {"max_tokens": 3, "temperature": 0.0})
    with grpc.insecure_channel(st.target) as ch:
        stub = pb_grpc.InferenceStub(ch)
        bare = stub.GenerateUnary(build_request(token_ids=prompts[0]), timeout=30)
        greedy3 = stub.GenerateUnary(build_request(token_ids=prompts[0], max_tokens=3,
                                                   temperature=0.0), timeout=30)
        five = stub.GenerateUnary(build_request(token_ids=prompts[0], max_tokens=5,
                                                ignore_eos=True), timeout=30)
    assert len(bare.token_ids) == 3 and list(bare.token_ids) == list(greedy3.token_ids)
    assert len(five.token_ids) == 5
    assert list(five.token_ids)[:3] == list(bare.token_ids)  # temperature 0 from the defaults
    limit = st.engine.config.max_model_len
    monkeypatch.setattr(st.engine, "sampling_defaults", {"max_tokens": 10 * limit,
                                                         "temperature": 0.0})
    with grpc.insecure_channel(st.target) as ch:  # a max_new_tokens past the room: capped
        stub = pb_grpc.InferenceStub(ch)
        capped = stub.GenerateUnary(build_request(token_ids=prompts[0], ignore_eos=True),
                                    timeout=60)
        assert len(capped.token_ids) == limit - len(prompts[0])
        assert capped.finish_reason == pb.FINISH_REASON_LENGTH
        with pytest.raises(grpc.RpcError) as e:  # an explicit one is the request's error
            stub.GenerateUnary(build_request(token_ids=prompts[0], max_tokens=10 * limit),
                               timeout=60)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    monkeypatch.setattr(st.engine, "sampling_defaults", {"max_tokens": 3, "temperature": 0.0})
    from jaxinfer.serving.protocol import model_info

    d = model_info(st.engine).default_sampling  # ModelInfo says what they are
    assert [f.name for f, _ in d.ListFields()] == ["temperature", "max_tokens"]
    assert (d.temperature, d.max_tokens) == (0.0, 3)
    with InferenceClient(st.target, timeout=60) as c:  # (the server's, made at its start:
        assert not c.model_info().default_sampling.ListFields()  # the tiny model has none)


def test_serve_takes_generation_config():
    import argparse

    from jaxinfer.cli import _engine_args
    from jaxinfer.serving.cli import add_serve_parser

    p = argparse.ArgumentParser()
    add_serve_parser(p.add_subparsers())
    assert "generation_config" not in _engine_args(p.parse_args(["serve"]))  # LLMEngine's
    ns = p.parse_args(["serve", "--generation-config", "vllm"])
    assert _engine_args(ns)["generation_config"] == "vllm"
    with pytest.raises(SystemExit):
        p.parse_args(["serve", "--generation-config", "hf"])


def test_unset_max_tokens_takes_the_room_left(tiny_server):
    """As vLLM's OpenAI server: without max_tokens (and no model default) a request may
    generate up to max_model_len (128 here); it took SamplingParams' 16 before."""
    st = tiny_server[0]
    with InferenceClient(st.target, timeout=60) as c:
        r = c.generate(token_ids=[5, 6, 7], temperature=0.0, ignore_eos=True)
    assert r.usage.completion_tokens == 128 - 3
    assert r.finish_reason == pb.FINISH_REASON_LENGTH
    wait_until(lambda: _all_free(st))
