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


class Speculate:
    """``suffix_speculate.speculate`` in one C call (needs ``load()``), with the output scratch
    of one drafter; ``pattern``: the context's last tokens, contiguous int32 (e.g. a slice of a
    corpus' ``buf``)."""

    def __init__(self) -> None:
        self.fn = load().sd_suffix_speculate
        self._grow(64)

    def _grow(self, max_nodes: int) -> None:
        self.ints = np.empty(2 * max_nodes + TOUCHED + 2, dtype=np.int64)  # tokens, parents,
        self.floats = np.empty(max_nodes + 1, dtype=np.float64)  # ends, meta; probs, score
        self.capacity, self.iptr, self.fptr = max_nodes, self.ints.ctypes.data, \
            self.floats.ctypes.data

    def __call__(self, corpus: TokenCorpus, pattern: np.ndarray, before: int, max_nodes: int,
                 max_depth: int, params: SpeculateParams) -> Draft | None:
        if not len(pattern) or max_nodes <= 0:
            return None
        assert pattern.dtype == np.int32 and pattern.flags.c_contiguous
        if max_nodes > self.capacity:
            self._grow(max_nodes)
        cap, ints, iptr = self.capacity, self.ints, self.iptr
        buf, order, keys = corpus.addresses()
        n = self.fn(buf, corpus.n, order, keys, len(corpus.keys), corpus.n_sorted, corpus.dead,
                    pattern.ctypes.data, len(pattern), before, max_nodes, max_depth,
                    params.max_spec_factor, params.max_spec_offset, params.min_token_prob,
                    params.max_candidates, params.tree, iptr, iptr + 8 * cap, self.fptr,
                    iptr + 16 * cap, iptr + 8 * (2 * cap + TOUCHED), self.fptr + 8 * cap)
        if n < 0:
            raise MemoryError("suffix drafter: the compiled speculation could not allocate "
                              f"its scratch ({corpus.n} tokens, max_candidates "
                              f"{params.max_candidates})")
        if n == 0:
            return None
        meta = ints[2 * cap + TOUCHED:].tolist()  # match length, occurrences in ends
        return Draft(ints[:n].copy(), ints[cap:cap + n].copy(), self.floats[:n].copy(),
                     float(self.floats[cap]), meta[0], ints[2 * cap:2 * cap + meta[1]].copy())
