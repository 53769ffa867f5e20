"""The kernel mode is a config field that reaches every op: an engine's model is built with its `Kernels`, each
layer that calls an op holds that same value (trunk, MTP drafter, MoE, tensor-parallel swaps), the reference mode
gives the auto mode's numbers on CPU, and a bad mode is refused where it is written."""

from __future__ import annotations

import pytest
import torch
from checkpoints import nemotron_h_moe, nemotron_h_mtp, random_prompts
from torch import nn

from hybridserve import LLM
from hybridserve.common.model_config import ModelConfig
from hybridserve.engine.config import EngineConfig
from hybridserve.kernels.ops import Kernels
from hybridserve.models.hybrid_model import HybridLM
from hybridserve.models.parallel import TPGroup
from hybridserve.models.tp_shard import sharded_model

REFERENCE = Kernels("reference")


def _kernel_holders(model: nn.Module) -> list[tuple[str, Kernels]]:
    """(name, kernels) of every module that calls an op (they hold a `kernels` attribute)."""
    return [(name, module.kernels) for name, module in model.named_modules() if hasattr(module, "kernels")]


def _assert_all(model: nn.Module, kernels: Kernels, at_least: int) -> None:
    holders = _kernel_holders(model)
    assert len(holders) >= at_least
    assert [name for name, held in holders if held != kernels] == []


def test_every_layer_of_a_model_holds_its_kernels() -> None:
    config = ModelConfig.from_dir(nemotron_h_mtp("M*-E", ("attention", "moe"), moe=True)[0])
    assert config.has_mtp and config.moe is not None
    with torch.device("meta"):
        model = HybridLM(config, REFERENCE)
    _assert_all(model, REFERENCE, at_least=20)
    # every op-calling class: a Linear, a norm, attention, the Mamba mixer, the MoE parts and the drafter's layers
    kinds = {type(module).__name__ for name, module in model.named_modules() if hasattr(module, "kernels")}
    assert {"Linear", "RMSNorm", "Attention", "Mamba2Mixer", "_GatedNormWeights", "MLP", "MoE", "TopkRouter",
            "Experts", "HybridLM"} <= kinds


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_a_tensor_parallel_shard_keeps_the_kernels_of_its_swapped_layers(expert_parallel: bool) -> None:
    config = ModelConfig.from_dir(nemotron_h_moe("M*E-", moe_latent_size=8)[0])
    model = sharded_model(config, TPGroup(rank=1, size=2, expert_parallel=expert_parallel), REFERENCE)
    _assert_all(model, REFERENCE, at_least=15)
    kinds = {type(module).__name__ for _, module in model.named_modules()}
    assert {"RowParallelLinear", "ShardedGatedRMSNorm", "VocabParallelLMHead"} <= kinds


def test_the_engine_builds_its_model_with_the_configured_mode() -> None:
    model_dir = nemotron_h_moe("ME*E")[0]
    prompt = random_prompts([9], vocab=128, seed=2)[0]
    reference = LLM(model_dir, kernel_mode="reference", max_num_seqs=2, max_model_len=64)
    _assert_all(reference.engine.model, REFERENCE, at_least=10)
    auto = LLM(model_dir, max_num_seqs=2, max_model_len=64)
    _assert_all(auto.engine.model, Kernels("auto"), at_least=10)
    torch.testing.assert_close(reference.prompt_logits(prompt), auto.prompt_logits(prompt))  # both references on CPU


def test_a_bad_kernel_mode_is_refused_with_the_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="kernel_mode must be one of auto, reference, interpret"):
        EngineConfig(kernel_mode="triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        EngineConfig(kernel_mode="interpret")
