"""GGUF files: the header and metadata (file.py, metadata.py), a decoder's weights from them
(model.py, block_weight.py), every GGUF type's bytes and dequantization (types.py, blocks.py,
kquant_blocks.py) and their layouts for the compiled kernels (repack.py, q8_activations.py,
weights.py)."""
