"""Benchmarks, one module per command: ``specdec bench`` (compare.py; sweep.py for several
batch sizes and controllers), ``bench-prefix`` (prefix.py), ``bench-serve`` (serve.py); shared
prompts (data.py), reports (report.py), timing (timing.py) and the llama.cpp baseline
(llamacpp.py)."""
