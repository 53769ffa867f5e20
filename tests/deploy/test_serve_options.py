"""Deployment options: prefill workers may differ from decode workers in named engine fields only."""

from __future__ import annotations

import pytest

from hybridserve.deploy.serve import ServeOptions
from hybridserve.engine.config import EngineConfig


def test_prefill_workers_get_their_overrides_and_decode_workers_do_not() -> None:
    options = ServeOptions(model_dir="m", engine=EngineConfig(prefill_chunk_size=256),
                           prefill_engine_overrides={"prefill_chunk_size": 4096})
    assert options.engine_for("prefill").prefill_chunk_size == 4096
    assert options.engine_for("decode").prefill_chunk_size == 256


@pytest.mark.parametrize("overrides, message", [
    ({"prefill_chunk_sz": 4096}, "name no EngineConfig field: ['prefill_chunk_sz']"),
    ({"prefill_chunk_size": 0}, "prefill_chunk_size must be a positive integer"),
])
def test_bad_overrides_are_refused_before_anything_starts(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError) as info:
        ServeOptions(model_dir="m", prefill_engine_overrides=overrides)
    assert message in str(info.value)
