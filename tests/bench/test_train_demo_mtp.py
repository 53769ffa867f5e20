"""tools/demo_model/train_demo_mtp.py's recurrent MTP (depth d fed by depth d-1's output) computes, in one parallel pass
per depth, exactly what the serving drafter computes slot by slot with its KV cache; and
tools/demo_model/train_demo_eval.py's parse test cuts continuations as documented."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

BENCH = Path(__file__).resolve().parents[2] / "tools" / "demo_model"


def _load(name: str):  # noqa: ANN202 - a module
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


mtp_mod = _load("train_demo_mtp")
eval_mod = _load("train_demo_eval")
CFG = {"hidden_size": 32, "layer_norm_epsilon": 1e-5, "num_attention_heads": 4, "num_key_value_heads": 2,
       "head_dim": 8, "intermediate_size": 64}


def _serving_draft(mtp, emb: torch.Tensor, hidden: torch.Tensor, start: int, depths: int) -> list[torch.Tensor]:  # noqa: ANN001
    """Drafts from slot `start` as engine/mtp_drafter.py does: depth 1 over slots 0..start (a causal catch-up
    pass), then one slot per depth, each attending to the cache: depth-1 keys 0..start and earlier drafts."""
    attn, mlp = mtp.layers[0], mtp.layers[1]
    cache_k, cache_v = [], []

    def slot(e: torch.Tensor, h: torch.Tensor) -> torch.Tensor:  # e, h [H] -> g [H]
        u = attn.eh_proj(torch.cat([attn.enorm(e), attn.hnorm(h)]))
        x = attn.norm(u)
        m = attn.mixer
        q = m.q_proj(x).view(m.heads, m.head_dim)
        cache_k.append(m.k_proj(x).view(m.kv_heads, m.head_dim))
        cache_v.append(m.v_proj(x).view(m.kv_heads, m.head_dim))
        k = torch.stack(cache_k, 1).repeat_interleave(m.heads // m.kv_heads, 0)  # [heads, S, head_dim]
        v = torch.stack(cache_v, 1).repeat_interleave(m.heads // m.kv_heads, 0)
        att = F.softmax((q[:, None] * k).sum(-1) * m.head_dim**-0.5, -1)
        u = u + m.o_proj((att[..., None] * v).sum(1).reshape(-1))
        u = u + mlp.mixer(mlp.norm(u))
        return mlp.final_layernorm(u)

    g = None
    for i in range(start + 1):
        g = slot(emb[i], hidden[i])
    outs = [g]
    for d in range(1, depths):
        g = slot(emb[start + d], g)
        outs.append(g)
    return outs


def test_recurrent_mtp_matches_the_serving_drafter_slot_by_slot() -> None:
    torch.manual_seed(0)
    mtp = mtp_mod.MTP(CFG, ["full_attention", "mlp"]).double()
    mtp_mod.init_mtp(mtp, std=0.2)
    t, depths = 9, 3
    emb, hidden = torch.randn(1, t, 32, dtype=torch.float64), torch.randn(1, t, 32, dtype=torch.float64)
    parallel = mtp_mod.recurrent_mtp(mtp, emb, hidden, depths)  # depth d at slot i: [1, t, H]
    for start in (0, 3, t - depths):
        serial = _serving_draft(mtp, emb[0], hidden[0], start, depths)
        for d in range(depths):
            torch.testing.assert_close(parallel[d][0, start + d], serial[d], rtol=1e-9, atol=1e-9)


def test_depth_mask_rows() -> None:
    mask = mtp_mod.depth_mask(4, 2, torch.device("cpu")).int().tolist()
    # depth-2 slot i: depth-1 slots <= i-1, and its own depth-2 slot
    assert mask == [[0, 0, 0, 0, 1, 0, 0, 0], [1, 0, 0, 0, 0, 1, 0, 0], [1, 1, 0, 0, 0, 0, 1, 0],
                    [1, 1, 1, 0, 0, 0, 0, 1]]


def test_parse_test_cuts_at_stops_and_last_complete_line() -> None:
    prompt = "def f(x):\n"
    assert eval_mod.parses(prompt, "    return x\n\n\ndef g(y):\n    return", finished=False)
    assert eval_mod.parses(prompt, "    y = x\n    return y + (", finished=False)
    assert not eval_mod.parses(prompt, "    if x:\n    ", finished=False)
    assert eval_mod.cut_continuation("    return 1", finished=True) == "    return 1"


def test_heldout_prompts_are_function_headers() -> None:
    src = 'import os\n\n\ndef a(x):\n    """Doc."""\n    return x\n\n\ndef b():\n    pass\n\n\n@d\ndef c():\n    pass\n'
    assert eval_mod.heldout_prompts([("m.py", src)], 5) == ['def a(x):\n    """Doc."""\n', "def b():\n"]


def test_repetitive_training_files_are_dropped() -> None:
    data = _load("train_demo_data")
    varied = "\n".join(f"value_{i} = compute({i}, {i * 7})" for i in range(20))
    table = "\n".join(["    'name': 'utf-8',"] * 15 + [f"line_number_{i} = {i}" for i in range(5)])
    assert data.duplicate_line_fraction(varied) == 0.0
    assert data.duplicate_line_fraction(table) == 0.75
    assert data.duplicate_line_fraction("x = 1\n" * 5) == 0.0  # too short to judge
    kept, dropped = data.drop_repetitive([("a.py", varied), ("b.py", table)], 0.5)
    assert [name for name, _ in kept] == ["a.py"] and dropped == 1
    assert data.drop_repetitive([("b.py", table)], 1.0) == ([("b.py", table)], 0)
