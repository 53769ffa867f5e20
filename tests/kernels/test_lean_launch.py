"""Lean Triton launches (kernels/launch.py): the same results as Triton's own launch path, one compiled entry per
specialization, the autotuner's configs and key, Triton's path where the lean one must not be taken."""

from __future__ import annotations

import ktest_utils as ku  # noqa: I001  (sets TRITON_INTERPRET before triton is imported)
import pytest
import torch

pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from hybridserve.kernels import launch  # noqa: E402


@triton.jit
def _axpy_kernel(x_ptr, y_ptr, out_ptr, a, n, stride, BLOCK: tl.constexpr):
    """out[i] = a * x[i * stride] + y[i] for i < n."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs * stride, mask=mask, other=0.0)
    y = tl.load(y_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, a * x + y, mask=mask)


def _configs() -> list[triton.Config]:
    return [triton.Config({"BLOCK": 32}, num_warps=1), triton.Config({"BLOCK": 64}, num_warps=2)]


def _tuned() -> launch.LeanKernel:
    return launch.lean_launch(triton.autotune(configs=_configs(), key=["n"])(_axpy_kernel))


def _grid(meta: dict) -> tuple[int]:
    return (triton.cdiv(meta["n"], meta["BLOCK"]),)


def _inputs(n: int, stride: int, device: str, offset: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(n + stride + offset)
    x = torch.randn(offset + n * stride, generator=gen).to(device)[offset:]
    y = torch.randn(n, generator=gen).to(device)
    return x, y, torch.full((n,), float("nan"), device=device)


def test_attributes_read_and_set_reach_the_wrapped_kernel() -> None:
    tuned = _tuned()
    assert tuned.fn is tuned.kernel and tuned.keys == ["n"]
    one = [tuned.configs[1]]
    tuned.configs = one  # what the kernel tests do to pin a config
    assert tuned.kernel.configs == one and tuned.configs == one
    with pytest.raises(AttributeError):
        tuned.no_such_attribute  # noqa: B018


@ku.interp_only
def test_interpreter_takes_tritons_path() -> None:
    lean = launch.lean_launch(_axpy_kernel)
    assert not launch.lean_enabled()
    x, y, out = _inputs(100, 2, "cpu")
    lean[(4,)](x, y, out, 2.0, 100, 2, BLOCK=32)
    torch.testing.assert_close(out, 2.0 * x[::2] + y)
    assert not lean._compiled  # nothing kept: every launch is Triton's own


@ku.interp_only
def test_tuned_config_uses_the_autotuners_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """The config the lean path finds is the one Triton's autotuner stored for the same arguments."""
    tuned = _tuned()
    tuner = tuned.kernel
    timings = {32: [2.0, 2.0, 2.0], 64: [1.0, 1.0, 1.0]}  # BLOCK 64 wins
    monkeypatch.setattr(tuner, "_bench", lambda *a, config, **k: timings[config.kwargs["BLOCK"]])
    x, y, out = _inputs(100, 1, "cpu")
    tuner[_grid](x, y, out, 3.0, 100, 1)  # Triton's path: tunes and stores its key
    torch.testing.assert_close(out, 3.0 * x + y)
    assert len(tuner.cache) == 1
    (stored,) = tuner.cache.values()
    assert tuned._tuned_config((x, y, out, 3.0, 100, 1), {}) is stored
    assert tuned._tuned_config((x, y), {"out_ptr": out, "a": 3.0, "n": 100, "stride": 1}) is stored
    assert tuned._tuned_config((x, y, out, 3.0, 101, 1), {}) is None  # another key: not tuned yet
    assert tuned._tuned_config((x.double(), y, out, 3.0, 100, 1), {}) is None  # dtypes are part of the key


@ku.gpu
@ku.cuda_only
def test_lean_launch_matches_triton_per_specialization() -> None:
    """Aligned and misaligned pointers, strides 1 / 16 / 3, lengths of 1 and of 16: each a specialization of its
    own (its own compiled entry) and each the same result as Triton's launch."""
    if not launch.lean_enabled():
        pytest.skip(f"lean launches are off for triton {triton.__version__}")
    lean = launch.lean_launch(_axpy_kernel)
    cases = [(100, 1, 0), (100, 1, 0), (100, 16, 0), (100, 3, 0), (100, 1, 1), (1, 1, 0), (16, 16, 0)]
    for n, stride, offset in cases:
        for _ in range(3):  # the first launch compiles through Triton, the next are lean
            x, y, out = _inputs(n, stride, "cuda", offset)
            lean[(triton.cdiv(n, 32),)](x, y, out, 1.5, n, stride, BLOCK=32)
            torch.testing.assert_close(out, 1.5 * x[::stride] + y)
    kinds = {key[1] for key in lean._compiled}
    assert len(kinds) >= 5  # misaligned x, stride 1 / 16 / other and n == 1 are specialized apart
    misaligned = _inputs(100, 1, "cuda", 1)
    assert misaligned[0].data_ptr() % 16


@ku.gpu
@ku.cuda_only
def test_lean_autotuned_kernel_and_cuda_graph() -> None:
    if not launch.lean_enabled():
        pytest.skip(f"lean launches are off for triton {triton.__version__}")
    tuned = _tuned()
    x, y, out = _inputs(1000, 1, "cuda")
    for _ in range(3):
        tuned[_grid](x, y, out, 0.5, 1000, 1)
        torch.testing.assert_close(out, 0.5 * x + y)
    assert tuned.kernel.cache and tuned._compiled
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tuned[_grid](x, y, out, 0.5, 1000, 1)
    x.copy_(torch.randn_like(x))
    out.fill_(float("nan"))
    graph.replay()
    torch.testing.assert_close(out, 0.5 * x + y)


@ku.gpu
@ku.cuda_only
def test_installed_launch_hook_takes_tritons_path() -> None:
    if not launch.lean_enabled():
        pytest.skip(f"lean launches are off for triton {triton.__version__}")
    lean = launch.lean_launch(_axpy_kernel)
    x, y, out = _inputs(64, 1, "cuda")
    lean[(2,)](x, y, out, 1.0, 64, 1, BLOCK=32)  # compiled and kept
    seen: list[object] = []
    hook = triton.knobs.runtime.launch_enter_hook
    hook.add(seen.append)
    try:
        lean[(2,)](x, y, out, 1.0, 64, 1, BLOCK=32)
    finally:
        hook.remove(seen.append)
    assert seen  # a profiler's hook saw the launch
    torch.testing.assert_close(out, x + y)


def test_the_launchers_assumptions_hold_for_the_installed_triton() -> None:
    """The lean path calls Triton's internals directly, so a Triton upgrade can break it silently: on a release
    it was checked against every assumption must hold against the installed Triton; on any other release the lean
    path must stay off (Triton's own launch path runs), whatever still matches."""
    mismatches = launch.triton_internals_mismatches()
    release = triton.__version__.rsplit(".", 1)[0]
    if launch.release_checked():
        assert mismatches == [], f"triton {triton.__version__} no longer matches kernels/launch.py: {mismatches}"
    else:
        assert not launch.lean_enabled()
        if not mismatches:
            pytest.skip(f"triton {release} is not in LEAN_TRITON_RELEASES {launch.LEAN_TRITON_RELEASES} yet every "
                        "assumption holds: check the lean path on a GPU and add the release")
