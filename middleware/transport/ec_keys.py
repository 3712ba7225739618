"""The key of an encoder output (EPD), as a consumer and an encoder compute it
alike: the namespace's weights fingerprint and the item's content key, for
any server's connector on :mod:`mmshm.transport.encoder_cache` (vLLM's:
:mod:`mmshm.integrations.vllm.epd`, which reads the server's own objects).

**The namespace** is what two instances must share for their outputs to be
interchangeable; its weights part is :func:`weights_fingerprint` (the HF
snapshot's commit where there is one, else a hash of the model directory's
config, index and weights files' names, sizes and mtimes, else the id as
typed), and other settings go in through :func:`short` (a short text or a
12-hex BLAKE3 of it).

**The item's key** (:func:`item_key`) is BLAKE3-256 over the namespace, the
adapter (LoRA: the output depends on it), the modality and either the
server's own content name of the item (vLLM's ``mm_hash``) or the item's
processed tensors: each tensor's dtype, shape and BLAKE3-128 digest
(:func:`tensor_digest`: the one mmshm's frontend computed while copying it
into shared memory, else computed here, its bytes and seconds counted).
Nothing here raises for an item that cannot be keyed: it gets None, and the
connector encodes it locally, counted.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections.abc import Mapping

import blake3
import torch

from mmshm.transport import sending

log = logging.getLogger("mmshm")

_KEY_DOMAIN = b"mmshm-vllm-ec-v2\0"
#: bytes of a tensor's digest in a key (BLAKE3-128, as mmshm's frontend computes it)
DIGEST_BYTES = 16
#: an HF cache snapshot directory: ``.../snapshots/<commit>``
_SNAPSHOT = re.compile(r"/snapshots/([0-9a-f]{40})(?:/|$)")


# -- the namespace ------------------------------------------------------------------------
def _snapshot_commit(model: str, revision: str | None) -> str | None:
    """The HF cache commit of ``model``: from a local path under
    ``snapshots/<commit>`` (symlinks resolved), or, for a hub id, from the
    local cache only (``try_to_load_from_cache``: no network)."""
    if os.path.isdir(model):
        m = _SNAPSHOT.search(os.path.realpath(model))
        return m.group(1) if m else None
    try:
        from huggingface_hub import try_to_load_from_cache

        path = try_to_load_from_cache(model, "config.json", revision=revision)
    except Exception:  # noqa: BLE001 - no hub library, a malformed id: no commit
        return None
    m = _SNAPSHOT.search(os.path.realpath(path)) if isinstance(path, str) else None
    return m.group(1) if m else None


def _files_fingerprint(directory: str) -> str:
    """BLAKE3 of a local model directory's ``config.json`` (its vision config
    and quantization config among the rest), its weights index, and each
    weights file's name, size and mtime (ns). Changed weights (files
    rewritten in place, a rolling update) change it; the same directory
    under two spellings (a symlink, a relative path) gives the same one.
    Hashing the weights' bytes would read gigabytes at start-up."""
    h = blake3.blake3()
    d = os.path.realpath(directory)
    for name in ("config.json", "model.safetensors.index.json",
                 "pytorch_model.bin.index.json", "preprocessor_config.json"):
        try:
            with open(os.path.join(d, name), "rb") as f:
                h.update(f"F{name}\0".encode() + f.read())
        except OSError:
            h.update(f"-{name}\0".encode())
    try:
        names = sorted(n for n in os.listdir(d) if n.endswith((".safetensors", ".bin", ".pt")))
    except OSError:
        names = []
    for n in names:
        try:
            st = os.stat(os.path.join(d, n))
        except OSError:
            continue
        h.update(f"W{n}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    return "files:" + h.hexdigest()[:16]


def weights_fingerprint(model: str, revision: str | None = None) -> str:
    """The weights of ``model`` (a hub id or a local path) at ``revision``:
    ``snapshot:<commit>`` where the model is an HF cache snapshot (a hub id
    cached here, or a path under ``snapshots/<commit>``: the two spellings
    meet), else ``files:<16 hex>`` (:func:`_files_fingerprint`) for a local
    directory, else ``id:<model>@<revision>`` (nothing local to read: the id
    as typed). Reads no network; raises nothing."""
    commit = _snapshot_commit(model, revision)
    if commit:
        return f"snapshot:{commit}"
    if os.path.isdir(model):
        return _files_fingerprint(model)
    return f"id:{model}@{revision or 'main'}"


def short(value) -> str:
    """A setting as a namespace part: ``-`` when unset, its JSON (keys
    sorted) up to 24 characters, else ``h:`` and 12 hex digits of its BLAKE3."""
    if value in (None, "", {}, []):
        return "-"
    try:
        text = json.dumps(value, sort_keys=True, default=repr)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 24 else "h:" + blake3.blake3(text.encode()).hexdigest()[:12]


def setting(extra: Mapping, key: str, default, kind, where: str = "ec_connector_extra_config"):
    """``extra[key]`` as ``kind`` (a number at least 0), else ``default`` with
    a WARNING naming ``where``, the key, the value and the default: a bad
    setting never stops the server (as a bad ``MMSHM_*`` value)."""
    raw = extra.get(key, default)
    try:
        value = kind(raw)
        if not value >= 0:  # NaN and negatives
            raise ValueError
        return value
    except (TypeError, ValueError, OverflowError):  # OverflowError: int(inf)
        log.warning("mmshm: %s.%s=%r is not a number at least 0: using %r; fix the setting",
                    where, key, raw, default)
        return default


# -- the key ------------------------------------------------------------------------------
def tensor_digest(t: torch.Tensor, counts: dict | None = None) -> bytes:
    """BLAKE3-128 (16 bytes) of ``t``'s bytes (any dtype and shape, C order;
    a device tensor is read on the CPU): the digest mmshm's frontend computed
    while copying it into shared memory when there is one (a materialized
    view of that segment), else hashed here (its bytes added to
    ``counts["hashed_bytes"]`` and the seconds, float, to
    ``counts["hash_seconds"]``)."""
    seg = sending.SEGMENTS.get(t)
    if seg is not None and len(seg[1].hash) >= DIGEST_BYTES:
        return bytes(seg[1].hash[:DIGEST_BYTES])
    t0 = time.perf_counter()
    x = t.detach()
    if x.device.type != "cpu":
        x = x.cpu()
    x = x.resolve_conj().resolve_neg().contiguous()
    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    if x.numel():
        h.update(x.reshape(-1).view(torch.uint8).numpy())
    if counts is not None:
        counts["hashed_bytes"] += x.numel() * x.element_size()
        counts["hash_seconds"] += time.perf_counter() - t0
    return h.digest(DIGEST_BYTES)


def _feed(h, value, counts) -> None:
    if isinstance(value, torch.Tensor):
        h.update(f"T{value.dtype}{tuple(value.shape)}\0".encode())
        h.update(tensor_digest(value, counts))
    elif isinstance(value, dict):
        h.update(f"D{len(value)}\0".encode())
        for k in sorted(value, key=str):
            h.update(f"K{k}\0".encode())
            _feed(h, value[k], counts)
    elif isinstance(value, (list, tuple)):
        h.update(f"L{len(value)}\0".encode())
        for v in value:
            _feed(h, v, counts)
    elif value is None or isinstance(value, (bool, int, float, str, bytes)):
        h.update(f"V{type(value).__name__}:{value!r}\0".encode())
    else:
        raise TypeError(f"cannot key a {type(value).__name__} by content")


def item_key(namespace: str, adapter: str, modality: str, *, name: str | None = None,
             data=None, counts: dict | None = None, label: str = "?") -> bytes | None:
    """The key of one item (32 bytes; module docstring): by the server's
    content ``name`` of it when given (vLLM's ``mm_hash``), else by its
    processed ``data`` (a mapping of field name to tensors, lists, scalars,
    or an object whose ``get_data()`` returns one: vLLM's
    ``MultiModalKwargsItem``), each tensor by :func:`tensor_digest`
    (``counts``: where the bytes hashed here are added). None where it
    cannot be keyed: an empty ``name`` with no ``data``, a value of a type
    that cannot be hashed (said at DEBUG, naming ``label``). Raises nothing."""
    h = blake3.blake3()
    h.update(_KEY_DOMAIN + f"{namespace}\0{adapter}\0{modality}\0".encode())
    if name is not None:
        if not name:
            return None
        h.update(b"I" + str(name).encode())
        return h.digest(32)
    if data is None:
        return None
    try:
        fields = data.get_data() if hasattr(data, "get_data") else dict(data)
        h.update(b"P")
        _feed(h, fields, counts)
    except (TypeError, ValueError) as exc:
        log.debug("mmshm: cannot key item %s by content: %s", label, exc)
        return None
    return h.digest(32)
