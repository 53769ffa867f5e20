"""GPU placement of worker processes: defaults, --gpus overrides, refusals, and each process's devices."""

from __future__ import annotations

import re

import pytest

from hybridserve.deploy.gpu_placement import assign_gpu_groups, assign_gpus, host_gpus, visible_devices

WORKERS = ["prefill-0", "decode-0"]


def test_default_puts_each_worker_on_its_own_gpu_and_wraps_round_robin() -> None:
    assert assign_gpus(WORKERS, 2) == {"prefill-0": 0, "decode-0": 1}
    assert assign_gpus(["prefill-0", "decode-0", "decode-1"], 2) == {"prefill-0": 0, "decode-0": 1, "decode-1": 0}
    assert assign_gpus(WORKERS, 0) == {}  # no GPUs: nothing to place


@pytest.mark.parametrize("spec, want", [
    ("prefill=1,decode=0", {"prefill-0": 1, "decode-0": 0}),
    ("prefill-0=0, decode-0=0", {"prefill-0": 0, "decode-0": 0}),
    ("1,0", {"prefill-0": 1, "decode-0": 0}),
])
def test_explicit_mapping(spec: str, want: dict[str, int]) -> None:
    assert assign_gpus(WORKERS, 2, spec) == want


@pytest.mark.parametrize("spec, message", [
    ("prefill=0,decode=2", "GPU(s) [2] but this host has 2"),
    ("0", "lists 1 GPUs for 2 workers"),
    ("prefill=0", "leaves decode-0 without a GPU"),
    ("router=0,prefill=0,decode=1", "'router', which is no role or worker"),
    ("prefill=a,decode=1", "'a' is not a GPU index"),
    ("0,decode=1", "mix no plain indices"),
])
def test_mappings_that_cannot_exist_are_refused(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        assign_gpus(WORKERS, 2, spec)


def test_no_gpu_host_refuses_a_mapping() -> None:
    with pytest.raises(ValueError, match="no GPU"):
        assign_gpus(WORKERS, 0, "prefill=0,decode=0")


def test_each_worker_sees_its_gpu_first_and_its_peers_after() -> None:
    assert visible_devices(0, ["0", "1"]) == "0,1"
    assert visible_devices(1, ["0", "1"]) == "1,0"
    assert visible_devices(1, ["4", "5", "6"]) == "5,4,6"  # the launcher's own CUDA_VISIBLE_DEVICES is respected
    assert host_gpus({"CUDA_VISIBLE_DEVICES": "4, 5"}) == ["4", "5"]
    assert host_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []


def test_tensor_parallel_groups_take_contiguous_gpus() -> None:
    """1 prefill (TP=1) + 1 decode (TP=2) on 4 GPUs: GPU 0, then GPUs 1-2; the decode group's devices first."""
    sizes = {"prefill-0": 1, "decode-0": 2}
    assert assign_gpu_groups(WORKERS, 4, sizes) == {"prefill-0": [0], "decode-0": [1, 2]}
    assert assign_gpu_groups(WORKERS, 4, {"prefill-0": 2, "decode-0": 2}) == {"prefill-0": [0, 1], "decode-0": [2, 3]}
    assert assign_gpu_groups(WORKERS, 2, {}) == {"prefill-0": [0], "decode-0": [1]}  # all TP=1: as before
    assert assign_gpu_groups(WORKERS, 0, sizes) == {}  # CPU host: nothing to place
    # --gpus: a group's index is its first GPU; sharing is the user's explicit choice
    assert assign_gpu_groups(WORKERS, 2, sizes, "prefill=0,decode=0") == {"prefill-0": [0], "decode-0": [0, 1]}
    assert visible_devices([1, 2], ["0", "1", "2", "3"]) == "1,2,0,3"  # rank r on cuda:r, peers after
    assert visible_devices([2, 3], ["4", "5", "6", "7"]) == "6,7,4,5"


@pytest.mark.parametrize("num_gpus, sizes, spec, message", [
    (2, {"prefill-0": 1, "decode-0": 2}, None, "the workers need 3 GPUs (prefill-0: 1, decode-0: 2) but this host has 2"),
    (1, {"prefill-0": 1, "decode-0": 2}, "prefill=0,decode=0", "decode-0 (tensor_parallel_size 2) would run on GPUs 0..1"),
    (4, {"prefill-0": 1, "decode-0": 2}, "prefill=0,decode=3", "would run on GPUs 3..4 but this host has 4"),
    (0, {"prefill-0": 1, "decode-0": 2}, "prefill=0,decode=0", "this host has no GPU"),
])
def test_tensor_parallel_groups_that_do_not_fit_are_refused(num_gpus: int, sizes: dict[str, int], spec: str | None,
                                                             message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        assign_gpu_groups(WORKERS, num_gpus, sizes, spec)


def test_ray_tp_group_bundles() -> None:
    from hybridserve.deploy.ray_workers import group_bundles

    assert group_bundles(2, "decode") == [{"GPU": 1.0, "CPU": 1.0, "decode": 1.0}, {"GPU": 1.0, "CPU": 1.0}]
    assert group_bundles(1, None) == [{"GPU": 1.0, "CPU": 1.0}]


def test_ray_reserves_a_tp_group_on_logical_gpus() -> None:
    """A local Ray with 3 logical GPUs: a TP=2 group gets a STRICT_PACK placement group whose two bundles hold
    distinct GPU ids (the actor's CUDA_VISIBLE_DEVICES); releasing it frees them for the next group."""
    ray = pytest.importorskip("ray")
    from hybridserve.deploy.ray_workers import RayPlacement, _reserve_group, release_group

    ray.init(num_cpus=3, num_gpus=3, resources={"decode": 2}, include_dashboard=False, log_to_driver=False)
    try:
        group, ids = _reserve_group("hybridserve-decode-0", 2, "decode", RayPlacement(num_gpus=1, ready_timeout_s=60))
        assert len(set(ids)) == 2 and set(ids) <= {"0", "1", "2"}
        assert ray.util.placement_group_table(group)["strategy"] == "STRICT_PACK"
        release_group("hybridserve-decode-0")
        _, again = _reserve_group("hybridserve-decode-1", 2, "decode", RayPlacement(num_gpus=1, ready_timeout_s=60))
        assert len(set(again)) == 2
    finally:
        ray.shutdown()
