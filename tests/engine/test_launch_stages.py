"""Where a captured decode step is cut into graphs: pieces growing 4x (1, 3, 12, 48 layers, ...) with
HYBRIDSERVE_STAGED_GRAPHS=1, one graph by default."""

from __future__ import annotations

import pytest

from hybridserve.engine.cuda_graphs import launch_stages, stage_cuts


def test_pieces_grow_fourfold_and_never_cut_after_the_last_layer() -> None:
    assert stage_cuts(1) == ()
    assert stage_cuts(4) == (0,)
    assert stage_cuts(5) == (0, 3)
    assert stage_cuts(52) == (0, 3, 15)  # Nemotron-3-Nano-30B-A3B: pieces of 1, 3, 12, 36 layers
    assert stage_cuts(56) == (0, 3, 15)  # Nemotron-Nano-9B-v2
    assert stage_cuts(118) == (0, 3, 15, 63)  # Nemotron-H-56B


def test_the_switch_off_by_default_on_and_malformed(monkeypatch) -> None:
    monkeypatch.delenv("HYBRIDSERVE_STAGED_GRAPHS", raising=False)
    assert launch_stages(56) == ()
    monkeypatch.setenv("HYBRIDSERVE_STAGED_GRAPHS", "1")
    assert launch_stages(56) == (0, 3, 15)
    monkeypatch.setenv("HYBRIDSERVE_STAGED_GRAPHS", "on")
    with pytest.raises(ValueError, match="HYBRIDSERVE_STAGED_GRAPHS must be 0 or 1"):
        launch_stages(56)
