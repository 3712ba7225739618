"""What the SGLang tests' ranks import, imported once per test session by
their fork server (:func:`tests.harness.procs.preload_ctx`): SGLang's
transport and receive modules (:func:`tests.integrations.sglang_env.load`:
the scheduler or its request receiver, io_struct, mm_utils, the tokenizer
manager, utils), pyzmq, and mmshm's SGLang integration, which is imported,
not applied: each rank calls ``mmshm.instrument("sglang")`` itself, as
before. Every rank is a fork of the server: it does not import SGLang again
(about 9 s of CPU per rank)."""

from __future__ import annotations

import mmshm.integrations.sglang
import mmshm.operations.autopatch  # noqa: F401 - mmshm.instrument
import pytest  # noqa: F401 - the DP-attention ranks' target's module imports it
import zmq  # noqa: F401 - test_sglang.py's ranks

from tests.harness import procs  # noqa: F401 - the ranks' entry points
from tests.integrations import sglang_env

sglang_env.load()
