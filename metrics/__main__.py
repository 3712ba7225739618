"""``python -m mmshm.metrics [--port N] [--addr A] [--once]``

With ``PROMETHEUS_MULTIPROC_DIR`` set (to the directory a server's processes
write to), serve their merged mmshm series on ``http://A:N/metrics``; a
side-car exporter for servers that do not expose ``/metrics`` themselves.
``--once`` prints one exposition to stdout and exits.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from . import DEFAULT_ADDR, render, start_exporter


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mmshm.metrics", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--port", type=int, default=int(os.environ.get("MMSHM_METRICS_PORT") or 9477))
    p.add_argument("--addr", default=os.environ.get("MMSHM_METRICS_ADDR") or DEFAULT_ADDR)
    p.add_argument("--once", action="store_true", help="print one exposition and exit")
    args = p.parse_args(argv)
    if args.once:
        sys.stdout.buffer.write(render())
        return 0
    srv = start_exporter(args.port, args.addr)
    print(f"serving on http://{args.addr}:{srv.server_port}/metrics", flush=True)
    signal.sigwait({signal.SIGINT, signal.SIGTERM})
    return 0


if __name__ == "__main__":
    sys.exit(main())
