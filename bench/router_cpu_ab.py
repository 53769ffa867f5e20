"""Router CPU per request, A/B between source trees (and the bare-proxy floor), on a noisy shared machine.

Every tree's router runs at once (each in its own process over its own stub decode worker, as in
`bench/router_overhead.py`); sequential requests go in blocks that alternate between the trees, both doors
in turn, the order reversed every round, so the machine's drifting load falls on all trees alike. The figure
is the router process's user+system CPU time per request (median over rounds), which the open-loop latency
of a 2-core box shared with other jobs cannot resolve at the 0.1 ms level.

    # a tree is a checkout with its .pylink (bash /work/wt/relink.sh TREE); "TREE+floor" is the bare proxy
    python bench/router_cpu_ab.py --trees /tmp/before,/work/wt/router,/work/wt/router+floor --rounds 10
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

PROMPT = list(range(10, 74))  # 64 tokens, as bench/router_overhead.py


def _serve(floor: bool) -> None:
    """Server process (run with this tree's PYTHONPATH): stub worker child + router or floor here; prints
    {"grpc", "http", "pid"} as one JSON line."""
    here = Path(__file__).resolve().parent
    sys.path[:0] = [str(here), str(here.parent / "tests" / "router"), str(here.parent / "tests")]
    import router_stub
    from router_cluster import tiny_model_dir

    queue = mp.get_context("spawn").Queue()
    mp.get_context("spawn").Process(target=router_stub.serve_stub, args=(queue,), daemon=True).start()
    stub_address = queue.get(timeout=120)

    class Announce:
        def put(self, addresses: tuple[str, str]) -> None:
            print(json.dumps({"grpc": addresses[0], "http": addresses[1], "pid": os.getpid()}), flush=True)

    if floor:
        from router_floor import serve_floor

        serve_floor(stub_address, Announce())
    from hybridserve.router.app import Router, RouterOptions
    from hybridserve.router.config import AdmissionConfig

    options = RouterOptions(str(tiny_model_dir()), model_name="bench", http_port=0, grpc_port=0, max_model_len=4096,
                            admission=AdmissionConfig(max_running=1024, max_queued=4096))
    router = Router(options, [], [stub_address]).start()
    time.sleep(1.0)  # first health poll
    Announce().put((router.grpc_address, router.http_address))
    threading.Event().wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trees", required=True, help="comma-separated tree paths; TREE+floor: that tree's floor")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--requests", type=int, default=300, help="sequential requests per block")
    parser.add_argument("--tokens", type=int, default=4, help="max_tokens of each request")
    parser.add_argument("--serve", choices=("router", "floor"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        _serve(args.serve == "floor")
        return

    import grpc
    import httpx
    from router_stub import cpu_seconds as _cpu_seconds

    from hybridserve.proto import common_pb2, router_pb2, router_pb2_grpc

    names = args.trees.split(",")
    servers, children = {}, []
    try:
        for name in names:
            tree, _, floor = name.partition("+")
            env = dict(os.environ, PYTHONPATH=f"{tree}/.pylink")
            # this script serves every tree (the stub, floor and tiny model are the bench's); the router is the tree's
            child = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--trees", name,
                                      "--serve", "floor" if floor else "router"],
                                     env=env, cwd=tree, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     start_new_session=True)  # its own group: the stub child goes with it
            children.append(child)
            assert child.stdout is not None
            servers[name] = json.loads(child.stdout.readline())
        sampling = common_pb2.SamplingOptions(max_tokens=args.tokens)
        body = {"model": "bench", "prompt": PROMPT, "max_tokens": args.tokens}
        clients = {n: (router_pb2_grpc.RouterStub(grpc.insecure_channel(s["grpc"])),
                       httpx.Client(base_url=f"http://{s['http']}")) for n, s in servers.items()}

        def send(name: str, door: str) -> None:
            stub, http = clients[name]
            if door == "grpc":
                list(stub.Generate(router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=PROMPT),
                                                              sampling=sampling), timeout=30))
            else:
                http.post("/v1/completions", json=body).raise_for_status()

        for name in names:  # warm up connections and code paths
            for door in ("grpc", "http"):
                for _ in range(100):
                    send(name, door)
        cpu: dict[tuple[str, str], list[float]] = {(n, d): [] for n in names for d in ("grpc", "http")}
        for r in range(args.rounds):
            for door in ("grpc", "http"):
                for name in names if r % 2 == 0 else names[::-1]:
                    pid = servers[name]["pid"]
                    before = _cpu_seconds(pid)
                    for _ in range(args.requests):
                        send(name, door)
                        time.sleep(0.002)  # ~ the gaps of an open-loop client, not back to back
                    cpu[(name, door)].append((_cpu_seconds(pid) - before) / args.requests * 1e3)
        for (name, door), runs in cpu.items():
            print(f"{name:40s} {door:5s} {statistics.median(runs):6.3f} ms/request  runs {[round(x, 2) for x in runs]}")
    finally:
        for child in children:
            os.killpg(child.pid, signal.SIGKILL)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
