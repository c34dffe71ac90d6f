"""The state machines the property files run and the planted-bug tests reuse.

* :mod:`~properties.machines.block_manager`: any class with the spec's block-manager API
  against an independent model, with simulated KV data;
* :mod:`~properties.machines.prefix_cache`: any class with the spec's prefix-cache API against
  an independent model;
* :mod:`~properties.machines.differential`: ``impl.BlockManager`` and ``spec.BlockManager`` in
  lockstep;
* :mod:`~properties.machines.prefix`: spec and impl prefix managers in lockstep, and the store
  on prefix-caching managers;
* :mod:`~properties.machines.store`: ``impl.BlockTableStore`` against the spec called once per
  sequence;
* :mod:`~properties.machines.free_queue`: ``FreeBlockQueue`` against a Python list;
* :mod:`~properties.machines.vllm`: vLLM's KV-cache manager against the spec (run in
  ``.venv-vllm`` by ``properties/vllm_env.py``, never collected by the main suite).
"""
