#!/usr/bin/env bash
# Launch a vLLM OpenAI-compatible server (0.33.x) with mmshm's shared-memory
# transport for multimodal tensors.
#
#   examples/vllm_launch.sh [MODEL] [extra vllm serve args...]
#
# What mmshm changes (see mmshm/integrations/vllm.py):
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
# Containers: give /dev/shm room for the images in flight plus what vLLM's
# multimodal receiver cache holds (docker run --shm-size=8g, or --ipc=host; a
# Kubernetes emptyDir with medium: Memory). `mmshm doctor` checks the host.
set -euo pipefail

MODEL=${1:-Qwen/Qwen2-VL-7B-Instruct}
shift || true

# Segments live here (a tmpfs). A private directory keeps them apart from
# other servers on the host and lets the reaper work on this one only.
export MMSHM_DIR=${MMSHM_DIR:-/dev/shm/mmshm-vllm}
mkdir -p -m 0700 "$MMSHM_DIR"
# Tensors smaller than this stay inline (pickling them is cheaper).
export MMSHM_MIN_BYTES=${MMSHM_MIN_BYTES:-65536}
# Keep this much of the tmpfs free for NCCL and vLLM's own ring buffers.
export MMSHM_MIN_FREE_BYTES=${MMSHM_MIN_FREE_BYTES:-268435456}
# Only the vLLM instrumentor (MMSHM_INSTRUMENT=none turns mmshm off).
export MMSHM_INSTRUMENT=${MMSHM_INSTRUMENT:-vllm}
# Metrics: `mmshm run` points PROMETHEUS_MULTIPROC_DIR at a private directory
# (unless it is set already) before any process starts, so mmshm's series
# (mmshm_broadcast_seconds{role}, mmshm_shm_written_bytes_total,
# mmshm_inline_fallbacks_total{reason}, ...) from the API server, the
# EngineCore and the workers land in the multiprocess files that vLLM's
# /metrics merges. With MMSHM_METRICS_PORT set, the first instrumented process
# also serves all of them on http://127.0.0.1:$MMSHM_METRICS_PORT/metrics.
export MMSHM_METRICS_PORT=${MMSHM_METRICS_PORT:-9477}

exec mmshm run -- vllm serve "$MODEL" \
  --tensor-parallel-size "${TP:-2}" \
  --limit-mm-per-prompt '{"image": 8}' \
  --max-model-len "${MAX_MODEL_LEN:-32768}" \
  "$@"
