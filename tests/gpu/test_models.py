"""Model directories: the tiny test model, loading errors, the default model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tserve.gpu.gguf import _convert
from tserve.gpu.gguf._convert import default_model_dir
from tserve.gpu.models._directory import ModelLoadError, build_tiny_model, load_model


def test_tiny_model_builds_deterministically(tmp_path: Path, tiny_model_dir: Path) -> None:
    again = build_tiny_model(tmp_path / "again")
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (again / name).read_bytes() == (tiny_model_dir / name).read_bytes(), name
    config = json.loads((again / "config.json").read_text())
    assert config["num_key_value_heads"] < config["num_attention_heads"]  # GQA


@pytest.mark.parametrize(
    "text", ["Hello, world!", "", "  spaces\tand\nnewlines ", "héllo wörld 日本語 🙂", "\x00\x7f"]
)
def test_tiny_tokenizer_round_trips_any_text(tiny_model: tuple[Any, Any], text: str) -> None:
    _, tokenizer = tiny_model
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text


def test_tiny_tokenizer_speaks_chatml(tiny_model: tuple[Any, Any]) -> None:
    model, tokenizer = tiny_model
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.eos_token == "<|im_end|>"
    assert model.config.eos_token_id == tokenizer.eos_token_id
    assert len(tokenizer) <= model.config.vocab_size
    assert len(tokenizer.encode("<|im_start|>", add_special_tokens=False)) == 1


def test_tiny_model_greedy_output_depends_on_the_prompt(tiny_model: tuple[Any, Any]) -> None:
    model, tokenizer = tiny_model
    outputs = set()
    for text in ("Hello", "The capital", "Numbers 123", "a"):
        ids = torch.tensor([tokenizer.encode(text)])
        with torch.inference_mode():
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False
            )
        new = tuple(out[0, ids.shape[1] :].tolist())
        assert len(set(new)) > 2, "greedy output collapsed to one token"
        outputs.add(new)
    assert len(outputs) == 4


def test_missing_directory_is_a_clear_error(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelLoadError, match="no-such-model"):
        load_model(missing, device="cpu", dtype=torch.float32)


def test_directory_without_a_model_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(ModelLoadError, match=str(tmp_path)):
        load_model(tmp_path, device="cpu", dtype=torch.float32)
    (tmp_path / "config.json").write_text('{"model_type": "no-such-architecture"}')
    with pytest.raises(ModelLoadError, match=str(tmp_path)):
        load_model(tmp_path, device="cpu", dtype=torch.float32)


def test_a_failed_conversion_leaves_no_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def crash(gguf: Path, out: Path, report: Any) -> None:
        (out / "model.safetensors").write_bytes(b"half written")
        raise RuntimeError("killed mid-conversion")

    monkeypatch.setattr(_convert, "write_fp32_dir", crash)
    with pytest.raises(RuntimeError, match="mid-conversion"):
        default_model_dir(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_default_model_converts_once_and_answers(tmp_path: Path) -> None:
    """End to end: GGUF -> fp32 directory (~20 s here), then plain from_pretrained."""
    lines: list[str] = []
    path = default_model_dir(tmp_path, progress=lines.append)
    assert path.parent == tmp_path and lines
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no staging leftovers
    weights = path / "model.safetensors"
    stamp = weights.stat().st_mtime_ns

    again: list[str] = []
    assert default_model_dir(tmp_path, progress=again.append) == path
    assert again == [] and weights.stat().st_mtime_ns == stamp

    model, tokenizer = load_model(path, device="cpu", dtype=torch.float32)
    assert "quantization_config" not in json.loads((path / "config.json").read_text())
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer
    shutil.rmtree(path)  # 540 MB; pytest keeps the last few temp dirs
