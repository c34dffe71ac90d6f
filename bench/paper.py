"""Numbers published in the vLLM paper that the benchmarks are compared with.

Kwon et al., "Efficient Memory Management for Large Language Model Serving with
PagedAttention", SOSP 2023 (arXiv:2309.06180). Each constant says where it is printed.
"""

from __future__ import annotations

PAPER = "Kwon et al., SOSP 2023 (arXiv:2309.06180)"

FIG2_MEMORY_SHARES: dict[str, dict[str, float]] = {
    # Fig. 2, "average percentage of memory wastes in different LLM serving systems during
    # the experiment in §6.2" (the caption names no model or dataset): token states,
    # reservation, internal fragmentation, external fragmentation & others, as printed on the
    # bars. vLLM's bar prints only its token states.
    "orca-max": {"token_states": 20.4, "reservation": 13.3, "internal": 57.3, "external": 8.9},
    "orca-pow2": {"token_states": 26.8, "reservation": 17.9, "internal": 13.6, "external": 41.6},
    "orca-oracle": {"token_states": 38.2, "reservation": 25.2, "internal": 0.0, "external": 36.6},
    "paged-bs16": {"token_states": 96.3},
}

FIG13A_BATCH_RATIOS = {"orca-max": 4.3, "orca-oracle": 2.2}
"""§6.2: on ShareGPT with OPT-13B, vLLM batches 4.3x more requests than Orca (Max) and 2.2x more
than Orca (Oracle)."""

FIG13_MEAN_BATCH: dict[str, dict[str, float]] = {
    # Fig. 13, printed on the bars: average batched requests serving OPT-13B, ShareGPT at
    # 2 requests/s (13a) and Alpaca at 30 requests/s (13b).
    "sharegpt": {"paged-bs16": 30.42, "orca-oracle": 13.62, "orca-pow2": 9.81, "orca-max": 7.00},
    "alpaca": {"paged-bs16": 132.44, "orca-oracle": 72.75, "orca-pow2": 43.24, "orca-max": 7.00},
}
FIG13_REQUEST_RATES = {"sharegpt": 2, "alpaca": 30}
"""Fig. 13's caption: the request rates (requests/s) at which the batches were averaged."""

FIG11_MEAN_LENGTHS = {"sharegpt": (161.31, 337.99), "alpaca": (19.31, 58.45)}
"""Fig. 11: mean input and output tokens (the text: ShareGPT's inputs are 8.4x and its outputs
5.8x longer than Alpaca's)."""

FIG15_PARALLEL_SAVING = {"alpaca": (6.1, 9.8), "sharegpt": (16.2, 30.5)}
"""§6.3 and Fig. 15: memory saved by sharing in parallel sampling (2 to 6 samples), in percent
of the blocks used without sharing."""
