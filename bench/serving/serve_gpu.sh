#!/usr/bin/env bash
# Serving benchmark on the GPU: Nemotron-Nano-9B-v2 shapes, random bf16 weights (--load-format dummy), the
# router and workers as plain processes (no Ray), bench/serving/serve.py as the client. Writes its JSON into $1.
#
#   bash bench/serving/serve_gpu.sh OUT [DEPLOYMENT ...]
#
# Deployments (default: all that the host's GPUs allow):
#   colocated-1gpu      one worker that prefills and decodes, on GPU 0
#   colocated-2gpu-dp   two such workers, GPU 0 and GPU 1; the router spreads requests over them
#   pd-2gpu-cuda_ipc    1 prefill worker (GPU 0) + 1 decode worker (GPU 1), state over CUDA IPC
#   pd-2gpu-cuda_ipc-chunk4k  the same, the prefill worker taking 4096 prompt tokens per step (it runs no
#                       decodes, so big steps cost no inter-token latency)
#   pd-2gpu-grpc        the pair, state over gRPC (through host memory)
#   pd-1gpu             1 prefill + 1 decode worker sharing GPU 0 (CUDA IPC on one device)
#   colocated-1gpu-nocache  colocated-1gpu with prefix caching off (cache cost on unique prompts)
#   colocated-2gpu-tp2  one worker at --tensor-parallel-size 2 on GPUs 0-1 (rank 0 serves, rank 1 follows)
# MODEL_CONFIG (default bench/configs/nemotron-nano-9b-v2.json) picks the shapes, e.g. the Nemotron-H-56B ones:
#   MODEL_CONFIG=bench/configs/nemotron-h-56b-base-8k.json WORKLOADS=512:128 RATES=1,4,inf \
#     bash bench/serving/serve_gpu.sh OUT colocated-2gpu-tp2
# GPU_MEMORY_GB (24) is each worker's cache budget.
# Workloads: random 512/128 and 2048/256 prompts, rates 4, 8, 16 req/s and all at once; NUM_PROMPTS (64)
# each, after a warm-up pass of 32 all-at-once requests per workload (WARM_PASS=0 skips it: then the first
# measured rates pay Triton's compile and autotune of new step shapes) and 4 warm-up requests.
# WORKLOADS="512:128 2048:256" and RATES="4,8,16,inf" override. PASSES="cold warm" runs the measured workloads
# twice per server with fresh prompts of one arrival pattern (no warm-up pass: the cold pass is the first
# traffic after ready; PROBE=1 adds one request right after ready and one after the passes);
# the results are named <deployment>-<in>-<out>-<pass>.
# KIND=shared-prefix or KIND=multi-turn replays that bench/serving/serve.py workload instead of random prompts (IN = the
# suffix / user-message tokens), with KIND_ARGS for its shape, e.g. prefix caching on vs off:
#   KIND=shared-prefix KIND_ARGS="--num-groups 4 --prefix-len 2048" WORKLOADS=64:64 RATES=8 \
#     bash bench/serving/serve_gpu.sh OUT colocated-1gpu colocated-1gpu-nocache
#   KIND=multi-turn KIND_ARGS="--num-turns 4 --prefix-len 512" WORKLOADS=128:64 NUM_PROMPTS=16 RATES=2 ...
# Their results are named <deployment>-<kind>-<in>-<out>.
# OFFLINE_BATCHES="4 8" also runs the offline engine (bench/system/one_batch.py, same shapes and settings) at those batch
# sizes for every workload after the servers, so the table sets each served TPOT beside the engine's own decode
# step at the nearest batch in the same run (one_batch-<batch>x<in>.json).
# bench/serving/serve_table.py OUT then prints and writes the comparison table (OUT/table.md).
set -euo pipefail
OUT=${1:-bench/results/gpu/serve}
shift || true
mkdir -p "$OUT"
NUM_PROMPTS=${NUM_PROMPTS:-64}
RATES=${RATES:-4,8,16,inf}
WORKLOADS=${WORKLOADS:-"512:128 2048:256"}
KIND=${KIND:-random}
case $KIND in
  random|shared-prefix|multi-turn) ;;
  *) echo "KIND must be random, shared-prefix or multi-turn, got '$KIND'" >&2; exit 2 ;;
esac
read -r -a KIND_EXTRA <<< "${KIND_ARGS:-}"
TAG=""; [ "$KIND" != random ] && TAG="-$KIND"
GPUS=$(nvidia-smi --list-gpus | wc -l)
if [ "$#" -eq 0 ]; then
  set -- colocated-1gpu
  if [ "$GPUS" -ge 2 ]; then set -- "$@" colocated-2gpu-dp pd-2gpu-cuda_ipc pd-2gpu-cuda_ipc-chunk4k pd-2gpu-grpc
  else set -- "$@" pd-1gpu; fi
fi
MODEL=$(mktemp -d)
cp "${MODEL_CONFIG:-bench/configs/nemotron-nano-9b-v2.json}" "$MODEL/config.json"
COMMON=(--no-ray --model "$MODEL" --device cuda --dtype bfloat16 --load-format dummy --gpu-memory-gb "${GPU_MEMORY_GB:-24}"
        --max-num-seqs 32 --max-model-len 4096 --port 8000 --grpc-port 50051)
# EXTRA_ARGS="--prefill-chunk-size 2048" adds engine / router flags to every deployment
read -r -a EXTRA <<< "${EXTRA_ARGS:-}"
COMMON+=("${EXTRA[@]}")
git rev-parse HEAD > "$OUT/commit.txt" 2>/dev/null || true
nvidia-smi --query-gpu=index,name,memory.total --format=csv > "$OUT/gpus.csv"

deployment_args() {
  case $1 in
    colocated-1gpu) echo --prefill-workers 0 --decode-workers 1 --gpus 0 ;;
    colocated-1gpu-nocache) echo --prefill-workers 0 --decode-workers 1 --gpus 0 --no-prefix-caching ;;
    colocated-2gpu-dp) echo --prefill-workers 0 --decode-workers 2 --gpus 0,1 ;;
    colocated-2gpu-tp2) echo --prefill-workers 0 --decode-workers 1 --tensor-parallel-size 2 ;;
    pd-2gpu-cuda_ipc) echo --prefill-workers 1 --decode-workers 1 --gpus prefill=0,decode=1 --transfer-planes cuda_ipc,grpc ;;
    pd-2gpu-cuda_ipc-chunk4k) echo --prefill-workers 1 --decode-workers 1 --gpus prefill=0,decode=1 --transfer-planes cuda_ipc,grpc \
      --prefill-worker-overrides '{"prefill_chunk_size":4096}' ;;
    pd-2gpu-grpc) echo --prefill-workers 1 --decode-workers 1 --gpus prefill=0,decode=1 --transfer-planes grpc ;;
    pd-1gpu) echo --prefill-workers 1 --decode-workers 1 --gpus prefill=0,decode=0 --transfer-planes cuda_ipc,grpc ;;
    *) echo "unknown deployment $1" >&2; return 2 ;;
  esac
}

run() {
  local name=$1
  local args
  read -r -a args <<< "$(deployment_args "$name")"
  hybridserve -v serve "${COMMON[@]}" "${args[@]}" > "$OUT/$name.server.log" 2>&1 &
  local pid=$! up=0
  for _ in $(seq 1 300); do
    if python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/ready', timeout=2)" 2>/dev/null; then
      up=1; break
    fi
    kill -0 "$pid" 2>/dev/null || break
    sleep 1
  done
  if [ "$up" = 1 ]; then
    if [ -z "${PASSES:-}" ] && [ "${WARM_PASS:-1}" = 1 ]; then  # compile every step shape before measuring
      for w in $WORKLOADS; do
        python3 bench/serving/serve.py --base-url http://127.0.0.1:8000 --workload random --input-len "${w%%:*}" \
          --output-len 8 --num-prompts 32 --request-rate inf --no-plots --no-scrape \
          --result-dir "$(mktemp -d)" > /dev/null 2>&1 || true
      done
    fi
    # every pass replays one arrival pattern and one set of lengths (--seed 1) with its own token ids
    # (--id-seed), so passes compare like for like and none finds another's prompts cached; PROBE=1 adds a
    # single request right after ready ("first") and one of the same length after the passes ("last")
    local index=0
    probe() {
      for w in $WORKLOADS; do
        python3 bench/serving/serve.py --base-url http://127.0.0.1:8000 --workload random --input-len "${w%%:*}" \
          --output-len "${w##*:}" --num-prompts 1 --request-rate inf --token-range 3,1000 --seed 1 \
          --id-seed "$2" --warmup 0 --no-plots --no-scrape --result-dir "$OUT" \
          --result-name "$name-${w%%:*}-${w##*:}-$1" > /dev/null 2>&1 || true
      done
    }
    if [ "${PROBE:-0}" = 1 ]; then probe first 500; fi
    for pass in ${PASSES:-measured}; do
      index=$((index + 1))
      local suffix=""; [ -n "${PASSES:-}" ] && suffix="-$pass"
      local warmup=4; [ -n "${PASSES:-}" ] && warmup=0
      for w in $WORKLOADS; do
        local in=${w%%:*} out=${w##*:}
        python3 bench/serving/serve.py --base-url http://127.0.0.1:8000 --workload "$KIND" ${KIND_EXTRA[@]+"${KIND_EXTRA[@]}"} \
          --input-len "$in" --output-len "$out" --num-prompts "$NUM_PROMPTS" --request-rate "$RATES" \
          --token-range 3,1000 --seed 1 --id-seed "$((index * 1000))" --warmup "$warmup" --no-plots \
          --result-dir "$OUT" --result-name "$name$TAG-$in-$out$suffix" || true
      done
    done
    if [ "${PROBE:-0}" = 1 ]; then probe last 501; fi
  else
    echo "$name: the server did not come up (see $OUT/$name.server.log)" >&2
  fi
  kill "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
  sleep 3
}

for deployment in "$@"; do
  run "$deployment"
done
for batch in ${OFFLINE_BATCHES:-}; do
  for w in $WORKLOADS; do
    python3 bench/system/one_batch.py --dummy-config "$MODEL/config.json" --gpu-memory-gb "${GPU_MEMORY_GB:-24}" \
      --max-num-seqs 32 --max-model-len 4096 --batch "$batch" --input-len "${w%%:*}" --output-len "${w##*:}" \
      --repeats 3 --json "$OUT/one_batch-${batch}x${w%%:*}.json" > "$OUT/one_batch-${batch}x${w%%:*}.log" 2>&1 || true
  done
done
python3 bench/serving/serve_table.py "$OUT" || true
