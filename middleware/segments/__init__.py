"""Layer 3, the segments: tensors in shared-memory files, and who owns them.

In dependency order:

- :mod:`~mmshm.segments.node`: node identity (which processes open each other's
  segments), and simulating several nodes on one machine;
- :mod:`~mmshm.segments.segfile`: the segment file (name, header, holder count,
  state byte, the segment directory); the ``mmshm-`` prefix is spelled here once
  (:data:`~mmshm.segments.segfile.PREFIX`);
- :mod:`~mmshm.segments.reaper`: reclaiming segments whose holders died;
- :mod:`~mmshm.segments.table`: the process's table of segments, the warm pool
  and its sweeper;
- :mod:`~mmshm.segments.segment`: one mapped segment and its references;
- :mod:`~mmshm.segments.codec`: a handle's wire metadata (:class:`HandleMeta`);
- :mod:`~mmshm.segments.refdebug`: reference debugging (``MMSHM_DEBUG_REFS``); it
  wraps the module below, which hands itself over at import;
- :mod:`~mmshm.segments.arena`: the arena, segments each consumer maps once
  and registers with CUDA once (``MMSHM_ARENA_BYTES``), and the copies
  between them and a GPU;
- :mod:`~mmshm.segments.shmtensor`: :class:`~mmshm.ShmTensor`, the picklable,
  refcounted handle to a tensor in a segment.

May import: :mod:`mmshm.errors`, :mod:`mmshm.config`, :mod:`mmshm.metrics`,
:mod:`mmshm.hooks`, and modules listed before it here (tests/test_layout.py's
``LAYERS`` is the rule).
"""
