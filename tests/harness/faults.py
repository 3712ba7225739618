"""Faults under load for the real-server e2e tests, whatever the server.

Three parts, each taking what it needs (an ``openai`` client, the served
model's name, photo data URLs, the segment directory, how to run ``mmshm``
where the server runs) and knowing nothing of SGLang or vLLM:

* :func:`storm`: an **abort storm**. :func:`plan` draws about 30 streamed
  chat requests from a fixed seed (the *client's* choices only: photos 1-3,
  ``n`` 1-4, and where the client gives up); :func:`storm` sends them
  ``concurrency`` at a time and closes each one where its plan says: while the
  server still prepares it (a client timeout, before any byte of the
  answer), right after the response headers (before the first token), after
  the first token, in the middle of the stream, or not at all. Sampling is
  never seeded (vLLM 0.32's CPU engine dies under concurrent seeded sampling
  with images: ``CPU Generator does not use offset``): greedy for ``n=1``,
  unseeded ``temperature`` for ``n>1``.
* :func:`rejects`: **rejected requests** (too many images, tokens over the
  context length, corrupt or empty base64, bytes that are no image, an SVG
  and a text file as data URLs, a truncated PNG), each sent once; what the
  server answered (HTTP status and message) is recorded.
* The checks after them: :class:`Mmshm` runs ``mmshm status --json`` and
  ``mmshm gc --dry-run --json`` where the server runs (in its mount
  namespace when it has a private /dev/shm: the per-process view needs the
  paths its processes see); :func:`explain` sorts each segment file left into
  pooled, held by a named cache, or unexplained; :func:`settle` waits past
  the pool's idle time and reads both; :func:`counter_deltas` and
  :func:`counter_problems` hold mmshm's counters against the events.

Sizes are in bytes, times in seconds.
"""

from __future__ import annotations

import base64
import dataclasses
import fnmatch
import json
import os
import random
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

#: The servers' own shared-memory segments, watched beside mmshm's: ``psm_*``
#: (Python's ``multiprocessing.shared_memory``: SGLang up to 0.5.15, vLLM)
#: and SGLang 0.5.23's ``sgl_shm_mm_<pid>_<hex>`` (its ``ShmPointerMMData``).
SERVER_OWN = ("psm_*", "sgl_shm_mm_*")
#: Where the client gives up on a request (see :func:`storm`).
POINTS = ("preparing", "before_first", "after_first", "mid_stream", "full")
PROMPT = "Describe the pictures."
#: Storm photos: small, so prefills are fast (336 x 224 is 24 x 16 Qwen2-VL
#: patches: pixel_values [384, 1176] float32, 1.8 MB, 96 image tokens).
SMALL = (336, 224)


def small_photo_urls(count: int = 4, size: tuple[int, int] = SMALL) -> list[str]:
    """``count`` different photos of scikit-image's bundled set (cycled),
    resized to ``size`` (width, height in pixels), as PNG data URLs."""
    from mmshm.bench.photos import _load_rgb, available_photos

    from tests.harness.servers import data_url

    names = available_photos()
    if not names:
        raise RuntimeError("no bundled scikit-image photo (is scikit-image installed?)")
    return [data_url(_load_rgb(names[i % len(names)], size)) for i in range(count)]


# -- the abort storm ------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Shot:
    """One request of the storm, as the client plans it.

    Attributes:
        index: its position in the plan.
        photos: indices into the storm's photo URLs (1-3 of them).
        n: choices asked for (parallel sampling when > 1).
        point: where the client gives up, one of :data:`POINTS`.
        chunks: for ``mid_stream``, how many stream chunks it reads first.
        timeout_s: for ``preparing``, the client's timeout in seconds
            (the request is dropped when it passes without an answer).
    """

    index: int
    photos: tuple[int, ...]
    n: int
    point: str
    chunks: int = 0
    timeout_s: float = 0.0


def plan(count: int = 30, photos: int = 4, seed: int = 21, max_photos: int = 3,
         max_n: int = 4, points: tuple[str, ...] = POINTS,
         max_n_multi: int | None = None) -> list[Shot]:
    """``count`` storm requests drawn from ``random.Random(seed)`` over
    ``photos`` photo URLs: 1..``max_photos`` distinct photos, ``n`` in
    1..``max_n`` (1..``max_n_multi`` with more than one photo, where given:
    SGLang refuses ``n > 1`` with several images, "The length of image_data
    should be equal to the batch size"), a give-up point from ``points``
    (every point at least once when ``count >= len(points)``). The same
    arguments give the same plan."""
    rnd = random.Random(seed)
    order = list(points) * (count // len(points)) + [rnd.choice(points)
                                                     for _ in range(count % len(points))]
    rnd.shuffle(order)
    shots = []
    for i, point in enumerate(order):
        k = rnd.randint(1, min(max_photos, photos))
        n = rnd.randint(1, max_n if k == 1 or max_n_multi is None else max_n_multi)
        shots.append(Shot(i, tuple(rnd.sample(range(photos), k)), n, point,
                          chunks=rnd.randint(2, 6) if point == "mid_stream" else 0,
                          timeout_s=round(rnd.uniform(0.05, 1.0), 3)
                          if point == "preparing" else 0.0))
    return shots


def chat_content(urls: list[str], text: str = PROMPT) -> list[dict]:
    """An OpenAI chat message's content: the images, then the text."""
    return [*({"type": "image_url", "image_url": {"url": u}} for u in urls),
            {"type": "text", "text": text}]


def _one(client, model: str, urls: list[str], shot: Shot, max_tokens: int) -> dict:
    import httpx
    import openai

    t0 = time.monotonic()
    rec = {"index": shot.index, "photos": len(shot.photos), "n": shot.n, "point": shot.point,
           "chunks": 0, "tokens": 0}
    sampling = dict(temperature=0.0) if shot.n == 1 else dict(temperature=0.8)
    c = client.with_options(timeout=shot.timeout_s) if shot.point == "preparing" else client
    stream = None
    try:
        stream = c.chat.completions.create(
            model=model, stream=True, n=shot.n, max_tokens=max_tokens,
            messages=[{"role": "user", "content": chat_content(
                [urls[i] for i in shot.photos])}], **sampling)
        if shot.point == "before_first":
            rec["outcome"] = "closed"
            return rec
        finished = set()
        for chunk in stream:
            rec["chunks"] += 1
            for ch in chunk.choices:
                if ch.delta is not None and ch.delta.content:
                    rec["tokens"] += 1
                if ch.finish_reason is not None:
                    finished.add(ch.index)
            if shot.point == "after_first" and rec["tokens"]:
                rec["outcome"] = "closed"
                return rec
            if shot.point == "mid_stream" and rec["chunks"] >= shot.chunks:
                rec["outcome"] = "closed"
                return rec
        rec["finished"] = len(finished)
        # read to the end: every choice must have finished
        rec["outcome"] = "completed" if len(finished) == shot.n else \
            f"error: {len(finished)} of {shot.n} choices finished"
    except (openai.APITimeoutError, httpx.TimeoutException):
        # only a shot that gives up while the server prepares times out (its
        # timeout may also pass between two chunks: httpx's, unwrapped)
        rec["outcome"] = "gave up" if shot.point == "preparing" else "error: client timeout"
    except Exception as exc:  # noqa: BLE001 - recorded, judged by the test
        rec["outcome"] = f"error: {type(exc).__name__}: {str(exc)[:300]}"
    finally:
        if stream is not None:
            stream.close()  # closes the HTTP response: the server sees the client go
        rec["seconds"] = round(time.monotonic() - t0, 3)
    return rec


def storm(client, model: str, urls: list[str], shots: list[Shot], concurrency: int = 4,
          max_tokens: int = 16) -> dict:
    """Send ``shots`` (:func:`plan`) to the server behind ``client`` (an
    ``openai.OpenAI``), ``concurrency`` at a time, each streamed and closed
    where its plan says (``preparing``: the client's timeout; ``before_first``:
    closed once the response headers are in, no chunk read; ``after_first``:
    after the first chunk with text; ``mid_stream``: after ``chunks`` chunks;
    ``full``: read to the end, every choice finished).

    Returns ``{"requests": [per request: index, photos, n, point, chunks,
    tokens, outcome, seconds], "outcomes": {outcome: count}, "errors":
    [requests whose outcome starts with "error"], "seconds": wall time}``.
    Outcomes: ``completed``, ``closed`` (the client closed it), ``gave up``
    (client timeout while preparing), ``error: ...`` (anything else)."""
    t0 = time.monotonic()
    with ThreadPoolExecutor(concurrency, thread_name_prefix="storm") as ex:
        recs = list(ex.map(lambda s: _one(client, model, urls, s, max_tokens), shots))
    outcomes: dict[str, int] = {}
    for r in recs:
        key = "error" if r["outcome"].startswith("error") else r["outcome"]
        outcomes[key] = outcomes.get(key, 0) + 1
    return {"requests": recs, "outcomes": outcomes,
            "errors": [r for r in recs if r["outcome"].startswith("error")],
            "seconds": round(time.monotonic() - t0, 2)}


# -- rejected requests ----------------------------------------------------------------
def _b64_url(mime: str, data: bytes) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def _truncated_png(url: str) -> str:
    raw = base64.b64decode(url.split(",", 1)[1])
    return _b64_url("image/png", raw[:len(raw) // 2])


SVG = (b'<svg xmlns="http://www.w3.org/2000/svg" width="64" height="64">'
       b'<rect width="64" height="64" fill="red"/></svg>')


def reject_cases(photo_url: str, max_images: int, context_tokens: int,
                 tokens_per_word: int = 1) -> list[tuple[str, list[str], str, int]]:
    """``(name, image URLs, text, max_tokens)`` of each request a server must
    refuse: ``max_images + 1`` photos; a prompt of at least ``1.25 x
    context_tokens`` tokens (``" hello"`` repeated, ``tokens_per_word``
    tokens each in the server's tokenizer), alone and after a photo; a photo
    with ``max_tokens`` twice the context; corrupt, empty and non-image
    base64; an SVG; a text file; a PNG cut in half."""
    long_text = " hello" * (int(1.25 * context_tokens / tokens_per_word) + 1)
    short = "What is in it?"
    return [
        ("too many images", [photo_url] * (max_images + 1), short, 4),
        ("prompt over the context length", [], long_text, 4),
        ("photo and prompt over the context length", [photo_url], long_text, 4),
        ("max_tokens over the context length", [photo_url], short, 2 * context_tokens),
        ("corrupt base64", ["data:image/png;base64,****not*base64****"], short, 4),
        ("empty base64", ["data:image/png;base64,"], short, 4),
        ("bytes that are no image", [_b64_url("image/png", os.urandom(4096))], short, 4),
        ("SVG", [_b64_url("image/svg+xml", SVG)], short, 4),
        ("text file", [_b64_url("text/plain", b"just some text\n" * 64)], short, 4),
        ("truncated PNG", [_truncated_png(photo_url)], short, 4),
    ]


def rejects(client, model: str, cases: list[tuple[str, list[str], str, int]]) -> list[dict]:
    """Send each case of :func:`reject_cases` once (not streamed, greedy).

    Returns per case ``{"case", "status", "error", "seconds"}``: ``status``
    the HTTP status of the server's error (``200`` if it answered, ``None``
    if the connection failed), ``error`` its message (shortened)."""
    import openai

    out = []
    for name, urls, text, max_tokens in cases:
        t0 = time.monotonic()
        rec = {"case": name}
        try:
            client.chat.completions.create(
                model=model, max_tokens=max_tokens, temperature=0.0,
                messages=[{"role": "user", "content": chat_content(urls, text)}])
            rec.update(status=200, error="")
        except openai.APIStatusError as exc:
            rec.update(status=exc.status_code, error=str(exc)[:300])
        except openai.APIError as exc:
            rec.update(status=None, error=f"{type(exc).__name__}: {str(exc)[:300]}")
        rec["seconds"] = round(time.monotonic() - t0, 2)
        out.append(rec)
    return out


def refused(rec: dict) -> bool:
    """A clean refusal: an HTTP 4xx."""
    return rec["status"] is not None and 400 <= rec["status"] < 500


# -- what is left ---------------------------------------------------------------------
class Mmshm:
    """Runs ``mmshm`` commands where the server's processes run.

    Args:
        directory: the segment directory as the server's processes see it
            (passed as ``--dir``).
        ns_pid: a process of the server whose mount namespace the commands
            enter (``nsenter -t PID -m``), or None to run them here. A server
            with a private /dev/shm (``unshare -m`` and a bind mount) needs
            it: from outside, the segments' locks and headers can be read
            through the host path, but its processes' descriptors name the
            paths they see, so no process would be matched to a segment.
        python: the interpreter that has mmshm (default this one).
    """

    def __init__(self, directory: str | os.PathLike, ns_pid: int | None = None,
                 python: str = sys.executable):
        self.directory = str(directory)
        self.ns_pid = ns_pid
        self.python = python

    def argv(self, *args: str) -> list[str]:
        cmd = [self.python, "-m", "mmshm.cli", *args, "--dir", self.directory, "--json"]
        return (["nsenter", "-t", str(self.ns_pid), "-m", *cmd] if self.ns_pid is not None
                else cmd)

    def _json(self, *args: str) -> dict:
        env = {k: v for k, v in os.environ.items() if not k.startswith("MMSHM_")}
        p = subprocess.run(self.argv(*args), capture_output=True, text=True, timeout=120,
                           env=env)
        if p.returncode != 0:
            raise RuntimeError(f"{' '.join(self.argv(*args))}: exit {p.returncode}\n"
                               f"{p.stderr[-3000:]}")
        return json.loads(p.stdout)

    def status(self) -> dict:
        """``mmshm status --json`` (:class:`mmshm.operations.status.StatusReport` as a dict)."""
        return self._json("status")

    def gc_dry_run(self) -> dict:
        """``mmshm gc --dry-run --json`` (:class:`mmshm.segments.reaper.ReapReport` as a dict)."""
        return self._json("gc", "--dry-run")


def explain(status: dict) -> dict:
    """Sort the segments of a ``mmshm status --json`` report.

    Returns ``{"segments": total, "pooled": idle in an owner's warm pool,
    "cached": held by a named cache (the processes' ``cached`` counts, e.g.
    vLLM's processor cache), "orphans", "in_flight", "unexplained": number of
    segments neither pooled nor cached (live ones in use, orphans, segments
    in flight), "bytes": their bytes, "processes": [(pid, role, owned, held,
    pooled, cached)] of those holding some}``."""
    segs = status["segments"]
    pooled = sum(1 for s in segs if s["state"] == "pooled" and s["held"])
    cached = sum(p.get("cached", 0) for p in status["processes"])
    return {
        "segments": len(segs), "pooled": pooled, "cached": cached,
        "orphans": status["orphans"], "in_flight": status["in_flight"],
        "unexplained": max(0, len(segs) - pooled - cached),
        "bytes": status["segment_bytes"],
        "processes": [(p["pid"], p["role"], p["owned"], p["held"], p["pooled"],
                       p.get("cached", 0))
                      for p in status["processes"] if p["owned"] or p["held"]],
    }


def settle(mm: Mmshm, list_segments, idle_s: float, timeout_s: float = 60.0) -> dict:
    """Wait ``idle_s`` (the pool's idle time) and a second more, then list
    the segment files (``list_segments()``: the names now), read ``mmshm
    status`` and ``mmshm gc --dry-run``, and wait (up to ``timeout_s``) for
    the directory to be empty, as it must be once the pools have gone idle and
    no request holds a segment.

    Returns ``{"at_idle": names listed after the idle time, "after_idle":
    explain(status), "gc": {"would_reclaim", "bytes", "names", "live",
    "in_flight"}, "left": the names still there at the end, "empty_after_s":
    seconds from the start until the directory was seen empty (None if
    never), "status_s": seconds status and gc took}``."""
    t0 = time.monotonic()
    time.sleep(idle_s + 1.0)
    at_idle = list_segments()
    t1 = time.monotonic()
    status = mm.status()
    gc = mm.gc_dry_run()
    status_s = time.monotonic() - t1
    left = at_idle
    empty_s = None if left else round(t1 - t0, 1)
    while left and time.monotonic() - t0 < idle_s + timeout_s:
        left = list_segments()
        if not left:
            empty_s = round(time.monotonic() - t0, 1)
            break
        time.sleep(0.5)
    return {"at_idle": at_idle, "after_idle": explain(status),
            "gc": {"would_reclaim": gc["reclaimed"], "bytes": gc["reclaimed_bytes"],
                   "names": gc["names"], "live": gc["live"], "in_flight": gc["in_flight"]},
            "left": left, "empty_after_s": empty_s, "status_s": round(status_s, 1)}


def settle_problems(rec: dict) -> list[str]:
    """What :func:`settle` found wrong (empty when all is well)."""
    out = []
    e, gc = rec["after_idle"], rec["gc"]
    if e["unexplained"]:
        out.append(f"{e['unexplained']} segment(s) after the idle time that mmshm status does "
                   f"not explain (neither pooled nor cached): {e}")
    if e["orphans"] or e["in_flight"]:
        out.append(f"mmshm status: {e['orphans']} orphan(s), {e['in_flight']} in flight")
    if gc["would_reclaim"]:
        out.append(f"mmshm gc --dry-run would reclaim {gc['would_reclaim']} orphan(s): "
                   f"{gc['names']}")
    if rec["left"]:
        out.append(f"segments still there after the pool's idle time: {rec['left']}")
    return out


# -- mmshm's counters against the events ------------------------------------------------
#: short name -> (series, labels) of the counters held against the events.
COUNTERS = {
    "created": ("mmshm_segments_created_total", {}),
    "pool_hits": ("mmshm_pool_requests_total", {"result": "hit"}),
    "pool_misses": ("mmshm_pool_requests_total", {"result": "miss"}),
    "written": ("mmshm_shm_written_bytes_total", {}),
    "fallbacks": ("mmshm_inline_fallbacks_total", {}),
    "reaped": ("mmshm_reaped_segments_total", {}),
    "materialize_failures": ("mmshm_materialize_failures_total", {}),
    "request_failures": ("mmshm_request_failures_total", {}),
}


def counter_deltas(before: str, after: str) -> dict:
    """The :data:`COUNTERS` between two Prometheus expositions, and the
    gauges ``mmshm_segments_in_use`` / ``mmshm_shm_in_use_bytes`` of
    ``after`` (``in_use``, ``in_use_bytes``)."""
    from tests.harness.servers import metric

    out = {k: metric(after, name, **lab) - metric(before, name, **lab)
           for k, (name, lab) in COUNTERS.items()}
    out["in_use"] = metric(after, "mmshm_segments_in_use")
    out["in_use_bytes"] = metric(after, "mmshm_shm_in_use_bytes")
    return out


def counter_problems(d: dict, files: int, rejected_failures: int = 0) -> list[str]:
    """Where the counters ``d`` (:func:`counter_deltas`, over the storm and
    the rejects, read once the directory has settled) disagree with the
    events: ``files`` segment files left in the directory, at most
    ``rejected_failures`` requests that may count as failed.

    - segments in use (created and not yet freed and closed, pooled ones
      included) == the segment files left: every created segment was
      released, or is still there;
    - each pool lookup either revived a pooled segment or was followed by a
      creation or an inline fallback: ``misses == created + fallbacks``
      (a fallback may also come from a share that failed, so ``<=``);
    - no segment was reaped (no process died), no handle failed to open, no
      request failed in mmshm beyond the rejected ones."""
    out = []
    if d["in_use"] != files:
        out.append(f"mmshm_segments_in_use is {d['in_use']:.0f}, the directory holds {files}")
    if not d["created"] <= d["pool_misses"] <= d["created"] + d["fallbacks"]:
        out.append(f"pool misses {d['pool_misses']:.0f} against {d['created']:.0f} created and "
                   f"{d['fallbacks']:.0f} inline fallbacks")
    if d["created"] + d["pool_hits"] == 0:
        out.append("no segment was made or reused: the storm went around mmshm")
    for k in ("reaped", "materialize_failures"):
        if d[k]:
            out.append(f"{COUNTERS[k][0]} rose by {d[k]:.0f}")
    if d["request_failures"] > rejected_failures:
        out.append(f"mmshm_request_failures_total rose by {d['request_failures']:.0f}")
    return out


# -- the server's own shared memory ------------------------------------------------------
def shm_files(root: str | os.PathLike, patterns: tuple[str, ...] = ("psm_*",)) -> list[str]:
    """Names of the files directly under ``root`` matching ``patterns``."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    return sorted(n for n in names if any(fnmatch.fnmatchcase(n, p) for p in patterns))


class ShmWatch:
    """Counts the files matching ``patterns`` made and removed directly
    under ``root`` while it runs (inotify: a file that lives a millisecond is
    counted too), and the most present at once. A context manager; read
    :meth:`figures` after it.

    Args:
        root: the directory watched (a server's /dev/shm as the host sees it).
        patterns: ``fnmatch`` patterns of the names counted.
    """

    def __init__(self, root: str | os.PathLike, patterns: tuple[str, ...] = ("psm_*",)):
        self.root, self.patterns = str(root), patterns
        self.made = self.removed = 0
        self.peak = 0
        self._present: set[str] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _match(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, p) for p in self.patterns)

    def __enter__(self) -> ShmWatch:
        from inotify_simple import INotify, flags

        self._ino = INotify()
        self._ino.add_watch(self.root, flags.CREATE | flags.DELETE | flags.MOVED_TO |
                            flags.MOVED_FROM)
        self._present = set(shm_files(self.root, self.patterns))
        self.at_start = len(self._present)
        self.peak = len(self._present)
        self._flags = flags
        self._thread = threading.Thread(target=self._run, name="shm-watch", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        f = self._flags
        while not self._stop.is_set():
            for ev in self._ino.read(timeout=200):
                if not ev.name or not self._match(ev.name):
                    continue
                if ev.mask & (f.CREATE | f.MOVED_TO):
                    self.made += 1
                    self._present.add(ev.name)
                    self.peak = max(self.peak, len(self._present))
                elif ev.mask & (f.DELETE | f.MOVED_FROM):
                    self.removed += 1
                    self._present.discard(ev.name)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        self._ino.close()

    def figures(self) -> dict:
        """``{"at_start", "made", "removed", "peak", "now"}``: files present
        when the watch began, made and removed during it, most present at
        once, present now (listed)."""
        return {"at_start": self.at_start, "made": self.made, "removed": self.removed,
                "peak": self.peak, "now": len(shm_files(self.root, self.patterns))}


def group_shm_files(pgid: int, root: str = "/dev/shm") -> list[str]:
    """Names of the files under ``root`` that a process of process group
    ``pgid`` maps or holds open (a server on the host's /dev/shm, beside other
    programs' files)."""
    from tests.harness.servers import mapped_shm_names

    return sorted(mapped_shm_names(root, pgid=pgid))


# -- the whole sequence --------------------------------------------------------------------
def run_faults(client, model: str, urls: list[str], shots: list[Shot],
               cases: list[tuple[str, list[str], str, int]], fixed, *,
               mm: Mmshm | None = None, list_segments=None, idle_s: float = 2.0,
               metrics=None, shm_root: str | os.PathLike | None = None,
               pgid: int | None = None, concurrency: int = 4, max_tokens: int = 16,
               detail_path: str | os.PathLike | None = None) -> dict:
    """The storm, then the rejects, then the checks, against one running
    server.

    Args:
        client, model: an ``openai.OpenAI`` for the server, its model name.
        urls, shots: the storm's photo URLs and its :func:`plan`.
        cases: :func:`reject_cases`.
        fixed: a callable sending the fixed request; what it returns (greedy
            texts, tokens and logprobs) must be equal before and after.
        mm: how to run ``mmshm`` where the server runs (None: a server
            without mmshm; no status, gc or counters).
        list_segments: a callable giving mmshm's segment file names now.
        idle_s: the pool's idle time (``MMSHM_POOL_IDLE_S``), seconds.
        metrics: a callable giving the server's Prometheus exposition (for
            mmshm's counters), or None.
        shm_root: the server's /dev/shm as this process sees it, when it is
            the server's own (a private tmpfs): the server's own shared
            memory (``psm_*``; SGLang 0.5.23's ``sgl_shm_mm_*``, see
            :data:`SERVER_OWN`) and mmshm's ``mmshm-*`` files are watched
            (made, removed, peak) over the storm and counted after it.
        pgid: the server's process group: the /dev/shm files its processes
            map or hold open, before and after (a server on the host's
            /dev/shm, beside other programs' files).
        detail_path: where to write the per-request record (JSON).

    Returns a dict: ``fixed_before``, ``fixed_after``, ``fixed_equal``;
    ``storm`` (``outcomes``, ``errors``, ``seconds``, ``shots``); ``watch``
    (per pattern, :meth:`ShmWatch.figures`) and ``psm_after_storm`` /
    ``psm_after_idle`` (with ``shm_root``); ``group_files_before`` /
    ``group_files_after`` (with ``pgid``); ``rejects`` (:func:`rejects`);
    with ``mm``: ``settle`` (:func:`settle`), ``counters``
    (:func:`counter_deltas`), ``segments_after_storm``; ``seconds``."""
    t0 = time.monotonic()
    rec: dict = {}
    rec["fixed_before"] = fixed()
    m0 = metrics() if metrics is not None and mm is not None else None
    if pgid is not None:
        rec["group_files_before"] = group_shm_files(pgid)
    watches = ([ShmWatch(shm_root, (p,)) for p in (*SERVER_OWN, "mmshm-*")]
               if shm_root is not None else [])
    for w in watches:
        w.__enter__()
    try:
        res = storm(client, model, urls, shots, concurrency, max_tokens)
    finally:
        for w in watches:
            w.__exit__(None, None, None)
    rec["storm"] = {"shots": len(shots), "outcomes": res["outcomes"],
                    "errors": res["errors"], "seconds": res["seconds"]}
    if watches:
        rec["watch"] = {w.patterns[0]: w.figures() for w in watches}
        rec["psm_after_storm"] = len(shm_files(shm_root, ("psm_*",)))
        rec["sgl_shm_mm_after_storm"] = len(shm_files(shm_root, ("sgl_shm_mm_*",)))
    if list_segments is not None:
        rec["segments_after_storm"] = len(list_segments())
    rec["rejects"] = rejects(client, model, cases)
    if mm is not None:
        rec["settle"] = settle(mm, list_segments, idle_s)
        if m0 is not None:
            rec["counters"] = counter_deltas(m0, metrics())
    else:
        time.sleep(idle_s + 1.0)
    if shm_root is not None:
        rec["psm_after_idle"] = len(shm_files(shm_root, ("psm_*",)))
        rec["sgl_shm_mm_after_idle"] = len(shm_files(shm_root, ("sgl_shm_mm_*",)))
    if pgid is not None:
        rec["group_files_after"] = group_shm_files(pgid)
    rec["fixed_after"] = fixed()
    rec["fixed_equal"] = rec["fixed_after"] == rec["fixed_before"]
    rec["seconds"] = round(time.monotonic() - t0, 1)
    if detail_path is not None:
        Path(detail_path).write_text(json.dumps({**rec, "requests": res["requests"]}, indent=1,
                                                default=str))
    return rec


def summary(rec: dict) -> dict:
    """The figures of :func:`run_faults`'s record worth printing (no
    per-request detail)."""
    out = {"storm": {k: rec["storm"][k] for k in ("shots", "outcomes", "seconds")},
           "rejects": {r["case"]: r["status"] for r in rec["rejects"]},
           "fixed_equal": rec["fixed_equal"], "seconds": rec["seconds"]}
    for k in ("watch", "psm_after_storm", "psm_after_idle", "sgl_shm_mm_after_storm",
              "sgl_shm_mm_after_idle", "segments_after_storm"):
        if k in rec:
            out[k] = rec[k]
    if "settle" in rec:
        st = rec["settle"]
        out["after_idle"] = {k: st["after_idle"][k] for k in
                             ("segments", "pooled", "cached", "unexplained", "orphans")}
        out["gc_would_reclaim"] = st["gc"]["would_reclaim"]
        out["empty_after_s"] = st["empty_after_s"]
    if "counters" in rec:
        out["counters"] = {k: int(v) for k, v in rec["counters"].items()}
    if "group_files_before" in rec:
        out["group_files"] = (len(rec["group_files_before"]), len(rec["group_files_after"]))
    return out


def problems(rec: dict, rejected_failures: int = 0) -> list[str]:
    """Everything :func:`run_faults`'s record shows wrong, in words (empty:
    all is well): a storm request that failed other than by the client
    closing it, a reject that was not refused with a 4xx, a fixed answer that
    changed, and with mmshm :func:`settle_problems` and
    :func:`counter_problems`."""
    out = [f"storm request {e['index']} ({e['photos']} photo(s), n={e['n']}, {e['point']}): "
           f"{e['outcome']}" for e in rec["storm"]["errors"]]
    out += [f"reject {r['case']!r}: HTTP {r['status']}: {r['error'][:200]}"
            for r in rec["rejects"] if not refused(r)]
    if not rec["fixed_equal"]:
        out.append(f"the fixed request's answer changed: {rec['fixed_before']!r} -> "
                   f"{rec['fixed_after']!r}")
    if "settle" in rec:
        out += settle_problems(rec["settle"])
    if "counters" in rec:
        out += counter_problems(rec["counters"], len(rec["settle"]["left"]), rejected_failures)
    return out


__all__ = [
    "POINTS", "SMALL", "Mmshm", "Shot", "chat_content", "counter_deltas", "counter_problems",
    "explain", "group_shm_files", "plan", "problems", "refused", "reject_cases", "rejects", "settle",
    "settle_problems", "ShmWatch", "shm_files", "small_photo_urls", "storm", "run_faults", "summary",
]
