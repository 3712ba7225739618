"""``mmshm bench serve``: benchmarks of a real server (SGLang, vLLM on CPU).

- :mod:`mmshm.bench.serve.ttft`: time to first token, the plain server
  against the same server under ``mmshm run`` (``mmshm bench serve ttft``);
- :mod:`mmshm.bench.serve.transport`: the multimodal IPC cost per hop, the
  server's own transport against mmshm's (``mmshm bench serve transport``);
- :mod:`mmshm.bench.serve.servers`: the server starter both use, and the
  e2e tests too (``tests/harness/servers.py`` imports it).

Each runs with the server's interpreter (``mmshm bench serve --python
PYTHON NAME``, or ``PYTHON -m mmshm.cli bench serve NAME``). None of them
imports the server: they talk HTTP to its processes.
"""
