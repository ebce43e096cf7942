"""Engine invariants on tiny random models (CPU): batching, paging, buckets, bad input."""

from __future__ import annotations

import dataclasses
import json
from collections import deque

import numpy as np
import pytest

from jaxinfer.engine import PromptTooLongError, RequestError
from jaxinfer.llm import LLM
from jaxinfer.sampling_params import ParameterError, SamplingParams
from jaxinfer.tokenizer import TokenizerError
from tests.conftest import tiny_loaded

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def _prompts(n: int, seed: int = 1) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    lens = [1, 3, 7, 8, 9, 16, 17, 30][:n]
    return [rng.integers(2, 96, size=L).tolist() for L in lens]


def _llm(family: str, **kw) -> LLM:
    args = dict(max_model_len=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    args.update(kw)
    return LLM(tiny_loaded(family), **args)


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_batch_invariance_and_page_placement(tiny_family):
    prompts = _prompts(8)
    alone_llm = _llm(tiny_family)
    alone = [_tokens(alone_llm.generate([p], GREEDY))[0] for p in prompts]
    assert all(len(t) == GREEDY.max_tokens for t in alone)
    assert len({tuple(t) for t in alone}) > 1, "distinct prompts should give distinct outputs"

    batched = _tokens(_llm(tiny_family).generate(prompts, GREEDY))
    assert batched == alone

    shuffled_llm = _llm(tiny_family)
    bm = shuffled_llm.engine.scheduler.block_manager
    free = bm.free_page_ids()
    np.random.default_rng(7).shuffle(free)
    bm._free = deque(free)  # scatter pages across the pool
    shuffled = _tokens(shuffled_llm.generate(prompts[::-1], GREEDY))[::-1]
    assert shuffled == alone


def test_chunked_prefill_and_preemption_do_not_change_outputs(tiny_family):
    prompts = _prompts(8, seed=3)
    ref = _tokens(_llm(tiny_family).generate(prompts, GREEDY))
    # 16-token steps force the 17- and 30-token prompts into chunks.
    chunked = _tokens(_llm(tiny_family, max_num_batched_tokens=16).generate(prompts, GREEDY))
    assert chunked == ref
    # 20 usable pages of 4 tokens cannot hold all 8 sequences: preemption must kick in.
    small = _llm(tiny_family, num_kv_pages=21)
    out = _tokens(small.generate(prompts, GREEDY))
    assert out == ref


def test_no_compilation_after_warmup():
    llm = _llm("llama")
    runner = llm.engine.runner
    llm.generate(_prompts(8, seed=5), GREEDY)
    # Warm-up built programs: compiled by XLA, or loaded from the persistent compilation
    # cache that the test suite shares (conftest.py).
    n_compiled, n_loaded = runner.num_compilations, runner.num_loaded
    assert n_compiled + n_loaded > 0
    # New prompts with the same shapes fall into already built buckets: nothing new at all.
    llm.generate(_prompts(8, seed=6), GREEDY)
    assert (runner.num_compilations, runner.num_loaded) == (n_compiled, n_loaded)


def test_prompt_logits_match_first_greedy_token(tiny_family):
    llm = _llm(tiny_family)
    prompt = _prompts(6)[5]
    logits = llm.engine.prompt_logits(prompt)
    assert logits.shape == (len(prompt), 96)
    first = _tokens(llm.generate([prompt], GREEDY))[0][0]
    assert int(np.argmax(logits[-1])) == first
    # Chunked scoring (8-token chunks) gives the same logits.
    chunked = _llm(tiny_family, max_num_batched_tokens=8).engine.prompt_logits(prompt)
    np.testing.assert_allclose(chunked, logits, atol=1e-4)


def test_seeded_sampling_is_batch_invariant():
    prompts = _prompts(4, seed=9)
    sp = [SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=100 + i, max_tokens=8,
                         ignore_eos=True) for i in range(4)]
    alone = [_tokens(_llm("llama").generate([p], s))[0] for p, s in zip(prompts, sp)]
    together = _tokens(_llm("llama").generate(prompts, sp))
    assert together == alone
    unseeded = _llm("llama").generate([prompts[0]] * 2,
                                      SamplingParams(temperature=1.0, max_tokens=8,
                                                     ignore_eos=True))
    assert _tokens(unseeded)[0] != _tokens(unseeded)[1]


@pytest.mark.parametrize("prompt, err", [
    ([], "empty"),
    ([5] * 64, "max_model_len"),
    ([5, 500], "not in"),
])
def test_bad_requests_fail_cleanly_and_engine_stays_usable(prompt, err):
    llm = _llm("llama")
    with pytest.raises(RequestError, match=err):
        llm.generate([prompt], GREEDY)
    assert not llm.engine.has_unfinished_requests()
    assert _tokens(llm.generate([[3, 4, 5]], GREEDY))[0]


@pytest.mark.parametrize("kw, field", [
    (dict(temperature=-1.0), "temperature"), (dict(top_p=0.0), "top_p"),
    (dict(top_k=-5), "top_k"), (dict(max_tokens=0), "max_tokens"),
])
def test_bad_sampling_params_name_the_field(kw, field):
    with pytest.raises(ParameterError, match=field):
        SamplingParams(**kw)


def test_eos_stops_and_max_tokens_is_length():
    llm = _llm("llama")
    out = llm.generate([[3, 4, 5]], SamplingParams(temperature=0.0, max_tokens=5))[0]
    c = out.outputs[0]
    assert c.finish_reason in ("stop", "length")
    if c.finish_reason == "length":
        assert len(c.token_ids) == 5 and 1 not in c.token_ids
    else:
        assert c.token_ids[-1] == 1 and len(c.token_ids) <= 5


def test_llm_is_importable_from_its_old_module() -> None:
    # LLM / iter_stream moved to jaxinfer/llm.py; jaxinfer.engine still resolves them.
    import jaxinfer
    from jaxinfer import llm
    from jaxinfer.engine import LLM as FromEngine
    from jaxinfer.engine import iter_stream

    assert FromEngine is jaxinfer.LLM is llm.LLM and iter_stream is llm.iter_stream
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        from jaxinfer import engine
        engine.nope  # noqa: B018


def test_generate_rejecting_a_later_prompt_leaves_nothing_queued() -> None:
    # The second prompt asks for more samples than max_num_seqs: the first, already added, is
    # aborted; the error names the prompt's position; the next batch runs as usual.
    llm = _llm("llama")
    too_many = SamplingParams(temperature=0.5, n=llm.engine.config.max_num_seqs + 1)
    with pytest.raises(RequestError, match="prompt 1 of the batch"):
        llm.generate([[5, 6, 7], [8, 9]], [SamplingParams(temperature=0, max_tokens=4), too_many])
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4))
    assert len(out) == 1 and len(out[0].outputs[0].token_ids) == 4


def test_interrupted_generate_aborts_its_requests(monkeypatch) -> None:
    # A KeyboardInterrupt from the third engine step: the batch's requests are aborted (no
    # KV pages held, nothing left to run in the next call) and the interrupt propagates.
    llm = _llm("llama")
    bm = llm.engine.scheduler.block_manager
    free = bm.num_free_pages
    step, calls = llm.engine.step, []

    def interrupted_step():
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return step()

    monkeypatch.setattr(llm.engine, "step", interrupted_step)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([[5, 6, 7], [8, 9]], SamplingParams(temperature=0, max_tokens=8))
    monkeypatch.setattr(llm.engine, "step", step)
    assert not llm.engine.has_unfinished_requests()
    assert bm.num_free_pages == free
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4))
    assert len(out) == 1 and len(out[0].outputs[0].token_ids) == 4
    # Interrupted while the batch is being added (the second add_request): the first goes.
    add, adds = llm.engine.add_request, []

    def interrupted_add(*a, **kw):
        adds.append(1)
        if len(adds) == 2:
            raise KeyboardInterrupt
        return add(*a, **kw)

    monkeypatch.setattr(llm.engine, "add_request", interrupted_add)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([[5, 6, 7], [8, 9]], SamplingParams(temperature=0, max_tokens=8))
    assert not llm.engine.has_unfinished_requests() and bm.num_free_pages == free


@pytest.fixture(scope="module")
def llama_llm() -> LLM:
    return _llm("llama")


@pytest.mark.parametrize("prompts, needle", [
    (None, r"prompts must be a str, a list of token ids \(ints\), or a list of those, "
           r"got NoneType None"),
    (5, r"prompts must be .* got int 5"),
    ({"a": 1}, r"prompt 0 of the batch is a dict with keys \['a'\]: only \{'prompt': text\} "
               r"or \{'prompt_token_ids': \[ids\]\} are taken \(vLLM's TextPrompt"),
    ([[3], {"prompt_token_ids": [3], "multi_modal_data": {}}],
     r"prompt 1 of the batch is a dict with keys \['multi_modal_data', 'prompt_token_ids'\]"),
    ([{"prompt_token_ids": [3, None]}], r"prompt 0 of the batch: token 1 is NoneType None"),
    ([{"prompt": 5}], r"prompt 0 of the batch must be a str or a list of token ids .* got int"),
    ([None], r"prompt 0 of the batch must be a str or a list of token ids \(ints\), "
             r"got NoneType None"),
    ([[3, 4], 5], r"prompt 1 of the batch must be a str or a list of token ids .* got int 5"),
    ([b"\x03\x04"], r"prompt 0 of the batch must be .* got bytes"),
    ([3, "hello"], r"prompt 0 of the batch: token 1 is str 'hello', not an int token id "
                   r"\(texts and token-id lists are separate prompts"),
    ([[3, 4], [[5, 6]]], r"prompt 1 of the batch: token 0 is list \[5, 6\], not an int"),
    ([[3, True]], r"prompt 0 of the batch: token 1 is bool True"),
    ([[3, 4], [5, 500]], r"prompt 1 of the batch: prompt token id 500 is not in \[0, 96\)"),
    # floats were reported as out of range ("prompt token id 1.5 is not in [0, 96)")
    ([[3, 1.5]], r"prompt 0 of the batch: token 1 is float 1\.5, not an int token id"),
    ([np.array([3.0, 4.0])], r"prompt 0 of the batch: token 0 is float64 np\.float64\(3\.0\)"),
])
def test_prompts_of_the_wrong_type_are_request_errors(llama_llm, prompts, needle):
    with pytest.raises(RequestError, match=needle):
        llama_llm.generate(prompts, GREEDY)
    assert not llama_llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("prompt, needle", [
    ([3, 1.5], r"prompt token ids must be integers: id 1 is 1\.5 \(float\)"),
    (np.array([1.0, 2.0]), r"id 0 is np\.float64\(1\.0\) \(float64\)"),
    ([3, np.True_], r"id 1 is np\.True_ \(bool\)"),
    (np.array([3, 999999], np.uint32), r"prompt token id 999999 is not in \[0, 96\)$"),
])
def test_engine_names_token_ids_that_are_not_integers(llama_llm, prompt, needle):
    """LLMEngine.add_request said "prompt token id 1.5 is not in [0, 96)" for a float."""
    with pytest.raises(RequestError, match=needle):
        llama_llm.engine.add_request(prompt, GREEDY)
    assert not llama_llm.engine.has_unfinished_requests()


def test_vllm_dict_prompts_are_taken(llama_llm):
    """vLLM's TokensPrompt / TextPrompt dicts, alone or mixed with plain prompts, give the
    tokens the plain forms give."""
    from tests.core.test_tokenizer import _tiny_tokenizer

    plain = _tokens(llama_llm.generate([[3, 4, 5], [6, 7]], GREEDY))
    assert _tokens(llama_llm.generate([{"prompt_token_ids": [3, 4, 5]}, [6, 7]], GREEDY)) == plain
    assert _tokens(llama_llm.generate({"prompt_token_ids": [6, 7]}, GREEDY)) == plain[1:]
    llama_llm.engine.tokenizer, tok = _tiny_tokenizer(), llama_llm.engine.tokenizer
    try:
        assert (_tokens(llama_llm.generate([{"prompt": "hello world"}], GREEDY))
                == _tokens(llama_llm.generate(["hello world"], GREEDY)))
    finally:
        llama_llm.engine.tokenizer = tok
    assert not llama_llm.engine.has_unfinished_requests()


def test_sampling_params_must_be_samplingparams(llama_llm):
    # vLLM takes no dict either; a dict used to be read as a list of its keys.
    with pytest.raises(ParameterError, match=r"sampling_params must be SamplingParams or a "
                                             r"list of them \(one per prompt\), got dict"):
        llama_llm.generate([[3, 4]], {"temperature": 0.0, "max_tokens": 4})
    with pytest.raises(ParameterError, match=r"sampling_params\[1\] must be SamplingParams, "
                                             r"got dict"):
        llama_llm.generate([[3, 4], [5]], [GREEDY, {"temperature": 0.0}])
    assert not llama_llm.engine.has_unfinished_requests()


def test_chat_rejects_malformed_conversations(monkeypatch, llama_llm):
    from tests.core.test_tokenizer import _ROLE_TEMPLATE, _tiny_tokenizer

    monkeypatch.setattr(llama_llm.engine, "tokenizer", _tiny_tokenizer(_ROLE_TEMPLATE))
    user = {"role": "user", "content": "hello"}
    for messages, needle in [
        (None, r"messages must be a non-empty list of message dicts .* got NoneType"),
        ({"role": "user", "content": "hi"}, r"messages must be a non-empty list .* got dict"),
        ("hello", r"messages must be a non-empty list .* got str 'hello'"),
        ([user, {"role": "robot", "content": "x"}], r"messages\[1\]\.role must be one of "
                                                     r"system, user, assistant, tool"),
        ([[user], [{"role": "user"}]], r"conversation 1: messages\[0\] \(user\) has no "
                                       r"'content'"),
        ([[user], "hello"], r"conversation 1: chat messages must be a non-empty list"),
    ]:
        with pytest.raises(ValueError, match=needle):
            llama_llm.chat(messages, GREEDY)
    assert not llama_llm.engine.has_unfinished_requests()


def _renders_only_short(monkeypatch, tok, limit: int) -> list[list[str]]:
    """Patch ``tok.render_chat`` (what the engine and ``apply_chat_template`` render with) to
    record each conversation's contents and fail on one that cannot fit ``limit`` tokens (it
    must be refused before rendering)."""
    real, rendered = tok.render_chat, []

    def render(messages, *args, **kw):
        assert tok.min_tokens(*(m["content"] for m in messages)) <= limit, "rendered it"
        rendered.append([m["content"] for m in messages])
        return real(messages, *args, **kw)

    monkeypatch.setattr(tok, "render_chat", render)
    return rendered


def test_oversized_chat_is_refused_before_rendering(monkeypatch, llama_llm):
    from tests.core.test_tokenizer import _ROLE_TEMPLATE, _tiny_tokenizer

    engine, tok = llama_llm.engine, _tiny_tokenizer(_ROLE_TEMPLATE)
    monkeypatch.setattr(engine, "tokenizer", tok)
    limit = engine.config.max_model_len
    big = "hello " * (limit * tok.max_token_chars)  # > 4 x longest token x limit characters
    rendered = _renders_only_short(monkeypatch, tok, limit)
    ok = [{"role": "user", "content": "hello"}]
    tail = rf"characters, so at least \d+ tokens; max_model_len is {limit}$"
    with pytest.raises(RequestError, match=rf"^conversation 1: prompt has {len(big) + 5} {tail}"):
        llama_llm.chat([ok, [{"role": "system", "content": "hello"},
                             {"role": "user", "content": big}]], GREEDY)
    with pytest.raises(RequestError, match=rf"^prompt has {len(big)} {tail}"):
        llama_llm.chat([{"role": "user", "content": big}], GREEDY)
    assert rendered == [["hello"]]  # the first conversation of the batch, nothing queued
    assert not engine.has_unfinished_requests()


def _type_lines(monkeypatch, lines: list[str]) -> None:
    """``input()`` returns ``lines`` one by one, then raises EOFError (Ctrl-D)."""
    it = iter(lines)

    def typed(prompt: str = "") -> str:
        try:
            return next(it)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr("builtins.input", typed)


def test_jaxinfer_chat_drops_a_turn_that_cannot_fit_and_goes_on(monkeypatch, capsys,
                                                                llama_llm):
    from jaxinfer import cli
    from jaxinfer import engine as engine_module
    from tests.core.test_tokenizer import _ROLE_TEMPLATE, _tiny_tokenizer

    engine, tok = llama_llm.engine, _tiny_tokenizer(_ROLE_TEMPLATE)
    monkeypatch.setattr(engine, "tokenizer", tok)
    monkeypatch.setattr(engine_module, "LLMEngine", lambda *args, **kw: engine)
    limit = engine.config.max_model_len
    big = "hello " * (limit * tok.max_token_chars)
    rendered = _renders_only_short(monkeypatch, tok, limit)
    _type_lines(monkeypatch, [big, "hello world"])
    assert cli.main(["chat", "--model", "dummy:tiny-llama", "--max-tokens", "3",
                     "--temperature", "0"]) == 0
    err = capsys.readouterr().err
    assert (f"jaxinfer chat: prompt has {len(big.strip())} characters, so at least "
            f"{tok.min_tokens(big.strip())} tokens; max_model_len is {limit} (turn dropped)"
            in err.splitlines())
    assert rendered == [["hello world"]]  # the dropped turn is not in the history
    assert not engine.has_unfinished_requests()


def test_jaxinfer_chat_says_when_a_reply_is_cut_and_when_the_conversation_is_full(
        monkeypatch, capsys, llama_llm):
    """A reply ended by max_tokens says so; a turn dropped for length after earlier turns
    says the conversation is what fills max_model_len (every later turn used to be dropped
    with no hint) and that /new starts a new one, which it does (the system prompt kept)."""
    from jaxinfer import cli
    from jaxinfer import engine as engine_module
    from tests.core.test_tokenizer import _ROLE_TEMPLATE, _tiny_tokenizer

    engine, tok = llama_llm.engine, _tiny_tokenizer(_ROLE_TEMPLATE)
    monkeypatch.setattr(engine, "tokenizer", tok)
    monkeypatch.setattr(engine_module, "LLMEngine", lambda *args, **kw: engine)
    sampling = cli._sampling  # the random model may emit EOS early: make the cut certain
    monkeypatch.setattr(cli, "_sampling", lambda ns: dataclasses.replace(sampling(ns),
                                                                         ignore_eos=True))
    limit = engine.config.max_model_len
    asked, encode_chat = [], engine.encode_chat

    def spy(messages, *a, **kw):
        asked.append([m["content"] for m in messages])
        return encode_chat(messages, *a, **kw)

    monkeypatch.setattr(engine, "encode_chat", spy)
    _type_lines(monkeypatch, ["hello world", "hello " * (limit * tok.max_token_chars), "/new",
                              "hello"])
    assert cli.main(["chat", "--model", "dummy:tiny-llama", "--max-tokens", "3",
                     "--temperature", "0", "--system", "be brief"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert f"jaxinfer chat: reply cut at 3 tokens (max_tokens 3; max_model_len {limit})" in err
    dropped = [ln for ln in err if "turn dropped" in ln]
    assert len(dropped) == 1 and dropped[0].endswith(
        f"(turn dropped; the conversation holds 1 earlier turn within max_model_len {limit}: "
        f"type /new to start a new conversation)")
    assert "jaxinfer chat: new conversation" in err
    assert asked[0] == ["be brief", "hello world"] and asked[-1] == ["be brief", "hello"]
    assert not engine.has_unfinished_requests()


def test_stop_token_ids_outside_the_vocabulary_are_rejected_at_admission(llama_llm):
    V = llama_llm.engine.model_config.vocab_size
    with pytest.raises(RequestError, match=rf"prompt 1 of the batch: stop_token_ids \[{V}, "
                                           rf"{V + 7}\] are not in the vocabulary: ids must be "
                                           rf"in \[0, {V}\) \(vocab size {V}\)"):
        llama_llm.generate([[3, 4], [5]], [GREEDY, SamplingParams(stop_token_ids=[2, V, V + 7])])
    with pytest.raises(RequestError, match="stop_token_ids"):
        llama_llm.engine.add_request([3, 4], SamplingParams(stop_token_ids=[V]))
    assert not llama_llm.engine.has_unfinished_requests()


def test_oversized_prompts_are_refused_before_encoding(monkeypatch, llama_llm):
    """A prompt that cannot fit max_model_len is refused from its length alone: a text from
    its characters (Tokenizer.min_tokens) before the tokenizer runs, ids before they are read
    -- a 10^12-id prompt would not fit in memory if they were."""
    from tests.core.test_tokenizer import _tiny_tokenizer

    tok = _tiny_tokenizer()

    def encode(*args, **kw):
        raise AssertionError("the oversized prompt was encoded")

    engine = llama_llm.engine
    monkeypatch.setattr(engine, "tokenizer", tok)
    limit = engine.config.max_model_len
    fits = "hello " * (limit // 2)  # the bound is no tighter than the real token count
    assert tok.min_tokens(fits) < limit <= tok.min_tokens(fits * 8 * tok.max_token_chars)
    monkeypatch.setattr(tok, "encode", encode)
    with pytest.raises(RequestError, match=rf"prompt has {len(fits) * 8 * tok.max_token_chars} "
                                           rf"characters, so at least \d+ tokens; "
                                           rf"max_model_len is {limit}"):
        llama_llm.generate([fits * 8 * tok.max_token_chars], GREEDY)
    with pytest.raises(RequestError, match=rf"prompt has {10**12} tokens; max_model_len"):
        engine.encode_prompt(range(10**12))
    assert not engine.has_unfinished_requests()
    assert _tokens(llama_llm.generate([[3, 4, 5]], GREEDY))[0]


def test_requests_that_cannot_fit_raise_the_typed_length_error(llama_llm):
    """Every "cannot fit" refusal is a PromptTooLongError (a RequestError: the server's
    INVALID_ARGUMENT, the chat's "start a new chat" hint keyed on its type); other bad input
    is a RequestError of another kind. Nothing is queued by any of them."""
    engine = llama_llm.engine
    limit = engine.config.max_model_len
    with pytest.raises(PromptTooLongError, match=rf"prompt has {limit} tokens; max_model_len "
                                                 rf"is {limit} \(at least one token"):
        engine.add_request([3] * limit, GREEDY)
    with pytest.raises(PromptTooLongError, match=rf"prompt \(4 tokens\) \+ max_tokens "
                                                 rf"\({limit}\) = {limit + 4} exceeds"):
        engine.add_request([3, 4, 5, 6], SamplingParams(max_tokens=limit))
    with pytest.raises(PromptTooLongError, match=rf"prompt has {limit + 1} tokens"):
        engine.encode_prompt([3] * (limit + 1))
    with pytest.raises(PromptTooLongError, match=rf"prompt has {limit + 1} tokens"):
        engine.prompt_logits([3] * (limit + 1))
    V = engine.model_config.vocab_size
    for bad in (lambda: engine.add_request([3, 4], SamplingParams(stop_token_ids=[V])),
                lambda: engine.add_request([], GREEDY),
                lambda: engine.add_request([3, 4], GREEDY, request_id=-1)):
        with pytest.raises(RequestError) as e:
            bad()
        assert not isinstance(e.value, PromptTooLongError), e.value
    assert not engine.has_unfinished_requests()


def test_max_tokens_none_generates_up_to_max_model_len(llama_llm):
    """vLLM's ``max_tokens=None``: as many tokens as fit after the prompt (the engine sets it
    when it queues the request, the caller's params unchanged; min_tokens capped at it),
    through the engine and LLM.generate; the prompt that leaves no room is still refused."""
    engine = llama_llm.engine
    limit = engine.config.max_model_len
    sp = SamplingParams(max_tokens=None, min_tokens=limit, temperature=0.0, ignore_eos=True)
    out = llama_llm.generate([[3, 4, 5, 6]], sp)[0].outputs[0]
    assert len(out.token_ids) == limit - 4 and out.finish_reason == "length"
    assert sp.max_tokens is None
    rid = engine.add_request([3, 4, 5], SamplingParams(max_tokens=None))
    seq = engine.scheduler.waiting[-1]
    assert seq.seq_id == rid and seq.sampling_params.max_tokens == limit - 3
    engine.abort_request(rid)
    with pytest.raises(PromptTooLongError, match=rf"prompt has {limit} tokens"):
        engine.add_request([3] * limit, SamplingParams(max_tokens=None))
    with pytest.raises(ParameterError, match="max_tokens must be >= 1 or None, got 0"):
        SamplingParams(max_tokens=0)


def test_llm_chat_takes_vllm_chat_template_options(monkeypatch, llama_llm):
    """LLM.chat(chat_template=, add_generation_prompt=, continue_final_message=,
    chat_template_kwargs=) renders as the tokenizer does with them, for one conversation or
    a list; a bad combination names the conversation."""
    from tests.core.test_tokenizer import _GEN_TEMPLATE, _tiny_tokenizer

    tok = _tiny_tokenizer(_GEN_TEMPLATE)
    monkeypatch.setattr(llama_llm.engine, "tokenizer", tok)
    conv = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "world"}]
    own = "{% if greet %}hello {% endif %}{% for m in messages %}{{ m['content'] }} {% endfor %}"
    for kw in ({}, dict(add_generation_prompt=False, continue_final_message=True),
               dict(chat_template=own, chat_template_kwargs={"greet": True})):
        want = tok.apply_chat_template(conv, **kw)
        outs = llama_llm.chat([conv, conv], GREEDY, **kw)
        assert [o.prompt_token_ids for o in outs] == [want, want]
        assert llama_llm.chat(conv, GREEDY, **kw)[0].prompt_token_ids == want
        text = tok.hf.apply_chat_template(  # vLLM's RequestOutput.prompt: the rendered text
            conv, tokenize=False, **{"add_generation_prompt": True, **{
                k: v for k, v in kw.items() if k != "chat_template_kwargs"}},
            **kw.get("chat_template_kwargs", {}))
        assert [o.prompt for o in outs] == [text, text] and text
    with pytest.raises(TokenizerError, match="conversation 0: continue_final_message and "):
        llama_llm.chat([conv, conv], GREEDY, continue_final_message=True)
    assert not llama_llm.engine.has_unfinished_requests()


def test_llm_chat_renders_each_conversation_once(monkeypatch, llama_llm):
    """LLM.chat renders a conversation once for both its prompt ids and its output's
    ``prompt`` text (session 41 found it rendered twice); the ids are the text's encoding."""
    from tests.core.test_tokenizer import _ROLE_TEMPLATE, _tiny_tokenizer

    tok = _tiny_tokenizer(_ROLE_TEMPLATE)
    monkeypatch.setattr(llama_llm.engine, "tokenizer", tok)
    real, renders = tok.render_chat, []

    def render(messages, *args, **kw):
        renders.append([m["content"] for m in messages])
        return real(messages, *args, **kw)

    monkeypatch.setattr(tok, "render_chat", render)
    a = [{"role": "user", "content": "hello"}]
    b = [{"role": "system", "content": "world"}, {"role": "user", "content": "hello world"}]
    outs = llama_llm.chat([a, b], GREEDY)
    assert renders == [["hello"], ["world", "hello world"]]
    for out, conv in zip(outs, (a, b)):
        assert out.prompt == real(conv) and out.prompt
        assert out.prompt_token_ids == tok.encode(out.prompt, add_special_tokens=False)
    renders.clear()
    assert llama_llm.chat(a, GREEDY)[0].prompt == real(a) and renders == [["hello"]]


def test_offline_generate_caps_max_tokens_at_max_model_len(llama_llm):
    """LLM.generate runs a prompt whose max_tokens passes max_model_len up to max_model_len,
    finishing with "length" (vLLM's offline LLM); min_tokens is capped with it. The engine's
    add_request still refuses it (above), and a prompt with no room left is still refused."""
    limit = llama_llm.engine.config.max_model_len
    prompt = [3, 4, 5, 6]
    fits = SamplingParams(temperature=0.0, max_tokens=limit - 4, ignore_eos=True)
    want = llama_llm.generate([prompt], fits)[0].outputs[0]
    for sp in (SamplingParams(temperature=0.0, max_tokens=limit + 50, ignore_eos=True),
               SamplingParams(temperature=0.0, max_tokens=limit, min_tokens=limit,
                              ignore_eos=True)):
        got = llama_llm.generate([prompt], sp)[0].outputs[0]
        assert (got.token_ids, got.finish_reason) == (want.token_ids, "length")
        assert len(got.token_ids) == limit - 4
    with pytest.raises(PromptTooLongError, match=rf"prompt 0 of the batch: prompt has {limit} "
                                                 rf"tokens; max_model_len is {limit}"):
        llama_llm.generate([[3] * limit], SamplingParams(max_tokens=5))
    assert not llama_llm.engine.has_unfinished_requests()


def test_a_prompt_that_is_not_utf8_is_a_request_error(llama_llm, monkeypatch):
    """Lone surrogates (what Python makes of non-UTF-8 bytes in argv or stdin) used to reach
    the tokenizers library and fail there with a TypeError naming no prompt."""
    from tests.core.test_tokenizer import _tiny_tokenizer

    monkeypatch.setattr(llama_llm.engine, "tokenizer", _tiny_tokenizer())
    with pytest.raises(RequestError, match=r"prompt 1 of the batch: prompt is not valid UTF-8 "
                                           r"text: character 4 is the byte 0xff, not UTF-8"):
        llama_llm.generate(["hello", "abc \udcff def"], GREEDY)
    with pytest.raises(RequestError, match=r"lone surrogate U\+D800"):
        llama_llm.engine.encode_prompt("x\ud800y")
    assert not llama_llm.engine.has_unfinished_requests()
    assert _tokens(llama_llm.generate(["hello world"], GREEDY))[0]


@pytest.mark.parametrize("prompt", [b"\x03\x04", None, 5, {3: 4}])
def test_add_request_refuses_a_prompt_that_is_neither_text_nor_ids(llama_llm, prompt):
    """bytes used to be taken as the ids of their byte values, None failed deep inside."""
    with pytest.raises(RequestError, match=rf"prompt must be a str or a sequence of token ids "
                                           rf"\(ints\), got {type(prompt).__name__}$"):
        llama_llm.engine.add_request(prompt, GREEDY)
    assert not llama_llm.engine.has_unfinished_requests()


def test_request_ids_are_ints_not_in_use_and_automatic_ids_skip_callers_ids(llama_llm):
    engine = llama_llm.engine
    for bad in ("abc", 1.5, (1, 2), -1, True):
        with pytest.raises(RequestError, match=r"request_id must be an int >= 0, got "):
            engine.add_request([3, 4], GREEDY, request_id=bad)
    assert not engine.has_unfinished_requests()
    first = engine.add_request([3, 4], GREEDY)  # automatic
    mine = engine.add_request([3, 4], GREEDY, request_id=np.int64(first + 1))
    assert mine == first + 1 and type(mine) is int
    with pytest.raises(RequestError, match=rf"request_id {mine} is already in use"):
        engine.add_request([5], GREEDY, request_id=mine)
    assert engine.add_request([3, 4], GREEDY) == first + 2  # skips the caller's id
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    assert sorted(outs) == [first, first + 1, first + 2]
    assert outs[first].outputs[0].token_ids == outs[first + 2].outputs[0].token_ids
    assert engine.add_request([5], GREEDY, request_id=mine) == mine  # free again once done
    engine.abort_request(mine)


def test_prompt_logits_with_the_pool_held_by_running_requests_is_a_request_error():
    """prompt_logits borrows pages from the pool: when running requests hold them, it says
    so (it used to raise the allocator's OutOfPagesError); the running request is untouched."""
    llm = _llm("llama", num_kv_pages=12)  # 11 usable 4-token pages
    engine, prompt = llm.engine, _prompts(8)[7]  # 30 tokens: 8 pages
    alone = _tokens(llm.generate([prompt], GREEDY))[0]
    rid = engine.add_request(prompt, GREEDY)
    engine.step()  # its prefill holds 8 pages (more as it decodes)
    with pytest.raises(RequestError, match=r"prompt_logits: the prompt \(30 tokens\) needs 8 KV "
                                           r"pages but \d of the pool's 11 are free \(running "
                                           r"requests hold the rest\)"):
        engine.prompt_logits(prompt)
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in outs] == [rid] and outs[0].outputs[0].token_ids == alone
    assert engine.prompt_logits(prompt).shape == (30, 96)  # the pool is free again


@pytest.mark.parametrize("flag, expect", [([], "room"), (["--max-tokens", "5"], 5),
                                          (["--max-tokens", "200"], "dropped")])
def test_jaxinfer_chat_default_max_tokens_fits_the_room_left(monkeypatch, capsys, llama_llm,
                                                             flag, expect):
    """Without --max-tokens a turn gets min(256, max_model_len - prompt) new tokens (it used
    to be refused once prompt + 256 passed max_model_len: every turn of a long chat
    dropped); an explicit --max-tokens is kept, and refused when it cannot fit."""
    from jaxinfer import cli
    from jaxinfer import engine as engine_module
    from tests.core.test_tokenizer import _ROLE_TEMPLATE, _tiny_tokenizer

    engine, tok = llama_llm.engine, _tiny_tokenizer(_ROLE_TEMPLATE)
    monkeypatch.setattr(engine, "tokenizer", tok)
    monkeypatch.setattr(engine_module, "LLMEngine", lambda *args, **kw: engine)
    asked, add = [], engine.add_request
    monkeypatch.setattr(engine, "add_request", lambda p, sp, **kw: (
        asked.append((len(kw["prompt_token_ids"]), sp.max_tokens)), add(p, sp, **kw))[1])
    _type_lines(monkeypatch, ["hello world"])
    assert cli.main(["chat", "--model", "dummy:tiny-llama", "--temperature", "0", *flag]) == 0
    err, limit = capsys.readouterr().err, engine.config.max_model_len
    assert len(asked) == 1
    n, max_tokens = asked[0]
    if expect == "dropped":
        assert (f"+ max_tokens (200) = {n + 200} exceeds max_model_len ({limit}) "
                f"(turn dropped)") in err
    else:
        assert "turn dropped" not in err
        assert max_tokens == (limit - n if expect == "room" else expect) and 0 < limit - n < 256
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("port", ["99999", "-1", "http"])
def test_serve_ports_out_of_range_are_refused_by_the_parser(capsys, port):
    from jaxinfer import cli
    from jaxinfer.serving.server import ServerError, check_port_free

    for flag in ("--port", "--metrics-port"):
        with pytest.raises(SystemExit) as e:
            cli.main(["serve", "--model", "dummy:tiny-llama", flag, port])
        assert e.value.code == 2
        assert f"argument {flag}: must be" in capsys.readouterr().err
    with pytest.raises(ServerError, match=r"cannot listen on 127\.0\.0\.1:70000: a port is in "
                                          r"\[0, 65535\]"):
        check_port_free("127.0.0.1", 70000)


def test_jaxinfer_generate_default_max_tokens_fits_each_prompt(monkeypatch, capsys, llama_llm):
    """--max-tokens left out: each prompt gets min(64, room left); given: kept, and a prompt
    it does not fit stops at max_model_len (LLM.generate, as vLLM's offline LLM)."""
    from jaxinfer import cli
    from jaxinfer import llm as llm_module

    monkeypatch.setattr(llm_module, "LLM", lambda *args, **kw: llama_llm)
    long, short = " ".join(["3"] * 60), "3 4"  # max_model_len 64: room 4 and 62
    args = ["generate", "--model", "dummy:tiny-llama", "--token-ids"]
    assert cli.main([*args, long, short]) == 0
    first = capsys.readouterr()
    out = first.out.splitlines()
    assert len(out[1].split()) <= 4 and out[0] == f"### {long}"  # fits the room
    with_eos = [o.outputs[0] for o in llama_llm.generate(
        [[3] * 60, [3, 4]], [SamplingParams(temperature=0, max_tokens=4),
                             SamplingParams(temperature=0, max_tokens=62)])]
    assert out[1].split() == [str(t) for t in with_eos[0].token_ids]
    assert out[3].split() == [str(t) for t in with_eos[1].token_ids]
    a, b = sorted(o.finish_reason for o in with_eos)  # the summary line counts them
    want = f"{a} 1, {b} 1" if a != b else f"{a} 2"
    assert f"finish_reason: {want}]" in first.err
    assert cli.main([*args, "--max-tokens", "5", long]) == 0
    got = capsys.readouterr()
    assert got.out.splitlines()[0].split() == [
        str(t) for t in with_eos[0].token_ids]  # the 4 tokens of the room, not refused
    assert f"finish_reason: {with_eos[0].finish_reason}]" in got.err
    assert not llama_llm.engine.has_unfinished_requests()


def test_jaxinfer_generate_min_tokens_and_stop_token_ids(monkeypatch, capsys, llama_llm):
    """--min-tokens, --ignore-eos and --stop-token-ids reach SamplingParams: the CLI prints
    what LLM.generate gives with them; a malformed list is an argparse error (exit 2)."""
    from jaxinfer import cli
    from jaxinfer import llm as llm_module

    monkeypatch.setattr(llm_module, "LLM", lambda *args, **kw: llama_llm)
    prompt = [5, 17, 33, 8]
    plain = llama_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6,
                                                        ignore_eos=True))[0].outputs[0]
    sp = SamplingParams(temperature=0, max_tokens=6, min_tokens=3, ignore_eos=True,
                        stop_token_ids=[plain.token_ids[0], 9])
    want = llama_llm.generate([prompt], sp)[0].outputs[0].token_ids
    assert want[0] != plain.token_ids[0]  # masked before min_tokens
    args = ["generate", "--model", "dummy:tiny-llama", "--token-ids", "--temperature", "0",
            "--max-tokens", "6", "--min-tokens", "3", "--ignore-eos", "--stop-token-ids",
            f"{plain.token_ids[0]},9", " ".join(map(str, prompt))]
    assert cli.main(args) == 0
    assert capsys.readouterr().out.split() == [str(t) for t in want]
    with pytest.raises(SystemExit) as e:
        cli.main(args[:-2] + ["-4", "1"])
    assert e.value.code == 2
    assert "token ids must be >= 0, got -4" in capsys.readouterr().err
    bias = {plain.token_ids[1]: -50.0, 40: 3.5}  # --logit-bias: OpenAI's JSON form
    want = llama_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6,
                                                       ignore_eos=True, logit_bias=bias))
    assert want[0].outputs[0].token_ids != plain.token_ids
    assert cli.main(args[:6] + ["--max-tokens", "6", "--ignore-eos", "--logit-bias",
                                json.dumps({str(k): v for k, v in bias.items()}),
                                args[-1]]) == 0
    assert capsys.readouterr().out.split() == [str(t) for t in want[0].outputs[0].token_ids]


def test_cli_min_tokens_follow_the_default_max_tokens_and_bad_stop_ids_stop_chat(
        monkeypatch, capsys, llama_llm):
    """Without --max-tokens, the default is cut to the room left and --min-tokens with it
    (it used to fail: "min_tokens must be in [0, max_tokens=29]"); chat refuses stop ids
    outside the vocabulary at start (every turn used to be dropped for them)."""
    from jaxinfer import cli
    from jaxinfer import engine as engine_module
    from jaxinfer import llm as llm_module
    from tests.core.test_tokenizer import _ROLE_TEMPLATE, _tiny_tokenizer

    monkeypatch.setattr(llm_module, "LLM", lambda *args, **kw: llama_llm)
    limit = llama_llm.engine.config.max_model_len
    prompt = " ".join(["3"] * (limit - 4))  # room for 4
    assert cli.main(["generate", "--model", "dummy:tiny-llama", "--token-ids", "--temperature",
                     "0", "--min-tokens", "30", prompt]) == 0
    assert len(capsys.readouterr().out.split()) == 4  # min_tokens 4: no EOS before the end
    engine = llama_llm.engine
    monkeypatch.setattr(engine, "tokenizer", _tiny_tokenizer(_ROLE_TEMPLATE))
    monkeypatch.setattr(engine_module, "LLMEngine", lambda *args, **kw: engine)
    _type_lines(monkeypatch, ["hello world"])
    V = engine.model_config.vocab_size
    assert cli.main(["chat", "--model", "dummy:tiny-llama", "--stop-token-ids",
                     f"5,{V}"]) == 2
    assert (f"jaxinfer: error: --stop-token-ids [{V}] are not in the vocabulary: ids must be "
            f"in [0, {V})") in capsys.readouterr().err


def test_generate_from_several_threads_runs_each_call_whole():
    """Two threads calling generate on one LLM used to fail inside XLA ("buffer has been
    donated") as both stepped the engine; they now run one after another, each getting its
    own outputs, as when called in turn."""
    import threading

    llm = _llm("llama")
    batches = [[[3, 4, 5], [6, 7]], [[8, 9, 10, 11]], [[12], [13, 14], [15]]]
    want = [_tokens(llm.generate(b, GREEDY)) for b in batches]
    got: dict[int, object] = {}
    start = threading.Barrier(len(batches))

    def run(i: int) -> None:
        start.wait()
        try:
            got[i] = _tokens(llm.generate(batches[i], GREEDY))
        except Exception as e:  # noqa: BLE001 - reported by the assertion below
            got[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(batches))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [got.get(i) for i in range(len(batches))] == want
    assert not llm.engine.has_unfinished_requests()


def test_requests_without_params_take_the_models_generation_defaults():
    """Without sampling params, LLM.generate / chat and engine.add_request run the
    checkpoint's generation-config defaults (vLLM's ``generation_config="auto"``, its
    get_default_sampling_params); explicit params ignore them; ``"vllm"`` ignores the file."""
    from jaxinfer.config import ConfigError

    args = dict(max_model_len=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    loaded = tiny_loaded("llama", sampling_defaults={"max_tokens": 3, "temperature": 0.0})
    llm = LLM(loaded, **args)
    sp = llm.get_default_sampling_params()
    assert (sp.max_tokens, sp.temperature, sp.top_p) == (3, 0.0, 1.0)
    assert sp is not llm.get_default_sampling_params()  # each caller gets its own
    prompts = [[5, 6, 7], [8, 9, 10, 11]]
    outs = _tokens(llm.generate(prompts))
    assert [len(t) for t in outs] == [3, 3]
    assert outs == _tokens(llm.generate(prompts, SamplingParams(max_tokens=3, temperature=0)))
    explicit = llm.generate(prompts, SamplingParams(max_tokens=5, temperature=0.0,
                                                     ignore_eos=True))
    assert [len(t) for t in _tokens(explicit)] == [5, 5]  # SamplingParams given: no defaults
    engine = llm.engine
    rid = engine.add_request(prompts[0])
    done = {}
    while engine.has_unfinished_requests():
        done |= {o.request_id: o for o in engine.step() if o.finished}
    assert done[rid].outputs[0].token_ids == outs[0]
    big = LLM(tiny_loaded("llama", sampling_defaults={"max_tokens": 1000}), **args).engine
    rid = big.add_request(prompts[0])  # the model's max_new_tokens: capped at the room left
    assert big.scheduler.get(rid).sampling_params.max_tokens == 64 - 3
    with pytest.raises(PromptTooLongError):  # an explicit one past it is refused, as before
        big.add_request(prompts[0], SamplingParams(max_tokens=1000))
    plain = LLM(loaded, generation_config="vllm", **args)
    assert plain.get_default_sampling_params() == SamplingParams()
    assert plain.engine.sampling_defaults == {}
    with pytest.raises(ConfigError, match=r"generation_config must be 'auto' .* or 'vllm' "
                                          r".*got 'hf'"):
        LLM(loaded, generation_config="hf", **args)


@pytest.mark.parametrize("mode, variants", [
    ("auto", {"greedy", "temperature", "top_p"}), ("vllm", {"greedy", "temperature"})])
def test_warm_up_builds_the_default_requests_k_step_program(mode, variants):
    """Under multi-step decode the warm-up builds the k-step program of the default
    requests' sampler variant too (Llama 3 Instruct's temperature 0.6 / top_p 0.9: top_p),
    so the first request without params does not run its windows one step at a time."""
    from jaxinfer.engine import LLMEngine
    from jaxinfer.warmup import warm_up_builds

    engine = LLMEngine(tiny_loaded("llama", sampling_defaults={"temperature": 0.6,
                                                               "top_p": 0.9}),
                       generation_config=mode, max_model_len=64, block_size=4,
                       max_num_seqs=4, max_num_batched_tokens=64, decode_buckets=(2, 4),
                       num_scheduler_steps=2)
    multi = [b.args for b in warm_up_builds(engine)
             if b.func == engine.multi_step_programs.executable]
    assert {v for _, v, _ in multi} == variants
    assert sorted(b.num_seqs for b, v, _ in multi if v == "greedy") == [2, 4]
    assert all(k == 2 for _, _, k in multi) and len(multi) == 2 * len(variants)


def test_admission_errors_name_no_engine_request_number():
    """The scheduler's "request <id>: ..." names an automatic id the caller never got (it
    read "prompt 0 of the batch: request 3: n = 9 samples ..."); a caller's own id stays."""
    llm = _llm("llama", max_num_seqs=4)
    llm.generate([[5, 6]], SamplingParams(max_tokens=2))  # ids 0.. are taken
    with pytest.raises(RequestError) as e:
        llm.generate([[5, 6]], SamplingParams(n=9))
    assert str(e.value) == ("prompt 0 of the batch: n = 9 samples, but at most max_num_seqs = "
                            "4 sequences run at once")
    with pytest.raises(PromptTooLongError, match=r"^prompt \(3 tokens\)"):
        llm.engine.add_request([5, 6, 7], SamplingParams(max_tokens=1000))
    with pytest.raises(RequestError, match=r"^request 77: n = 9 samples"):
        llm.engine.add_request([5], SamplingParams(n=9), request_id=77)
    assert not llm.engine.has_unfinished_requests()
