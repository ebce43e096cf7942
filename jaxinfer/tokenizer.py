"""Tokenizer: HF fast tokenizers (also built from GGUF metadata), chat templates, streaming text.

:class:`Tokenizer` wraps a ``transformers`` fast tokenizer. From a GGUF it is built without torch
through ``transformers.integrations.gguf.gguf_tokenizer_mapping.convert_gguf_tokenizer``, fed
with the ``tokenizer.ggml.*`` fields read by the ``gguf`` package -- the same builder and the
same init arguments that ``AutoTokenizer.from_pretrained(dir, gguf_file=...)`` uses, so ids
match transformers. Streaming text: :class:`jaxinfer.detokenizer.IncrementalDetokenizer`.
"""

from __future__ import annotations

import json
import operator
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

# Tokens that end a chat turn in common templates. When a model's chat template uses one, its id
# joins the EOS set: chat models stop on the turn end (e.g. SmolLM2's "<|im_end|>").
TURN_END_TOKENS = ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|end|>", "<|eom_id|>")
_META_FILE = "jaxinfer_tokenizer.json"
# Message roles a conversation may use (OpenAI's / vLLM's chat roles, less the newer
# "developer" that templates do not know); others are rejected before the template runs.
CHAT_ROLES = ("system", "user", "assistant", "tool")
_SPECIAL_IDS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id",
                "unk_token": "unknown_token_id", "pad_token": "padding_token_id"}


# transformers' apply_chat_template arguments, and the names its render passes the template:
# not settable through chat_template_kwargs.
_TEMPLATE_ARGUMENTS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


class TokenizerError(ValueError):
    """A tokenizer cannot be built, or cannot do what was asked (e.g. no chat template)."""


def utf8_problem(text: str) -> str | None:
    """Why ``text`` cannot be encoded as UTF-8 (a lone surrogate: what Python makes of bytes
    that are not UTF-8 in ``sys.argv`` or stdin, ``errors="surrogateescape"``), or None.
    The tokenizers library refuses such text with an unhelpful TypeError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        ch = text[e.start]
        what = (f"the byte 0x{ord(ch) - 0xDC00:02x}, not UTF-8" if 0xDC80 <= ord(ch) <= 0xDCFF
                else f"a lone surrogate U+{ord(ch):04X}")
        return f"is not valid UTF-8 text: character {e.start} is {what}"
    return None


def check_messages(messages: Any) -> None:
    """Check a conversation before a chat template renders it.

    ``messages`` must be a non-empty list of dicts, each with a ``role`` in
    :data:`CHAT_ROLES` and a str ``content`` that is valid UTF-8 (an assistant message with
    ``tool_calls`` may have none). Other keys (``name``, ``tool_calls``, ``tool_call_id``)
    pass to the template.

    Raises:
      TokenizerError: naming the message (``messages[i]``), the field and what is allowed.
    """
    if not isinstance(messages, (list, tuple)) or not messages:
        raise TokenizerError(f"chat messages must be a non-empty list of "
                             f"{{'role': ..., 'content': ...}} dicts, got {_short(messages)}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise TokenizerError(f"messages[{i}] must be a dict with 'role' and 'content', "
                                 f"got {_short(m)}")
        role = m.get("role")
        if "role" not in m:
            raise TokenizerError(f"messages[{i}] has no 'role' (one of {', '.join(CHAT_ROLES)})")
        if not isinstance(role, str) or role not in CHAT_ROLES:
            raise TokenizerError(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}; "
                                 f"got {role!r}")
        content = m.get("content")
        if isinstance(content, str):
            if (why := utf8_problem(content)) is not None:
                raise TokenizerError(f"messages[{i}].content {why}")
            continue
        if content is None and role == "assistant" and m.get("tool_calls"):
            continue
        if "content" not in m:
            raise TokenizerError(f"messages[{i}] ({role}) has no 'content' (a string)")
        raise TokenizerError(f"messages[{i}].content must be a string or a list of text parts, "
                             f"got {_short(content)}")


def text_contents(messages: Any) -> Any:
    """``messages`` with each content given as OpenAI's list of text parts
    (``[{"type": "text", "text": "..."}, ...]``) joined into one string with newlines, as
    vLLM's chat preprocessing does for a template that takes string contents; other
    messages unchanged (``check_messages`` judges them). Raises TokenizerError for a part
    that is not text (images and audio are not supported), naming it."""
    if not isinstance(messages, (list, tuple)):
        return messages
    out = []
    for i, m in enumerate(messages):
        parts = m.get("content") if isinstance(m, dict) else None
        if isinstance(parts, (list, tuple)):
            texts = []
            for j, p in enumerate(parts):
                kind = p.get("type") if isinstance(p, dict) else None
                if kind != "text" or not isinstance(p.get("text"), str):
                    raise TokenizerError(f"messages[{i}].content[{j}] must be a text part "
                                         f"{{'type': 'text', 'text': str}} (only text is "
                                         f"supported), got {p!r:.60}")
                texts.append(p["text"])
            m = {**m, "content": "\n".join(texts)}
        out.append(m)
    return out


def _short(v: object) -> str:
    return f"{type(v).__name__} {v!r:.40}"


class Tokenizer:
    """Text <-> token ids for one model.

    Args:
      hf: a transformers fast tokenizer (``PreTrainedTokenizerFast`` / ``TokenizersBackend``).
      extra_eos_ids: more ids that end generation besides ``hf.eos_token_id`` (e.g. from a
        ``generation_config.json``).
      source: where it came from, for messages.
    """

    def __init__(self, hf: Any, extra_eos_ids: Iterable[int] = (), source: str = "") -> None:
        self.hf = hf
        self.source = source
        eos: list[int] = []
        if hf.eos_token_id is not None:
            eos.append(int(hf.eos_token_id))
        eos += [int(i) for i in extra_eos_ids]
        template = hf.chat_template if isinstance(hf.chat_template, str) else ""
        vocab = hf.get_vocab()
        eos += [vocab[t] for t in TURN_END_TOKENS if t in template and t in vocab]
        self._eos = tuple(dict.fromkeys(eos))
        # The longest vocabulary string: byte-level BPE spells a token one character a byte,
        # SentencePiece one a character, an added token as its text -- so no token covers
        # more input characters than this (see min_tokens).
        self.max_token_chars = max((len(t) for t in vocab), default=1)

    # ----------------------------------------------------------------- properties
    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Ids that end generation: the EOS token, chat turn ends, extras; no duplicates."""
        return self._eos

    @property
    def bos_token_id(self) -> int | None:
        return None if self.hf.bos_token_id is None else int(self.hf.bos_token_id)

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (added tokens included)."""
        return len(self.hf)

    @property
    def chat_template(self) -> str | None:
        t = self.hf.chat_template
        return t if isinstance(t, str) and t else None

    # ----------------------------------------------------------------- text <-> ids
    def min_tokens(self, *texts: str) -> int:
        """The fewest tokens ``texts`` (together or one by one) can encode to, without
        encoding: their characters over four times :attr:`max_token_chars` (four: room for
        normalizers that merge characters, e.g. NFC). Lets a caller refuse a prompt that
        cannot fit before spending seconds encoding megabytes of it.

        A true lower bound where every token spells out the characters it covers: byte-level
        BPE and SentencePiece with byte fallback -- the Llama 3, Mistral, Qwen2/3, Gemma 3 and
        SmolLM2 tokenizers. A tokenizer that folds any run of unknown characters into one
        ``<unk>`` (WordLevel, or BPE with ``fuse_unk`` and no byte fallback) can encode such
        a run to fewer tokens; a prompt refused on this count there is mostly unknown text.
        """
        return sum(len(t) for t in texts) // (4 * self.max_token_chars)

    def encode(self, text: str, add_special_tokens: bool = True,
               max_length: int | None = None) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` adds BOS where the model wants one.

        ``max_length``: keep at most this many ids by dropping text tokens from the start
        (left truncation; the special tokens stay), as a transformers tokenizer called with
        ``truncation=True, max_length=...`` and ``truncation_side="left"`` (vLLM's
        ``truncate_prompt_tokens``). Raises TokenizerError when it leaves no text token
        (transformers then returns the special tokens alone, or below their count the
        untruncated ids with a logged error).
        """
        full = list(self.hf.encode(text, add_special_tokens=add_special_tokens))
        if max_length is None or len(full) <= max_length:
            return full
        plain = full if not add_special_tokens or not self.hf.num_special_tokens_to_add() \
            else list(self.hf.encode(text, add_special_tokens=False))  # (encoded twice)
        # The special tokens around the text: where the text's ids sit inside ``full``.
        p = next((i for i in range(len(full) - len(plain) + 1)
                  if full[i:i + len(plain)] == plain), None)
        if p is None:
            raise TokenizerError(f"cannot truncate this text to {max_length} tokens: its ids "
                                 f"with special tokens do not contain those without")
        prefix, suffix = full[:p], full[p + len(plain):]
        room = max_length - len(prefix) - len(suffix)
        if room < 1:
            raise TokenizerError(f"a truncation to {max_length} tokens leaves no room for the "
                                 f"text after the {len(prefix) + len(suffix)} special token(s) "
                                 f"the tokenizer adds")
        return prefix + plain[len(plain) - room:] + suffix

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids`` (special tokens dropped unless ``skip_special_tokens=False``).

        Ids at or past the tokenizer's own size decode to "" (a model's vocabulary may be
        padded past it, as SmolLM2's and Gemma's are, so such ids are legitimate outputs).

        Raises:
          TokenizerError: an id that is not an integer, or is negative (naming its index);
            transformers would raise an OverflowError from inside its Rust decoder.
        """
        checked = []
        for i, t in enumerate(ids):
            try:
                v = -1 if isinstance(t, bool) else operator.index(t)
            except TypeError:
                v = -1
            if v < 0:
                raise TokenizerError(f"token id at index {i} must be an integer >= 0, got "
                                     f"{t!r}")
            checked.append(v)
        return self.decode_ids(checked, skip_special_tokens)

    def decode_ids(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """:meth:`decode` without its checks, for ids known to be ints >= 0 (the engine's
        outputs and checked prompts: the streaming detokenizer's path, two calls a token)."""
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, str]],
                            add_generation_prompt: bool = True, *,
                            chat_template: str | None = None,
                            continue_final_message: bool = False,
                            chat_template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """Token ids of a conversation rendered with the model's chat template.

        ``messages`` is ``[{"role": "user", "content": "..."}, ...]`` (see
        :func:`check_messages`; a content may be a list of text parts,
        :func:`text_contents`). The rendered text is encoded without adding special tokens
        (the template writes them), as transformers does. The keywords are transformers' /
        vLLM ``LLM.chat``'s: ``chat_template`` a Jinja template used instead of the model's;
        ``continue_final_message`` leaves the last (assistant) message open so the model
        continues it (not with ``add_generation_prompt``); ``chat_template_kwargs`` extra
        template variables (e.g. Qwen3's ``{"enable_thinking": False}``).

        Raises:
          TokenizerError: the model has no chat template (and none is given); malformed
            messages (naming the message and the field); both ``add_generation_prompt`` and
            ``continue_final_message``; or the template refused the conversation (its own
            message, e.g. roles that do not alternate).
        """
        return self.encode(self.render_chat(
            messages, add_generation_prompt, chat_template=chat_template,
            continue_final_message=continue_final_message,
            chat_template_kwargs=chat_template_kwargs), add_special_tokens=False)

    def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                    *, chat_template: str | None = None, continue_final_message: bool = False,
                    chat_template_kwargs: dict[str, Any] | None = None) -> str:
        """The text :meth:`apply_chat_template` encodes (transformers'
        ``apply_chat_template(..., tokenize=False)``); same arguments and errors."""
        if chat_template is not None and not isinstance(chat_template, str):
            raise TokenizerError(f"chat_template must be a Jinja template string, got "
                                 f"{type(chat_template).__name__}")
        if chat_template is None and self.chat_template is None:
            raise TokenizerError(f"the tokenizer of {self.source or 'this model'} has no chat "
                                 "template (not an instruction-tuned model?); use a plain prompt")
        if add_generation_prompt and continue_final_message:
            raise TokenizerError("continue_final_message and add_generation_prompt cannot both "
                                 "be set (the last message is either continued or answered)")
        kwargs = chat_template_kwargs or {}
        if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
            raise TokenizerError(f"chat_template_kwargs must be a dict of str keys, got "
                                 f"{kwargs!r}")
        if taken := sorted(set(kwargs) & _TEMPLATE_ARGUMENTS):
            raise TokenizerError(f"chat_template_kwargs may not set {', '.join(taken)} (an "
                                 f"argument of the chat template call itself)")
        messages = text_contents(messages)
        check_messages(messages)
        try:
            text = self.hf.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                chat_template=chat_template, continue_final_message=continue_final_message,
                **kwargs)
        except Exception as e:  # jinja2's TemplateError (raise_exception in the template) ...
            whose = ("the chat_template given" if chat_template is not None
                     else f"the chat template of {self.source or 'this model'}")
            raise TokenizerError(f"{whose} cannot render these messages: "
                                 f"{type(e).__name__}: {e}") from e
        return text

    # ----------------------------------------------------------------- persistence
    def save(self, path: str | Path) -> None:
        """Write ``tokenizer.json``, ``tokenizer_config.json`` (+ chat template) and a small
        ``jaxinfer_tokenizer.json`` (EOS ids, BOS id, init arguments) into directory ``path``."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.hf.save_pretrained(str(path))
        init = {k: getattr(self.hf, k) for k in _SPECIAL_IDS}
        init = {k: str(v) for k, v in init.items() if v is not None}
        init["clean_up_tokenization_spaces"] = bool(self.hf.clean_up_tokenization_spaces)
        if self.chat_template is not None:
            init["chat_template"] = self.chat_template
        meta = {"format": 1, "eos_token_ids": list(self._eos), "bos_token_id": self.bos_token_id,
                "init_kwargs": init}
        (path / _META_FILE).write_text(json.dumps(meta, indent=1))

    @classmethod
    def from_pretrained(cls, path: str | Path, extra_eos_ids: Iterable[int] = ()) -> Tokenizer:
        """Load from a directory written by :meth:`save` (fast path: ``tokenizer.json`` plus the
        recorded init arguments) or an HF model directory (``AutoTokenizer``).
        Raises TokenizerError when the directory holds no usable tokenizer."""
        path = Path(path)
        meta_file = path / _META_FILE
        hf: Any
        try:
            if meta_file.is_file():
                meta = json.loads(meta_file.read_text())
                from transformers import PreTrainedTokenizerFast  # lazy: 1-10 s import

                hf = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"),
                                             **meta["init_kwargs"])
                extra = list(meta.get("eos_token_ids", ())) + list(extra_eos_ids)
                return cls(hf, extra, source=str(path))
            from transformers import AutoTokenizer

            hf = AutoTokenizer.from_pretrained(str(path))
        except Exception as e:  # tokenizers/transformers raise many kinds
            raise TokenizerError(f"cannot load a tokenizer from {path}: {e}") from e
        return cls(hf, extra_eos_ids, source=str(path))

    @classmethod
    def from_gguf(cls, reader_or_path: Any) -> Tokenizer:
        """Build from a GGUF's ``tokenizer.*`` metadata (a ``gguf.GGUFReader`` or a path).

        Mirrors ``transformers.integrations.gguf.gguf_tokenizer_mapping.get_gguf_tokenizer``
        (which imports torch through its reader) using the ``gguf`` package's reader instead.
        Raises TokenizerError when the file cannot be read (truncated, corrupt), has no
        vocabulary or an unsupported tokenizer type.
        """
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            GGUF_TOKENIZER_MAPPING,
            convert_gguf_tokenizer,
        )

        if isinstance(reader_or_path, (str, Path)):
            from jaxinfer.loading.gguf_loader import open_gguf  # (it imports this module)

            try:  # a missing, truncated or corrupt file: the loader's message
                reader = open_gguf(reader_or_path)
            except ValueError as e:
                raise TokenizerError(str(e)) from e
            source = str(reader_or_path)
        else:
            reader = reader_or_path
            source = str(getattr(getattr(reader, "data", None), "filename", None) or "GGUF")
        fields = reader.fields

        def value(key: str) -> Any:
            f = fields.get(key)
            return None if f is None else f.contents()

        if value("tokenizer.ggml.tokens") is None:
            raise TokenizerError(f"{source}: GGUF has no tokenizer.ggml.tokens (no vocabulary)")
        groups = {g: {name: value(f"tokenizer.{k}") for k, name in m.items()
                      if f"tokenizer.{k}" in fields}
                  for g, m in GGUF_TOKENIZER_MAPPING.items()}
        tok_dict, tok_config = groups["tokenizer"], groups["tokenizer_config"]
        # Same defaults as get_gguf_tokenizer (transformers 5.24).
        ttype = tok_dict.get("tokenizer_type")
        if ttype == "llama":
            tok_config.setdefault("add_bos_token", True)
        elif ttype == "gemma4":
            tok_config["add_bos_token"] = False
        for name, key in _SPECIAL_IDS.items():
            tid = value(f"tokenizer.ggml.{key}")
            tok_config[name] = tok_dict["tokens"][tid] if tid is not None else None
        arch = value("general.architecture")
        try:
            backend, extra = convert_gguf_tokenizer(arch, tok_dict)
        except (ValueError, KeyError) as e:
            raise TokenizerError(f"{source}: cannot build the tokenizer: {e}") from e
        tok_config.update(extra)
        from transformers import PreTrainedTokenizerFast

        hf = PreTrainedTokenizerFast(tokenizer_object=backend, **tok_config)
        return cls(hf, source=source)


def check_vocab(tokenizer: Tokenizer, vocab_size: int, path: str | Path) -> None:
    """Refuse the tokenizer of model directory ``path`` when it has no ``tokenizer.json`` and
    its vocabulary is far smaller (under half) than the model's ``vocab_size``: a
    ``tokenizer_config.json`` naming a class whose vocabulary files are absent builds a
    tokenizer of only its special tokens. A ``tokenizer.json`` that is there is taken as it
    is (small test tokenizers are legitimate); padded embedding tables pass.

    Raises:
      TokenizerError: naming the missing ``tokenizer.json``.
    """
    n = tokenizer.vocab_size
    d = Path(path)
    if 2 * n >= vocab_size or (d / "tokenizer.json").is_file():
        return
    raise TokenizerError(f"{d}: the tokenizer has {n} tokens but the model's vocabulary has "
                         f"{vocab_size}: {d / 'tokenizer.json'} is missing (the model's "
                         f"tokenizer files are not all there)")
