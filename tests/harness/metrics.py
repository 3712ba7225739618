"""Reading Prometheus samples: mmshm's counters in this process, a merged
registry, or a scraped exposition.

One reader, :func:`metric`: the sum of the samples called ``name`` whose
labels include the given ones. With every label of the series given, that
is the one sample's value; with fewer, the sum over the rest (every reason
of ``mmshm_inline_fallbacks_total``); 0.0 when there is none.
"""

from __future__ import annotations

#: The reasons of ``mmshm_inline_fallbacks_total`` a single tensor can have
#: (``group`` is a whole group's, counted elsewhere).
FALLBACK_REASONS = ("enospc", "budget", "emfile", "other")


def _samples(source):
    if source is None:
        from prometheus_client import REGISTRY

        source = REGISTRY
    if isinstance(source, str):
        from prometheus_client.parser import text_string_to_metric_families

        families = text_string_to_metric_families(source)
    else:
        families = source.collect()
    for fam in families:
        yield from fam.samples


def metric(name: str, source=None, **labels) -> float:
    """The sum of the samples called ``name`` (``..._total`` for a counter)
    whose labels include ``labels`` (values compared as strings), 0.0 when
    there is none.

    ``source``: None for the default registry (this process), a
    ``CollectorRegistry`` (e.g. a ``MultiProcessCollector``'s), or the text
    of an exposition (``GET /metrics``)."""
    want = {k: str(v) for k, v in labels.items()}
    return float(sum(s.value for s in _samples(source)
                     if s.name == name and all(s.labels.get(k) == v for k, v in want.items())))


def series(source, name: str) -> list[tuple[dict, float]]:
    """Every sample called ``name`` in ``source`` (as :func:`metric`):
    ``(labels, value)``."""
    return [(dict(s.labels), s.value) for s in _samples(source) if s.name == name]


def scrape(port: int, timeout: float = 10.0) -> str:
    """The exposition served on ``http://127.0.0.1:<port>/metrics`` (asserts 200)."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as r:
        assert r.status == 200, r.status
        return r.read().decode()


def fallbacks(source=None) -> dict[str, float]:
    """``mmshm_inline_fallbacks_total`` per single-tensor reason."""
    return {r: metric("mmshm_inline_fallbacks_total", source, reason=r)
            for r in FALLBACK_REASONS}


def fallbacks_total(source=None) -> float:
    """``mmshm_inline_fallbacks_total`` summed over every reason."""
    return metric("mmshm_inline_fallbacks_total", source)


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, int]:
    """``after - before`` per key, as whole numbers."""
    return {k: int(after[k] - before[k]) for k in before}
