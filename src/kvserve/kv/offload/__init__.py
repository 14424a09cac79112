"""KV offloading below the primary pool.

- ``connector.py``: :class:`OffloadingConnector` (``kv_connector="offload"``), both halves;
- ``manager.py``: which chunks a tier holds, their ref counts, eviction, KV events;
- ``policies/``: LRU and ARC eviction order;
- ``worker.py`` / ``block_copy.py``: asynchronous batched copies (CPU thread, CUDA streams).

Storage itself lives in :mod:`kvserve.kv.backends`. Nothing here touches the scheduler's
state or the model: the connector interface (:mod:`kvserve.kv.connector`) is the boundary.
"""
