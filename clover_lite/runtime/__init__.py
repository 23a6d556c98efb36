"""The runtime: the engine, the block-by-block decoding loop, the cache and the CUDA-graph step."""
