"""Encoder disaggregation (EPD) on vLLM 0.32-0.33: ``MmshmECConnector``, vLLM's EC
connector on mmshm's content-keyed encoder cache (:mod:`mmshm.transport.encoder_cache`;
docs/vllm.md, "Encoder disaggregation").

vLLM keeps one file per connector and imports it only when a config names it:
this module is that file. It imports vLLM at the top, so nothing in mmshm
imports it (the package ``mmshm.integrations.vllm`` never does); vLLM's
``ECConnectorFactory`` loads it from ``ec_connector_module_path``::

    --ec-transfer-config '{"ec_connector": "MmshmECConnector",
      "ec_connector_module_path": "mmshm.integrations.vllm.epd",
      "ec_role": "ec_consumer", "ec_connector_extra_config": {"keep_s": 60}}'

with or without ``mmshm run`` (under it, the frontend hashes each item's
tensors while it copies them into shared memory, so the EngineCore's key
costs no pass over the pixels).

**The key** (:func:`item_key`) cannot give another answer: it is BLAKE3-256
over the namespace (:func:`ec_namespace`: a fingerprint of the weights, the
dtype, the tower's quantization, ``--revision``, ``--hf-overrides``, the
server's ``--mm-processor-kwargs`` and how items are keyed), the LoRA adapter
when vLLM's tower/connector LoRA is on (``enable_tower_connector_lora``: vLLM
keys its own encoder cache by ``<lora_name>:<mm_hash>`` then), the modality,
and the item: vLLM's ``mm_hash`` where it is a content hash (this instance's
processor cache or prefix caching on: ``_process_mm_uuids`` hashes the raw
item, the model and the processor kwargs in the API server; a request's own
``uuid`` is trusted as vLLM trusts it), else each processed tensor's dtype,
shape and BLAKE3-128 digest (the one mmshm's frontend computed under ``mmshm
run``, else computed here). An item that cannot be keyed (the adapter
unknown, a withheld stand-in of a decode instance, no processed data) is
neither loaded nor published: encoded locally, counted (``unkeyed``).

**Failures per request.** A held entry whose file was removed or truncated by
a third party is found out before vLLM decides to load it
(``has_cache_item``): the item is encoded locally (``segment_gone``). A load
that fails in a worker anyway (any :class:`EncoderCacheError` or OS error)
never raises into the model runner: the worker fills that step's slot with
zeros, reports the request in its worker metadata, and the scheduler fails
it through ``take_unavailable_requests`` (vLLM's path for one request:
``FINISHED_ERROR``, "re-issuing the request re-runs the encode"); the next
request is served, and later requests naming that item are failed too while
vLLM's encoder cache may still hold the zeros (until vLLM asks the connector
for the item again, which it does only once it no longer holds it).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import time
from collections import OrderedDict

import blake3
import torch
from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorBase,
    ECConnectorMetadata,
    ECConnectorRole,
    ECConnectorWorkerMetadata,
)
from vllm.distributed.ec_transfer.ec_connector.metrics import (
    ECConnectorPromMetrics,
    ECConnectorStats,
)

from mmshm.errors import MmshmError
from mmshm.hooks.instrumentor import Role
from mmshm.segments import arena
from mmshm.segments.segfile import HEADER_SIZE
from mmshm.transport import sending
from mmshm.transport.encoder_cache import (
    DEFAULT_KEEP_S,
    EncoderCache,
    EncoderCacheError,
    count_fallback,
)

from . import pd
from .server import KEY_MM_HASH, key_mode, log, me

#: ``ec_connector`` and ``ec_connector_module_path`` of the connector.
EC_CONNECTOR = "MmshmECConnector"
EC_MODULE = __name__
#: keys of ``ec_connector_extra_config`` the connector reads
EC_EXTRA_KEYS = ("keep_s", "max_bytes", "namespace", "directory")
#: counters of :class:`MmshmECConnectorStats` (vLLM's connector stats, summed
#: over workers and steps): ``loads``/``loaded_bytes``/``load_failed``
#: (worker), ``saves``/``saved_bytes`` (worker), ``hits`` and
#: ``fallback_<reason>`` (scheduler), ``transfer_seconds`` (worker, summed),
#: ``hashed_bytes``/``hash_seconds`` (bytes the EngineCore hashed itself for a
#: key, and the seconds it took: 0 where vLLM's mm_hash or mmshm's frontend
#: digest is the key)
EC_STAT_KEYS = ("hits", "loads", "loaded_bytes", "load_failed", "saves", "saved_bytes",
                "transfer_seconds", "hashed_bytes", "hash_seconds")
#: how many request ids / item names the connector remembers (bounded maps)
_MAX_REMEMBERED = 4096
_KEY_DOMAIN = b"mmshm-vllm-ec-v2\0"
_DIGEST_BYTES = 16
#: an HF cache snapshot directory: ``.../snapshots/<commit>``
_SNAPSHOT = re.compile(r"/snapshots/([0-9a-f]{40})(?:/|$)")


def _new_counts() -> dict:
    return dict.fromkeys(EC_STAT_KEYS, 0)




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


def weights_fingerprint(model_config) -> str:
    """``snapshot:<commit>`` where the model is an HF cache snapshot (a hub
    id cached here, or a path under ``snapshots/<commit>``: the two
    spellings meet), else ``files:<16 hex>`` (:func:`_files_fingerprint`)
    for a local directory, else ``id:<model>@<revision>`` (nothing local to
    read: the id as typed)."""
    model = str(getattr(model_config, "model", "") or "")
    revision = getattr(model_config, "revision", None)
    commit = _snapshot_commit(model, revision)
    if commit:
        return f"snapshot:{commit}"
    if os.path.isdir(model):
        return _files_fingerprint(model)
    return f"id:{model}@{revision or 'main'}"


def _short(value) -> str:
    if value in (None, "", {}, []):
        return "-"
    try:
        text = json.dumps(value, sort_keys=True, default=repr)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 24 else "h:" + blake3.blake3(text.encode()).hexdigest()[:12]


def ec_namespace(vllm_config, extra: dict) -> str:
    """What two instances must share for their encoder outputs to be
    interchangeable, printed on the connector's "on:" line:
    ``extra["namespace"]`` when given (the user's word), else
    ``weights=<fingerprint> dtype=<dtype> quant=<quantization> rev=<revision>
    hf_overrides=<...> mm_kwargs=<...> key=<mode>`` (:func:`weights_fingerprint`,
    :func:`key_mode`; the key mode is part of it, as instances keying
    differently never meet)."""
    ns = extra.get("namespace")
    if ns:
        return str(ns)
    mc = vllm_config.model_config
    hf = getattr(mc, "hf_config", None)
    quant = getattr(mc, "quantization", None) or (
        getattr(hf, "quantization_config", None) if hf is not None else None)
    mm = getattr(mc, "multimodal_config", None)
    parts = {
        "weights": weights_fingerprint(mc),
        "dtype": str(getattr(mc, "dtype", "")).removeprefix("torch."),
        "quant": _short(quant),
        "rev": getattr(mc, "revision", None) or "-",
        "hf_overrides": _short(getattr(mc, "hf_overrides", None)),
        "mm_kwargs": _short(getattr(mm, "mm_processor_kwargs", None)),
        "key": key_mode(vllm_config),
    }
    return " ".join(f"{k}={v}" for k, v in parts.items())


# -- the key ------------------------------------------------------------------------------
def tower_lora_on(vllm_config) -> bool:
    """vLLM's ``enable_tower_connector_lora`` (``--enable-tower-connector-lora``)."""
    return bool(getattr(getattr(vllm_config, "lora_config", None),
                        "enable_tower_connector_lora", False))


def adapter_of(request, tower_lora: bool) -> str | None:
    """What the encoder output depends on besides the item: ``""`` when
    tower LoRA is off or the request has no adapter; the adapter's name and
    path when it has one; None when tower LoRA is on and the adapter cannot
    be read (the item is not keyed)."""
    if not tower_lora:
        return ""
    if not hasattr(request, "lora_request"):
        return None
    lora = request.lora_request
    if lora is None:
        return ""
    name = getattr(lora, "lora_name", None)
    if not name:
        return None
    return f"{name}\0{getattr(lora, 'lora_path', '') or ''}"


def tensor_digest(t: torch.Tensor, counts: dict | None = None) -> bytes:
    """BLAKE3-128 of ``t``'s bytes (C order): the digest mmshm's frontend
    computed while copying it into shared memory when there is one (a
    materialized view of that segment), else hashed here (added to
    ``counts["hashed_bytes"]`` and ``counts["hash_seconds"]``)."""
    seg = sending.SEGMENTS.get(t)
    if seg is not None and len(seg[1].hash) >= _DIGEST_BYTES:
        return bytes(seg[1].hash[:_DIGEST_BYTES])
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
    return h.digest(_DIGEST_BYTES)


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


def item_key(feature, namespace: str, adapter: str, mode: str,
             counts: dict | None = None) -> bytes | None:
    """The key of one ``MultiModalFeatureSpec`` (32 bytes; see the module
    docstring): ``mode`` :data:`KEY_MM_HASH` keys by its ``mm_hash`` (else
    its identifier without vLLM's ``<lora>:`` prefix), :data:`KEY_PIXELS`
    by its processed tensors (``feature.data``: ``pixel_values``,
    ``image_grid_thw``...). None where it cannot be keyed: a withheld
    stand-in (:func:`mmshm.integrations.vllm.pd.withheld_in`), no data in
    pixels mode, a value of a type that cannot be hashed.
    Raises nothing."""
    if pd.withheld_in(feature):
        return None
    h = blake3.blake3()
    h.update(_KEY_DOMAIN + f"{namespace}\0{adapter}\0{getattr(feature, 'modality', '')}\0"
             .encode())
    if mode == KEY_MM_HASH:
        name = getattr(feature, "mm_hash", None) or getattr(feature, "identifier", "")
        if not name:
            return None
        h.update(b"I" + str(name).encode())
        return h.digest(32)
    data = getattr(feature, "data", None)
    if data is None:
        return None
    try:
        fields = data.get_data() if hasattr(data, "get_data") else dict(data)
        h.update(b"P")
        _feed(h, fields, counts)
    except (TypeError, ValueError) as exc:
        log.debug("mmshm: cannot key item %s by content: %s",
                  getattr(feature, "identifier", "?"), exc)
        return None
    return h.digest(32)


def intact(entry) -> bool:
    """Whether a held entry's file is still loadable by name: the name
    still links to the inode this process holds, at its full size (a third
    party's ``rm``, ``truncate`` or replacement says no). Two syscalls."""
    seg = getattr(entry, "_seg", None)
    if seg is None:
        return False
    try:
        held, named = os.fstat(seg.fd), os.stat(seg.path)
    except (OSError, AttributeError, TypeError):
        return False
    return ((held.st_dev, held.st_ino) == (named.st_dev, named.st_ino)
            and named.st_size >= HEADER_SIZE + entry.nbytes)


# -- what crosses between the scheduler and the workers -----------------------------------
@dataclasses.dataclass
class MmshmECConnectorMetadata(ECConnectorMetadata):
    """Scheduler -> workers, one per step. ``loads``: (request id,
    ``mm_hash``, :class:`~mmshm.transport.encoder_cache.EntryHandle`) of
    the items to load this step; ``keys``: ``mm_hash`` -> content key of
    the items a producer may have to publish (sent once per request)."""

    loads: list = dataclasses.field(default_factory=list)
    keys: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class MmshmECWorkerMetadata(ECConnectorWorkerMetadata):
    """Worker -> scheduler, one per step: the counts of :data:`EC_STAT_KEYS`
    (summed over TP ranks) and ``failed``: ``{request id: mm_hash}`` of the
    loads that failed (united over TP ranks)."""

    counts: dict = dataclasses.field(default_factory=_new_counts)
    failed: dict = dataclasses.field(default_factory=dict)

    def aggregate(self, other):
        out = MmshmECWorkerMetadata(dict(self.counts), {**self.failed,
                                                        **getattr(other, "failed", {})})
        for k, v in other.counts.items():
            out.counts[k] = out.counts.get(k, 0) + v
        return out


@dataclasses.dataclass
class MmshmECConnectorStats(ECConnectorStats):
    """vLLM's connector stats: ``data`` holds the counts of
    :data:`EC_STAT_KEYS` and ``fallback_<reason>`` since the last report;
    the frontend logs them ("EC Transfer metrics: ...") and feeds them to
    :class:`MmshmECPromMetrics`."""

    def reset(self):
        self.data = {}

    def aggregate(self, other):
        out = MmshmECConnectorStats(data=dict(self.data))
        for k, v in (other.data or {}).items():
            out.data[k] = out.data.get(k, 0) + v
        return out

    def reduce(self):
        return {k: (round(v, 6) if isinstance(v, float) else v)
                for k, v in sorted(self.data.items()) if v}

    def is_empty(self):
        return not any(self.data.values())


class MmshmECPromMetrics(ECConnectorPromMetrics):
    """vLLM's connector metrics on the server's own ``/metrics``:
    ``vllm:mmshm_ec_loads``, ``vllm:mmshm_ec_saves``,
    ``vllm:mmshm_ec_bytes{direction}``, ``vllm:mmshm_ec_fallbacks{reason}``
    (counters, with vLLM's per-engine labels). mmshm's own families
    (``mmshm_epd_*``) are counted where the events happen (EngineCore,
    workers) and merged into ``/metrics`` under ``mmshm run``."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        c = self._counter_cls
        self._loads = c(name="vllm:mmshm_ec_loads", labelnames=labelnames,
                        documentation="Encoder outputs loaded through mmshm (per holder).")
        self._saves = c(name="vllm:mmshm_ec_saves", labelnames=labelnames,
                        documentation="Encoder outputs published through mmshm.")
        self._bytes = c(name="vllm:mmshm_ec_bytes", labelnames=[*labelnames, "direction"],
                        documentation="Bytes of encoder outputs saved or loaded by mmshm.")
        self._fallbacks = c(name="vllm:mmshm_ec_fallbacks", labelnames=[*labelnames, "reason"],
                            documentation="Items encoded locally (or not published), "
                                          "by reason.")
        self._values = dict(per_engine_labelvalues)

    def observe(self, transfer_stats_data, engine_idx: int = 0):
        values = self._values.get(engine_idx)
        if values is None or not transfer_stats_data:
            return
        d = transfer_stats_data
        if d.get("loads"):
            self._loads.labels(*values).inc(d["loads"])
        if d.get("saves"):
            self._saves.labels(*values).inc(d["saves"])
        for direction in ("loaded", "saved"):
            if d.get(f"{direction}_bytes"):
                self._bytes.labels(*values, direction).inc(d[f"{direction}_bytes"])
        for k, v in d.items():
            if k.startswith("fallback_") and v:
                self._fallbacks.labels(*values, k.removeprefix("fallback_")).inc(v)


# -- the connector ------------------------------------------------------------------------
def _setting(extra: dict, key: str, default, kind):
    """``ec_connector_extra_config[key]`` as ``kind`` (a number at least 0),
    else ``default`` with a WARNING naming the key, the value and the default:
    a bad setting never stops the server (as a bad ``MMSHM_*`` value)."""
    raw = extra.get(key, default)
    try:
        value = kind(raw)
        if not value >= 0:  # NaN and negatives
            raise ValueError
        return value
    except (TypeError, ValueError):
        log.warning("mmshm: ec_connector_extra_config.%s=%r is not a number at least 0: using "
                    "%r; fix the setting", key, raw, default)
        return default


class MmshmECConnector(ECConnectorBase):
    """vLLM's EC connector on mmshm's content-keyed encoder cache (see the
    module docstring). Roles ``ec_producer`` (encoder instance),
    ``ec_consumer`` (prefill or PD instance), ``ec_both``.

    ``ec_connector_extra_config``: ``keep_s`` (seconds a producer keeps an
    entry after its last save, default 60), ``max_bytes`` (the producer's
    cap on the bytes of its published entries, oldest evicted first; an
    output above it is not published, ``over_budget``; default 0: only the
    core's budget), ``namespace`` (what must match between instances,
    default :func:`ec_namespace`), ``directory`` (the segment directory,
    default ``MMSHM_DIR``).

    Scheduler side (EngineCore): ``ensure_cache_available`` keys each item
    of a request once (:func:`item_key`) and, on a consumer, looks the key
    up and holds the entry (one reference, until the item's encoder input
    is freed or the request finishes); a miss is counted by reason and the
    item is encoded here. ``has_cache_item`` answers from what it holds and
    is still intact (:func:`intact`), never from vLLM's item names.
    ``take_unavailable_requests`` returns the requests whose load failed in
    a worker (vLLM fails them).

    Worker side: ``start_load_caches`` maps each held entry zero-copy (a CPU
    view holding the worker's own reference, given back when vLLM drops it;
    on a device copied with :func:`mmshm.segments.arena.to_device`, the
    view's reference given back once the copy is done); a load that fails
    is reported, never raised. ``save_caches`` (producer, TP rank 0)
    publishes the encoder output under its key.
    """

    def __init__(self, vllm_config, role):
        super().__init__(vllm_config=vllm_config, role=role)
        tc = vllm_config.ec_transfer_config
        extra = dict(getattr(tc, "ec_connector_extra_config", None) or {})
        unknown = set(extra) - set(EC_EXTRA_KEYS)
        if unknown:
            log.warning("mmshm: MmshmECConnector ignores ec_connector_extra_config keys %s "
                        "(it reads %s)", sorted(unknown), list(EC_EXTRA_KEYS))
        self._mode = key_mode(vllm_config)
        self._namespace = ec_namespace(vllm_config, extra)
        self._tower_lora = tower_lora_on(vllm_config)
        self._directory = extra.get("directory")
        self._store = EncoderCache(self._directory, server="vllm",
                                   keep_s=_setting(extra, "keep_s", DEFAULT_KEEP_S, float),
                                   max_bytes=_setting(extra, "max_bytes", 0, int),
                                   namespace=self._namespace)
        dtype = getattr(vllm_config.model_config, "dtype", None)
        #: what a loaded output must be: the model's dtype, the measured width
        #: per modality where vLLM measured it (an EC producer's config)
        self._dtype = dtype if isinstance(dtype, torch.dtype) else None
        self._widths = dict(getattr(tc, "mm_encoder_output_widths", None) or {})
        self._counts = _new_counts()
        # scheduler side
        self._req_keys: dict[str, list] = {}           # req id -> key per feature
        self._held: dict[tuple[str, int], object] = {}  # (req id, index) -> Entry
        self._by_id: dict[str, tuple[str, int]] = {}    # mm identifier -> (req id, index)
        self._looked: set[tuple[str, int]] = set()      # looked up once per request item
        self._loads: list = []
        self._keys_out: dict[str, bytes] = {}
        self._unavailable: set[str] = set()             # failed in a worker: vLLM fails them
        self._poisoned: OrderedDict[str, str] = OrderedDict()  # identifier -> request
        # worker side
        self._keys: OrderedDict[str, bytes] = OrderedDict()
        self._failed: dict[str, str] = {}
        self._tp_rank0: bool | None = None
        self._say_line(tc, role)

    def _say_line(self, tc, role) -> None:
        side = "scheduler" if role == ECConnectorRole.SCHEDULER else "worker"
        what = {"ec_producer": "published", "ec_consumer": "loaded",
                "ec_both": "published and loaded"}.get(tc.ec_role, "?")
        line = (f"encoder outputs {what} through shared memory ({tc.ec_role}), keyed by "
                f"content{' and LoRA adapter' if self._tower_lora else ''}; "
                f"{self._store.describe()} "
                f"(compare both instances' lines: they meet only on one namespace and one "
                f"directory of one node)")
        try:
            me().say(Role(f"EC connector ({side})", [line]))
        except Exception:  # noqa: BLE001 - no instrumentor: the line anyway
            log.info("mmshm: MmshmECConnector (%s): on: %s", side, line)

    # -- scheduler side ---------------------------------------------------------------
    def _refuse(self, feature, rid: str, why: str) -> None:
        self._counts["fallback_unkeyed"] = self._counts.get("fallback_unkeyed", 0) + 1
        count_fallback("vllm", "unkeyed",
                       f"item {getattr(feature, 'identifier', '?')} of request {rid} is not "
                       f"keyed ({why}): it is "
                       f"{'not published' if self.is_producer else 'encoded locally'}",
                       fix="nothing to fix when it is a decode instance's withheld item; "
                           "else report the vLLM version and flags to mmshm")

    def _keys_of(self, request) -> list:
        rid = request.request_id
        keys = self._req_keys.get(rid)
        if keys is not None:
            return keys
        adapter = adapter_of(request, self._tower_lora)
        keys = []
        for f in request.mm_features:
            if adapter is None:
                key, why = None, "tower LoRA is on and the request's adapter cannot be read"
            else:
                key, why = item_key(f, self._namespace, adapter, self._mode,
                                    self._counts), "a withheld stand-in or no processed data"
            if key is None:
                self._refuse(f, rid, why)
            elif self.is_producer:
                self._keys_out[f.identifier] = key
            keys.append(key)
        self._req_keys[rid] = keys
        return keys

    def ensure_cache_available(self, request, num_computed_tokens: int) -> bool:
        keys = self._keys_of(request)
        if not self.is_consumer:
            return True
        rid = request.request_id
        if self._poisoned and any(
                f.identifier in self._poisoned
                and f.mm_position.offset + f.mm_position.length > num_computed_tokens
                for f in request.mm_features):
            self._unavailable.add(rid)  # it needs an item vLLM may hold zeros for: failed
            return False
        for i, (f, key) in enumerate(zip(request.mm_features, keys)):
            if key is None or (rid, i) in self._looked:
                continue
            pos = f.mm_position
            if pos.offset + pos.length <= num_computed_tokens:
                continue  # already in the KV cache: nothing to encode or load
            if self._by_id.get(f.identifier) is not None:
                continue  # held for another request (looked up again once it lets go)
            self._looked.add((rid, i))
            entry = self._lookup(key, request.get_num_encoder_embeds(i), f, rid)
            if entry is None:
                continue  # counted when vLLM allocates the local encode
            self._held[(rid, i)] = entry
            self._by_id[f.identifier] = (rid, i)
            log.debug("mmshm: EC hit %s (request %s item %d) -> %s", f.identifier, rid, i,
                      entry.name)
        return True

    def _lookup(self, key: bytes, rows: int, feature, rid: str):
        """The store's entry of ``key`` if it is what this instance would
        encode: this model's dtype, ``rows`` rows, the measured width where
        known; held for request ``rid``."""
        width = self._widths.get(getattr(feature, "modality", ""))
        return self._store.lookup(key, dtype=self._dtype, rows=rows, count=False,
                                  shape=(rows, width or None), holder=f"request {rid}")

    def has_cache_item(self, identifier: str) -> bool:
        """Whether this consumer holds an intact entry for the item (vLLM
        asks only for items its own encoder cache does not hold)."""
        self._poisoned.pop(identifier, None)  # vLLM holds no output of it any more
        owner = self._by_id.get(identifier) if self.is_consumer else None
        if owner is None:
            return False
        entry = self._held[owner]
        if intact(entry):
            return True
        self._release(*owner)
        self._counts["fallback_segment_gone"] = self._counts.get("fallback_segment_gone",
                                                                 0) + 1
        count_fallback("vllm", "segment_gone",
                       f"the held encoder output {entry.name} of item {identifier} was "
                       f"removed or truncated in the segment directory by something outside "
                       f"mmshm: the item is encoded here",
                       fix="keep tmpfs cleaners, systemd's RemoveIPC=yes and operators off "
                           "mmshm-* files in MMSHM_DIR")
        return False

    def update_state_after_alloc(self, request, index: int):
        rid = request.request_id
        ident = request.mm_features[index].identifier
        owner = self._by_id.get(ident) if self.is_consumer else None
        if owner is not None:
            self._loads.append((rid, ident, self._held[owner].handle()))
            self._counts["hits"] += 1
            return
        if not self.is_consumer:
            return
        keys = self._req_keys.get(rid)
        key = keys[index] if keys and index < len(keys) else None
        if key is None:
            return  # counted as unkeyed
        reason = self._miss_reason(key, request.get_num_encoder_embeds(index))
        self._counts["fallback_" + reason] = self._counts.get("fallback_" + reason, 0) + 1
        count_fallback("vllm", reason, f"item {ident} of request {rid} is encoded here: no "
                       f"loadable encoder output of its content (namespace "
                       f"'{self._namespace}')")

    def _miss_reason(self, key: bytes, rows: int) -> str:
        """Why ``key`` missed, looked up once more, counting nothing (an
        entry published since is not taken: the local encode is decided)."""
        found, reason, _ = self._store._search(key, None, rows, hold=False)
        if found is not None:
            found.release()
        return reason or "missing"

    def update_state_after_free(self, request, index: int):
        self._release(request.request_id, index)
        self._looked.discard((request.request_id, index))

    def _release(self, rid: str, index: int) -> None:
        entry = self._held.pop((rid, index), None)
        if entry is None:
            return
        for ident, owner in list(self._by_id.items()):
            if owner == (rid, index):
                del self._by_id[ident]
        entry.release()

    def build_connector_meta(self, scheduler_output):
        meta = MmshmECConnectorMetadata(self._loads, self._keys_out)
        self._loads, self._keys_out = [], {}
        return meta

    def request_finished(self, request):
        rid = request.request_id
        for (r, i) in [k for k in self._held if k[0] == rid]:
            self._release(r, i)
        self._req_keys.pop(rid, None)
        self._looked = {k for k in self._looked if k[0] != rid}
        return False, None

    def take_unavailable_requests(self) -> set[str]:
        """The requests whose encoder output a worker could not load (vLLM
        fails each with ``FINISHED_ERROR``; re-issuing one re-runs it), and
        those naming an item vLLM's encoder cache may hold zeros for."""
        out, self._unavailable = self._unavailable, set()
        return out

    def update_connector_output(self, connector_output):
        meta = getattr(connector_output, "ec_connector_worker_meta", None)
        if not isinstance(meta, MmshmECWorkerMetadata):
            return
        for k, v in meta.counts.items():
            self._counts[k] = self._counts.get(k, 0) + v
        for rid, ident in meta.failed.items():
            self._unavailable.add(rid)
            self._poisoned[ident] = rid
            self._poisoned.move_to_end(ident)
            while len(self._poisoned) > _MAX_REMEMBERED:
                self._poisoned.popitem(last=False)

    def get_ec_connector_stats(self):
        if not any(self._counts.values()):
            return None
        stats = MmshmECConnectorStats(data=self._counts)
        self._counts = _new_counts()
        return stats

    @classmethod
    def build_ec_connector_stats(cls, data=None):
        return MmshmECConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return MmshmECPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # -- worker side ------------------------------------------------------------------
    def _learn_keys(self) -> None:
        meta = self._connector_metadata
        if isinstance(meta, MmshmECConnectorMetadata) and meta.keys:
            for ident, key in meta.keys.items():
                self._keys[ident] = key
                self._keys.move_to_end(ident)
            while len(self._keys) > _MAX_REMEMBERED:
                ident, _ = self._keys.popitem(last=False)
                log.warning("mmshm: the EC producer's worker forgot the key of %s (more than "
                            "%d items keyed and not yet encoded): it is not published",
                            ident, _MAX_REMEMBERED)

    def _writes(self) -> bool:
        """Whether this worker publishes: TP rank 0 (every rank encodes the
        same output; one copy is enough)."""
        if self._tp_rank0 is None:
            try:
                from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

                self._tp_rank0 = get_tensor_model_parallel_rank() == 0
            except Exception:  # noqa: BLE001 - no TP group (tests, one process)
                self._tp_rank0 = True
        return self._tp_rank0

    def start_save_caches(self, **kwargs):
        """Learn this step's keys; publish items vLLM already holds from an
        earlier step (it will not encode them again, so ``save_caches`` does
        not fire for them)."""
        self._learn_keys()
        cache = kwargs.get("encoder_cache")
        meta = self._connector_metadata
        if not cache or not isinstance(meta, MmshmECConnectorMetadata):
            return
        for ident in meta.keys:
            if ident in cache:
                self.save_caches(cache, ident)

    def save_caches(self, encoder_cache, mm_hash: str, **kwargs) -> None:
        if not self.is_producer or not self._writes():
            return
        self._learn_keys()
        key = self._keys.get(mm_hash)
        if key is None:
            log.debug("mmshm: no content key for %s: not published", mm_hash)
            return
        t0 = time.perf_counter()
        res = self._store.save(key, encoder_cache[mm_hash], label=mm_hash)
        if res.published and res.nbytes:
            self._counts["saves"] += 1
            self._counts["saved_bytes"] += res.nbytes
            self._counts["transfer_seconds"] += time.perf_counter() - t0
            log.debug("mmshm: EC save %s -> %s (%d bytes)", mm_hash, res.name, res.nbytes)
        elif not res.published and res.reason:
            k = "fallback_" + res.reason
            self._counts[k] = self._counts.get(k, 0) + 1

    def start_load_caches(self, encoder_cache, **kwargs) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, MmshmECConnectorMetadata):
            return
        from vllm.platforms import current_platform

        device = current_platform.device_type or "cpu"  # "": no platform
        for rid, mm_hash, handle in meta.loads:
            if mm_hash in encoder_cache:
                continue
            t0 = time.perf_counter()
            try:
                t = handle.load("vllm")
                if device != "cpu":
                    # from the arena's registered mapping: pinned speed (counted
                    # and timed in mmshm_gpu_copy_*{direction="h2d"})
                    t = arena.to_device(t, device)
            except (MmshmError, OSError, ValueError, RuntimeError) as exc:
                encoder_cache[mm_hash] = self._failed_load(rid, mm_hash, handle, device, exc)
                continue
            encoder_cache[mm_hash] = t
            self._counts["loads"] += 1
            self._counts["loaded_bytes"] += handle.nbytes
            self._counts["transfer_seconds"] += time.perf_counter() - t0
            log.debug("mmshm: EC load %s from %s (%d bytes)", mm_hash, handle.name,
                      handle.nbytes)

    def _failed_load(self, rid: str, mm_hash: str, handle, device: str, exc) -> torch.Tensor:
        """Report request ``rid`` (its scheduler fails it); returns the zeros
        that fill this step's slot, so the step runs and the engine lives."""
        err = exc if isinstance(exc, EncoderCacheError) else EncoderCacheError(
            f"request {rid}: the encoder output of {mm_hash} ({handle.name}) cannot be "
            f"loaded: {exc}", reason="load_failed")
        self._failed[rid] = mm_hash
        self._counts["load_failed"] += 1
        count_fallback("vllm", "load_failed",
                       f"request {rid}: {err}; the request is failed (vLLM's "
                       f"take_unavailable_requests: re-issuing it re-runs the encode) and "
                       f"the server goes on",
                       fix="keep tmpfs cleaners, systemd's RemoveIPC=yes and operators off "
                           "mmshm-* files in the segment directory")
        return torch.zeros(tuple(handle.shape), dtype=handle.dtype, device=device)

    def build_connector_worker_meta(self):
        if not any(self._counts.values()) and not self._failed:
            return None
        meta = MmshmECWorkerMetadata(self._counts, self._failed)
        self._counts, self._failed = _new_counts(), {}
        return meta

    def shutdown(self) -> None:
        for key in list(self._held):
            self._release(*key)
        self._store.close()


__all__ = ["EC_CONNECTOR", "EC_MODULE", "MmshmECConnector", "MmshmECConnectorMetadata",
           "MmshmECConnectorStats", "MmshmECPromMetrics", "MmshmECWorkerMetadata",
           "ec_namespace", "item_key", "weights_fingerprint"]
