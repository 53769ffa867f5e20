"""Model configs, layers, the hybrid NemotronH / Mamba2 model, checkpoint and tokenizer loading."""

from hybridserve.models.config import AttentionConfig, MambaConfig, ModelConfig, MoEConfig
from hybridserve.models.default_model import default_model_dir
from hybridserve.models.forward_batch import ForwardBatch
from hybridserve.models.hybrid_model import HybridLM
from hybridserve.models.tokenizer import Tokenizer, load_tokenizer
from hybridserve.models.weights import load_model

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
