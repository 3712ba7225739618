#!/usr/bin/env python3
"""Run the SGLang integration tests against the real code of each supported
release, one virtual environment per release.

Usage::

    python tests/integrations/run_sglang.py [--release 0.5.23 ...] [--setup-only]
        [--no-e2e | --e2e-only] [-- PYTEST ARGS]

After the module-level tests, the real-server e2e tests
(tests/e2e/test_sglang_e2e.py on one node, then
tests/e2e/test_sglang_multinode_e2e.py on two simulated nodes; for 0.5.23
also the model matrix, tests/e2e/test_matrix.py) run for 0.5.9
and 0.5.23 in
``.venvs/sglang-<version>-server`` (the lean environment plus what a server
needs, and the stubs installed as packages); ``--no-e2e`` skips them.

Lean environments. Each release gets ``.venvs/sglang-<version>`` (git-ignored)
holding only SGLang (``--no-deps``) and the few packages its modules need to
import on CPU. Everything else (torch 2.13.0 CPU, numpy, msgspec, pytest and
mmshm itself) comes from the interpreter that runs this script, through a
``.pth`` file that calls ``site.addsitedir`` on its site-packages (so its
editable install of mmshm works too); the release's own packages come first on
``sys.path`` and so win over the runner's. Packages that every release needs
live once in ``.venvs/sglang-common``. pip keeps its wheel cache, torch is
pinned with ``constraints.txt`` and never downloaded. A stamp file records
what was installed, so a second run reuses the environments (a few seconds).

The tests run with ``MMSHM_SGLANG_RELEASE=<version>`` in the environment; in
any other environment (the main dev virtualenv, without SGLang) they skip.

Exit status: 0 when every release passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VENVS = ROOT / ".venvs"
#: Module-level tests: the transport (TP broadcast, fan-out, a full /dev/shm),
#: then the DP-attention race (four gloo ranks, two attention-TP groups).
TESTS = [ROOT / "tests" / "integrations" / "test_sglang.py",
         ROOT / "tests" / "integrations" / "test_sglang_dp_attention.py"]

#: Packages every release imports (the issue's list, without those the runner's
#: environment already provides: numpy, packaging, pillow, msgspec, pydantic,
#: pyzmq, tqdm).
COMMON = [
    "orjson", "psutil", "pybase64", "requests", "starlette", "ipython", "aiohttp", "dill",
    "gguf", "partial-json-parser", "setproctitle", "einops", "loguru", "fastapi", "uvicorn",
    "uvloop", "sentencepiece==0.2.1", "compressed-tensors==0.18.0",
]
#: Per-release pins, from each wheel's metadata.
RELEASES: dict[str, list[str]] = {
    "0.5.9": ["transformers==4.57.1", "openai==2.6.1"],
    # transformers 5.6-5.12 break importing the runner's newer ``kernels``
    # (``LayerRepository`` wants a revision): their own pin, kernels<0.13
    "0.5.12": ["transformers==5.6.0", "openai==2.6.1", "kernels==0.12.3"],
    "0.5.15": ["transformers==5.12.1", "openai==2.6.1", "kernels==0.12.3"],
    "0.5.23": ["transformers==5.19.0", "openai==2.8.0", "apache-tvm-ffi==0.1.11"],
}


#: What a real server needs on top of a release's lean environment (the e2e
#: tests, tests/e2e/test_sglang_e2e.py), found by starting the server on CPU
#: until nothing was missing. Layered over ``sglang-<version>``.
SERVER: dict[str, list[str]] = {
    "0.5.9": ["jsonschema==4.26.0", "python-multipart==0.0.34",
              "decord2==3.4.0"],  # the Qwen-VL processor imports decord
    "0.5.23": ["jsonschema==4.26.0", "python-multipart==0.0.34", "soundfile==0.13.1"],
}
#: Installed ``--no-deps`` (xgrammar would pull in triton, 1 GB, never used:
#: ``--grammar-backend none``; 0.5.23 imports it for function calling).
SERVER_NO_DEPS: dict[str, list[str]] = {"0.5.9": [], "0.5.23": ["xgrammar==0.2.7"]}
#: Added to a release's server environment once it exists, under a stamp of
#: their own, so that adding one never rebuilds (``--clear``) an environment
#: a running server may be using: 0.5.23's Qwen-VL video path decodes with
#: torchcodec, else decord (torchcodec wants FFmpeg's shared libraries and a
#: build for this exact torch; decord2 bundles FFmpeg).
SERVER_ADD: dict[str, list[str]] = {"0.5.9": [], "0.5.23": ["decord2==3.4.0"]}
STUBS = ROOT / "tests" / "integrations" / "stubs"
#: Stub packages copied into every server environment (see :func:`_install_stubs`),
#: and cpu_stubs.py with the .pth that installs its post-import hooks at start-up
#: (SGLang's host KV pool without CUDA, for a PD decode instance).
STUB_PACKAGES = ("_anything.py", "triton", "torchvision", "sgl_kernel", "torchaudio",
                 "cpu_stubs.py", "zzz_cpu_stubs.pth")
#: One node (test_sglang_e2e.py), then two simulated nodes (--nnodes 2).
E2E_TESTS = [ROOT / "tests" / "e2e" / "test_sglang_e2e.py",
             ROOT / "tests" / "e2e" / "test_sglang_multinode_e2e.py"]
#: Real-server tests of one release only, after :data:`E2E_TESTS`: the model
#: matrix (LLaVA-NeXT, Qwen2.5-VL images and video, Qwen2-Audio) on 0.5.23,
#: a PD decode instance (--disaggregation-mode decode, one start), and data
#: parallelism (--dp-size 2, plain and under mmshm run: two starts).
E2E_TESTS_BY_RELEASE: dict[str, list[Path]] = {
    "0.5.23": [ROOT / "tests" / "e2e" / "test_matrix.py",
               ROOT / "tests" / "e2e" / "test_sglang_pd_e2e.py",
               ROOT / "tests" / "e2e" / "test_sglang_dp_e2e.py"],
}


def _site_packages(prefix: Path) -> Path:
    v = f"python{sys.version_info.major}.{sys.version_info.minor}"
    return prefix / "lib" / v / "site-packages"


def _pip(venv: Path, args: list[str], log) -> None:
    env = dict(os.environ)
    env["PIP_CONSTRAINT"] = str(ROOT / "constraints.txt")
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    cmd = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", *args]
    r = subprocess.run(cmd, check=False, env=env, stdout=log, stderr=subprocess.STDOUT)
    if r.returncode:
        raise SystemExit(f"pip failed in {venv} (see {log.name}): {' '.join(args)}")


def _make_venv(venv: Path, layers: list[Path], packages: list[str], no_deps: list[str],
               log) -> None:
    """Create ``venv`` (if its stamp is stale) with ``layers`` added as site
    directories after its own site-packages, then install ``packages`` (with
    dependencies) and ``no_deps`` (without)."""
    stamp = venv / "mmshm-stamp.json"
    want = {"layers": [str(p) for p in layers], "packages": packages, "no_deps": no_deps,
            "python": sys.version, "constraints": (ROOT / "constraints.txt").read_text()}
    digest = hashlib.sha256(json.dumps(want, sort_keys=True).encode()).hexdigest()
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


def setup(release: str, log) -> Path:
    base = Path(sysconfig.get_paths()["purelib"])
    common = VENVS / "sglang-common"
    _make_venv(common, [base], COMMON, [], log)
    venv = VENVS / f"sglang-{release}"
    _make_venv(venv, [_site_packages(common), base], RELEASES[release],
               [f"sglang=={release}"], log)
    return venv


def _install_stubs(venv: Path) -> None:
    """Copy the stub packages (triton, torchvision, sgl_kernel, torchaudio)
    and ``cpu_stubs``' start-up hooks (``zzz_cpu_stubs.pth``, read after
    ``zz_mmshm_layers.pth`` has put wrapt on the path) into a server
    environment, where no PYTHONPATH is needed (``mmshm run``
    sets its own), with distribution metadata for torchvision: transformers'
    Qwen2-VL processor insists on finding it (PyPI's build is CUDA-only:
    ``operator torchvision::nms does not exist``). torchaudio gets none:
    SGLang 0.5.23's audio loader only imports it (PyPI has no torchaudio for
    torch 2.13), and nothing should take it for a real one."""
    import shutil

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


def setup_server(release: str, log) -> Path:
    """``.venvs/sglang-<version>-server``: what ``python -m sglang.launch_server``
    needs on CPU, layered over the release's lean environment."""
    lean = setup(release, log)
    base = Path(sysconfig.get_paths()["purelib"])
    venv = VENVS / f"sglang-{release}-server"
    _make_venv(venv, [_site_packages(lean), _site_packages(VENVS / "sglang-common"), base],
               SERVER[release], SERVER_NO_DEPS[release], log)
    _add_packages(venv, SERVER_ADD.get(release, []), log)
    _install_stubs(venv)
    return venv


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


_SUMMARY = re.compile(r"^(?:=+ )?(\d+ (?:passed|failed|skipped|errors?|deselected)[^\n]*?)"
                      r" in ([0-9.]+)s", re.MULTILINE)


def run(release: str, pytest_args: list[str], setup_only: bool,
        e2e: bool = False) -> tuple[int, str, float, float]:
    """Module-level tests (``e2e=False``) or the real-server e2e tests of one
    release in its environment."""
    VENVS.mkdir(exist_ok=True)
    kind = "server" if e2e else "lean"
    log_path = VENVS / f"setup-{release}{'-server' if e2e else ''}.log"
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        venv = setup_server(release, log) if e2e else setup(release, log)
    t_setup = time.monotonic() - t0
    if setup_only:
        return 0, f"set up ({kind})", t_setup, 0.0
    env = dict(os.environ)
    env["MMSHM_SGLANG_RELEASE"] = release
    env.pop("PYTHONPATH", None)
    if e2e:
        env["MMSHM_E2E"] = "sglang"
    tests = [*E2E_TESTS, *E2E_TESTS_BY_RELEASE.get(release, [])] if e2e else TESTS
    cmd = [str(venv / "bin" / "python"), "-m", "pytest", "-p", "no:cacheprovider",
           "-p", "no:benchmark", *map(str, tests), "-q", "-rs", *pytest_args]
    t1 = time.monotonic()
    print(f"--- SGLang {release} ({'e2e' if e2e else 'module'}): {' '.join(cmd[1:])}",
          flush=True)
    proc = subprocess.run(cmd, check=False, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    sys.stdout.write(proc.stdout)
    m = None
    for m in _SUMMARY.finditer(proc.stdout):
        pass
    summary = m.group(1) if m else f"exit {proc.returncode}"
    return proc.returncode, summary, t_setup, time.monotonic() - t1


#: Releases whose real server the e2e tests start (about 10 minutes each on
#: two cores: start-ups dominate).
E2E_RELEASES = ("0.5.9", "0.5.23")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    pytest_args: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, pytest_args = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--release", action="append", choices=sorted(RELEASES),
                    help="release(s) to test (default: all)")
    ap.add_argument("--setup-only", action="store_true", help="build the venvs, run nothing")
    ap.add_argument("--no-e2e", action="store_true",
                    help="module-level tests only, no real server")
    ap.add_argument("--e2e-only", action="store_true",
                    help=f"the real-server e2e tests only (releases {', '.join(E2E_RELEASES)})")
    args = ap.parse_args(argv)
    releases = args.release or list(RELEASES)
    jobs = [] if args.e2e_only else [(rel, False) for rel in releases]
    if not args.no_e2e:
        jobs += [(rel, True) for rel in releases if rel in E2E_RELEASES]
    results = []
    for rel, e2e in jobs:
        label = f"{rel} e2e" if e2e else rel
        try:
            results.append((label, *run(rel, pytest_args, args.setup_only, e2e)))
        except SystemExit as exc:
            results.append((label, 1, f"setup failed: {exc}", 0.0, 0.0))
    print("\nSGLang releases:")
    failed = 0
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    for rel, rc, summary, t_setup, t_test in results:
        failed += rc != 0
        status = "ok" if rc == 0 else "FAILED"
        print(f"  {rel:11s} {status:6s} {summary}  (venv {t_setup:.0f}s, tests {t_test:.0f}s)")
        for n, key in re.findall(r"(\d+) (passed|failed|skipped|errors?)", summary):
            counts["failed" if key.startswith("error") else key] += int(n)
        if rc != 0 and not re.search(r"\d+ (failed|errors?)", summary):
            counts["failed"] += 1  # a release whose setup or run broke
    if not args.setup_only:
        print(f"sglang: {counts['passed']} passed, {counts['failed']} failed, "
              f"{counts['skipped']} skipped")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
