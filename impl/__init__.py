"""pagedkv's optimized implementation, in two layers.

* :mod:`pagedkv.impl.blocks`: block management with the spec's behaviour, on numpy arrays (no
  torch): the free queue, the block manager, prefix caching and the batched block-table store.
* :mod:`pagedkv.impl.serving`: what serves a model from the paged cache: the scheduler (no
  torch), the model, the paged KV cache, sampling, metrics, the engine and the dense oracle.

Serving builds on block management, never the other way round. This package's namespace holds
nothing of its own: import from the layer.
"""

if __name__ != "pagedkv.impl":  # the repository root is on sys.path: refuse a second name
    raise ImportError(f"import pagedkv.impl, not {__name__}: one module, one name")
