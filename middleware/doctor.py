"""``mmshm doctor``: is this host's segment directory fit for the load?"""

from __future__ import annotations

import os

import msgspec

from . import config, reaper
from .segment import segment_dir

MiB = 1 << 20
# One 720p photo through Qwen2-VL's processor: pixel_values [4784, 1176] float32.
QWEN2VL_720P_BYTES = 4784 * 1176 * 4


class Problem(msgspec.Struct):
    problem: str
    fix: str


class DoctorReport(msgspec.Struct):
    """Findings of :func:`diagnose`. Sizes are in bytes."""

    directory: str
    fs_type: str
    fs_size_bytes: int
    fs_free_bytes: int
    reserve_bytes: int
    expected_bytes: int
    segments: int
    segment_bytes: int
    orphans: int
    orphan_bytes: int
    problems: list[Problem]

    @property
    def ok(self) -> bool:
        return not self.problems


def _fs_type(path: str) -> str:
    best, kind = "", "unknown"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3 and path.startswith(parts[1]) and len(parts[1]) > len(best):
                    best, kind = parts[1], parts[2]
    except OSError:
        pass
    return kind


def _size_fix(need: int) -> str:
    gib = max(1, -(-need // (1 << 30)))
    return (f"give the container at least {gib} GiB of shared memory: docker run "
            f"--shm-size={gib}g (or --ipc=host); on Kubernetes mount an emptyDir with "
            f"medium: Memory and sizeLimit: {gib}Gi at /dev/shm; or point MMSHM_DIR at a "
            f"larger tmpfs")


def diagnose(directory: str | None = None, expected_bytes: int | None = None) -> DoctorReport:
    """Inspect the segment directory.

    Args:
        directory: segment directory (default ``MMSHM_DIR``).
        expected_bytes: multimodal bytes expected in flight at once (default:
            32 Qwen2-VL 720p images, about 720 MB).
    """
    d = segment_dir(directory)
    expected = 32 * QWEN2VL_720P_BYTES if expected_bytes is None else expected_bytes
    problems: list[Problem] = []
    try:
        st = os.statvfs(d)
    except OSError as exc:
        return DoctorReport(d, "missing", 0, 0, 0, expected, 0, 0, 0, 0, [Problem(
            f"the segment directory {d} cannot be read: {exc.strerror}",
            "create it or set MMSHM_DIR to a tmpfs directory (default /dev/shm)")])
    size = st.f_blocks * st.f_frsize
    free = st.f_bavail * st.f_frsize
    reserve = config.min_free_bytes(size)
    infos = reaper.scan(d)
    orphans = [i for i in infos if i.orphan]
    fs = _fs_type(os.path.realpath(d))
    if fs not in ("tmpfs", "shm", "ramfs", "unknown"):
        problems.append(Problem(
            f"{d} is on {fs}, not tmpfs: segments would be written to disk",
            "set MMSHM_DIR to a tmpfs such as /dev/shm"))
    if orphans:
        problems.append(Problem(
            f"{len(orphans)} orphaned segment(s) hold {sum(i.bytes for i in orphans)} bytes "
            f"(left by killed processes, or references in flight past "
            f"MMSHM_IN_FLIGHT_GRACE_S)",
            "run `mmshm gc` (servers under mmshm also reclaim them on start-up)"))
    if size < reserve + expected:
        problems.append(Problem(
            f"{d} is only {size // MiB} MiB: NCCL's reserve ({reserve // MiB} MiB) plus the "
            f"expected multimodal load ({expected // MiB} MiB) do not fit, so most tensors "
            f"will travel inline (slow) instead of through shared memory",
            _size_fix(reserve + expected)))
    elif free + sum(i.bytes for i in orphans) < reserve + expected:
        problems.append(Problem(
            f"only {free // MiB} MiB free in {d} (of {size // MiB} MiB): below the reserve "
            f"({reserve // MiB} MiB) plus the expected load ({expected // MiB} MiB)",
            "find what fills it (ls -la " + d + "), run `mmshm gc`, or " + _size_fix(
                reserve + expected)))
    return DoctorReport(
        directory=d, fs_type=fs, fs_size_bytes=size, fs_free_bytes=free, reserve_bytes=reserve,
        expected_bytes=expected, segments=len(infos), segment_bytes=sum(i.bytes for i in infos),
        orphans=len(orphans), orphan_bytes=sum(i.bytes for i in orphans), problems=problems)
