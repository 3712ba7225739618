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

**The key** (:func:`item_key`, on :mod:`mmshm.transport.ec_keys`) cannot give
another answer: the namespace (:func:`ec_namespace`: the weights' fingerprint,
the dtype, the tower's quantization, ``--revision``, ``--hf-overrides``,
``--mm-processor-kwargs``, how items are keyed), the LoRA adapter when
``enable_tower_connector_lora`` is on (vLLM keys its own encoder cache by
``<lora_name>:<mm_hash>`` then), the modality, and the item: vLLM's
``mm_hash`` where it is a content hash (the processor cache or prefix caching
on: hashed in the API server; a request's own ``uuid`` is trusted as vLLM
trusts it), else its processed tensors' digests (mmshm's frontend's under
``mmshm run``). An item that cannot be keyed (the adapter unknown, a withheld
stand-in of a decode instance, no processed data) is neither loaded nor
published: encoded locally, counted (``unkeyed``).

**Failures per request** (the bookkeeping is :mod:`mmshm.transport.ec_connector`'s).
A held entry whose file was removed or truncated by a third party is found out
before vLLM decides to load it (``has_cache_item``): the item is encoded
locally (``segment_gone``). A load that fails in a worker anyway never raises
into the model runner: the worker fills that step's slot with zeros, reports
the request in its worker metadata, and the scheduler fails it through
``take_unavailable_requests`` (vLLM's path for one request: ``FINISHED_ERROR``,
"re-issuing the request re-runs the encode"); the next request is served, and later requests naming that item are failed too while
vLLM's encoder cache may still hold the zeros (until vLLM asks the connector
for the item again, which it does only once it no longer holds it).
"""

from __future__ import annotations

import dataclasses

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

from mmshm.hooks.instrumentor import Role
from mmshm.transport import ec_connector, ec_items, ec_keys
from mmshm.transport.ec_connector import (
    PENDING, STAT_KEYS, Counts, Holdings, add_counts, new_counts, open_tier)
from mmshm.transport.ec_items import CountStats, CountsAndFailures, ItemKeys, connector_line
from mmshm.transport.ec_keys import setting
from mmshm.transport.ec_store import EXTRA_KEYS as STORE_KEYS
from mmshm.transport.encoder_cache import DEFAULT_KEEP_S, EncoderCache, KeyQueue

from . import pd
from .server import KEY_MM_HASH, SERVER, key_mode, log, me

#: ``ec_connector`` and ``ec_connector_module_path`` of the connector.
EC_CONNECTOR = "MmshmECConnector"
EC_MODULE = __name__
#: keys of ``ec_connector_extra_config`` the connector reads (the Store's: docs/epd-nodes.md)
EC_EXTRA_KEYS = ("keep_s", "max_bytes", "namespace", "directory", *STORE_KEYS)
#: counters of :class:`MmshmECConnectorStats` (vLLM's connector stats, summed
#: over workers and steps; :data:`mmshm.transport.ec_connector.STAT_KEYS`)
EC_STAT_KEYS = STAT_KEYS
#: what vLLM does with a request whose load failed (said with the failure)
FAILED_SAYS = ("the request is failed (vLLM's take_unavailable_requests: re-issuing it "
               "re-runs the encode) and the server goes on")


def ec_namespace(vllm_config, extra: dict) -> str:
    """What two instances must share for their encoder outputs to be
    interchangeable, printed on the connector's "on:" line:
    ``extra["namespace"]`` when given (the user's word), else the model's
    weights, dtype, quantization, revision, ``hf_overrides``,
    ``mm_processor_kwargs`` and :func:`key_mode`
    (:func:`mmshm.transport.ec_items.namespace`)."""
    ns = extra.get("namespace")
    if ns:
        return str(ns)
    mc = vllm_config.model_config
    hf = getattr(mc, "hf_config", None)
    quant = getattr(mc, "quantization", None) or (
        getattr(hf, "quantization_config", None) if hf is not None else None)
    return ec_items.namespace(
        str(getattr(mc, "model", "") or ""), getattr(mc, "revision", None),
        getattr(mc, "dtype", ""), quant, getattr(mc, "hf_overrides", None),
        getattr(getattr(mc, "multimodal_config", None), "mm_processor_kwargs", None),
        key_mode(vllm_config))


def tower_lora_on(vllm_config) -> bool:
    """vLLM's ``enable_tower_connector_lora`` (``--enable-tower-connector-lora``)."""
    return bool(getattr(getattr(vllm_config, "lora_config", None),
                        "enable_tower_connector_lora", False))


def adapter_of(request, tower_lora: bool) -> str | None:
    """The request's ``lora_request`` as :func:`mmshm.transport.ec_items.adapter` keys it."""
    return ec_items.adapter(getattr(request, "lora_request", ec_items.UNREADABLE), tower_lora)


def item_key(feature, namespace: str, adapter: str, mode: str,
             counts: dict | None = None) -> bytes | None:
    """The key of one ``MultiModalFeatureSpec`` (32 bytes;
    :func:`mmshm.transport.ec_keys.item_key`): ``mode`` :data:`KEY_MM_HASH`
    keys by its ``mm_hash`` (else its identifier), :data:`KEY_PIXELS` by its
    processed tensors (``feature.data``: ``pixel_values``,
    ``image_grid_thw``...). None where it cannot be keyed: a withheld
    stand-in (:func:`mmshm.integrations.vllm.pd.withheld_in`), no data in
    pixels mode, a value of a type that cannot be hashed. Raises nothing."""
    if pd.withheld_in(feature):
        return None
    modality = getattr(feature, "modality", "")
    if mode == KEY_MM_HASH:
        name = getattr(feature, "mm_hash", None) or getattr(feature, "identifier", "")
        return ec_keys.item_key(namespace, adapter, modality, name=name)
    return ec_keys.item_key(namespace, adapter, modality, data=getattr(feature, "data", None),
                            counts=counts, label=getattr(feature, "identifier", "?"))


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
class MmshmECWorkerMetadata(CountsAndFailures, ECConnectorWorkerMetadata):
    """Worker -> scheduler, one per step: the counts of :data:`EC_STAT_KEYS`
    (summed over TP ranks) and ``failed``: ``{request id: mm_hash}`` of the
    loads that failed (united over TP ranks)."""

    counts: dict = dataclasses.field(default_factory=new_counts)
    failed: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class MmshmECConnectorStats(CountStats, ECConnectorStats):
    """vLLM's connector stats: ``data`` holds the counts of
    :data:`EC_STAT_KEYS` and ``fallback_<reason>`` since the last report;
    the frontend logs them ("EC Transfer metrics: ...") and feeds them to
    :class:`MmshmECPromMetrics`."""


class MmshmECPromMetrics(ECConnectorPromMetrics):
    """vLLM's connector metrics on the server's own ``/metrics``:
    ``vllm:mmshm_ec_loads``, ``vllm:mmshm_ec_saves``,
    ``vllm:mmshm_ec_bytes{direction}``, ``vllm:mmshm_ec_fallbacks{reason}``
    (counters, with vLLM's per-engine labels). mmshm's own families
    (``mmshm_epd_*``) are counted where the events happen (EngineCore,
    workers) and merged into ``/metrics`` under ``mmshm run``."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = ec_connector.prom_counters(self._counter_cls, labelnames,
                                                    "vllm:mmshm_ec_")
        self._values = dict(per_engine_labelvalues)

    def observe(self, transfer_stats_data, engine_idx: int = 0):
        values = self._values.get(engine_idx)
        if values is not None and transfer_stats_data:
            ec_connector.observe_counts(self._counters, values, transfer_stats_data)


# -- the connector ------------------------------------------------------------------------
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
    default ``MMSHM_DIR``); ``master_server_address`` and the other keys of
    docs/epd-nodes.md turn the Mooncake Store leg on (across nodes: a
    producer's TP rank 0 also puts each output it publishes; a consumer
    that misses on its node defers the request while the Store is asked,
    :class:`~mmshm.transport.ec_connector.StoreFetches`).

    Scheduler side (EngineCore): ``ensure_cache_available`` keys each item
    of a request once (:func:`item_key`) and, on a consumer, holds the entry
    it finds until the item's input is freed or the request finishes; a
    miss is counted by reason and encoded here; ``has_cache_item`` answers
    from an entry still intact; ``take_unavailable_requests`` returns the
    requests a worker could not load for
    (:class:`~mmshm.transport.ec_connector.Holdings`). Worker side:
    ``start_load_caches`` maps each held entry zero-copy (a device copy by
    :func:`mmshm.segments.arena.to_device`), a failure reported, never raised;
    ``save_caches`` (producer, TP rank 0) publishes under the item's key
    (:func:`mmshm.transport.ec_connector.load`, :func:`~mmshm.transport.ec_connector.save`).
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
        keep_s = setting(extra, "keep_s", DEFAULT_KEEP_S, float)
        self._store = EncoderCache(self._directory, server=SERVER, keep_s=keep_s,
                                   max_bytes=setting(extra, "max_bytes", 0, int),
                                   namespace=self._namespace)
        dtype = getattr(vllm_config.model_config, "dtype", None)
        #: what a loaded output must be: the model's dtype, the measured width
        #: per modality where vLLM measured it (an EC producer's config)
        self._dtype = dtype if isinstance(dtype, torch.dtype) else None
        self._widths = dict(getattr(tc, "mm_encoder_output_widths", None) or {})
        self._counts = Counts(SERVER)
        self._tp_rank0: bool | None = None
        # the Store leg: a consumer's scheduler fetches, a producer's TP rank 0 worker puts
        # (vLLM makes the worker's connector once the TP group exists)
        scheduler = role == ECConnectorRole.SCHEDULER
        self._tier = (open_tier(extra, SERVER, keep_s) if (
            self.is_consumer if scheduler else self.is_producer and self._writes()) else None)
        # scheduler side: the held entries; req id -> key per feature; this step's loads
        self._holds = Holdings(self._store, self._counts, self._tier)
        self._item_keys = ItemKeys(self._counts, self.is_producer, "vLLM")
        self._loads: list = []
        # worker side
        self._keys = KeyQueue(SERVER)
        self._failed: dict[str, str] = {}
        self._say_line(tc, role)

    def _say_line(self, tc, role) -> None:
        side = "scheduler" if role == ECConnectorRole.SCHEDULER else "worker"
        line = connector_line(tc.ec_role, self._tower_lora, self._store.describe(), self._tier)
        try:
            me().say(Role(f"EC connector ({side})", [line]))
        except Exception:  # noqa: BLE001 - no instrumentor: the line anyway
            log.info("mmshm: MmshmECConnector (%s): on: %s", side, line)

    # -- scheduler side ---------------------------------------------------------------
    def _keys_of(self, request) -> list:
        adapter = adapter_of(request, self._tower_lora)

        def key(f):
            if adapter is None:
                return None, "tower LoRA is on and the request's adapter cannot be read"
            return (item_key(f, self._namespace, adapter, self._mode, self._counts),
                    "a withheld stand-in or no processed data")

        return self._item_keys.of(request.request_id, request.mm_features, key,
                                  lambda f: getattr(f, "identifier", "?"))

    def ensure_cache_available(self, request, num_computed_tokens: int) -> bool:
        keys = self._keys_of(request)
        if not self.is_consumer:
            return True
        rid = request.request_id
        # the items not yet in the KV cache (the others need no encode nor load)
        pending = [(i, f) for i, f in enumerate(request.mm_features)
                   if f.mm_position.offset + f.mm_position.length > num_computed_tokens]
        if self._holds.fails(rid, [f.identifier for _, f in pending]):
            return False  # it needs an item vLLM may hold zeros for: failed
        ready = True
        with self._holds.looking():  # the request's Store fetches start as one batch
            for i, f in pending:
                if keys[i] is not None:
                    ready &= self._holds.look(
                        rid, i, f.identifier, keys[i], dtype=self._dtype,
                        rows=request.get_num_encoder_embeds(i),
                        width=self._widths.get(getattr(f, "modality", ""))) is not PENDING
        return ready  # False: a Store fetch in flight, asked again at the next step

    def has_cache_item(self, identifier: str) -> bool:
        """Whether this consumer holds an intact entry for the item (vLLM
        asks only for items its own encoder cache does not hold)."""
        return self.is_consumer and self._holds.has(identifier)

    def update_state_after_alloc(self, request, index: int):
        if not self.is_consumer:
            return
        rid = request.request_id
        ident = request.mm_features[index].identifier
        handle = self._holds.hit(ident)
        if handle is not None:
            self._loads.append((rid, ident, handle))
            return
        keys = self._item_keys.by_request.get(rid)
        key = keys[index] if keys and index < len(keys) else None
        if key is not None:  # else counted as unkeyed
            self._holds.miss(rid, ident, key, request.get_num_encoder_embeds(index))

    def update_state_after_free(self, request, index: int):
        self._holds.free(request.request_id, index)

    def build_connector_meta(self, scheduler_output):
        meta = MmshmECConnectorMetadata(self._loads, self._item_keys.take_out())
        self._loads = []
        return meta

    def request_finished(self, request):
        self._holds.finish(request.request_id)
        self._item_keys.forget(request.request_id)
        return False, None

    def take_unavailable_requests(self) -> set[str]:
        """The requests whose encoder output a worker could not load (vLLM
        fails each with ``FINISHED_ERROR``; re-issuing one re-runs it), and
        those naming an item vLLM's encoder cache may hold zeros for."""
        return self._holds.take_unavailable()

    def update_connector_output(self, connector_output):
        meta = getattr(connector_output, "ec_connector_worker_meta", None)
        if isinstance(meta, MmshmECWorkerMetadata):
            add_counts(self._counts, meta.counts)
            self._holds.failed(meta.failed)

    def get_ec_connector_stats(self):
        if not any(self._counts.values()):
            return None
        return MmshmECConnectorStats(data=self._counts.take())

    @classmethod
    def build_ec_connector_stats(cls, data=None):
        return MmshmECConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return MmshmECPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # -- worker side ------------------------------------------------------------------
    def _learn_keys(self) -> None:
        meta = self._connector_metadata
        if isinstance(meta, MmshmECConnectorMetadata):
            for ident, key in meta.keys.items():
                if ident not in self._keys:  # a key put again would count as not taken
                    self._keys.put(ident, key)

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
        ec_connector.save(self._store, key, encoder_cache[mm_hash], mm_hash, self._counts,
                          self._tier)

    def start_load_caches(self, encoder_cache, **kwargs) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, MmshmECConnectorMetadata):
            return
        from vllm.platforms import current_platform

        device = current_platform.device_type or "cpu"  # "": no platform
        ec_connector.load(meta.loads, encoder_cache, device, self._counts, self._failed,
                          FAILED_SAYS)

    def build_connector_worker_meta(self):
        if not any(self._counts.values()) and not self._failed:
            return None
        meta = MmshmECWorkerMetadata(self._counts.take(), self._failed)
        self._failed = {}
        return meta

    def shutdown(self) -> None:
        self._holds.close()
        if self._tier is not None:
            self._tier.close()
        self._store.close()


__all__ = ["EC_CONNECTOR", "EC_MODULE", "MmshmECConnector", "MmshmECConnectorMetadata",
           "MmshmECConnectorStats", "MmshmECPromMetrics", "MmshmECWorkerMetadata",
           "ec_namespace", "item_key"]
