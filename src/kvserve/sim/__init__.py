"""kvserve.sim: simulated engines for cluster-scale experiments on small machines.

A simulated instance is the real engine (``LLMEngine``: block pool, prefix cache, scheduler,
KV connector, KV events) behind the real OpenAI server and metrics, with the model runner
replaced by a latency model (:mod:`.latency_model`, :mod:`.runner`) and the host offload
tier's copies replaced by timed transfers (:mod:`.offload`). Cache behaviour is therefore
real; only time is modelled. :mod:`.instance` serves one or many instances in one process,
:mod:`.oracle` is a router that reads every instance's exact state (an upper bound),
:mod:`.calibrate` fits the latency model to the real engine, :mod:`.cli` is `kvserve sim`.

This package must not change engine, server or router behaviour: it only plugs into their
extension points (the ``runner`` argument of ``LLMEngine``, the connector registry, the
router's scorer interface).
"""
