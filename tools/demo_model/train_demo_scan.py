"""Training-time Mamba2 chunk scan for tools/demo_model/train_demo.py: transformers' NemotronH runs its SSD scan as a
chain of fp32 einsums whose backward dominates a training step of the small demo model (~1 % of the GPU's
matmul peak). mamba_ssm's Triton `mamba_chunk_scan_combined` has a fused forward and backward; when its
sources are present (mamba_ssm's sdist unpacked under .peer/, see bench/kernels/peer.py) it is patched in for the training
loop only, after a check against transformers' own scan on the same inputs. Evaluation runs unpatched.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger("train_demo")


def _triton_scan(combined: Callable[..., Any]) -> Callable[..., Any]:
    """transformers' `mamba2_chunk_scan` signature on top of mamba_ssm's combined Triton scan."""

    def scan(hidden_states, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,  # noqa: ANN001, ANN202, N803, PLR0913
             dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False, **_: Any):
        # hidden_states [b, l, h, p]; dt [b, l, h]; A [h]; B, C [b, l, g, n]
        return combined(hidden_states, dt, A, B, C, chunk_size, D=D, z=z, dt_bias=dt_bias,
                        initial_states=initial_states, dt_softplus=dt_softplus, dt_limit=dt_limit,
                        return_final_states=return_final_states)

    return scan


def _max_rel_error(reference: Callable[..., Any], candidate: Callable[..., Any], device: str, cfg: dict) -> float:
    """Largest relative error of output and input gradients, candidate vs reference, on one random input with
    the model's head / state / chunk sizes and the training loop's bf16 activations (mamba_ssm autotunes per
    those sizes and dtypes, so the check's tuning is the training loop's too)."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    b, length = 2, 4 * cfg["chunk_size"]
    heads, dim, groups, state = cfg["mamba_num_heads"], cfg["mamba_head_dim"], cfg["n_groups"], cfg["ssm_state_size"]

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(device, torch.bfloat16).requires_grad_()

    x, dt, b_, c_ = rand(b, length, heads, dim), rand(b, length, heads, scale=0.5), rand(b, length, groups, state), \
        rand(b, length, groups, state)
    a = (-torch.rand(heads, generator=gen) - 0.5).to(device)
    d, bias = torch.ones(heads, device=device), torch.zeros(heads, device=device)
    worst = 0.0
    outs = []
    for fn in (reference, candidate):
        y = fn(x, dt, a, b_, c_, cfg["chunk_size"], D=d, dt_bias=bias, dt_softplus=True).float()
        grads = torch.autograd.grad(y.square().sum(), (x, dt, b_, c_))
        outs.append((y, *grads))
    for ref, got in zip(*outs):
        worst = max(worst, float((got.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12)))
    return worst


def _tuners() -> dict[str, Any]:
    """mamba_ssm's autotuned Triton kernels that are loaded, by `module.name`."""
    from triton.runtime.autotuner import Autotuner

    found = {}
    for module_name, module in list(sys.modules.items()):
        if module_name.startswith("mamba_ssm.ops.triton") and module is not None:
            found.update({f"{module_name}.{attr}": value for attr, value in vars(module).items()
                          if isinstance(value, Autotuner)})
    return found


def config_fields(config: Any) -> dict[str, Any]:
    """What identifies a triton.Config across Triton versions: its meta-parameters, warps, stages and CTAs (its
    str() gains fields between versions)."""
    return {"kwargs": dict(config.kwargs), "num_warps": config.num_warps, "num_stages": config.num_stages,
            "num_ctas": config.num_ctas}


def tuned_configs() -> dict[str, list[dict[str, Any]]]:
    """The configs the autotuner picked so far, per kernel (what --scan-configs pins in a later run)."""
    picks: dict[str, list[dict[str, Any]]] = {}
    for name, tuner in _tuners().items():
        for fields in map(config_fields, tuner.cache.values()):
            if fields not in picks.setdefault(name, []):
                picks[name].append(fields)
    return picks


def pin_configs(path: Path) -> int:
    """Restrict each of mamba_ssm's autotuned kernels to the configs `path` (a tuned_configs() dump) lists, so a
    fresh machine compiles one config instead of benchmarking every one (~1.5 minutes of a 9-minute run on an
    H200). A kernel the file does not name, or none of whose configs match, keeps all its configs. A pick is one
    of the kernel's own configs, so results stay within what mamba_ssm can produce anyway (block sizes change
    the order of some sums: rounding-level differences, as between two GPUs' autotuner picks). Returns the
    number of kernels pinned."""
    picks = json.loads(path.read_text())
    pinned = 0
    for name, tuner in _tuners().items():
        keep = [c for c in tuner.configs if config_fields(c) in picks.get(name, [])]
        if keep:
            tuner.configs = keep
            pinned += 1
    return pinned


@contextmanager
def fast_scan(device: str, cfg: dict, configs: Path | None = None) -> Iterator[bool]:
    """Patch the Triton scan into transformers' NemotronH while the block runs; yields whether it did. `configs`:
    a tuned_configs() dump whose choices are pinned (see pin_configs)."""
    if not device.startswith("cuda"):
        yield False
        return
    try:
        from peer import load_peer  # bench/kernels/peer.py, when bench/kernels is on sys.path
    except ImportError:
        import importlib.util
        from pathlib import Path

        peer_file = Path(__file__).resolve().parents[2] / "bench" / "kernels" / "peer.py"
        spec = importlib.util.spec_from_file_location("peer", peer_file)
        assert spec is not None and spec.loader is not None  # ships in the same checkout
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        load_peer = module.load_peer
    try:
        combined = load_peer()["mamba_chunk_scan_combined"]
    except ImportError as exc:
        logger.warning("mamba_ssm Triton sources not available (%s): training with transformers' torch scan", exc)
        yield False
        return
    if configs is not None and configs.is_file():
        logger.info("pinned %d of mamba_ssm's autotuned kernels to the configs in %s", pin_configs(configs), configs)
    from transformers.models.nemotron_h import modeling_nemotron_h as modeling

    reference = modeling.mamba2_chunk_scan
    patched = _triton_scan(combined)
    error = _max_rel_error(reference, patched, device, cfg)
    if error > 5e-2:  # bf16 inputs and gradients: rounding is ~1e-2; a wrong kernel is off by O(1)
        logger.warning("Triton scan differs from transformers' by %.2e (> 5e-2): not used", error)
        yield False
        return
    logger.info("training with mamba_ssm's Triton chunk scan (max rel. error vs transformers %.1e)", error)
    modeling.mamba2_chunk_scan = patched
    try:
        yield True
    finally:
        modeling.mamba2_chunk_scan = reference
