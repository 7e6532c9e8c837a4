"""Randomness as a function of (request seed, token position, stream): counter-based, no state.

A sampled request's random numbers are not drawn from a generator whose state advances with
every draw: the noise behind the token at position ``n`` (its index in prompt + output) is a pure
function of the request's seed, ``n`` and a stream id. So a seed gives the same tokens whether a
step verified 0, 1 or 30 draft nodes for it, whatever else is in the batch, after a preemption, and
on any device (the hash is integer arithmetic, the same on CPU and CUDA).

Streams (independent of each other):

* ``SAMPLE``: the Exp(1) noise row ``E[n]`` of the token drawn at position n: plain sampling is
  ``argmax p / E[n]`` (the exponential race, an exact draw from p); the ``gumbel`` verifier
  emits that same token; drafters that sample draw with the same noise (coupled drafts).
* ``RESIDUAL``: the ``rejection`` verifier's final draws, which must be independent of any
  noise a drafter has seen.
* ``COIN + s``: the rejection verifier's acceptance coin for the child of rank ``s`` tried at
  position n.

Construction: a 64-bit key per (seed, position, stream) on the host (splitmix64, as in
Steele et al., "Fast splittable pseudorandom number generators", 2014), split into two 32-bit
words k1, k2; per token t a 32-bit hash ``h = mix(mix(t * G + k1) ^ k2)`` with the "lowbias32"
finaliser (Wellons, hash-prospector), in int32 tensor ops (wrapping arithmetic, logical shifts by
masking) so that a whole batch of rows is one vectorised pass. A uniform is
``(h + 2**31 + 0.5) / 2**32`` in float64 (h signed) (never 0 or 1), Exp(1) noise is ``-log`` of it.

Example: ``noise([key(seed=7, position=12)], vocab=5)`` is one [1, 5] float64 row; the same call
gives the same row in any process.
"""

from __future__ import annotations

import torch

from specdec.sampling import greedy

SAMPLE, RESIDUAL, COIN = 0, 1, 2
_M64 = (1 << 64) - 1
_GOLDEN64 = 0x9E3779B97F4A7C15


def _s32(u: int) -> int:
    """An unsigned 32-bit value as the int32 with the same bits."""
    u &= 0xFFFFFFFF
    return u - (1 << 32) if u >= 1 << 31 else u


_A, _B, _G = _s32(0x7FEB352D), _s32(0x846CA68B), _s32(0x9E3779B9)


def splitmix64(x: int) -> int:
    """The splitmix64 finaliser of ``x + golden`` (a bijection of 64-bit ints)."""
    x = (x + _GOLDEN64) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def key(seed: int, position: int, stream: int = SAMPLE) -> int:
    """The 64-bit key of one (seed, position, stream): seed an int in [0, 2**63), position >= 0."""
    return splitmix64(splitmix64(splitmix64(seed & _M64) ^ position) ^ stream)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on int32 tensors: wrapping multiplies, logical right shifts (masked)."""
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * _A
    x = x ^ ((x >> 15) & 0x1FFFF)
    x = x * _B
    return x ^ ((x >> 16) & 0xFFFF)


def _words(keys: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
    """keys [R] (64-bit host ints) -> (k1, k2) [R, 1] int32 on ``device``."""
    k1 = [_s32(k) for k in keys]
    k2 = [_s32(k >> 32) for k in keys]
    as_col = dict(dtype=torch.int32, device=device)
    return torch.tensor(k1, **as_col)[:, None], torch.tensor(k2, **as_col)[:, None]


def hash_bits(keys: list[int], vocab: int, device="cpu") -> torch.Tensor:
    """[R, vocab] int32: 32 random bits per (key, token id)."""
    k1, k2 = _words(keys, device)
    tokens = torch.arange(vocab, dtype=torch.int32, device=device)[None, :]
    return _mix32(_mix32(tokens * _G + k1) ^ k2)


def _to_uniform(bits: torch.Tensor) -> torch.Tensor:
    """int32 bits b -> float64 uniforms in (0, 1): (b + 2**31 + 0.5) / 2**32 (b read as a
    signed value: the same 2**32 equally spaced points as the unsigned reading, in another
    order)."""
    return bits.to(torch.float64).add_(2.0 ** 31 + 0.5).mul_(2.0 ** -32)


def uniforms(keys: list[int], vocab: int, device="cpu") -> torch.Tensor:
    """[R, vocab] float64 U(0, 1), one row per key."""
    return _to_uniform(hash_bits(keys, vocab, device))


def noise(keys: list[int], vocab: int, device="cpu") -> torch.Tensor:
    """[R, vocab] float64 Exp(1) noise, one row per key (no zeros: u < 1 strictly)."""
    return uniforms(keys, vocab, device).log_().neg_()


def coins(keys: list[int], device="cpu") -> torch.Tensor:
    """[R] float64 U(0, 1), one per key (token 0 of the key's row)."""
    return uniforms(keys, 1, device)[:, 0]


def draw(probs: torch.Tensor, keys: list[int]) -> torch.Tensor:
    """One token per row: probs [R, V] (rows sum to 1), keys [R] -> tokens [R] int64, the
    exponential race ``argmax p / E`` with E = ``noise(keys)``: an exact draw from each row, a
    function of the row and its key only. Tokens with probability 0 are never drawn."""
    if probs.dim() != 2 or len(keys) != probs.shape[0]:
        raise ValueError(f"need probs [R, V] and R keys, got {tuple(probs.shape)} and {len(keys)}")
    e = noise(keys, probs.shape[1], probs.device)
    return greedy(probs.to(torch.float64) / e)
