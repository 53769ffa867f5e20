"""bench/system/tp_decode.py runs end to end on CPU with a tiny checkpoint (gloo, TP=1 and TP=2) and writes its JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from checkpoints import nemotron_h

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "system" / "tp_decode.py"


def test_tp_decode_smoke(tmp_path: Path) -> None:
    model_dir, _ = nemotron_h("M*-M")
    out = tmp_path / "tp.json"
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--config", str(model_dir), "--device", "cpu", "--dtype", "float32",
         "--steps", "2", "--batch", "1", "2", "--agreement", "24", "--out", str(out)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(out.read_text())
    assert [(r["tp"], r["batch"]) for r in result["rows"]] == [(1, 1), (1, 2), (2, 1), (2, 2)]
    assert all(r["step_ms"] > 0 and r["floor_ms"] > 0 for r in result["rows"])
    assert result["top1_agreement"] == 1.0  # fp32, same dummy weights sliced


def test_56b_config_has_the_published_shape_and_shards(tmp_path: Path) -> None:
    """bench/configs/nemotron-h-56b-base-8k.json: 118 layers (54 Mamba-2, 54 MLP, 10 attention), ~56 B
    parameters; TP=2 rank 0 holds about half, TP=8 still divides every head count."""
    import shutil

    from hybridserve.common.model_config import ModelConfig
    from hybridserve.models.parallel import TPGroup
    from hybridserve.models.tp_shard import sharded_model

    shutil.copy(SCRIPT.parents[1] / "configs" / "nemotron-h-56b-base-8k.json", tmp_path / "config.json")
    config = ModelConfig.from_dir(tmp_path)
    assert [config.layer_types.count(k) for k in ("mamba", "mlp", "attention")] == [54, 54, 10]

    def params(size: int) -> float:
        return sum(p.numel() for p in sharded_model(config, TPGroup(0, size)).parameters()) / 1e9

    assert 55.5 < params(1) < 57.0
    assert abs(params(2) - params(1) / 2) < 0.2 and params(8) < params(1) / 7  # meta tensors: nothing allocated
