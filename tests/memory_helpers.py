"""An engine's start in a process of its own, the resident memory it adds measured (VmRSS,
VmHWM) after the imports a start makes (transformers' config and tokenizer classes, the
kernels): ``START``, run as ``python -c START <model> <weights>``, prints one JSON line
{"grew", "peak", "matrices" (bytes of its matrices as float32), "weights"}."""

START = """
import json, sys
from specdec import LLM, SamplingParams
from specdec.models.loader import resolve_model_path
def rss(key):
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(key))
from specdec import native
from specdec.models.loader import load_hf_config
from specdec.models.tokenizer import load_tokenizer
folder = resolve_model_path(sys.argv[1])  # made, and what reading it imports, before
load_hf_config(folder), load_tokenizer(folder), native.load()
before = rss("VmRSS:")
llm = LLM(model=sys.argv[1], weights=sys.argv[2], max_model_len=64, num_pages=8)
llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
print(json.dumps({"grew": rss("VmRSS:") - before, "peak": rss("VmHWM:") - before,
                  "matrices": sum(w.numel() for w in llm.engine.parts.model.matrices()) * 4,
                  "weights": llm.engine.parts.weights}))
"""
