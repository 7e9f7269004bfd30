"""The model's recommended sampling values: where the engine reads them, and what
a request that leaves them unset samples with (``Sequence.sampling``)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from tests.gpu.cores import generated, small_core
from tests.gpu.gguf_files import write_gguf
from tserve.gpu.engine._engine_core import EngineCore
from tserve.gpu.forward._load import is_default_gguf
from tserve.gpu.models._directory import ModelLoadError, default_gguf
from tserve.gpu.models._sampling_defaults import read_sampling_defaults
from tserve.protocol import AddRequest, Sampling, SamplingDefaults, SamplingParams


def _directory(tmp_path: Path, config: object, name: str = "model") -> Path:
    directory = tmp_path / name
    directory.mkdir()
    (directory / "generation_config.json").write_text(json.dumps(config))
    return directory


def test_generation_config_json_gives_what_it_states(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "min_p": 0.05}
    directory = _directory(tmp_path, {**config, "repetition_penalty": 1.05, "eos_token_id": 2})
    with caplog.at_level(logging.INFO):
        found = read_sampling_defaults("auto", model_dir=directory)
    assert (found.temperature, found.top_p, found.top_k) == (0.7, 0.8, 20)
    assert found.source == str(directory / "generation_config.json")
    assert "min_p, repetition_penalty, which tserve does not apply" in caplog.text


def test_each_field_comes_from_the_first_source_that_states_it(tmp_path: Path) -> None:
    directory = _directory(tmp_path, {"temperature": 0.6})
    gguf = {"general.sampling.temp": 0.30000001192092896, "general.sampling.top_p": 0.95}
    found = read_sampling_defaults(
        "auto", model_dir=directory, gguf_metadata=gguf, default_model=True
    )
    # The file's temperature, the GGUF's top_p (its float32 read as the decimal
    # it was written from), nothing stated for top_k: the card adds nothing new.
    assert (found.temperature, found.top_p, found.top_k) == (0.6, 0.95, None)
    assert found.source == (
        f"{directory / 'generation_config.json'} and the GGUF file's general.sampling metadata"
    )


def test_the_default_model_gets_its_model_cards_values(tmp_path: Path) -> None:
    found = read_sampling_defaults("auto", model_dir=tmp_path, default_model=True)
    assert found == SamplingDefaults(0.2, 0.9, None, "SmolLM2-135M-Instruct's model card")
    assert is_default_gguf(default_gguf())
    assert not is_default_gguf(tmp_path / "other.gguf")


def test_none_is_openais_defaults_and_a_directory_replaces_the_models(tmp_path: Path) -> None:
    model = _directory(tmp_path, {"temperature": 0.6}, "model")
    chosen = _directory(tmp_path, {"top_k": 5}, "chosen")
    gguf = {"general.sampling.top_p": 0.5}
    assert (
        read_sampling_defaults("none", model_dir=model, gguf_metadata=gguf, default_model=True)
        == SamplingDefaults()
    )
    found = read_sampling_defaults(str(chosen), model_dir=model, gguf_metadata=gguf)
    assert found == SamplingDefaults(top_k=5, source=str(chosen / "generation_config.json"))
    with pytest.raises(ModelLoadError, match=r"no generation_config\.json"):
        read_sampling_defaults(str(tmp_path), model_dir=model)


def test_values_a_request_could_not_have_are_dropped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    directory = _directory(tmp_path, {"temperature": -1, "top_p": 0, "top_k": 1.5})
    with caplog.at_level(logging.WARNING):
        found = read_sampling_defaults("auto", model_dir=directory, default_model=True)
    # Each falls through to the next source that states a valid one.
    assert (found.temperature, found.top_p, found.top_k) == (0.2, 0.9, None)
    assert "temperature -1 is not applied" in caplog.text
    for bad in ({"temperature": "hot"}, {"top_p": True}, {"top_k": 2.0}):
        (directory / "generation_config.json").write_text(json.dumps(bad))
        assert read_sampling_defaults("auto", model_dir=directory) == SamplingDefaults()
    (directory / "generation_config.json").write_text("[1]")
    with pytest.raises(ModelLoadError, match="JSON object"):
        read_sampling_defaults("auto", model_dir=directory)


def test_a_request_samples_with_its_own_values_then_the_models_then_openais() -> None:
    defaults = SamplingDefaults(temperature=0.2, top_p=0.9, source="card")
    assert defaults.resolve(SamplingParams()) == Sampling(0.2, 0.9, 0)
    explicit = SamplingParams(temperature=1.0, top_p=1.0, top_k=4)
    assert defaults.resolve(explicit) == Sampling(1.0, 1.0, 4)
    assert defaults.resolve(SamplingParams(temperature=0.0)) == Sampling(0.0, 0.9, 0)
    assert SamplingDefaults().resolve(SamplingParams()) == Sampling(1.0, 1.0, 0)
    assert "temperature 0.2, top_p 0.9 (from card)" in defaults.describe()
    assert "OpenAI's" in SamplingDefaults().describe()


def _tokens(core: EngineCore, params: SamplingParams, rid: str) -> list[int]:
    return generated(core, AddRequest(rid, [5, 9, 14, 3, 7], params))


def test_the_engine_applies_a_gguf_files_sampling_metadata(
    smollm2_tiny_dir: Path, tmp_path: Path
) -> None:
    """top_k 1 from the file makes an unset request greedy, whatever its seed,
    as it is or dequantized; the request's own top_k wins; with
    generation_config "none" it samples."""
    path = write_gguf(
        smollm2_tiny_dir, tmp_path / "gguf" / "tiny.gguf", "F32", sampling={"top_k": 1}
    )
    cache = str(tmp_path / "cache")
    core = small_core(path, cache_dir=cache)
    assert core.sampling_defaults == SamplingDefaults(
        top_k=1, source="the GGUF file's general.sampling metadata"
    )
    assert core.ready_info().sampling_defaults == core.sampling_defaults
    n = 24
    greedy = _tokens(core, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), "g")
    unset = [
        _tokens(core, SamplingParams(max_tokens=n, seed=seed, ignore_eos=True), f"u{seed}")
        for seed in range(3)
    ]
    assert unset == [greedy] * 3
    own = [
        _tokens(core, SamplingParams(max_tokens=n, seed=s, top_k=0, ignore_eos=True), f"o{s}")
        for s in range(3)
    ]
    assert greedy not in own  # sampling at temperature 1 over the whole vocabulary
    # Served through its fp32 conversion, the file still says top_k 1.
    converted = small_core(path, cache_dir=cache, dequantize=True)
    assert converted.sampling_defaults == core.sampling_defaults
    assert _tokens(converted, SamplingParams(max_tokens=n, seed=0, ignore_eos=True), "c") == greedy
    off = small_core(path, cache_dir=cache, generation_config="none")
    assert off.sampling_defaults == SamplingDefaults()
    unset_off = [
        _tokens(off, SamplingParams(max_tokens=n, seed=seed, ignore_eos=True), f"u{seed}")
        for seed in range(3)
    ]
    assert unset_off == own
