"""Disaggregation on vLLM (docs/vllm.md): prefill/decode, where a decode instance writes no
pixels, and encoder disaggregation (EPD), where ``MmshmECConnector`` carries encoder outputs
from an encoder instance to a prefill/decode instance through mmshm's content-keyed encoder
cache (:mod:`mmshm.transport.encoder_cache`). vLLM loads it with ``--ec-transfer-config
'{"ec_connector": "MmshmECConnector", "ec_connector_module_path":
"mmshm.integrations.vllm.disagg", "ec_role": "ec_producer"}'`` (``ec_consumer`` on the other
instance); it needs vLLM 0.32 or 0.33 in the same environment."""

import contextvars

import torch
from mmshm.errors import PayloadWithheldError
from mmshm.metrics import REQUEST_FAILURES
from torch.utils.weak import WeakIdKeyDictionary

from .server import SCHED, log, tensors

#: The placeholder of a withheld tensor: ``{WITHHELD_KEY: nbytes}``.
WITHHELD_KEY = "mmshm_withheld"
#: Inside the ``ADD`` of a request whose payload is withheld: [tensors, bytes].
WITHHOLDING: contextvars.ContextVar[list | None] = contextvars.ContextVar(
    "mmshm_vllm_withholding", default=None)
#: This frontend's decode_payload_policy: True withholds, False keeps, None: no KV consumer.
DECODE_WITHHOLDS: bool | None = None
#: The EngineCore's stand-ins for withheld tensors (empty, of their dtype).
_WITHHELD = WeakIdKeyDictionary()
PATH_DECODE_WITHHOLD = (
    "decode instance (kv_consumer, kv_load_failure_policy=fail): requests prefilled "
    "elsewhere (kv_transfer_params.do_remote_prefill) carry no pixel payload; the "
    "EngineCore keeps their hashes, placeholder ranges and grids, and a request that would "
    "still run its encoder fails with PayloadWithheldError")
PATH_DECODE_KEEP = "decode instance: pixels kept for requests prefilled elsewhere ({})"


def decode_payload_policy(vllm_config) -> tuple[bool, str] | None:
    """``(True, line)``: withhold the pixels of requests prefilled elsewhere;
    ``(False, line)``: keep them (why); None: no KV consumer. Withheld only
    where vLLM fails such a request rather than compute it: a pure
    ``kv_consumer``, ``kv_load_failure_policy=fail``, no processor cache, a
    scheduler mmshm can guard."""
    kv = getattr(vllm_config, "kv_transfer_config", None)
    if kv is None or not getattr(kv, "is_kv_consumer", False):
        return None
    policy = getattr(kv, "kv_load_failure_policy", "recompute")
    mm = getattr(getattr(vllm_config, "model_config", None), "multimodal_config", None)
    if getattr(kv, "kv_role", None) != "kv_consumer":
        why = f"kv_role={kv.kv_role}: this instance prefills too"
    elif policy != "fail":
        why = (f"kv_load_failure_policy={policy}: a KV load that fails is recomputed here, "
               f"which needs them")
    elif (getattr(mm, "mm_processor_cache_gb", 0) or 0) > 0:
        why = ("the multimodal processor cache is on; --mm-processor-cache-gb 0 lets mmshm "
               "withhold them")
    elif not scheduler_guarded():
        why = "this vLLM's scheduler has no _try_schedule_encoder_inputs to guard"
    else:
        return True, PATH_DECODE_WITHHOLD
    return False, PATH_DECODE_KEEP.format(why)


def scheduler_guarded() -> bool:
    """vLLM's ``Scheduler`` has ``_try_schedule_encoder_inputs`` (read once at start-up)."""
    try:
        import importlib

        sched = importlib.import_module(SCHED).Scheduler
    except Exception:  # noqa: BLE001 - no scheduler: nothing to guard with
        return False
    return hasattr(sched, "_try_schedule_encoder_inputs")


def remote_prefilled(request) -> bool:
    """``kv_transfer_params.do_remote_prefill`` in the request's sampling
    params' ``extra_args`` (where vLLM's OpenAI server puts it)."""
    extra = getattr(getattr(request, "sampling_params", None), "extra_args", None)
    params = extra.get("kv_transfer_params") if isinstance(extra, dict) else None
    return isinstance(params, dict) and bool(params.get("do_remote_prefill"))


def withheld_tensor(dtype: str, shape) -> torch.Tensor:
    """The stand-in for a withheld tensor (``dtype``: vLLM's name without
    ``torch.``): empty, known to :func:`withheld_in`."""
    dt = getattr(torch, dtype, None) if isinstance(dtype, str) else None
    t = torch.empty(0, dtype=dt if isinstance(dt, torch.dtype) else torch.uint8)
    _WITHHELD[t] = tuple(shape)
    return t


def withheld_in(feature) -> bool:
    """Whether a ``MultiModalFeatureSpec``'s data holds a withheld stand-in."""
    data = getattr(feature, "data", None)
    if data is None or not _WITHHELD:
        return False
    return any(t in _WITHHELD for elem in data.values()
               for t in tensors(getattr(elem, "data", None)))


def try_schedule_encoder_inputs(wrapped, instance, args, kwargs):
    """An encoder input whose pixels were withheld fails its request (vLLM's
    ``encoder_cache_mismatch_reqs``: ``FINISHED_ERROR`` after the step)."""
    out = wrapped(*args, **kwargs)
    if not _WITHHELD:
        return out
    request = args[0] if args else kwargs.get("request")
    features = getattr(request, "mm_features", None) or ()
    # (to schedule, num_new_tokens, budget[, loaded from the EC connector[, duplicates]])
    duplicates = out[4] if len(out) > 4 else ()
    need = [i for i in (*out[0], *duplicates)
            if i < len(features) and withheld_in(features[i])]
    failed = getattr(instance, "encoder_cache_mismatch_reqs", None)
    if not need or failed is None:
        return out
    rid = getattr(request, "request_id", "?")
    err = PayloadWithheldError(
        f"request {rid}: the decode instance would run the encoder for "
        f"{len(need)} item(s) whose pixels mmshm withheld (its KV did not load up to "
        f"them: {args[1] if len(args) > 1 else kwargs.get('num_computed_tokens', '?')} of "
        f"{getattr(request, 'num_prompt_tokens', '?')} prompt tokens computed). Fix: "
        f"prefill it on the prefill instance first, or set kv_load_failure_policy=recompute "
        f"on the decode instance")
    log.warning("mmshm: %s: %s", type(err).__name__, err)
    REQUEST_FAILURES.labels(reason=PayloadWithheldError.reason).inc()
    failed.add(rid)
    budget = args[3] if len(args) > 3 else kwargs.get("encoder_compute_budget")
    return ([], 0, budget, *([] for _ in out[3:]))


# -- encoder disaggregation (EPD): vLLM's EC connector on mmshm's encoder cache ------------
#: ``ec_connector_module_path`` of the connector (vLLM imports it and takes
#: :data:`EC_CONNECTOR` from it by name; no patch, with or without ``mmshm run``).
EC_MODULE = __name__
EC_CONNECTOR = "MmshmECConnector"
#: keys of ``ec_connector_extra_config`` the connector reads
EC_EXTRA_KEYS = ("keep_s", "max_bytes", "namespace", "directory")
#: the connector classes, built on first use (importing this module must not import vLLM)
_EC_CLASSES: dict[str, type] = {}


def __getattr__(name: str):
    """``MmshmECConnector`` and its metadata, stats and metrics classes, made
    the first time vLLM's ``ECConnectorFactory`` (or anyone) asks for them."""
    if name in ("MmshmECConnector", "MmshmECConnectorMetadata", "MmshmECWorkerMetadata",
                "MmshmECConnectorStats", "MmshmECPromMetrics"):
        if not _EC_CLASSES:
            try:
                _EC_CLASSES.update(_build_ec_classes())
            except ImportError as e:
                raise ImportError(
                    f"mmshm: {name} is built on vLLM's EC connector classes, which this "
                    f"environment cannot import ({e}); fix: install mmshm into the vLLM "
                    "server's own environment (vLLM 0.32 or 0.33)") from e
        return _EC_CLASSES[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


#: counters of :class:`MmshmECConnectorStats` (vLLM's connector stats, summed
#: over workers and steps): ``loads``/``loaded_bytes`` (worker), ``saves``/
#: ``saved_bytes`` (worker), ``hits`` and ``fallback_<reason>`` (scheduler),
#: ``transfer_seconds`` (worker, summed)
EC_STAT_KEYS = ("hits", "loads", "loaded_bytes", "saves", "saved_bytes", "transfer_seconds")


def ec_namespace(vllm_config, extra: dict) -> str:
    """What two instances must share for their encoder outputs to be
    interchangeable: ``extra["namespace"]`` when given, else the model (its
    name or path, as given to vLLM) and its dtype."""
    ns = extra.get("namespace")
    if ns:
        return str(ns)
    mc = vllm_config.model_config
    return f"{getattr(mc, 'model', '')}|{getattr(mc, 'dtype', '')}"


def feature_key(feature, namespace: str) -> bytes | None:
    """The content key (:func:`mmshm.transport.encoder_cache.content_key`) of
    one ``MultiModalFeatureSpec``: its modality and its processed item
    (``feature.data.get_data()``: ``pixel_values``, ``image_grid_thw``...).
    None when the scheduler has no processed data for it (nothing to key:
    the item is neither loaded nor published)."""
    from mmshm.transport.encoder_cache import content_key

    data = getattr(feature, "data", None)
    if data is None:
        return None
    try:
        items = data.get_data() if hasattr(data, "get_data") else dict(data)
        return content_key({"modality": getattr(feature, "modality", ""), "item": items},
                           namespace)
    except (TypeError, ValueError) as exc:
        log.warning("mmshm: cannot key multimodal item %s by content (%s); it is encoded "
                    "locally and not shared. Fix: report this item type to mmshm",
                    getattr(feature, "identifier", "?"), exc)
        return None


def _build_ec_classes() -> dict[str, type]:
    """Define the connector on vLLM's base classes (imported now)."""
    import dataclasses
    import time
    from collections import OrderedDict

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

    from mmshm.metrics import EPD_FALLBACK_REASONS
    from mmshm.segments import arena
    from mmshm.transport.encoder_cache import DEFAULT_KEEP_S, EncoderCache, EncoderCacheError

    def _new_counts() -> dict:
        return dict.fromkeys(EC_STAT_KEYS, 0)

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
        """Worker -> scheduler, one per step: the counts of
        :data:`EC_STAT_KEYS` (summed over TP ranks)."""

        counts: dict = dataclasses.field(default_factory=_new_counts)

        def aggregate(self, other):
            out = MmshmECWorkerMetadata(dict(self.counts))
            for k, v in other.counts.items():
                out.counts[k] = out.counts.get(k, 0) + v
            return out

    @dataclasses.dataclass
    class MmshmECConnectorStats(ECConnectorStats):
        """vLLM's connector stats: ``data`` holds the counts of
        :data:`EC_STAT_KEYS` and ``fallback_<reason>`` since the last
        report; the frontend logs them ("EC Transfer metrics: ...") and feeds
        them to :class:`MmshmECPromMetrics`."""

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
            self._fallbacks = c(name="vllm:mmshm_ec_fallbacks",
                                labelnames=[*labelnames, "reason"],
                                documentation="Items encoded locally (or not published), "
                                              "by reason.")
            self._per_engine = {}
            for idx, values in per_engine_labelvalues.items():
                self._per_engine[idx] = (
                    self._loads.labels(*values), self._saves.labels(*values),
                    {d: self._bytes.labels(*values, d) for d in ("saved", "loaded")},
                    {r: self._fallbacks.labels(*values, r) for r in EPD_FALLBACK_REASONS})

        def observe(self, transfer_stats_data, engine_idx: int = 0):
            m = self._per_engine.get(engine_idx)
            if m is None or not transfer_stats_data:
                return
            loads, saves, nbytes, fallbacks = m
            d = transfer_stats_data
            if d.get("loads"):
                loads.inc(d["loads"])
            if d.get("saves"):
                saves.inc(d["saves"])
            if d.get("loaded_bytes"):
                nbytes["loaded"].inc(d["loaded_bytes"])
            if d.get("saved_bytes"):
                nbytes["saved"].inc(d["saved_bytes"])
            for r, counter in fallbacks.items():
                if d.get("fallback_" + r):
                    counter.inc(d["fallback_" + r])

    class MmshmECConnector(ECConnectorBase):
        """vLLM's EC connector on mmshm's content-keyed encoder cache
        (:mod:`mmshm.transport.encoder_cache`; docs/vllm.md "Encoder
        disaggregation"). Roles ``ec_producer`` (encoder instance),
        ``ec_consumer`` (prefill or PD instance), ``ec_both``.

        Load it with vLLM's own mechanism, no patch, with or without ``mmshm run``::

            --ec-transfer-config '{"ec_connector": "MmshmECConnector",
              "ec_connector_module_path": "mmshm.integrations.vllm.disagg",
              "ec_role": "ec_consumer", "ec_connector_extra_config": {"keep_s": 60}}'

        ``ec_connector_extra_config``: ``keep_s`` (seconds a producer keeps an
        entry after its last save, default 60), ``max_bytes`` (the producer's
        cap on the bytes of its published entries, oldest evicted first; an
        output above it is not published, ``over_budget``; default 0: only
        the core's budget), ``namespace`` (what must
        match between instances, default the model and its dtype),
        ``directory`` (the segment directory, default ``MMSHM_DIR``).

        Scheduler side (EngineCore): ``ensure_cache_available`` keys each
        item of a request by content once (BLAKE3 of its processed input)
        and, on a consumer, looks the key up and holds the entry (one
        reference, until the item's encoder input is freed or the request
        finishes); a miss is counted by reason and the item is encoded
        here. ``has_cache_item`` answers from what it holds, never from
        vLLM's item names, so counter names out of step cannot pair an item
        with another image's output. Always returns True: nothing is in
        flight, an item is either held or encoded locally.

        Worker side: ``start_load_caches`` maps each held entry zero-copy
        (a CPU view holding the worker's own reference, given back when
        vLLM drops it from its encoder cache; on a GPU copied to the
        device with :func:`mmshm.segments.arena.to_device`, from the
        arena's mapping that this worker registered with CUDA once: the
        view's reference goes back once the copy is done);
        ``save_caches`` (producer, TP rank 0) publishes the encoder output
        under its content key (from a GPU, one copy into the arena's
        registered mapping: :meth:`EncoderCache.save`).

        Raises (worker): :class:`mmshm.transport.encoder_cache.EncoderCacheError`
        if an entry the scheduler holds cannot be mapped: only a third party
        deleting or truncating the file in the segment directory can cause
        that, since the scheduler's reference and liveness lock keep it.
        """

        def __init__(self, vllm_config, role):
            super().__init__(vllm_config=vllm_config, role=role)
            tc = vllm_config.ec_transfer_config
            extra = dict(getattr(tc, "ec_connector_extra_config", None) or {})
            unknown = set(extra) - set(EC_EXTRA_KEYS)
            if unknown:
                log.warning("mmshm: MmshmECConnector ignores ec_connector_extra_config "
                            "keys %s (it reads %s)", sorted(unknown), list(EC_EXTRA_KEYS))
            self._namespace = ec_namespace(vllm_config, extra)
            self._store = EncoderCache(extra.get("directory"), server="vllm",
                                       keep_s=float(extra.get("keep_s", DEFAULT_KEEP_S)),
                                       max_bytes=int(extra.get("max_bytes", 0)))
            self._counts = _new_counts()
            # scheduler side
            self._req_keys: dict[str, list] = {}          # req id -> key per feature
            self._held: dict[tuple[str, int], object] = {}  # (req id, index) -> Entry
            self._by_id: dict[str, tuple[str, int]] = {}   # mm identifier -> (req id, index)
            self._looked: set[tuple[str, int]] = set()     # looked up once per request item
            self._unkeyed_said = False
            self._loads: list = []
            self._keys_out: dict[str, bytes] = {}
            # worker side
            self._keys: OrderedDict[str, bytes] = OrderedDict()
            self._tp_rank0: bool | None = None
            log.info("mmshm: MmshmECConnector (%s, %s): encoder outputs %s, keyed by content "
                     "(namespace %r), segment directory %s",
                     tc.ec_role, "scheduler" if role == ECConnectorRole.SCHEDULER else "worker",
                     {"ec_producer": "published", "ec_consumer": "loaded",
                      "ec_both": "published and loaded"}.get(tc.ec_role, "?"),
                     self._namespace, extra.get("directory") or "MMSHM_DIR")

        # -- scheduler side ------------------------------------------------------
        def _keys_of(self, request) -> list:
            rid = request.request_id
            keys = self._req_keys.get(rid)
            if keys is None:
                keys = [feature_key(f, self._namespace) for f in request.mm_features]
                self._req_keys[rid] = keys
                for f, k in zip(request.mm_features, keys):
                    if k is not None and self.is_producer:
                        self._keys_out[f.identifier] = k
                    elif k is None and not self._unkeyed_said:
                        self._unkeyed_said = True
                        log.warning("mmshm: multimodal item %s of request %s has no processed "
                                    "data in the scheduler, so it cannot be keyed by content: "
                                    "it is %s. Fix: report the vLLM version and flags to mmshm",
                                    f.identifier, rid, "not published" if self.is_producer
                                    else "encoded locally")
            return keys

        def ensure_cache_available(self, request, num_computed_tokens: int) -> bool:
            keys = self._keys_of(request)
            if not self.is_consumer:
                return True
            rid = request.request_id
            for i, (f, key) in enumerate(zip(request.mm_features, keys)):
                if key is None or (rid, i) in self._looked:
                    continue
                pos = f.mm_position
                if pos.offset + pos.length <= num_computed_tokens:
                    continue  # already in the KV cache: nothing to encode or load
                if self._by_id.get(f.identifier) is not None:
                    continue  # held for another request (looked up again once it lets go)
                self._looked.add((rid, i))
                rows = request.get_num_encoder_embeds(i)
                entry = self._store.lookup(key, rows=rows, count=False)
                if entry is None:
                    continue  # counted when vLLM allocates the local encode
                self._held[(rid, i)] = entry
                self._by_id[f.identifier] = (rid, i)
                log.debug("mmshm: EC hit %s (request %s item %d) -> %s", f.identifier, rid,
                          i, entry.name)
            return True

        def has_cache_item(self, identifier: str) -> bool:
            return self.is_consumer and identifier in self._by_id

        def update_state_after_alloc(self, request, index: int):
            rid = request.request_id
            ident = request.mm_features[index].identifier
            owner = self._by_id.get(ident)
            if self.is_consumer and owner is not None:
                entry = self._held[owner]
                self._loads.append((rid, ident, entry.handle()))
                self._counts["hits"] += 1
                return
            if self.is_consumer:
                keys = self._req_keys.get(rid)
                key = keys[index] if keys and index < len(keys) else None
                if key is None:
                    reason = "missing"
                else:
                    reason = self._miss_reason(key, request.get_num_encoder_embeds(index))
                self._counts["fallback_" + reason] = self._counts.get("fallback_" + reason,
                                                                      0) + 1
                from mmshm.transport.encoder_cache import count_fallback

                count_fallback("vllm", reason, f"item {ident} of request {rid} is encoded "
                               f"here: no loadable encoder output of its content")

        def _miss_reason(self, key: bytes, rows: int) -> str:
            """Why ``key`` missed, looked up once more, counting nothing (an
            entry published since is not taken: the local encode is decided)."""
            found, reason, _ = self._store._search(key, None, rows)
            if found is not None:
                found.release()
                return "missing"
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

        def update_connector_output(self, connector_output):
            meta = getattr(connector_output, "ec_connector_worker_meta", None)
            if isinstance(meta, MmshmECWorkerMetadata):
                for k, v in meta.counts.items():
                    self._counts[k] = self._counts.get(k, 0) + v

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
        def build_prom_metrics(cls, vllm_config, metric_types, labelnames,
                               per_engine_labelvalues):
            return MmshmECPromMetrics(vllm_config, metric_types, labelnames,
                                      per_engine_labelvalues)

        # -- worker side -----------------------------------------------------------
        def _learn_keys(self) -> None:
            meta = self._connector_metadata
            if isinstance(meta, MmshmECConnectorMetadata) and meta.keys:
                for ident, key in meta.keys.items():
                    self._keys[ident] = key
                    self._keys.move_to_end(ident)
                while len(self._keys) > 4096:
                    self._keys.popitem(last=False)

        def _writes(self) -> bool:
            """Whether this worker publishes: TP rank 0 (every rank encodes
            the same output; one copy is enough)."""
            if self._tp_rank0 is None:
                try:
                    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

                    self._tp_rank0 = get_tensor_model_parallel_rank() == 0
                except Exception:  # noqa: BLE001 - no TP group (tests, one process)
                    self._tp_rank0 = True
            return self._tp_rank0

        def start_save_caches(self, **kwargs):
            """Learn this step's keys; publish items vLLM already holds from
            an earlier step (it will not encode them again, so
            ``save_caches`` does not fire for them)."""
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
            device = None
            for rid, mm_hash, handle in meta.loads:
                if mm_hash in encoder_cache:
                    continue
                t0 = time.perf_counter()
                try:
                    t = handle.load("vllm")
                except (OSError, ValueError) as exc:
                    err = EncoderCacheError(
                        f"request {rid}: the encoder output of {mm_hash} ({handle.name}) "
                        f"cannot be mapped although this instance's scheduler holds it: "
                        f"{exc}. Something outside mmshm removed or truncated it in the "
                        f"segment directory; fix: leave mmshm-* files in MMSHM_DIR alone")
                    log.error("mmshm: %s", err)
                    raise err from exc
                if device is None:
                    from vllm.platforms import current_platform

                    device = current_platform.device_type or "cpu"  # "": no platform
                if device != "cpu":
                    # from the arena's registered mapping: pinned speed (counted
                    # and timed in mmshm_gpu_copy_*{direction="h2d"})
                    t = arena.to_device(t, device)
                encoder_cache[mm_hash] = t
                self._counts["loads"] += 1
                self._counts["loaded_bytes"] += handle.nbytes
                self._counts["transfer_seconds"] += time.perf_counter() - t0
                log.debug("mmshm: EC load %s from %s (%d bytes)", mm_hash, handle.name,
                          handle.nbytes)

        def build_connector_worker_meta(self):
            if not any(self._counts.values()):
                return None
            meta = MmshmECWorkerMetadata(self._counts)
            self._counts = _new_counts()
            return meta

        def shutdown(self) -> None:
            for key in list(self._held):
                self._release(*key)
            self._store.close()

    for cls in (MmshmECConnectorMetadata, MmshmECWorkerMetadata, MmshmECConnectorStats,
                MmshmECPromMetrics, MmshmECConnector):
        cls.__module__ = __name__
        cls.__qualname__ = cls.__name__
    return {c.__name__: c for c in (MmshmECConnector, MmshmECConnectorMetadata,
                                    MmshmECWorkerMetadata, MmshmECConnectorStats,
                                    MmshmECPromMetrics)}
