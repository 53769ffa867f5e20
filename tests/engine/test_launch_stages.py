"""Where a captured decode step is cut into graphs: pieces growing 4x (1, 3, 12, 48 layers, ...), or one graph."""

from __future__ import annotations

import pytest

from hybridserve.engine.cuda_graphs import launch_stages


def test_pieces_grow_fourfold_and_never_cut_after_the_last_layer(monkeypatch) -> None:
    monkeypatch.delenv("HYBRIDSERVE_STAGED_GRAPHS", raising=False)
    assert launch_stages(1) == ()
    assert launch_stages(4) == (0,)
    assert launch_stages(5) == (0, 3)
    assert launch_stages(52) == (0, 3, 15)  # Nemotron-3-Nano-30B-A3B: pieces of 1, 3, 12, 36 layers
    assert launch_stages(56) == (0, 3, 15)  # Nemotron-Nano-9B-v2
    assert launch_stages(118) == (0, 3, 15, 63)  # Nemotron-H-56B


def test_staging_off_and_a_malformed_switch(monkeypatch) -> None:
    monkeypatch.setenv("HYBRIDSERVE_STAGED_GRAPHS", "0")
    assert launch_stages(56) == ()
    monkeypatch.setenv("HYBRIDSERVE_STAGED_GRAPHS", "on")
    with pytest.raises(ValueError, match="HYBRIDSERVE_STAGED_GRAPHS must be 0 or 1"):
        launch_stages(56)
