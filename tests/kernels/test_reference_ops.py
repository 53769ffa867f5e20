"""The pure-torch reference ops against their definitions: per-token recurrences and dense attention."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from hybridserve.kernels import (
    causal_conv1d_update_ref,
    causal_conv1d_varlen_ref,
    gated_rmsnorm_ref,
    multi_token_state_update_ref,
    paged_attention_ref,
    ssd_scan_varlen_ref,
    write_kv_pages,
)
from hybridserve.kernels.ops import selective_state_update

H, P, N, G = 4, 8, 6, 2
TOL = dict(rtol=1e-5, atol=1e-5)  # the references compute in fp32; the definitions here run in fp64


def _naive_ssm(x, dt, A, B, C, D, state):
    """Token-by-token recurrence (the definition). x [L,H,P], dt processed [L,H], B/C [L,G,N]."""
    ys, states = [], []
    for t in range(x.shape[0]):
        b = B[t].repeat_interleave(H // G, 0)  # [H, N]
        c = C[t].repeat_interleave(H // G, 0)
        state = state * torch.exp(dt[t] * A)[:, None, None] + (dt[t][:, None] * x[t])[..., None] * b[:, None, :]
        ys.append(torch.einsum("hpn,hn->hp", state, c) + D[:, None] * x[t])
        states.append(state)
    return torch.stack(ys), states


def _inputs(T, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, P, generator=g, dtype=torch.float64)
    dt = torch.randn(T, H, generator=g, dtype=torch.float64)
    A = -torch.rand(H, generator=g, dtype=torch.float64) * 2
    B = torch.randn(T, G, N, generator=g, dtype=torch.float64)
    C = torch.randn(T, G, N, generator=g, dtype=torch.float64)
    D = torch.randn(H, generator=g, dtype=torch.float64)
    bias = torch.randn(H, generator=g, dtype=torch.float64)
    return x, dt, A, B, C, D, bias


@pytest.mark.parametrize("chunk_size", [1, 4, 5, 16])
def test_ssd_scan_matches_recurrence_with_aligned_chunk_states(chunk_size: int) -> None:
    lengths, starts = [7, 1, 19, 12], [0, 3, 5, 16]
    T = sum(lengths)
    x, dt, A, B, C, D, bias = _inputs(T, seed=chunk_size)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    init = torch.randn(len(lengths), H, P, N, dtype=torch.float64)
    out = ssd_scan_varlen_ref(
        x, dt, A, B, C, cu, chunk_size, D=D, dt_bias=bias, dt_limit=(0.05, 3.0),
        initial_states=init, start_positions=torch.tensor(starts),
    )
    dt_p = F.softplus(dt + bias).clamp(0.05, 3.0)
    expected_positions = []
    for s, (begin, end) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        y, states = _naive_ssm(x[begin:end], dt_p[begin:end], A, B[begin:end], C[begin:end], D, init[s])
        torch.testing.assert_close(out.y[begin:end].double(), y, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out.final_states[s].double(), states[-1], rtol=1e-5, atol=1e-5)
        for i in range(end - begin):
            pos = starts[s] + i + 1
            if pos % chunk_size == 0:
                expected_positions.append((s, pos))
                k = len(expected_positions) - 1
                torch.testing.assert_close(out.chunk_states[k].double(), states[i], rtol=1e-5, atol=1e-5)
    assert list(zip(out.chunk_state_seq.tolist(), out.chunk_state_pos.tolist())) == expected_positions


def test_ssd_scan_state_block_keeps_only_block_multiples() -> None:
    x, dt, A, B, C, D, bias = _inputs(30, seed=9)
    cu = torch.tensor([0, 30])
    out = ssd_scan_varlen_ref(x, dt, A, B, C, cu, 4, D=D, dt_bias=bias, start_positions=torch.tensor([2]), state_block=8)
    assert out.chunk_state_pos.tolist() == [8, 16, 24, 32]
    with pytest.raises(ValueError, match="multiple of chunk_size"):
        ssd_scan_varlen_ref(x, dt, A, B, C, cu, 4, state_block=6)


def _naive_conv(history, weight, bias):
    """history [D, K-1+L] -> silu(conv) [L, D] by the definition."""
    K = weight.shape[1]
    out = [(history[:, t : t + K] * weight).sum(1) + bias for t in range(history.shape[1] - K + 1)]
    return F.silu(torch.stack(out))


def test_conv_varlen_and_boundary_windows_match_definition() -> None:
    D_ch, K, W = 5, 4, 6
    lengths, starts = [9, 2, 14], [0, 7, 3]
    x = torch.randn(sum(lengths), D_ch, dtype=torch.float64)
    weight, bias = torch.randn(D_ch, K, dtype=torch.float64), torch.randn(D_ch, dtype=torch.float64)
    init = torch.randn(len(lengths), D_ch, W, dtype=torch.float64)
    cu = torch.tensor([0, 9, 11, 25])
    out = causal_conv1d_varlen_ref(x, weight, bias, cu, init, start_positions=torch.tensor(starts), state_block=4)
    k = 0
    for s in range(3):
        begin, end = cu[s].item(), cu[s + 1].item()
        history = torch.cat([init[s], x[begin:end].T], dim=1)
        torch.testing.assert_close(out.y[begin:end], _naive_conv(history[:, W - (K - 1) :], weight, bias), **TOL)
        torch.testing.assert_close(out.final_windows[s].double(), history[:, -W:], **TOL)
        for i in range(end - begin):
            if (starts[s] + i + 1) % 4 == 0:
                assert (out.boundary_seq[k].item(), out.boundary_pos[k].item()) == (s, starts[s] + i + 1)
                torch.testing.assert_close(out.boundary_windows[k].double(), history[:, i + 1 : i + 1 + W], **TOL)
                k += 1
    assert k == out.boundary_windows.shape[0]


def test_conv_update_multi_token_matches_varlen_and_skips_padding() -> None:
    D_ch, K, W, T = 5, 4, 5, 3
    pool = torch.randn(4, D_ch, W, dtype=torch.float64)
    before = pool.clone()
    x = torch.randn(3, T, D_ch, dtype=torch.float64)
    weight, bias = torch.randn(D_ch, K, dtype=torch.float64), torch.randn(D_ch, dtype=torch.float64)
    slots = torch.tensor([2, -1, 0])
    y = causal_conv1d_update_ref(x, pool, slots, weight, bias)
    for row, slot in ((0, 2), (2, 0)):
        history = torch.cat([before[slot], x[row].T], dim=1)
        torch.testing.assert_close(y[row], _naive_conv(history[:, W - (K - 1) :], weight, bias), **TOL)
        torch.testing.assert_close(pool[slot], history[:, -W:], **TOL)
    assert torch.equal(y[1], torch.zeros_like(y[1]))
    assert torch.equal(pool[[1, 3]], before[[1, 3]])


def test_multi_token_update_matches_recurrence_and_single_steps() -> None:
    T, batch = 4, 3
    x, dt, A, B, C, D, bias = _inputs(batch * T, seed=11)
    x, dt = x.view(batch, T, H, P), dt.view(batch, T, H)
    B, C = B.view(batch, T, G, N), C.view(batch, T, G, N)
    pool = torch.randn(5, H, P, N, dtype=torch.float64)
    start = pool.clone()
    slots = torch.tensor([4, 1, -1])
    inter = torch.zeros(batch, T, H, P, N, dtype=torch.float64)
    y = multi_token_state_update_ref(pool, slots, x, dt, A, B, C, D, bias, intermediate_states=inter)
    step_pool = start.clone()
    for row, slot in ((0, 4), (1, 1)):
        ref_y, ref_states = _naive_ssm(x[row], F.softplus(dt[row] + bias), A, B[row], C[row], D, start[slot])
        torch.testing.assert_close(y[row], ref_y, **TOL)
        torch.testing.assert_close(inter[row], torch.stack(ref_states), **TOL)
        torch.testing.assert_close(pool[slot], ref_states[-1], **TOL)
        for t in range(T):  # the single-token update, T times, is the same thing
            one = selective_state_update(
                step_pool, torch.tensor([slot]), x[row, t][None], dt[row, t][None], A, B[row, t][None],
                C[row, t][None], D, bias,
            )
            torch.testing.assert_close(one[0], ref_y[t], **TOL)
    assert torch.equal(y[2], torch.zeros_like(y[2]))
    assert torch.equal(pool[[0, 2, 3]], start[[0, 2, 3]])


def test_paged_attention_matches_dense_causal_attention() -> None:
    Hq, Hkv, Dh, page = 4, 2, 8, 4
    context, new = [5, 0, 11], [1, 6, 3]
    total = [c + n for c, n in zip(context, new)]
    k_pages = torch.zeros(16, page, Hkv, Dh, dtype=torch.float64)
    v_pages = torch.zeros_like(k_pages)
    tables = torch.tensor([[3, 7, 0, 0], [1, 9, 0, 0], [2, 5, 11, 12]])
    keys = [torch.randn(t, Hkv, Dh, dtype=torch.float64) for t in total]
    values = [torch.randn(t, Hkv, Dh, dtype=torch.float64) for t in total]
    for s in range(3):
        slots = torch.tensor([tables[s, p // page] * page + p % page for p in range(total[s])])
        write_kv_pages(keys[s], values[s], k_pages, v_pages, slots)
    queries = [torch.randn(n, Hq, Dh, dtype=torch.float64) for n in new]
    cu = torch.tensor([0, 1, 7, 10])
    out = paged_attention_ref(torch.cat(queries), k_pages, v_pages, cu, torch.tensor(total), tables, 0.3)
    for s in range(3):
        q = queries[s].transpose(0, 1)  # [Hq, n, Dh]
        k = keys[s].repeat_interleave(Hq // Hkv, 1).transpose(0, 1)
        v = values[s].repeat_interleave(Hq // Hkv, 1).transpose(0, 1)
        mask = torch.arange(total[s])[None, :] <= (torch.arange(new[s]) + context[s])[:, None]
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3).transpose(0, 1)
        torch.testing.assert_close(out[cu[s] : cu[s + 1]], ref, **TOL)


def test_gated_rmsnorm_matches_transformers_module() -> None:
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHRMSNormGated

    module = NemotronHRMSNormGated(24, group_size=8, eps=1e-5)
    torch.nn.init.normal_(module.weight)
    x, z = torch.randn(5, 24), torch.randn(5, 24)
    torch.testing.assert_close(gated_rmsnorm_ref(x, z, module.weight, 8, 1e-5), module(x, z), **TOL)
    with pytest.raises(ValueError, match="group_size"):
        gated_rmsnorm_ref(x, z, module.weight, 7, 1e-5)
    with torch.no_grad():
        assert math.isfinite(float(gated_rmsnorm_ref(x, None, module.weight, 24, 1e-5).sum()))
