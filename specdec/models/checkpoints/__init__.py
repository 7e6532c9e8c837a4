"""Safetensors checkpoints: memory-mapped (safetensors_file.py), their matrices on their own
bytes or quantized into GGUF blocks at load (weights.py, quantize.py), cached
(quantized_cache.py)."""
