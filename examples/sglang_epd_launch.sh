#!/usr/bin/env bash
# Encoder disaggregation (EPD) with SGLang 0.5.23 on one node: an
# --encoder-only instance runs the vision encoder, a --language-only instance
# (the one clients talk to) gets each item's embedding from it. Under
# `mmshm run` on both, the encoder writes each embedding once into shared
# memory and every TP rank of the language instance maps it zero-copy, instead
# of one TCP send and one copy per TP rank (docs/sglang.md, "Encoder
# disaggregation").
#
# Install mmshm into the server's own environment (the venv or image that has
# SGLang), and run this script there, once per instance, each on its own
# GPU(s) and port:
#   ROLE=encoder  PORT=30001 TP=1 CUDA_VISIBLE_DEVICES=0   examples/sglang_epd_launch.sh
#   ROLE=language PORT=30000 TP=2 CUDA_VISIBLE_DEVICES=1,2 ENCODER_URL=http://127.0.0.1:30001 \
#     examples/sglang_epd_launch.sh
# Extra arguments go to sglang.launch_server. Clients send their requests to
# the language instance only; it asks the encoder for the items itself (no
# proxy). Run both under mmshm run on one node for mmshm: the same host or
# container (mount and IPC namespaces) and the same MMSHM_DIR. Each language
# TP rank proves it (a card in MMSHM_DIR naming its node id); the encoder sends
# shared-memory handles only to ranks that did, and SGLang's own bytes to any
# other (counted: mmshm_epd_fallbacks_total{reason="unproven"} on the
# encoder), so a language instance elsewhere still gets its answers. The encoder
# pushes to the address SGLang detects for the host; SGLANG_HOST_IP sets it
# (e.g. 127.0.0.1 when everything stays on loopback, on both instances).
#
# Where each item's embedding came from, on the language instance's /metrics:
# mmshm_epd_loads_total{server="sglang"} (one per TP rank and item mapped from
# shared memory), mmshm_epd_fallbacks_total{server="sglang",reason}
# (encoder_error: the encoder rejected the item, the request fails cleanly;
# encoder_gone: the encoder died or did not deliver; encoder_dropped: SGLang's
# registry dropped the encoder and the item was encoded here); on the
# encoder's: mmshm_epd_saves_total and mmshm_epd_bytes_total{direction="saved"},
# and mmshm_epd_fallbacks_total{reason="unproven"} (sends in SGLang's bytes to
# a language TP rank that did not prove it can open the encoder's segments).
# Check the node from the same environment: mmshm doctor; mmshm status; mmshm gc
set -euo pipefail

MODEL=${MODEL:-Qwen/Qwen2-VL-7B-Instruct}
ROLE=${ROLE:?set ROLE to encoder or language}
export MMSHM_DIR=${MMSHM_DIR:-/dev/shm}
# Which instrumentors to load (default: every installed one).
export MMSHM_INSTRUMENT=${MMSHM_INSTRUMENT:-sglang}

case "$ROLE" in
  encoder)
    # zmq_to_scheduler (0.5.23's default) is the backend mmshm carries.
    FLAGS=(--encoder-only --encoder-transfer-backend zmq_to_scheduler)
    PORT=${PORT:-30001} ;;
  language)
    FLAGS=(--language-only --encoder-urls "${ENCODER_URL:?set ENCODER_URL to the encoder, http://host:port}"
           --encoder-bootstrap-port "${BOOTSTRAP_PORT:-30002}")
    PORT=${PORT:-30000} ;;
  *) echo "ROLE must be encoder or language (not $ROLE)" >&2; exit 2 ;;
esac

exec mmshm run -- python -m sglang.launch_server \
  --model-path "$MODEL" \
  --tp "${TP:-1}" \
  --port "$PORT" \
  --enable-metrics \
  "${FLAGS[@]}" \
  "$@"
