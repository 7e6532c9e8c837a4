"""llama.cpp as a `specdec bench` baseline: the same GGUF, the same token ids, greedy.

`--baseline llama.cpp` runs llama-cpp-python (the optional extra ``specdec[llamacpp]``; it
builds llama.cpp from source, ~15 min on 2 cores, so never in CI) on the model's GGUF file —
the one a GGUF alias or folder keeps as ``model.gguf`` — one prompt at a time, on as many
threads as torch uses. `--baseline llama.cpp-pld` (or `--extra-baseline llama.cpp-pld` beside
`--baseline llama.cpp`) adds its prompt-lookup decoding (``LlamaPromptLookupDecoding``, 10
tokens), and the report says whether its output equals its own plain output.

Both stop on the engine's stop set and at max_new_tokens, so token counts compare. llama.cpp
computes Q4_1 dot products against activations it rounds to 8 bits (Q8_1), so its tokens are
not the fp32 model's: the match rate against the engine is reported, never expected to be 1.

Install (AMX builds have crashed; these flags build for AVX2 without AMX on any x86-64 CPU):

    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \\
      -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" \\
      pip install 'specdec[llamacpp]'
"""

from __future__ import annotations

from pathlib import Path

import torch

from specdec.bench.timing import one_by_one
from specdec.models.aliases import GGUF_NAME

LLAMA_CPP_BASELINES = ("llama.cpp", "llama.cpp-pld")
PLD_NUM_TOKENS = 10


def gguf_path(model: str, folder: Path) -> Path:
    """The GGUF file of ``model`` (a .gguf path, or its converted folder's copy)."""
    if str(model).endswith(".gguf") and Path(model).is_file():
        return Path(model)
    path = folder / GGUF_NAME
    if not path.exists():
        raise ValueError(f"--baseline llama.cpp needs a GGUF model; {model!r} ({folder}) has "
                         f"no {GGUF_NAME}")
    return path


class LlamaCppSystem:
    """llama-cpp-python on a GGUF, greedy, one prompt at a time (see module docstring)."""

    def __init__(self, path: Path, max_new_tokens: int, eos_ids: tuple[int, ...], pld: bool,
                 n_ctx: int = 4096) -> None:
        try:
            import llama_cpp
        except ImportError as e:
            raise ValueError(f"--baseline llama.cpp needs llama-cpp-python ({e}; pip install "
                             "'specdec[llamacpp]'; see specdec/bench/llamacpp.py for the "
                             "build flags)") from e
        kwargs = {}
        if pld:
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            kwargs["draft_model"] = LlamaPromptLookupDecoding(num_pred_tokens=PLD_NUM_TOKENS)
        threads = torch.get_num_threads()
        self.llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_threads=threads,
                                   n_threads_batch=threads, verbose=False, **kwargs)
        self.max_new_tokens, self.eos_ids = max_new_tokens, set(eos_ids)
        self.version = getattr(llama_cpp, "__version__", "?")

    def _one(self, ids: list[int]) -> list[int]:
        out: list[int] = []
        for token in self.llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0,
                                       reset=True):
            if token in self.eos_ids:
                break
            out.append(int(token))
            if len(out) >= self.max_new_tokens:
                break
        return out

    def run(self, prompts: list[list[int]], salt: str | None = None):
        return one_by_one(self._one, prompts)  # reset=True per prompt: salt unused
