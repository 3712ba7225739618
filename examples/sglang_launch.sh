#!/usr/bin/env bash
# Serve a vision-language model with SGLang at TP=2, every process instrumented
# by mmshm (tokenizer, both scheduler ranks, detokenizer), without editing SGLang.
#
# Install mmshm into the server's own environment (the venv or image that has
# SGLang: every process of the server imports it), and run this script there:
#   pip install sglang==0.5.23 -e /path/to/mmshm   # any SGLang from 0.5.9 to 0.5.23
#   MODEL=... PORT=30000 TP=2 examples/sglang_launch.sh [extra sglang.launch_server flags]
#
# Docker: /dev/shm defaults to 64 MiB; give the container room for in-flight
# images: docker run --shm-size=1g (or --ipc=host) holds 32 Qwen2-VL 720p images
# plus NCCL's reserve; `mmshm doctor --expected-bytes 2GiB` prints the size for
# your load (the README's formula, "Sizing /dev/shm"). mmshm never SIGBUSes on a
# full /dev/shm: a tensor that does not fit travels inline and is counted.
#
# Check the host from the same environment (same MMSHM_DIR: both use the
# default /dev/shm unless you export another one before running this script):
#   mmshm doctor; mmshm status; mmshm config; mmshm gc
set -euo pipefail

MODEL=${MODEL:-Qwen/Qwen2-VL-7B-Instruct}
PORT=${PORT:-30000}

# Which instrumentors to load (default: every installed one).
export MMSHM_INSTRUMENT=${MMSHM_INSTRUMENT:-sglang}
# Segment directory (a tmpfs). Keep the default unless /dev/shm is too small; if
# you change it, export the same value where you run mmshm doctor/status/gc
# (or pass them --dir).
export MMSHM_DIR=${MMSHM_DIR:-/dev/shm}
# Tensors below this many bytes stay inline (pickling them is cheaper).
export MMSHM_MIN_BYTES=${MMSHM_MIN_BYTES:-65536}

# `mmshm run` puts a start-up hook on PYTHONPATH, so SGLang's spawned scheduler
# and detokenizer processes instrument themselves too. It also sets
# PROMETHEUS_MULTIPROC_DIR (when unset) so that --enable-metrics merges mmshm's
# series from every process into SGLang's own /metrics.
# OBSERVE=1: measure first. mmshm leaves the server's own transport exactly as
# it is and only times each hop (mmshm_ipc_seconds / mmshm_ipc_bytes with
# transport="server"); run once with and once without it, compare the panel
# "multimodal IPC seconds per request, by hop and transport".
OBSERVE_FLAG=()
[ "${OBSERVE:-0}" = 1 ] && OBSERVE_FLAG=(--observe)
# Several nodes (TP across nodes): run this script on every node with the same
# DIST_INIT_ADDR (node 0's host:port) and NNODES, and NODE_RANK 0..NNODES-1,
# each under `mmshm run` (a node without mmshm, or with another version, makes
# the group carry its tensors inline, with a WARNING naming it). Each payload
# crosses the network once per node. SGLang serves /metrics on node 0 only:
# the other nodes' mmshm series go to their own exporter on METRICS_PORT.
#   DIST_INIT_ADDR=10.0.0.1:5000 NNODES=2 NODE_RANK=0 TP=16 examples/sglang_launch.sh
#   DIST_INIT_ADDR=10.0.0.1:5000 NNODES=2 NODE_RANK=1 TP=16 examples/sglang_launch.sh
NODE_FLAGS=()
if [ "${NNODES:-1}" -gt 1 ]; then
  NODE_FLAGS=(--nnodes "$NNODES" --node-rank "${NODE_RANK:?set NODE_RANK}"
              --dist-init-addr "${DIST_INIT_ADDR:?set DIST_INIT_ADDR to host:port of node 0}")
  if [ "${NODE_RANK}" != 0 ]; then
    export MMSHM_METRICS_PORT=${METRICS_PORT:-9477}
  fi
fi
exec mmshm run "${OBSERVE_FLAG[@]}" -- python -m sglang.launch_server \
  --model-path "$MODEL" \
  --tp "${TP:-2}" \
  --port "$PORT" \
  --enable-metrics \
  "${NODE_FLAGS[@]}" \
  "$@"

# What to look at in http://localhost:$PORT/metrics (all series start at 0):
#
#   mmshm_ipc_seconds{hop,transport}, mmshm_ipc_bytes{hop,transport} (histograms)
#       each hop of the multimodal path, per message, for the server's own
#       transport (OBSERVE=1: transport="server") and for mmshm's ("mmshm").
#   mmshm_segments_created_total, mmshm_shm_written_bytes_total
#       pixels written to /dev/shm once per image: parallel sampling (n > 1)
#       adds references, not segments (compare with the number of images sent).
#   mmshm_broadcast_bytes{role="src"} (histogram)
#       what broadcast_pyobj carries to the other TP rank: handle metadata,
#       a few KB per request (up to ~60 kB with 0.5.9, which sends mrope
#       positions inline), not megabytes of pixels.
#   mmshm_internode_bytes_total
#       several nodes: payload bytes TP rank 0 sent to the other nodes, once
#       per node (SGLang's own transport sends the pickle to every remote rank).
#   mmshm_broadcast_seconds{role=...}, mmshm_materialize_seconds
#       the scheduler boundary: milliseconds, whatever the image size.
#   mmshm_inline_fallbacks_total{reason="enospc"|"budget"|"emfile"|"other"}
#       tensors that could not go through shared memory. Rising "enospc" or
#       "budget": /dev/shm is too small (raise --shm-size) or MMSHM_MIN_FREE_BYTES
#       too high. These requests still succeed, just slower.
#   mmshm_materialize_failures_total{reason}, mmshm_request_failures_total{reason}
#       handles a rank could not open, and the requests turned into errors on
#       every rank because of it. Should stay at 0.
#   mmshm_segments_in_use, mmshm_shm_in_use_bytes, mmshm_dir_free_bytes
#       live shared memory and head-room in MMSHM_DIR; in_use should return to
#       ~0 when the server is idle (a steady climb is a leak).
#   mmshm_reaped_segments_total
#       orphans left by killed processes and reclaimed at start-up.
