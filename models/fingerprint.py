"""A model fingerprint: two workers may exchange state only if they serve the same weights and layout."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from hybridserve.models.weights import checkpoint_files

_SAMPLE_BYTES = 1 << 16


def model_fingerprint(
    model_dir: str | Path, dtype: str, ssm_dtype: str, load_format: str = "safetensors", seed: int = 0
) -> str:
    """blake2b over the canonical config, the runtime dtypes, and each weight file's size plus its first
    and last 64 KiB (header and data): cheap even for 17 GB checkpoints, and tells random weights apart.
    Dummy weights (load_format "dummy") are named by their seed instead of files."""
    model_dir = Path(model_dir)
    digest = hashlib.blake2b(digest_size=16)
    config = json.loads((model_dir / "config.json").read_text())
    digest.update(json.dumps(config, sort_keys=True).encode())
    digest.update(f"dtype={dtype};ssm_dtype={ssm_dtype}".encode())
    if load_format == "dummy":
        digest.update(f"dummy-weights;seed={seed}".encode())
        return digest.hexdigest()
    for path in checkpoint_files(model_dir):
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}".encode())
        with path.open("rb") as handle:
            digest.update(handle.read(_SAMPLE_BYTES))
            handle.seek(max(0, size - _SAMPLE_BYTES))
            digest.update(handle.read(_SAMPLE_BYTES))
    return digest.hexdigest()
