"""The suffix drafter's speculation in C (specdec/native/suffix.c), called through ctypes.

``speculate`` here takes and returns what ``suffix_speculate.speculate`` does, and gives the same
drafts (tests/drafters/test_suffix_native.py); one C call replaces the ~100 numpy calls a step
cost in Python. ``load()`` is None when specdec was installed without its compiled kernels
(``SPECDEC_NO_NATIVE=1``, no C compiler) or their library predates this file: the drafter then
runs the Python path, which stays the oracle.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import logging

import numpy as np

from specdec.drafters.suffix_corpus import TokenCorpus
from specdec.drafters.suffix_speculate import TOUCHED, Draft, SpeculateParams

logger = logging.getLogger("specdec")

ABI = 1  # SD_SUFFIX_ABI in suffix.c
_P, _I, _D = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double


@functools.cache  # one handle per process (and one log line)
def load() -> ctypes.CDLL | None:
    """The kernels' library with ``sd_suffix_speculate`` bound, or None (said once in the log)."""
    spec = importlib.util.find_spec("specdec._cpu_kernels")
    if spec is None or spec.origin is None:
        logger.info("suffix drafter: compiled kernels not built: drafting in Python")
        return None
    try:
        lib = ctypes.CDLL(spec.origin)
        abi = lib.sd_suffix_abi()
    except (OSError, AttributeError) as e:
        logger.warning("suffix drafter: no compiled speculation in %s (%s; rebuild: pip install "
                       "-e .): drafting in Python", spec.origin, e)
        return None
    if abi != ABI:
        logger.warning("suffix drafter: compiled speculation in %s is ABI %s, this specdec "
                       "expects %s (rebuild: pip install -e .): drafting in Python",
                       spec.origin, abi, ABI)
        return None
    fn = lib.sd_suffix_speculate
    fn.restype = _I
    fn.argtypes = [_P, _I, _P, _P, _I, _I, _I,  # the corpus
                   _P, _I, _I, _I, _I,  # pattern, its length, before, max_nodes, max_depth
                   _D, _D, _D, _I, _I,  # the SpeculateParams
                   _P, _P, _P, _P, _P, _P]  # tokens, parents, probs, ends, meta, score
    return lib


def speculate(corpus: TokenCorpus, pattern: np.ndarray, before: int, max_nodes: int,
              max_depth: int, params: SpeculateParams) -> Draft | None:
    """``suffix_speculate.speculate`` in one C call; needs ``load()``. ``pattern``: the context's
    last tokens, contiguous int32 (e.g. a slice of a corpus' ``buf``)."""
    if not len(pattern) or max_nodes <= 0:
        return None
    assert pattern.dtype == np.int32 and pattern.flags.c_contiguous
    tokens = np.empty(max_nodes, dtype=np.int64)
    parents = np.empty(max_nodes, dtype=np.int64)
    probs = np.empty(max_nodes, dtype=np.float64)
    ends = np.empty(TOUCHED, dtype=np.int64)
    meta = np.empty(2, dtype=np.int64)  # match length, occurrences in `ends`
    score = np.empty(1, dtype=np.float64)
    n = load().sd_suffix_speculate(
        corpus.buf.ctypes.data, corpus.n, corpus.order.ctypes.data, corpus.keys.ctypes.data,
        len(corpus.keys), corpus.n_sorted, corpus.dead, pattern.ctypes.data, len(pattern),
        before, max_nodes, max_depth, params.max_spec_factor, params.max_spec_offset,
        params.min_token_prob, params.max_candidates, params.tree, tokens.ctypes.data,
        parents.ctypes.data, probs.ctypes.data, ends.ctypes.data, meta.ctypes.data,
        score.ctypes.data)
    if n < 0:
        raise MemoryError("suffix drafter: the compiled speculation could not allocate its "
                          f"scratch ({len(corpus.keys)} indexed tokens, max_candidates "
                          f"{params.max_candidates})")
    if n == 0:
        return None
    return Draft(tokens[:n], parents[:n], probs[:n], float(score[0]), int(meta[0]),
                 ends[:int(meta[1])])
