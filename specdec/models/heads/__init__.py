"""The learned drafters' models and their folders: the EAGLE-3 head, MTP heads and the
block-diffusion drafter (each with its *_io.py checkpoint format), what they share with their
target (draft_vocab.py, feature_head.py), their quantized weights (weights.py) and which serving
engines load what they export (export_formats.py, checkpoint.py)."""
