"""The MTP step trained with the demo model (tools/demo_model/train_demo.py), in pure torch with the parameter names of
vLLM's nemotron_h_mtp layout; the trunk is transformers' NemotronH.

The module is applied recurrently for K drafts the way the serving drafter does (engine/mtp_drafter.py): depth d
feeds depth d-1's output g as the previous hidden state. Its attention then sees what the serving KV cache
holds when the depth-d draft is computed at position q: depth-1 keys at positions <= q-d+1 (the caught-up
slots) and the depth-j key at position q-d+j for j = 2..d (the earlier drafts of the same step);
`depth_mask` builds exactly that mask.
"""

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


KV = tuple[torch.Tensor, torch.Tensor]


def depth_mask(t: int, depth: int, device: torch.device) -> torch.Tensor:
    """[t, depth * t] bool (True = attend) for depth-`depth` queries over the keys of depths 1..depth, all
    indexed by slot: depth-1 slots <= i-depth+1, and the depth-j slot i-depth+j for j = 2..depth."""
    i = torch.arange(t, device=device)[:, None]
    p = torch.arange(t, device=device)[None, :]
    blocks = [p <= i - depth + 1] + [p == i - depth + j for j in range(2, depth + 1)]
    return torch.cat(blocks, dim=1)


class CausalGQA(nn.Module):
    """NemotronH attention (q/k/v/o projections, GQA, no positional embedding), causal over its input."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)

    def forward(self, x: torch.Tensor, past: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, KV]:
        """x [B, T, H]; past: the (k, v) [B, kv_heads, T, head_dim] of depths 1..d-1 -> (out, this depth's k, v)."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        keys = torch.cat([pk for pk, _ in past] + [k], dim=2)
        values = torch.cat([pv for _, pv in past] + [v], dim=2)
        rep = self.heads // self.kv_heads
        keys, values = keys.repeat_interleave(rep, dim=1), values.repeat_interleave(rep, dim=1)
        if past:
            mask = depth_mask(t, len(past) + 1, x.device)
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.head_dim**-0.5)
        else:
            out = F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=self.head_dim**-0.5)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1)), (k, v)


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

    def forward(
        self, token_embeds: torch.Tensor, prev_hidden: torch.Tensor, past: list[list[KV]] | None = None
    ) -> tuple[torch.Tensor, list[KV]]:
        """token_embeds = embed(x_q), prev_hidden = h_{q-1} (or depth d-1's g_{q-1}), both [B, T, H];
        past[j] = depth j+1's keys/values per attention layer -> (g [B, T, H], this depth's keys/values)."""
        past = past or []
        first = self.layers[0]
        u = first.eh_proj(torch.cat([first.enorm(token_embeds), first.hnorm(prev_hidden)], dim=-1))
        kvs: list[KV] = []
        for layer in self.layers:
            if isinstance(layer.mixer, CausalGQA):
                out, kv = layer.mixer(layer.norm(u), [depth[len(kvs)] for depth in past])
                kvs.append(kv)
                u = u + out
            else:
                u = u + layer.mixer(layer.norm(u))
        return self.layers[-1].final_layernorm(u), kvs


def recurrent_mtp(mtp: MTP, token_embeds: torch.Tensor, hidden: torch.Tensor, depths: int) -> list[torch.Tensor]:
    """The drafter's K-step recurrence over a whole window: token_embeds = embed(x_1..x_{L-1}), hidden =
    h_0..h_{L-2} [B, T, H] -> g of depths 1..K, each [B, T, H]; depth d's slot i (position i+1) predicts
    x_{i+2} and is valid for i >= d-1 (earlier slots lack a depth d-1 state and must be left out of losses)."""
    outs: list[torch.Tensor] = []
    past: list[list[KV]] = []
    prev = hidden
    for _ in range(depths):
        g, kvs = mtp(token_embeds, prev, past)
        outs.append(g)
        past.append(kvs)
        prev = torch.cat([torch.zeros_like(g[:, :1]), g[:, :-1]], dim=1)
    return outs


def init_mtp(mtp: MTP, std: float) -> None:
    for module in mtp.modules():
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=std)


def forward_losses(trunk, mtp: MTP, batch: torch.Tensor, depths: int) -> tuple[torch.Tensor, list, torch.Tensor, list]:  # noqa: ANN001
    """batch [B, L+1] -> (trunk CE, [MTP CE of depths 1..K], trunk logits [B,L,V], [depth-d logits [B,L-d,V]])."""
    x = batch[:, :-1]
    h = trunk.model(input_ids=x, use_cache=False).last_hidden_state  # after norm_f
    logits = trunk.lm_head(h)
    loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten().long())
    gs = recurrent_mtp(mtp, trunk.model.embeddings(x[:, 1:]), h[:, :-1], depths)  # slots q = 1..L-1
    mtp_losses, mtp_logits = [], []
    for d, g in enumerate(gs, start=1):  # depth d is valid from slot d-1 on; slot i predicts x_(i+2)
        lg = trunk.lm_head(g[:, d - 1 :])
        mtp_losses.append(F.cross_entropy(lg.float().flatten(0, 1), batch[:, d + 1 :].flatten().long()))
        mtp_logits.append(lg)
    return loss, mtp_losses, logits, mtp_logits
