#!/usr/bin/env bash
# State transfer on ONE GPU (H100 / H200), workers as plain processes: gRPC (1, 2 and 4 PushState streams per
# transfer) and the tcp plane (gRPC control, bytes over a plain socket) against raw loopback TCP with as many concurrent connections as transfers in flight, and CUDA IPC
# between two processes sharing the GPU against a copy within the GPU. Nemotron-Nano-9B-v2 states of 1K, 8K
# and 32K tokens, 1 and 4 transfers in flight, medians of 5; each row also gives CPU seconds per GB on both
# sides. About 2-3 minutes. TESTS=1 then also runs the transfer plane tests on the GPU (device landing,
# faults, tcp-gpu across processes; about 2 more minutes).
#
#   bash bench/system/transfer_gpu.sh [OUT]      (OUT default bench/results/gpu/transfer)
#
# Look for: grpc and tcp rows at "x4" against raw TCP ("(NN%)"; the issue asks >= 70 % for gRPC); which
# stream count is best (TransferConfig.grpc_streams default is 2); cuda_ipc ms/state for 1K-8K tokens.
set -euo pipefail
OUT=${1:-bench/results/gpu/transfer}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
nproc | tee -a "$OUT/gpu.txt"
timeout 200 python bench/system/transfer_planes.py --device cuda --planes cuda_ipc tcp grpc --grpc-streams 1 2 4 \
  --tokens 1024 8192 32768 --in-flight 1 4 --repeats 5 --out "$OUT/transfer_planes.json" 2>&1 \
  | tee "$OUT/transfer_planes.txt"
if [ "${TESTS:-0}" = 1 ]; then
  timeout 240 python -m pytest -q tests/transfer/test_host_copy.py tests/transfer/test_tcp_plane.py \
    tests/transfer/test_planes.py 2>&1 | tail -15 | tee "$OUT/tests.txt"
fi
