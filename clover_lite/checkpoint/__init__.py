"""Checkpoints on disk: reading safetensors, mapping Hub names, loading, saving."""
