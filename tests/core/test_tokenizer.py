"""Tokenizer built from GGUF metadata (no torch) vs transformers' own GGUF tokenizer, chat
templates, save/load, and vLLM-style incremental detokenization.

References: tests/fixtures/real/<model>_tokenizer.json, produced with torch + transformers'
``AutoTokenizer.from_pretrained(dir, gguf_file=...)`` by scripts/make_reference_fixtures.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from jaxinfer.detokenizer import IncrementalDetokenizer
from jaxinfer.loading import CheckpointError
from jaxinfer.loading.named import resolve_named
from jaxinfer.tokenizer import Tokenizer, TokenizerError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "real"
REFS = {"smollm2-135m": "smollm2-135m-instruct_tokenizer.json",
        "gemma3-270m": "gemma3-270m_tokenizer.json"}


def _gguf_tokenizer(name: str, tmp_factory: pytest.TempPathFactory) -> Tokenizer:
    try:
        path = resolve_named(name, root=tmp_factory.mktemp("ckpt"))
    except CheckpointError as e:
        pytest.skip(str(e))
    return Tokenizer.from_gguf(path)


@pytest.fixture(scope="module")
def smollm(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return _gguf_tokenizer("smollm2-135m", tmp_path_factory)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return _gguf_tokenizer("gemma3-270m", tmp_path_factory)


def _reference(name: str) -> dict:
    path = FIXTURES / REFS[name]
    if not path.is_file():
        pytest.skip(f"reference {path} not generated yet")
    return json.loads(path.read_text())


def _check_against_reference(tok: Tokenizer, ref: dict) -> None:
    assert tok.vocab_size == ref["vocab_size"]
    assert tok.hf.bos_token == ref["bos_token"] and tok.hf.eos_token == ref["eos_token"]
    for token, tid in ref["special_tokens"].items():
        assert tok.hf.convert_tokens_to_ids(token) == tid, token
    for case in ref["cases"]:
        text = case["text"]
        assert tok.encode(text) == case["ids_with_special_tokens"], text
        plain = tok.encode(text, add_special_tokens=False)
        assert plain == case["ids_without_special_tokens"], text
        assert tok.decode(plain, skip_special_tokens=False) == case["decoded"], text
    for chat in ref["chat"]:
        assert tok.apply_chat_template(chat["messages"]) == chat["ids"]
        assert tok.decode(chat["ids"], skip_special_tokens=False) == chat["rendered"]


def test_smollm2_matches_transformers(smollm: Tokenizer) -> None:
    ref = _reference("smollm2-135m")
    assert ref["chat"], "SmolLM2 reference has chat cases"
    _check_against_reference(smollm, ref)


@pytest.mark.slow
def test_gemma3_matches_transformers(gemma: Tokenizer, tmp_path: Path) -> None:
    ref = _reference("gemma3-270m")
    _check_against_reference(gemma, ref)
    assert gemma.encode("hi")[0] == gemma.bos_token_id == 2  # Gemma prepends <bos>
    assert gemma.chat_template is None and gemma.eos_token_ids == (1,)
    gemma.save(tmp_path)  # what a converted checkpoint holds
    _check_against_reference(Tokenizer.from_pretrained(tmp_path), ref)


def test_smollm2_special_ids_and_chat_end(smollm: Tokenizer) -> None:
    vocab = smollm.hf.get_vocab()
    assert vocab["<|im_end|>"] in smollm.eos_token_ids  # chat turns end with <|im_end|>
    assert smollm.bos_token_id == vocab["<|im_start|>"]
    ids = smollm.apply_chat_template([{"role": "user", "content": "What is 2+2?"}])
    text = smollm.decode(ids, skip_special_tokens=False)
    assert text.endswith("<|im_start|>assistant\n") and "What is 2+2?" in text
    assert smollm.decode(ids).count("<|im_start|>") == 0  # special tokens skipped by default


def _tiny_tokenizer(chat_template: str | None = None) -> Tokenizer:
    """A word-level tokenizer built in memory (no files, no model)."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4}
    raw = RawTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.decoder = decoders.WordPiece()
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>",
                                 unk_token="<unk>", chat_template=chat_template)
    return Tokenizer(hf, source="tiny")


def test_no_chat_template_is_a_clear_error() -> None:
    tok = _tiny_tokenizer()
    with pytest.raises(TokenizerError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hello"}])


@pytest.mark.parametrize("ids, needle", [
    ([3, -1], "index 1 must be an integer >= 0, got -1"),
    ([3.0], "index 0 must be an integer >= 0, got 3.0"),
    (["3"], "index 0 must be an integer >= 0, got '3'"),
    ([True], "index 0 must be an integer >= 0, got True"),
])
def test_decode_of_a_bad_id_is_a_tokenizer_error(ids, needle: str) -> None:
    with pytest.raises(TokenizerError, match=re.escape(needle)):
        _tiny_tokenizer().decode(ids)


def test_decode_takes_numpy_ids_and_ids_past_the_vocabulary() -> None:
    tok = _tiny_tokenizer()
    assert tok.decode(np.array([3, 4], dtype=np.uint32)) == tok.decode([3, 4]) == "hello world"
    assert tok.decode([3, 999]) == "hello"  # a padded model vocabulary's ids decode to ""


def test_turn_end_tokens_join_eos_only_when_the_template_uses_them() -> None:
    assert _tiny_tokenizer().eos_token_ids == (2,)
    tok = _tiny_tokenizer("{% for m in messages %}{{ m['content'] }}</s>{% endfor %}")
    assert tok.apply_chat_template([{"role": "user", "content": "hello world"}]) == [3, 4, 2]


_ROLE_TEMPLATE = "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} </s>{% endfor %}"


@pytest.mark.parametrize("messages, needle", [
    ([{"role": "user"}], r"messages\[0\] \(user\) has no 'content'"),
    ([{"role": "user", "content": "hello"}, {"role": "robot", "content": "world"}],
     r"messages\[1\]\.role must be one of system, user, assistant, tool; got 'robot'"),
    ([{"content": "hello"}], r"messages\[0\] has no 'role'"),
    ([{"role": "user", "content": ["hello"]}], r"messages\[0\]\.content\[0\] must be a text "
                                                r"part"),
    ([{"role": "user", "content": None}], r"messages\[0\]\.content must be a string or a "
                                          r"list of text parts, got NoneType"),
    ([{"role": "user", "content": "hello"}, "world"], r"messages\[1\] must be a dict"),
    ({"role": "user", "content": "hello"}, r"non-empty list of .* got dict"),
    ([], r"non-empty list of .* got list \[\]"),
    ([{"role": "user", "content": "hi \udcff"}],  # a byte that is not UTF-8, from argv/stdin
     r"messages\[0\]\.content is not valid UTF-8 text: character 3 is the byte 0xff"),
    ([{"role": "system", "content": "ok"}, {"role": "user", "content": "x\ud800y"}],
     r"messages\[1\]\.content is not valid UTF-8 text: character 1 is a lone surrogate U\+D800"),
])
def test_malformed_chat_messages_are_tokenizer_errors(messages, needle: str) -> None:
    tok = _tiny_tokenizer(_ROLE_TEMPLATE)
    with pytest.raises(TokenizerError, match=needle):
        tok.apply_chat_template(messages)


def test_engine_chat_takes_openai_text_parts_joined_by_newlines() -> None:
    """As vLLM's chat preprocessing for string-content templates: a content given as a list
    of text parts is the parts joined with newlines; a part that is not text is refused by
    position."""
    from jaxinfer.prompts import encode_chat

    tok = _tiny_tokenizer(_ROLE_TEMPLATE)
    parts = [{"role": "system", "content": "hello"},
             {"role": "user", "content": [{"type": "text", "text": "hello"},
                                          {"type": "text", "text": "world"}]}]
    joined = [parts[0], {"role": "user", "content": "hello\nworld"}]
    assert encode_chat(tok, parts, 64) == encode_chat(tok, joined, 64) == \
        tok.apply_chat_template(joined) == tok.apply_chat_template(parts)
    assert parts[1]["content"][0] == {"type": "text", "text": "hello"}  # not edited
    bad = [{"role": "user", "content": [{"type": "text", "text": "hi"},
                                        {"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(TokenizerError, match=r"messages\[0\]\.content\[1\] must be a text "
                                             r"part .* \(only text is supported\)"):
        encode_chat(tok, bad, 64)


def test_a_template_refusing_a_conversation_is_a_tokenizer_error() -> None:
    # As Gemma's template does for roles that do not alternate.
    tok = _tiny_tokenizer("{% if messages[0]['role'] != 'user' %}{{ raise_exception('first "
                          "message must be the user') }}{% endif %}{{ messages[0]['content'] }}")
    assert tok.apply_chat_template([{"role": "user", "content": "hello"}]) == [3]
    with pytest.raises(TokenizerError, match=r"chat template of tiny cannot render these "
                                             r"messages: .*first message must be the user"):
        tok.apply_chat_template([{"role": "assistant", "content": "hello"}])


def test_save_and_reload_round_trip(smollm: Tokenizer, tmp_path: Path) -> None:
    smollm.save(tmp_path)
    again = Tokenizer.from_pretrained(tmp_path)
    texts = ["Hello world", "  two spaces", "日本語 🙂 <|im_end|>", "x = {'a': [1, 2]}\n"]
    for t in texts:
        assert again.encode(t) == smollm.encode(t)
        assert again.decode(smollm.encode(t), skip_special_tokens=False) == t
    assert again.eos_token_ids == smollm.eos_token_ids
    assert again.bos_token_id == smollm.bos_token_id
    assert again.chat_template == smollm.chat_template
    msgs = [{"role": "user", "content": "hi"}]
    assert again.apply_chat_template(msgs) == smollm.apply_chat_template(msgs)


def test_from_pretrained_missing_dir_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="cannot load a tokenizer"):
        Tokenizer.from_pretrained(tmp_path / "nope")


def _stream(tok: Tokenizer, prompt: list[int], gen: list[int]) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = [detok.step([t]) for t in gen]
    deltas.append(detok.flush())
    assert detok.output_text == "".join(deltas)
    return deltas


@pytest.mark.parametrize("text", ["Hello world, how are you?", "日本語のテキスト 中文测试",
                                  "emoji 😀🚀👍🏽 done", "  spaced   out\n\nlines",
                                  "café naïve 👨\u200d👩\u200d👧"])
def test_incremental_detokenizer_matches_full_decode(smollm: Tokenizer, text: str) -> None:
    prompt = smollm.encode("The prompt:")
    gen = smollm.encode(text, add_special_tokens=False)
    deltas = _stream(smollm, prompt, gen)
    assert "".join(deltas) == smollm.decode(gen)
    assert all("\ufffd" not in d for d in deltas)


def test_incremental_detokenizer_holds_back_partial_utf8(smollm: Tokenizer) -> None:
    gen = smollm.encode("🙂", add_special_tokens=False)
    assert len(gen) > 1, "the emoji should span several byte-level tokens"
    detok = IncrementalDetokenizer(smollm, [])
    assert [detok.step([t]) for t in gen[:-1]] == [""] * (len(gen) - 1)
    assert detok.step(gen[-1:]) == "🙂"


def test_incremental_detokenizer_skips_special_tokens(smollm: Tokenizer) -> None:
    end = smollm.hf.convert_tokens_to_ids("<|im_end|>")
    gen = smollm.encode("Four.", add_special_tokens=False) + [end]
    assert "".join(_stream(smollm, [], gen)) == "Four."


@pytest.mark.slow
def test_incremental_detokenizer_sentencepiece_spaces(gemma: Tokenizer) -> None:
    # SentencePiece puts the space inside the next token ("▁world"): decoding a token alone
    # loses it, the prefix/read offsets keep it.
    prompt = gemma.encode("Once upon a time")
    text = " there was a café in 東京 with 👍🏽 and   spaces."
    gen = gemma.encode(text, add_special_tokens=False)
    assert "".join(_stream(gemma, prompt, gen)) == gemma.decode(gen) == text


_BOUND_TEXTS = ["Hello world, how are you?", " " * 5000, "\n" * 3000, "a" * 20000,
                "ab " * 4000, "日本語のテキスト" * 500, "😀🚀👍🏽" * 700,
                "e\u0301" * 3000, "def f(x):\n    return x\n" * 400, "<|im_start|>" * 300,
                "<start_of_turn>" * 300]


def _check_min_tokens(tok: Tokenizer) -> None:
    rng = np.random.default_rng(0)
    texts = list(_BOUND_TEXTS) + ["".join(chr(int(c)) for c in rng.integers(32, 0x3000, 4000))
                                  for _ in range(3)]
    for text in texts:
        n = len(tok.encode(text))
        assert tok.min_tokens(text) <= n, (text[:20], tok.min_tokens(text), n)
    assert tok.min_tokens(*texts[:2]) == (len(texts[0]) + len(texts[1])) // (
        4 * tok.max_token_chars)
    assert tok.min_tokens("x" * (4 * tok.max_token_chars * 1000)) == 1000


def test_min_tokens_is_a_lower_bound_smollm2(smollm: Tokenizer) -> None:
    _check_min_tokens(smollm)


@pytest.mark.slow
def test_min_tokens_is_a_lower_bound_gemma3(gemma: Tokenizer) -> None:
    _check_min_tokens(gemma)


_GEN_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} </s>{% endfor %}"
                 "{% if add_generation_prompt %}<s>{% endif %}")


def test_chat_template_options_as_vllm_llm_chat() -> None:
    """chat_template (instead of the model's), add_generation_prompt, continue_final_message
    and chat_template_kwargs reach transformers' apply_chat_template; bad combinations are
    TokenizerErrors, as is a template that is not a string."""
    tok = _tiny_tokenizer(_GEN_TEMPLATE)
    conv = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "world"}]
    # roles are not in the word-level vocabulary: <unk> (0)
    assert tok.apply_chat_template(conv) == [0, 3, 2, 0, 4, 2, 1]
    assert tok.apply_chat_template(conv, add_generation_prompt=False) == [0, 3, 2, 0, 4, 2]
    # the last message left open: no </s> after "world", no generation prompt
    assert tok.apply_chat_template(conv, add_generation_prompt=False,
                                   continue_final_message=True) == [0, 3, 2, 0, 4]
    with pytest.raises(TokenizerError, match="cannot both be set"):
        tok.apply_chat_template(conv, continue_final_message=True)
    own = "{% if greet %}hello {% endif %}{% for m in messages %}{{ m['content'] }} {% endfor %}"
    plain = _tiny_tokenizer()  # no template of its own: a given one is enough
    assert plain.apply_chat_template(conv, chat_template=own) == [3, 4]
    assert plain.apply_chat_template(conv, chat_template=own,
                                     chat_template_kwargs={"greet": True}) == [3, 3, 4]
    with pytest.raises(TokenizerError, match="no chat template"):
        plain.apply_chat_template(conv)
    with pytest.raises(TokenizerError, match="chat_template must be a Jinja template string"):
        plain.apply_chat_template(conv, chat_template=5)
    with pytest.raises(TokenizerError, match="chat_template_kwargs must be a dict"):
        tok.apply_chat_template(conv, chat_template_kwargs=["greet"])
    with pytest.raises(TokenizerError, match="chat_template_kwargs may not set messages, "
                                             "tokenize"):
        tok.apply_chat_template(conv, chat_template_kwargs={"tokenize": 1, "messages": 2})
    with pytest.raises(TokenizerError, match="the chat_template given cannot render"):
        tok.apply_chat_template(conv, chat_template="{% for m in messages %}{{ m.x.y }}")
