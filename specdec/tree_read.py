"""Drafts left on the device (``DraftTree.on_device``) brought to the host in one read.

``read_to_host(trees, t)`` reads what the trees have not read (their tokens; their parents
where the shape is the device's; their path probabilities, as float32 bits: exact) together
with ``t`` (e.g. the step's target tokens: ``VerifyStage.to_host``) in one device -> host copy,
and sets the host copies on each tree. A pruning controller and the rejection verifier's
layout use it too, before the verification's read.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdec.tree import DraftTree


def read_to_host(trees: Sequence[DraftTree], t: torch.Tensor | None = None,
                 copy=None) -> torch.Tensor | None:
    """What the trees have not read (their tokens; their parents where the shape is the
    device's; their path probabilities, as float32 bits: exact) in one device -> host copy
    (``copy``; ``.cpu()`` by default), set on each tree, with ``t`` (int64: e.g. the step's
    target tokens), which is returned on the host. Parents that are not topological are kept
    out of the tree (every node then hangs below the root, so that walking it is safe) and
    kept in ``tree.unread_problem`` for the engine to fail the request."""
    trees = [tr for tr in trees if not (tr.tokens_on_host and tr.shape_on_host)]
    if not trees:
        return t if t is None else (copy or _to_cpu)(t)
    parts = [] if t is None else [t.reshape(-1)]
    for tree in trees:
        parts.append(tree.tokens)
        if not tree.shape_on_host:
            parts.append(tree.parents)
        if tree.path_probs is not None:
            parts.append(tree.path_probs.float().view(torch.int32).to(torch.int64))
    flat = (copy or _to_cpu)(torch.cat(parts))
    at = 0 if t is None else t.numel()
    for tree in trees:
        n = tree.num_nodes
        tokens, at = flat[at:at + n].tolist(), at + n
        parents = None
        if not tree.shape_on_host:
            parents, at = flat[at:at + n].tolist(), at + n
            if not all(-1 <= p < i for i, p in enumerate(parents)):
                tree.__dict__["unread_problem"] = (
                    f"DraftTree.parents {parents} are not topological (parents[i] < i)")
                parents = [-1] * n
        probs = None
        if tree.path_probs is not None:
            probs = flat[at:at + n].to(torch.int32).view(torch.float32).to(tree.path_probs.dtype)
            at += n
        tree.set_host(tokens, probs, parents)
    return None if t is None else flat[:t.numel()].view(t.shape)


def _to_cpu(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_cpu else t.cpu()
