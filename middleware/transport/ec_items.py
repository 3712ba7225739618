"""An EC connector's scheduler-side memo of its requests' item keys, and its
"on:" line: server-neutral, beside :mod:`mmshm.transport.ec_connector`.

A server's scheduler asks its connector about a request at every step; the
content key of each of its items (:func:`mmshm.transport.ec_keys.item_key`,
which may hash the item's processed tensors) is computed once per request
and kept until the request finishes (:class:`ItemKeys`). An item that cannot
be keyed is refused once, counted (``unkeyed``: neither loaded nor
published, encoded locally); a producer's keys go to its workers with the
next step's metadata (:meth:`ItemKeys.take_out`), which publish under them.
The arithmetic of the stats and metadata a server's connector reports is
here too (:class:`CountStats`, :class:`CountsAndFailures`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from mmshm.transport.ec_connector import Counts, add_counts, reduce_counts
from mmshm.transport.ec_keys import short, weights_fingerprint

#: what a connector does with encoder outputs, by its role
_DOES = {"ec_producer": "published", "ec_consumer": "loaded", "ec_both": "published and loaded"}


class ItemKeys:
    """The item keys of each request of one connector (a list per request
    id, one key or None per item, in the request's order).

    Args:
        counts: the connector's :class:`~mmshm.transport.ec_connector.Counts`
            (a refused item counts ``fallback_unkeyed``).
        producer: the connector publishes: each key is also kept for the
            workers (:meth:`take_out`), by the item's server name.
        title: the server's name in the fix said with a refusal ("vLLM").
    """

    def __init__(self, counts: Counts, producer: bool, title: str):
        self.counts, self.producer, self.title = counts, producer, title
        self.by_request: dict[str, list[bytes | None]] = {}
        self.out: dict[str, bytes] = {}

    def of(self, rid: str, items: Iterable, key: Callable, ident: Callable) -> list:
        """The keys of request ``rid``'s ``items``, computed at its first call
        (``key(item) -> (bytes | None, why)``, ``ident(item) -> str``, the
        item's server name); an item keyed None is refused (:meth:`refuse`)."""
        keys = self.by_request.get(rid)
        if keys is not None:
            return keys
        keys = []
        for item in items:
            k, why = key(item)
            if k is None:
                self.refuse(ident(item), rid, why)
            elif self.producer:
                self.out[ident(item)] = k
            keys.append(k)
        self.by_request[rid] = keys
        return keys

    def refuse(self, name: str, rid: str, why: str) -> None:
        """Count item ``name`` of request ``rid`` as ``unkeyed`` (``why``), said
        at WARNING the first time."""
        self.counts.fallback("unkeyed", f"item {name} of request {rid} is not keyed ({why}): "
                             f"it is {'not published' if self.producer else 'encoded locally'}",
                             fix="nothing to fix when it is a decode instance's withheld "
                                 f"item; else report the {self.title} version and flags to mmshm")

    def take_out(self) -> dict[str, bytes]:
        """The keys to send the workers since the last call (item name -> key)."""
        out, self.out = self.out, {}
        return out

    def forget(self, rid: str) -> None:
        """Request ``rid`` finished: its keys go."""
        self.by_request.pop(rid, None)


class CountStats:
    """The arithmetic of a server's connector stats whose ``data`` is a dict of
    counts (:class:`~mmshm.transport.ec_connector.Counts`' keys), mixed into
    the server's stats class (vLLM's ``ECConnectorStats``): summed on
    aggregation, the non-zero ones reported (:func:`reduce_counts`)."""

    data: dict

    def reset(self):
        self.data = {}

    def aggregate(self, other):
        return type(self)(data=add_counts(dict(self.data), other.data or {}))

    def reduce(self):
        return reduce_counts(self.data)

    def is_empty(self):
        return not any(self.data.values())


class CountsAndFailures:
    """The arithmetic of a worker's per-step metadata, mixed into the
    server's class: ``counts`` summed, ``failed`` (request id -> item name)
    united over the TP ranks."""

    counts: dict
    failed: dict

    def aggregate(self, other):
        return type(self)(add_counts(dict(self.counts), other.counts),
                          {**self.failed, **getattr(other, "failed", {})})


def namespace(model: str, revision: str | None, dtype, quant, hf_overrides, mm_kwargs,
              key: str) -> str:
    """What two instances must share for their encoder outputs to be
    interchangeable, as a connector's "on:" line prints it:
    ``weights=<fingerprint> dtype=<dtype> quant=<quantization> rev=<revision>
    hf_overrides=<...> mm_kwargs=<...> key=<mode>`` (``model``: a hub id or
    a local path, :func:`~mmshm.transport.ec_keys.weights_fingerprint`; each
    setting :func:`~mmshm.transport.ec_keys.short`; ``key``: how the server
    keys items, as instances keying differently never meet)."""
    parts = {
        "weights": weights_fingerprint(model, revision),
        "dtype": str(dtype).removeprefix("torch."),
        "quant": short(quant),
        "rev": revision or "-",
        "hf_overrides": short(hf_overrides),
        "mm_kwargs": short(mm_kwargs),
        "key": key,
    }
    return " ".join(f"{k}={v}" for k, v in parts.items())


#: :func:`adapter`'s stand-in for a request whose adapter cannot be read
UNREADABLE = object()


def adapter(lora, tower_lora: bool) -> str | None:
    """What an encoder output depends on besides the item, from a request's
    LoRA request ``lora`` (vLLM's ``LoRARequest``: ``lora_name``,
    ``lora_path``; None: no adapter; :data:`UNREADABLE`: the request has no
    such attribute): ``""`` when tower LoRA is off or there is no adapter;
    the adapter's name and path when there is one; None when tower LoRA is
    on and the adapter cannot be read (the item is not keyed)."""
    if not tower_lora:
        return ""
    if lora is UNREADABLE:
        return None
    if lora is None:
        return ""
    name = getattr(lora, "lora_name", None)
    if not name:
        return None
    return f"{name}\0{getattr(lora, 'lora_path', '') or ''}"


def connector_line(ec_role: str, by_adapter: bool, store: str, tier=None) -> str:
    """An EC connector's "on:" line: what it does in ``ec_role``
    (``ec_producer``, ``ec_consumer``, ``ec_both``), what keys an output
    (content, and the LoRA adapter where ``by_adapter``), ``store``
    (:meth:`~mmshm.transport.encoder_cache.EncoderCache.describe`) and,
    with ``tier``, the Mooncake Store leg: the master and what listens where
    (:meth:`~mmshm.transport.ec_store.StoreTier.describe`)."""
    across = (f"; across nodes through the {tier.describe()}" if tier is not None else
              " (compare both instances' lines: they meet only on one namespace and one "
              "directory of one node)")
    return (f"encoder outputs {_DOES.get(ec_role, '?')} through shared memory ({ec_role}), "
            f"keyed by content{' and LoRA adapter' if by_adapter else ''}; {store}{across}")


__all__ = ["UNREADABLE", "CountStats", "CountsAndFailures", "ItemKeys", "adapter", "connector_line",
           "namespace"]
