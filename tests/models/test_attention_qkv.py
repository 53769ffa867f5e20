"""Attention's q/k/v projections as one fused weight: same numbers, no second copy, loads write through."""

from __future__ import annotations

import pytest
import torch

from hybridserve.common.model_config import AttentionConfig
from hybridserve.models.attention import Attention


def _attention(bias: bool) -> Attention:
    attn = Attention(24, AttentionConfig(num_heads=4, num_kv_heads=2, head_dim=8, bias=bias))
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for param in attn.parameters():
            param.copy_(torch.randn(param.shape, generator=gen))
    return attn


@pytest.mark.parametrize("bias", [False, True])
def test_fused_projection_equals_the_three_and_shares_their_storage(bias):
    attn = _attention(bias)
    before = {k: v.clone() for k, v in attn.state_dict().items()}
    x = torch.randn(5, 24)
    separate = [torch.nn.functional.linear(x, p.weight, p.bias) for p in (attn.q_proj, attn.k_proj, attn.v_proj)]
    weight, fused_bias, _, _ = attn._qkv()
    assert weight.shape == (32 + 16 + 16, 24)
    assert (fused_bias is not None) == bias
    torch.testing.assert_close(torch.nn.functional.linear(x, weight, fused_bias), torch.cat(separate, 1),
                               rtol=1e-6, atol=1e-6)
    assert attn.q_proj.weight.data_ptr() == weight.data_ptr()
    assert attn.v_proj.weight.data_ptr() == weight[48:].data_ptr()
    after = attn.state_dict()
    assert list(after) == list(before)  # checkpoint names unchanged, the fused tensor is not a parameter
    for name, value in before.items():
        assert torch.equal(after[name], value)
    assert attn._qkv()[0] is weight  # cached while the parameters are its views


def test_a_checkpoint_load_writes_through_even_after_an_inference_mode_forward():
    attn = _attention(bias=False)
    with torch.inference_mode():
        weight = attn._qkv()[0]
    new_k = torch.full_like(attn.k_proj.weight, 0.5)
    attn.load_state_dict({**attn.state_dict(), "k_proj.weight": new_k})
    assert attn._qkv()[0] is weight
    assert torch.equal(weight[32:48], new_k)


def test_replaced_parameters_are_fused_again():
    attn = _attention(bias=True)
    weight = attn._qkv()[0]
    attn.to(torch.float64)  # .to() gives each parameter a new tensor
    again, bias, _, _ = attn._qkv()
    assert again is not weight and again.dtype == torch.float64 and bias is not None
    torch.testing.assert_close(again[:32], attn.q_proj.weight)
    attn.k_proj.weight = torch.nn.Parameter(torch.zeros(16, 24, dtype=torch.float64), requires_grad=False)
    third = attn._qkv()[0]
    assert third is not again and torch.equal(third[32:48], torch.zeros(16, 24, dtype=torch.float64))
