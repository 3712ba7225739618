"""mmshm's segment files: list them, read their header, see who maps them.

Segment files are named ``mmshm-<creator pid>-<16 hex>``
(:data:`mmshm.segments.segfile.PREFIX`, :data:`~mmshm.segments.segfile.NAME_RE`)
in the segment directory (``MMSHM_DIR``; the conftest gives every test a
private one under /dev/shm).
"""

from __future__ import annotations

import os

#: The host's shared-memory tmpfs.
SHM_ROOT = "/dev/shm"


def seg_dir() -> str:
    """The segment directory of this process's configuration (``MMSHM_DIR``)."""
    from mmshm import config

    return config.get().dir


def segment_files(directory: str | os.PathLike | None = None) -> list[str]:
    """Sorted names of the entries (files, links, anything) in ``directory``
    (default :func:`seg_dir`) that start with mmshm's segment prefix; [] when
    the directory does not exist."""
    from mmshm.segments.segfile import PREFIX

    d = seg_dir() if directory is None else directory
    try:
        return sorted(n for n in os.listdir(d) if n.startswith(PREFIX))
    except FileNotFoundError:
        return []


def pid_of(name: str) -> int | None:
    """The creator pid in a well-formed segment name, else None."""
    from mmshm.segments.segfile import NAME_RE

    m = NAME_RE.match(name)
    return None if m is None else int(m.group(1))


def created_by(pids, directory: str = SHM_ROOT) -> set[str]:
    """The segment files in ``directory`` whose creator is one of ``pids``."""
    return {n for n in segment_files(directory) if pid_of(n) in pids}


def header(name: str, directory: str | None = None) -> tuple:
    """The decoded header of segment ``name``: (magic, version, state,
    payload size, refcount, creator pid, created ns, reserved)."""
    from mmshm.segments import segfile

    path = os.path.join(directory or seg_dir(), name)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        return segfile.read_header(fd, path)
    finally:
        os.close(fd)  # OFD locks: closing this descriptor drops nobody's lock


def refcount(name: str, directory: str | None = None) -> int:
    """The reference count stored in the segment's header."""
    return header(name, directory)[4]


def mapped_shm_names(root: str = SHM_ROOT, pgid: int | None = None) -> set[str]:
    """Names of files under ``root`` that some live process maps or holds
    open (with ``pgid``: a process of that process group). The product's
    :func:`mmshm.bench.serve.servers.mapped_shm_names` (its servers' leak
    clean-up uses it), imported when called (``mmshm.bench`` loads torch)."""
    from mmshm.bench.serve.servers import mapped_shm_names as product_mapped_shm_names

    return product_mapped_shm_names(root, pgid)


def one_segment_per_tensor(monkeypatch=None) -> None:
    """Make the walker give each tensor its own segment, as before a request's
    tensors were grouped in one (``mmshm.transport.wrapping.to_shm_group``), for
    tests whose figures are per segment (counts, references, descriptors);
    grouping itself: tests/test_group_segments.py. With ``monkeypatch`` undone
    after the test; without (a child process), for good."""
    from mmshm.transport import wrapping

    def per_tensor(ts, hashes=None, directory=None, hash_now=None):
        return [wrapping.to_shm(t, directory=directory) for t in ts]

    if monkeypatch is None:
        wrapping.to_shm_group = per_tensor
    else:
        monkeypatch.setattr(wrapping, "to_shm_group", per_tensor)
