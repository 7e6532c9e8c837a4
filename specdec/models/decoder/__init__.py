"""Our Llama-family decoder: its config read from a Hugging Face one (config.py: the families it
runs), the layers (llama.py), RoPE (rope.py) and the one-kernel-per-step ops a GPU runs
(layer_ops.py)."""
