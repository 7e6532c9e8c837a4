"""What a model is and how its weights reach the kernels.

    loader.py, aliases.py, tokenizer.py   find a model (alias, HF folder, GGUF, hub id), load it
    weights.py                            the engine's weights made ready at build
    decoder/                              the Llama-family decoder (a new family goes here)
    gguf/                                 GGUF files and every GGUF type (a new type goes here)
    checkpoints/                          safetensors checkpoints, quantized at load
    matmul/                               the matmul hook a model gets, and what it runs
    heads/                                the learned drafters' models and their folders

The compiled CPU kernels' Python side is specdec.native (attention and the engine call it too).
"""
