"""pagedkv: PagedAttention's KV-cache block management, specified, implemented and checked.

The package's layers, each a subpackage (``pyproject.toml`` maps them to the repository's
top-level folders ``spec/``, ``impl/`` and ``kernels/``):

* :mod:`pagedkv.spec`: the executable semantics in plain Python; every other layer is checked
  against it.
* :mod:`pagedkv.impl.blocks`: block management on numpy arrays, with the spec's behaviour
  (free queue, block manager, prefix cache, batched block-table store). No torch.
* :mod:`pagedkv.kernels`: Triton kernels that read the KV cache through block tables, and
  their torch reference.
* :mod:`pagedkv.impl.serving`: the scheduler (no torch), the model, the paged KV cache and the
  engine, built on the two layers above.

Dependencies run one way: spec <- blocks <- serving, and spec <- kernels <- serving.
"""

__version__ = "0.1.0"
