"""gRPC serving of the default real model (SmolLM2-135M-Instruct): text and chat prompts give the
offline engine's tokens and text; tokenizer RPCs round-trip."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from jaxinfer.engine import LLM
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.serving import jaxinfer_pb2_grpc as pb_grpc
from jaxinfer.serving.client import InferenceClient, build_request
from tests.serving.conftest import ServerThread

TEXTS = ["The capital of France is", "def fibonacci(n):"]
CHAT = [{"role": "user", "content": "What is 2+2?"}]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16)


@pytest.fixture(scope="module")
def real_server():
    llm = LLM("smollm2-135m", max_model_len=256, block_size=16, max_num_seqs=4,
              decode_buckets=(4,), max_num_batched_tokens=64, prefill_buckets=(64,),
              max_prefill_seqs=2)
    ref = llm.generate(TEXTS, GREEDY) + llm.chat(CHAT, GREEDY)
    st = ServerThread(llm.engine).start()
    yield st, ref
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
    st, ref = real_server
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
    st, _ = real_server
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
                            ({"messages": [{"role": "user", "content": ""}]}, "content")):
            with pytest.raises(grpc.RpcError) as e:
                c.generate(**bad, max_tokens=4)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert needle in e.value.details()
