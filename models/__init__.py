"""Model configs, layers, the hybrid NemotronH / Mamba2 model, checkpoint and tokenizer loading.

Names are imported on first use (PEP 562), so importing one torch-free module of this package (as the router
does) does not load the rest of it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hybridserve.lazy_exports import lazy_getattr

_EXPORTS = {
    "AttentionConfig": "hybridserve.models.config",
    "MambaConfig": "hybridserve.models.config",
    "ModelConfig": "hybridserve.models.config",
    "MoEConfig": "hybridserve.models.config",
    "default_model_dir": "hybridserve.models.default_model",
    "ForwardBatch": "hybridserve.models.forward_batch",
    "HybridLM": "hybridserve.models.hybrid_model",
    "Tokenizer": "hybridserve.models.tokenizer",
    "load_tokenizer": "hybridserve.models.tokenizer",
    "load_model": "hybridserve.models.weights",
}
__all__ = [
    "AttentionConfig",
    "ForwardBatch",
    "HybridLM",
    "MambaConfig",
    "MoEConfig",
    "ModelConfig",
    "Tokenizer",
    "default_model_dir",
    "load_model",
    "load_tokenizer",
]

if TYPE_CHECKING:
    from hybridserve.models.config import AttentionConfig, MambaConfig, ModelConfig, MoEConfig
    from hybridserve.models.default_model import default_model_dir
    from hybridserve.models.forward_batch import ForwardBatch
    from hybridserve.models.hybrid_model import HybridLM
    from hybridserve.models.tokenizer import Tokenizer, load_tokenizer
    from hybridserve.models.weights import load_model

__getattr__ = lazy_getattr(__name__, _EXPORTS)
