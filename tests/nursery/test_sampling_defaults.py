"""The embeddable API: a SamplingParams that leaves temperature, top_p or top_k
unset gets the model's recommended value, through open_llm and attach_llm alike
(the engine applies them, and says which in its ready message)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import anyio
import pytest

from tests.guards import HANG_GUARD
from tests.nursery.conftest import ENGINE
from tserve import SamplingDefaults, SamplingParams, open_llm
from tserve.nursery import attach_llm

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the engine's doing, not the loop's
async def test_unset_fields_take_the_models_values_for_every_client(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """top_k 1 from the model makes every unset request greedy, whatever its
    seed; a request's own top_k samples (so the model's value did the work)."""
    model = tmp_path / "tiny"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**config, "top_k": 1}))
    greedy_params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompt = [5, 9, 14, 3, 7]
    with anyio.fail_after(HANG_GUARD):
        async with open_llm(model, **ENGINE) as owner:
            expected = SamplingDefaults(top_k=1, source=str(model / "generation_config.json"))
            assert owner.sampling_defaults == expected
            greedy = (await owner.complete(prompt, greedy_params)).token_ids
            async with attach_llm(owner.engine_address, owner.engine_pid) as attached:
                assert attached.sampling_defaults == expected
                for llm in (owner, attached):
                    for seed in (1, 2, 3):
                        unset = SamplingParams(max_tokens=24, seed=seed, ignore_eos=True)
                        assert (await llm.complete(prompt, unset)).token_ids == greedy
            own = SamplingParams(max_tokens=24, seed=1, top_k=0, ignore_eos=True)
            assert (await owner.complete(prompt, own)).token_ids != greedy
