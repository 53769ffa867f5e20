"""The MTP step trained with the demo model (bench/train_demo.py), in pure torch with the parameter names of
vLLM's nemotron_h_mtp layout; the trunk is transformers' NemotronH."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """NemotronH's RMSNorm: normalize and scale in float32, cast back."""

    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * xf).to(x.dtype)


class CausalGQA(nn.Module):
    """NemotronH attention (q/k/v/o projections, GQA, no positional embedding), causal over its input."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.head_dim**-0.5)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class Relu2MLP(nn.Module):
    """NemotronH's non-gated MLP: down(relu(up(x))^2)."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.relu(self.up_proj(x)).square())


class MTPLayer(nn.Module):
    def __init__(self, cfg: dict, kind: str, first: bool, last: bool) -> None:
        super().__init__()
        hidden, eps = cfg["hidden_size"], cfg["layer_norm_epsilon"]
        if first:
            self.enorm = RMSNorm(hidden, eps)
            self.hnorm = RMSNorm(hidden, eps)
            self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.norm = RMSNorm(hidden, eps)
        if kind == "full_attention":
            self.mixer: nn.Module = CausalGQA(
                hidden, cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
            )
        elif kind == "mlp":
            self.mixer = Relu2MLP(hidden, cfg["intermediate_size"])
        else:
            raise ValueError(f"unsupported MTP layer type {kind!r}")
        if last:
            self.final_layernorm = RMSNorm(hidden, eps)


class MTP(nn.Module):
    """One MTP step; parameter names match `mtp.layers.{i}.*` of vLLM's nemotron_h_mtp."""

    def __init__(self, cfg: dict, kinds: list[str]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            MTPLayer(cfg, kind, first=i == 0, last=i == len(kinds) - 1) for i, kind in enumerate(kinds)
        )

    def forward(self, token_embeds: torch.Tensor, prev_hidden: torch.Tensor) -> torch.Tensor:
        """token_embeds = embed(x_q), prev_hidden = h_{q-1}, both [B, T, H] -> g [B, T, H]."""
        first = self.layers[0]
        u = first.eh_proj(torch.cat([first.enorm(token_embeds), first.hnorm(prev_hidden)], dim=-1))
        for layer in self.layers:
            u = u + layer.mixer(layer.norm(u))
        return self.layers[-1].final_layernorm(u)


def init_mtp(mtp: MTP, std: float) -> None:
    for module in mtp.modules():
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=std)
