"""pagedkv's optimized block manager: the spec's behaviour, array-backed and batched."""
