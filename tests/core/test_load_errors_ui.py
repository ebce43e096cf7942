"""Load-time refusals of a model directory's tokenizer (vocabulary far smaller than the
model's) and the CLI's error line after a progress bar."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.numpy import load_file, save_file

from jaxinfer.cli import main
from jaxinfer.loading import CheckpointError, load_model

TINY = Path(__file__).resolve().parents[1] / "fixtures" / "tiny" / "llama"


def test_tokenizer_config_without_its_files_is_refused_naming_tokenizer_json(
        tmp_path: Path) -> None:
    d = shutil.copytree(TINY, tmp_path / "m")
    (d / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer"}))
    with pytest.raises(CheckpointError, match=r"tokenizer has \d+ tokens but the model's "
                       r"vocabulary has 256: .*tokenizer\.json is missing"):
        load_model(str(d), progress=False)


def test_error_line_starts_after_the_progress_bar(tmp_path: Path, capsys) -> None:
    d = shutil.copytree(TINY, tmp_path / "m")
    w = load_file(str(d / "model.safetensors"))
    w["model.mystery.weight"] = w["model.norm.weight"]
    save_file(w, str(d / "model.safetensors"))
    assert main(["generate", "--model", str(d), "--token-ids", "1 2"]) == 2
    lines = capsys.readouterr().err.replace("\r", "\n").splitlines()
    errors = [ln for ln in lines if "jaxinfer: error:" in ln]
    assert len(errors) == 1 and errors[0].startswith("jaxinfer: error:"), lines
    assert "unexpected tensor 'model.mystery.weight'" in errors[0]
