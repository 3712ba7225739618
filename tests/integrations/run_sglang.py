#!/usr/bin/env python3
"""Run the SGLang integration tests against the real code of each supported
release, one virtual environment per release.

Usage::

    python tests/integrations/run_sglang.py [--release 0.5.23 ...] [--setup-only]
        [-- PYTEST ARGS]

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
TESTS = ROOT / "tests" / "integrations" / "test_sglang.py"

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
    "0.5.12": ["transformers==5.6.0", "openai==2.6.1"],
    "0.5.15": ["transformers==5.12.1", "openai==2.6.1"],
    "0.5.23": ["transformers==5.19.0", "openai==2.8.0", "apache-tvm-ffi==0.1.11"],
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


_SUMMARY = re.compile(r"^(?:=+ )?(\d+ (?:passed|failed|skipped|errors?|deselected)[^\n]*?)"
                      r" in ([0-9.]+)s", re.MULTILINE)


def run(release: str, pytest_args: list[str], setup_only: bool) -> tuple[int, str, float, float]:
    VENVS.mkdir(exist_ok=True)
    log_path = VENVS / f"setup-{release}.log"
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        venv = setup(release, log)
    t_setup = time.monotonic() - t0
    if setup_only:
        return 0, "set up", t_setup, 0.0
    env = dict(os.environ)
    env["MMSHM_SGLANG_RELEASE"] = release
    env.pop("PYTHONPATH", None)
    cmd = [str(venv / "bin" / "python"), "-m", "pytest", "-p", "no:cacheprovider",
           "-p", "no:benchmark", str(TESTS), "-q", *pytest_args]
    t1 = time.monotonic()
    print(f"--- SGLang {release}: {' '.join(cmd[1:])}", flush=True)
    proc = subprocess.run(cmd, check=False, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    sys.stdout.write(proc.stdout)
    m = None
    for m in _SUMMARY.finditer(proc.stdout):
        pass
    summary = m.group(1) if m else f"exit {proc.returncode}"
    return proc.returncode, summary, t_setup, time.monotonic() - t1


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
    args = ap.parse_args(argv)
    releases = args.release or list(RELEASES)
    results = []
    for rel in releases:
        try:
            results.append((rel, *run(rel, pytest_args, args.setup_only)))
        except SystemExit as exc:
            results.append((rel, 1, f"setup failed: {exc}", 0.0, 0.0))
    print("\nSGLang releases:")
    failed = 0
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    for rel, rc, summary, t_setup, t_test in results:
        failed += rc != 0
        status = "ok" if rc == 0 else "FAILED"
        print(f"  {rel:7s} {status:6s} {summary}  (venv {t_setup:.0f}s, tests {t_test:.0f}s)")
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
