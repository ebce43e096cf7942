"""The runner's loaders of per-slot sampling state (a mixin of ``runner.ModelRunner``): the
penalty-count row of a sequence (``load_history``: its tokens, stop and allowed token flags)
and its ``logit_bias`` and ``bad_words`` tables (``load_logit_bias``), each by a small
compiled program of its own mode (HISTORY, BIAS), run when the engine admits a sequence that
needs them; and the allowed-token flags of structured-outputs rows (``load_allowed_masks``,
mode MASK), run in every step that samples such a row, between its model and sampler
programs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxinfer.batch import Bucket
from jaxinfer.sampling_bad_words import table_rows
from jaxinfer.sampling_params import MAX_LOGIT_BIAS
from jaxinfer.sampling_penalties import ALLOWED_FLAG, STOP_FLAG, STOP_IDS_PER_CALL

# HISTORY is not a step: it loads one slot of the penalty state (``load_history``); its
# bucket is Bucket("history", L, 1, 0). BIAS loads one slot's ``logit_bias`` table
# (``load_logit_bias``); its bucket is ``BIAS_BUCKET``.
HISTORY, BIAS = "history", "bias"
BIAS_BUCKET = Bucket(BIAS, MAX_LOGIT_BIAS, 1, 0)
# MASK loads the allowed-token flags of R slots from [R, W] bitmasks (``load_allowed_masks``);
# its buckets are ``mask_bucket(R)``, R one of the engine's decode batch buckets.
MASK = "mask"


def mask_bucket(num_rows: int) -> Bucket:
    """Bucket of the program that loads ``num_rows`` slots' allowed-token bitmasks."""
    return Bucket(MASK, num_rows, num_rows, 0)


class SlotStateLoaders:
    """``load_history``, ``load_allowed_masks`` and ``load_logit_bias`` of ``ModelRunner``
    (which provides ``num_slots``, ``counts``, ``logit_bias`` and ``executable``)."""

    num_slots: int
    counts: Any
    logit_bias: Any

    def executable(self, bucket: Bucket, mode: str = ...) -> Any:  # ModelRunner's
        raise NotImplementedError

    def load_history(self, slot: int, token_ids: np.ndarray, num_prompt: int,
                     stop_ids: Sequence[int] = (), allowed_ids: Sequence[int] = ()) -> None:
        """Overwrite penalty-state row ``slot`` with the counts of one sequence's tokens and
        the flags of its stop tokens (masked while it has fewer than ``min_tokens`` outputs)
        and of its allowed tokens (``allowed_token_ids``: the others are masked).

        Args:
          slot: row in [0, num_slots).  token_ids: [L] int32 prompt then output tokens, -1
            padding; L fixes the program's bucket (the engine always pads to max_model_len).
          num_prompt: how many leading tokens are the prompt.
          stop_ids: token ids to flag (EOS unless ``ignore_eos``, ``stop_token_ids``);
          allowed_ids: the request's ``allowed_token_ids``. One call of the program per
            ``STOP_IDS_PER_CALL`` of each (at least one call).
        Raises:
          ValueError: slot out of range.
        """
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} is not in [0, {self.num_slots})")
        exe = self.executable(Bucket(HISTORY, int(token_ids.shape[0]), 1, 0), HISTORY)
        n = STOP_IDS_PER_CALL
        calls = []  # (flag, chunk of ids)
        for flag, given in ((STOP_FLAG, stop_ids), (ALLOWED_FLAG, allowed_ids)):
            ids = np.asarray(list(given), np.int64)
            calls += [(flag, ids[i:i + n]) for i in range(0, len(ids), n)]
        for j, (flag, chunk) in enumerate(calls or [(STOP_FLAG, np.zeros(0, np.int64))]):
            part = np.full(n, -1, np.int32)
            part[:len(chunk)] = np.where((chunk >= 0) & (chunk < 2**31), chunk, -1)
            toks = token_ids if j == 0 else np.full(token_ids.shape, -1, np.int32)
            self.counts = exe(self.counts, np.int32(slot), np.asarray(toks, np.int32),
                              np.int32(num_prompt), part, np.bool_(j > 0), np.int32(flag))

    def load_allowed_masks(self, slots: Sequence[int], masks: np.ndarray,
                           row_buckets: Sequence[int]) -> None:
        """Set the allowed-token flags of ``slots`` from ``masks`` (the next token's allowed
        set of each, ``structured_outputs.GrammarMatchers.masks``); the rows' other state is
        kept. Their rows in a step need ``SamplingArrays.allowed_only``.

        Args:
          slots: the rows' slots, each in [0, num_slots).
          masks: [len(slots), W] int32 bitmasks, W = ceil(V / 32).
          row_buckets: the row counts compiled (the engine's decode batch buckets): a call
            pads to the smallest that holds the rows (the scratch slot), or runs in chunks of
            the largest.
        Raises:
          ValueError: a slot out of range, or masks of another shape.
        """
        V = int(self.counts.shape[1])
        W = (V + 31) // 32
        if masks.shape != (len(slots), W):
            raise ValueError(f"masks have shape {masks.shape}; expected ({len(slots)}, {W})")
        if bad := [s for s in slots if not 0 <= s < self.num_slots]:
            raise ValueError(f"slots {bad[:8]} are not in [0, {self.num_slots})")
        top = max(row_buckets)
        for start in range(0, len(slots), top):
            part = list(slots[start:start + top])
            R = min(b for b in row_buckets if b >= len(part))
            rows = np.full(R, self.num_slots, np.int32)  # padding: the scratch row
            rows[:len(part)] = part
            bits = np.zeros((R, W), np.int32)
            bits[:len(part)] = masks[start:start + top]
            self.counts = self.executable(mask_bucket(R), MASK)(self.counts, rows, bits)

    def load_logit_bias(self, slot: int, logit_bias: dict[int, float] | None,
                        bad_words: Sequence[Sequence[int]] = (),
                        outputs: Sequence[int] = ()) -> None:
        """Overwrite slot ``slot``'s tables with ``logit_bias`` (token id -> bias, at most
        ``MAX_LOGIT_BIAS`` entries; the engine checks the ids against the vocabulary) and
        the ``bad_words`` token sequences (``SamplingParams.bad_words_token_ids``), whose
        matching starts from the sequence's ``outputs`` so far (its output token ids).
        Raises ValueError for a slot out of range or too many entries."""
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} is not in [0, {self.num_slots})")
        logit_bias = logit_bias or {}
        if len(logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias has {len(logit_bias)} entries; at most "
                             f"{MAX_LOGIT_BIAS}")
        ids = np.full(MAX_LOGIT_BIAS, -1, np.int32)
        values = np.zeros(MAX_LOGIT_BIAS, np.float32)
        ids[:len(logit_bias)] = list(logit_bias)
        values[:len(logit_bias)] = list(logit_bias.values())
        bad_ids, recent = table_rows(bad_words, outputs)
        exe = self.executable(BIAS_BUCKET, BIAS)
        self.logit_bias = exe(self.logit_bias, np.int32(slot), ids, values, bad_ids, recent)

