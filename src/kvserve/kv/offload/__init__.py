"""KV offloading below the primary pool.

- ``connector.py``: :class:`OffloadingConnector` (``kv_connector="offload"``), both halves,
  its parts in ``scheduler_side.py``, ``worker_side.py``, ``group_stage.py`` (KV cache groups),
  ``storage_tiers.py`` (the tiers below the host tier) and ``connector_state.py`` (records);
- ``storage_worker.py`` / ``storage_writer.py``: storage-tier I/O off the engine thread;
- ``manager.py``: which chunks a tier holds, their ref counts, eviction, KV events;
- ``policies/``: LRU and ARC eviction order;
- ``worker.py`` / ``block_copy.py``: asynchronous batched copies (CPU thread, CUDA streams).

Storage itself lives in :mod:`kvserve.kv.backends`. Nothing here touches the scheduler's
state or the model: the connector interface (:mod:`kvserve.kv.connector`) is the boundary.
"""
