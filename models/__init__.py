"""Layers, the hybrid NemotronH / Mamba2 model and checkpoint loading (its config: `hybridserve.common`).

Names are imported on first use (PEP 562), so importing one module of this package does not load the rest
of it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hybridserve.common.lazy_exports import lazy_getattr

_EXPORTS = {
    "default_model_dir": "hybridserve.models.default_model",
    "ForwardBatch": "hybridserve.models.forward_batch",
    "HybridLM": "hybridserve.models.hybrid_model",
    "load_model": "hybridserve.models.weights",
}
__all__ = [
    "ForwardBatch",
    "HybridLM",
    "default_model_dir",
    "load_model",
]

if TYPE_CHECKING:
    from hybridserve.models.default_model import default_model_dir
    from hybridserve.models.forward_batch import ForwardBatch
    from hybridserve.models.hybrid_model import HybridLM
    from hybridserve.models.weights import load_model

__getattr__ = lazy_getattr(__name__, _EXPORTS)
