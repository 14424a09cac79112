"""Prefill/decode disaggregation, engine side: KV blocks computed by a prefill engine are pulled
by a decode engine, as a connector load (a load is a load: asynchronous, verified, recomputed
when it fails).

- :mod:`.params`: ``kv_transfer_params`` of vLLM's P/D contract, read and written;
- :mod:`.leases`: the producer's held blocks (lease per finished prefill, released on pull,
  abort or timeout);
- :mod:`.block_memory`: byte access to the primary pool's blocks (runs of consecutive blocks);
- :mod:`.transport`: what a transport is (pull jobs; a lease server); :mod:`.wire`,
  :mod:`.transfer_server`, :mod:`.transfer_client`: the TCP transport;
- :mod:`.connector`: the ``pd`` connector tying them to the scheduler.

The router side (which requests are split, which engines) lives in ``kvserve.cluster``.
"""
