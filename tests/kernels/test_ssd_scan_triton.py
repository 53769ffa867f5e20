"""Triton varlen SSD scan against the torch reference: y, final states and every aligned chunk-end state,
for sequences that start mid-chunk (resumed after a cached prefix) and from initial states."""

from __future__ import annotations

import ktest_utils as ku  # noqa: I001  (sets TRITON_INTERPRET before triton is imported)
import pytest
import torch

pytest.importorskip("triton")

from hybridserve.kernels.ssd_scan import ssd_scan_varlen_ref  # noqa: E402
from hybridserve.kernels.ssd_scan_triton import ssd_scan_varlen_triton  # noqa: E402


def _inputs(lens, heads, head_dim, groups, state, dtype, device, gen):
    """Random scan inputs for packed sequences of the given lengths: cu_seqlens, x, dt, A, B, C, D, dt_bias."""
    total = sum(lens)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), device=device)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)

    x, dt = r(total, heads, head_dim), r(total, heads, scale=0.5)
    B, C = r(total, groups, state), r(total, groups, state)
    A = -(torch.rand(heads, generator=gen) * 2 + 0.1).to(device)
    D, bias = torch.randn(heads, generator=gen).to(device), (torch.randn(heads, generator=gen) * 0.5).to(device)
    return cu, x, dt, A, B, C, D, bias


def _check(lens, starts, heads, head_dim, groups, state, chunk, state_block, dtype, device, gen, tol, with_init=True,
           segment_chunks=16, output_kernel=None):
    cu, x, dt, A, B, C, D, bias = _inputs(lens, heads, head_dim, groups, state, dtype, device, gen)
    # initial states as a strided view of a request-major pool, zero for fresh sequences
    pool = torch.randn(len(lens), 2, heads, head_dim, state, generator=gen).to(device)
    init = pool[:, 1] * (torch.tensor(starts, device=device) > 0).float()[:, None, None, None]
    sp = torch.tensor(starts, device=device)
    kw = dict(D=D, dt_bias=bias, dt_limit=(0.001, 5.0), initial_states=init if with_init else None,
              start_positions=sp,
              state_block=state_block)
    ref = ssd_scan_varlen_ref(x, dt, A, B, C, cu, chunk, **kw)
    got = ssd_scan_varlen_triton(x, dt, A, B, C, cu, chunk, segment_chunks=segment_chunks,
                                 output_kernel=output_kernel, **kw)
    ku.assert_close(got.y, ref.y, tol, f"y ({output_kernel or 'default'} output kernel)")
    ku.assert_close(got.final_states, ref.final_states, tol, "final states")
    assert torch.equal(got.chunk_state_seq.cpu(), ref.chunk_state_seq.cpu())
    assert torch.equal(got.chunk_state_pos.cpu(), ref.chunk_state_pos.cpu())
    assert got.chunk_states.shape == ref.chunk_states.shape
    for i in range(ref.chunk_states.shape[0]):
        ku.assert_close(got.chunk_states[i], ref.chunk_states[i], tol, f"chunk state {i}")


OUTPUT_KERNELS = ["dense", "blocked"]


@ku.interp_only
@pytest.mark.parametrize("output_kernel", OUTPUT_KERNELS)
def test_ssd_scan_interpreter(output_kernel):
    gen = torch.Generator().manual_seed(0)
    kw = dict(output_kernel=output_kernel)
    # a fresh sequence, two resumed mid-chunk, an empty one; chunk 16, kept states every 32 tokens
    _check([5, 40, 0, 23], [0, 7, 3, 33], 4, 12, 2, 16, 16, 32, torch.float32, "cpu", gen, 2e-3, **kw)
    _check([20, 33], [0, 0], 2, 16, 1, 32, 16, None, torch.float32, "cpu", gen, 2e-3, with_init=False, **kw)
    # the tiny test checkpoints' shapes: chunk 8, state 8 (blocks padded to the 16 tl.dot needs)
    _check([11, 6], [0, 5], 4, 16, 2, 8, 8, 8, torch.float32, "cpu", gen, 2e-3, **kw)
    # chunk 64 = four 16-token sub-blocks of the blocked kernel (its in-chunk state carry), short first chunks
    _check([70, 130, 9], [0, 21, 50], 4, 12, 2, 16, 64, 64, torch.float32, "cpu", gen, 2e-3, **kw)
    # head_dim 40: not a power of two (as Nano-9B-v2's 80), the last head_dim tile is partly masked
    _check([37, 19], [9, 0], 2, 40, 1, 16, 16, 32, torch.float32, "cpu", gen, 2e-3, **kw)


@ku.interp_only
@pytest.mark.parametrize("output_kernel", OUTPUT_KERNELS)
@pytest.mark.parametrize("segment_chunks", [1, 2, 3])
def test_ssd_scan_segments_interpreter(segment_chunks, output_kernel):
    """Sequences walked in segments of a few chunks (in parallel from zeros) and joined: y, final and kept
    states (kept ends inside later segments are completed by the join), in plain and pool mode."""
    gen = torch.Generator().manual_seed(10 + segment_chunks)
    _check([5, 40, 0, 23, 61], [0, 7, 3, 33, 0], 4, 12, 2, 16, 8, 16, torch.float32, "cpu", gen, 2e-3,
           segment_chunks=segment_chunks, output_kernel=output_kernel)
    _check([30, 3], [0, 0], 2, 16, 1, 16, 8, None, torch.float32, "cpu", gen, 2e-3, with_init=False,
           segment_chunks=segment_chunks, output_kernel=output_kernel)
    _check([70, 41], [0, 13], 2, 16, 1, 16, 32, 32, torch.float32, "cpu", gen, 2e-3,
           segment_chunks=segment_chunks, output_kernel=output_kernel)
    _check_pool([5, 40, 0, 23, 61], [0, 7, 3, 33, 0], 4, 12, 2, 16, 8, 16, torch.float32, torch.float32, "cpu", gen,
                2e-3, segment_chunks=segment_chunks)
    _check_pool([37, 19], [9, 0], 2, 40, 1, 16, 8, None, torch.float32, torch.float32, "cpu", gen, 2e-3,
                checkpoints=False, segment_chunks=segment_chunks)


@ku.gpu
@ku.cuda_only
@pytest.mark.parametrize(
    "shape",
    [(128, 80, 8, 128, 128, 256), (80, 64, 1, 128, 256, 256)],  # Nano-9B-v2 (chunk 128), mamba2-2.7b (256)
)
@pytest.mark.parametrize("lens,starts", [([1000, 37, 513], [0, 300, 129]), ([2048], [0])])
@pytest.mark.parametrize("output_kernel", OUTPUT_KERNELS)
def test_ssd_scan_gpu(shape, lens, starts, output_kernel):
    heads, head_dim, groups, state, chunk, block = shape
    gen = torch.Generator().manual_seed(sum(lens))
    for segment_chunks in (3, 16):  # joined segments of 3 chunks, and (mostly) one segment per sequence
        _check(lens, starts, heads, head_dim, groups, state, chunk, block, torch.bfloat16, "cuda", gen, 3e-2,
               segment_chunks=segment_chunks, output_kernel=output_kernel)


def _check_pool(lens, starts, heads, head_dim, groups, state, chunk, state_block, dtype, pool_dtype, device, gen, tol,
                scan=ssd_scan_varlen_triton, checkpoints=True, segment_chunks=None):
    """Pool mode: initial states read from slot rows (resumed sequences only), final states written back to
    them and kept states to checkpoint rows (-1 skipped), through a strided view; every other row untouched."""
    cu, x, dt, A, B, C, D, bias = _inputs(lens, heads, head_dim, groups, state, dtype, device, gen)
    rows = 3 * len(lens) + 8
    backing = torch.randn(rows, 2, heads, head_dim, state, generator=gen).to(device=device, dtype=pool_dtype)
    pool = backing[:, 1]  # strided per-layer view of a request-major cache
    slots = torch.randperm(rows, generator=gen)[: len(lens)].to(device)
    sp = torch.tensor(starts, device=device)
    init = torch.where((sp > 0)[:, None, None, None], pool[slots].float(), 0.0)
    kw = dict(D=D, dt_bias=bias, dt_limit=(0.001, 5.0), start_positions=sp, state_block=state_block)
    ref = ssd_scan_varlen_ref(x, dt, A, B, C, cu, chunk, initial_states=init, **kw)
    num_kept = ref.chunk_states.shape[0]
    free = [r_ for r_ in range(rows) if r_ not in set(slots.tolist())]
    ckpt = torch.tensor(free[:num_kept], device=device)
    ckpt[::2] = -1  # every other kept state is not wanted
    if not checkpoints:  # no rows at all: the scan keeps nothing (and must not read past an empty row list)
        ckpt[:] = -1
    before = pool.clone()
    extra = {} if segment_chunks is None else {"segment_chunks": segment_chunks}
    got = scan(x, dt, A, B, C, cu, chunk, state_pool=pool, slots=slots, checkpoint_rows=ckpt if checkpoints else None,
               **kw, **extra)
    ku.assert_close(got.y, ref.y, tol, "y")
    assert got.final_states.shape[0] == 0 and got.chunk_states.shape[0] == 0
    state_tol = max(tol, ku.TOL[pool_dtype])
    for s in range(len(lens)):
        ku.assert_close(pool[slots[s]].float(), ref.final_states[s], state_tol, f"final state {s} in the pool")
    written = set(slots.tolist())
    for k in range(num_kept):
        if int(ckpt[k]) >= 0:
            ku.assert_close(pool[ckpt[k]].float(), ref.chunk_states[k], state_tol, f"kept state {k} in the pool")
            written.add(int(ckpt[k]))
    untouched = [r_ for r_ in range(rows) if r_ not in written]
    assert torch.equal(pool[untouched], before[untouched]), "the scan wrote pool rows it was not given"


@ku.interp_only
def test_ssd_scan_pool_mode_interpreter():
    gen = torch.Generator().manual_seed(1)
    _check_pool([5, 40, 0, 23], [0, 7, 3, 33], 4, 12, 2, 16, 16, 32, torch.float32, torch.float32, "cpu", gen, 2e-3)
    _check_pool([37, 19], [9, 0], 2, 40, 1, 16, 16, 16, torch.float32, torch.bfloat16, "cpu", gen, 2e-3)
    _check_pool([37, 19], [9, 0], 2, 40, 1, 16, 16, None, torch.float32, torch.float32, "cpu", gen, 2e-3,
                checkpoints=False)


def test_ssd_scan_pool_mode_reference():
    gen = torch.Generator().manual_seed(2)
    _check_pool([5, 40, 23], [0, 7, 33], 4, 12, 2, 16, 16, 32, torch.float32, torch.float32, "cpu", gen, 1e-5,
                scan=ssd_scan_varlen_ref)


def test_ssd_scan_pool_mode_errors():
    x, dt, A = torch.zeros(4, 2, 4), torch.zeros(4, 2), -torch.ones(2)
    B = C = torch.zeros(4, 1, 4)
    cu, pool = torch.tensor([0, 4]), torch.zeros(3, 2, 4, 4)
    with pytest.raises(ValueError, match="slots"):
        ssd_scan_varlen_ref(x, dt, A, B, C, cu, 4, state_pool=pool)
    with pytest.raises(ValueError, match="not both"):
        ssd_scan_varlen_ref(x, dt, A, B, C, cu, 4, state_pool=pool, slots=torch.tensor([0]),
                            initial_states=torch.zeros(1, 2, 4, 4))
    with pytest.raises(ValueError, match="checkpoint_rows"):
        ssd_scan_varlen_ref(x, dt, A, B, C, cu, 4, state_pool=pool, slots=torch.tensor([0]),
                            checkpoint_rows=torch.tensor([1, 2]))


@ku.gpu
@ku.cuda_only
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_ssd_scan_pool_mode_gpu(pool_dtype):
    gen = torch.Generator().manual_seed(3)
    _check_pool([1000, 37, 513], [0, 300, 129], 128, 80, 8, 128, 128, 256, torch.bfloat16, pool_dtype, "cuda", gen,
                3e-2, segment_chunks=2)


@ku.gpu
@ku.cuda_only
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_ssd_scan_tiny_shapes_gpu(dtype, tol):
    """The tiny parity checkpoints' shapes (4 heads x 16 x 8 state, 2 groups, chunk 8): every block is padded
    to the 16 tl.dot needs; fp32 runs without TF32, so it matches the reference closely."""
    gen = torch.Generator().manual_seed(4)
    for output_kernel in OUTPUT_KERNELS:
        _check([3, 40, 17, 90], [0, 0, 0, 0], 4, 16, 2, 8, 8, None, dtype, "cuda", gen, tol, with_init=False,
               output_kernel=output_kernel)
        _check([11, 6, 1, 30], [0, 5, 16, 19], 4, 16, 2, 8, 8, 8, dtype, "cuda", gen, tol, output_kernel=output_kernel)
    for pool_dtype in (torch.float32, torch.bfloat16):
        for segment_chunks in (1, 16):
            _check_pool([11, 6, 1, 30], [0, 5, 16, 19], 4, 16, 2, 8, 8, 16, dtype, pool_dtype, "cuda", gen, tol,
                        segment_chunks=segment_chunks)
    for _ in range(20):  # no checkpoint rows: nothing kept, nothing read past them (the engine's plain prefill)
        _check_pool([11, 6, 1, 30], [0, 5, 16, 19], 4, 16, 2, 8, 8, None, dtype, dtype, "cuda", gen, tol,
                    checkpoints=False)
    torch.cuda.synchronize()


@ku.interp_only
def test_ssd_scan_walk_shapes_interpreter():
    """The state walk with several heads stacked in one program, half-height head_dim tiles and B's addresses
    computed before the chunk loop."""
    from hybridserve.kernels.ssd_chunk_state_triton import WalkConfig

    gen = torch.Generator().manual_seed(5)
    for walk in (WalkConfig(8, 16, 4, 1, heads=2), WalkConfig(16, 32, 4, 1, heads=4), WalkConfig(16, 16, 4, 1),
                 WalkConfig(16, 16, 4, 1, hoist_b_addresses=True)):
        lens, starts = [9, 30], [0, 21]
        total = sum(lens)
        cu = torch.tensor([0, 9, 39])
        x, dt = torch.randn(total, 4, 24, generator=gen), torch.randn(total, 4, generator=gen) * 0.5
        B, C = torch.randn(total, 1, 32, generator=gen), torch.randn(total, 1, 32, generator=gen)
        A = -(torch.rand(4, generator=gen) + 0.1)
        init = torch.randn(2, 4, 24, 32, generator=gen)
        kw = dict(initial_states=init, start_positions=torch.tensor(starts), state_block=16)
        ref = ssd_scan_varlen_ref(x, dt, A, B, C, cu, 8, **kw)
        got = ssd_scan_varlen_triton(x, dt, A, B, C, cu, 8, walk=walk, **kw)
        ku.assert_close(got.y, ref.y, 2e-3, f"y {walk}")
        ku.assert_close(got.final_states, ref.final_states, 2e-3, f"final {walk}")
        ku.assert_close(got.chunk_states, ref.chunk_states, 2e-3, f"kept {walk}")


def test_output_kernel_errors():
    x, dt, A = torch.zeros(4, 2, 16), torch.zeros(4, 2), -torch.ones(2)
    B = C = torch.zeros(4, 1, 16)
    with pytest.raises(ValueError, match="output_kernel must be one of"):
        ssd_scan_varlen_triton(x, dt, A, B, C, torch.tensor([0, 4]), 16, output_kernel="fast")


def test_default_output_kernel():
    from hybridserve.kernels.ssd_scan_triton import default_output_kernel

    assert default_output_kernel(128) == "dense" and default_output_kernel(256) == "blocked"


def test_walk_config_errors():
    from hybridserve.kernels.ssd_chunk_state_triton import WalkConfig

    with pytest.raises(ValueError, match="power of two"):
        WalkConfig(block_p=24)
    with pytest.raises(ValueError, match="rows of a tl.dot"):
        WalkConfig(block_p=4, heads=2)


@ku.gpu
@ku.cuda_only
@pytest.mark.parametrize(
    "output_kernel,shape",
    [("dense", (128, 80, 8, 128, 128)), ("blocked", (128, 80, 8, 128, 128)), ("blocked", (80, 64, 1, 128, 256))],
)
def test_output_configs_gpu(output_kernel, shape, monkeypatch):
    """Every config of the output kernel's autotune space (after its prune) against the reference, so that the
    autotuner can never pick a miscompiled one (Triton 3.6 got 32-row blocked sub-blocks with 2 stages wrong)."""
    from hybridserve.kernels import ssd_chunk_output_triton as blocked_mod
    from hybridserve.kernels import ssd_chunk_scan_triton as dense_mod

    module, kernel = ((blocked_mod, blocked_mod.chunk_output_kernel) if output_kernel == "blocked"
                      else (dense_mod, dense_mod.chunk_scan_kernel))
    heads, head_dim, groups, state, chunk = shape
    gen = torch.Generator().manual_seed(6)
    lens, starts = [600, 37, 300], [0, 300, 129]
    cu, x, dt, A, B, C, D, bias = _inputs(lens, heads, head_dim, groups, state, torch.bfloat16, "cuda", gen)
    kw = dict(D=D, dt_bias=bias, start_positions=torch.tensor(starts, device="cuda"), state_block=2 * chunk)
    ref = ssd_scan_varlen_ref(x, dt, A, B, C, cu, chunk, **kw).y
    named = {"P": head_dim, "heads_per_group": heads // groups}
    configs = module._prune(kernel.configs, named, QBLOCK=chunk)
    monkeypatch.setattr(kernel, "early_config_prune", None)
    for config in configs:
        monkeypatch.setattr(kernel, "configs", [config])
        monkeypatch.setattr(kernel, "cache", {})
        got = ssd_scan_varlen_triton(x, dt, A, B, C, cu, chunk, output_kernel=output_kernel, **kw).y
        ku.assert_close(got, ref, 1e-2, f"y with {config}")
