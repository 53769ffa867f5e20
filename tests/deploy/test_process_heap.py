"""A server process freezes its start-up heap: afterwards a full collection skips it (run in a child process,
as freezing is for the whole process)."""

from __future__ import annotations

import subprocess
import sys

CHILD = """
import gc, time
import torch  # a start-up heap of the size a worker has (most of it)
from hybridserve.deploy.process_heap import freeze_startup_heap
before = len(gc.get_objects())
frozen = freeze_startup_heap("test")
start = time.perf_counter()
gc.collect()
print(before, frozen, len(gc.get_objects()), gc.get_freeze_count() == frozen)
"""


def test_freezing_takes_the_startup_objects_out_of_collections() -> None:
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=300, check=True)
    before, frozen, tracked_after, same = out.stdout.split()
    assert int(frozen) > 0.9 * int(before)  # nearly everything alive at start-up is frozen
    assert int(tracked_after) < 0.05 * int(before)  # what collections still walk
    assert same == "True"


def test_a_worker_process_freezes_its_heap_before_it_reports_ready(tmp_path) -> None:
    from router_cluster import ENGINE, tiny_model_dir

    from hybridserve.deploy.launch import start_worker_process
    from hybridserve.deploy.options import WorkerOptions

    process = start_worker_process("decode", "heap-d0", WorkerOptions(str(tiny_model_dir()), ENGINE),
                                   log_dir=tmp_path, verbose=True)
    try:
        log = (tmp_path / "heap-d0.log").read_text()
        assert "decode worker heap-d0: froze" in log and "start-up objects" in log
    finally:
        process.kill()


def test_the_other_server_entry_points_freeze_after_start() -> None:
    """The Ray actors and `serve`'s router process (not started here: Ray, and the CLI's main thread)."""
    import inspect

    from hybridserve.deploy import cluster_up, ray_workers, serve

    for module in (ray_workers, cluster_up, serve):
        assert "freeze_startup_heap(" in inspect.getsource(module), module.__name__
