"""The one draft-tree format, and everything derived from it.

A draft tree hangs below the last committed token (the "root", index -1). Nodes are stored in
topological order, ``parents[i] < i``, so a chain is ``parents = [-1, 0, 1, ...]``. Example::

    root ─┬─ 0 (tok 11) ── 2 (tok 13) ── 4 (tok 15)
          └─ 1 (tok 12) ── 3 (tok 14)

    tokens        = [11, 12, 13, 14, 15]
    parents       = [-1, -1,  0,  1,  2]
    depths        = [ 0,  0,  1,  1,  2]        positions(offset=7) = [7, 7, 8, 8, 9]
    children(-1)  = [0, 1]                      paths()             = [[0, 2, 4], [1, 3]]

Depths, positions, masks and paths are computed here and nowhere else. Derived values are cached
on first use, so treat a tree as immutable once built.
"""

from __future__ import annotations

import array
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch


@dataclass(eq=False)
class DraftTree:
    """Draft tokens for one request, verified by one target forward.

    Construction does not check anything (it is on the hot path); call :meth:`validate` on trees
    that come from a drafter. ``draft_probs`` is what the drafter sampled each node from (given
    its parent and any earlier siblings); None means deterministic drafts (e.g. top-k), which the
    sampling verifier accepts with the q = 1 rule.
    """

    tokens: torch.Tensor  # [n] int64
    parents: torch.Tensor  # [n] int64; -1 = child of the last committed token; parents[i] < i
    draft_probs: torch.Tensor | None = None  # [n, V] float; row i = distribution node i was drawn from
    # [n] float: the drafter's cumulative probability of the path to node i (its confidence; a
    # controller may use it), or None; never used for acceptance
    path_probs: torch.Tensor | None = None

    @classmethod
    def empty(cls) -> DraftTree:
        """A tree with no nodes: verification then emits exactly one token."""
        return cls(torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64))

    @classmethod
    def chain(cls, tokens, draft_probs: torch.Tensor | None = None) -> DraftTree:
        """A linear draft: ``chain([5, 9])`` has tokens [5, 9] and parents [-1, 0]."""
        if isinstance(tokens, list) and tokens:
            # host ints (what most drafters have): the tensors made through buffers, a third
            # of as_tensor's and arange's cost, which every drafted request pays every step
            token_list = [int(t) for t in tokens]
            n = len(token_list)
            tree = cls(_int64(token_list), _int64(range(-1, n - 1)), draft_probs)
            # (validate knows these two well formed while they are the tree's: _made_here)
            tree.__dict__.update(token_list=token_list, _made=(tree.tokens, tree.parents))
        else:
            toks = torch.as_tensor(tokens, dtype=torch.int64)
            n = toks.numel()
            tree = cls(toks, torch.arange(-1, n - 1, dtype=torch.int64, device=toks.device),
                       draft_probs)
            if isinstance(tokens, list):
                tree.__dict__["token_list"] = []
        # what the host walks read, known without reading the tensors back (parent_list and
        # max_depth too: verification's walk and checks read them every step)
        parent_list = list(range(-1, n - 1))
        tree.__dict__.update(_parent_list=parent_list, parent_list=parent_list, is_chain=True,
                             _depth_list=list(range(n)), max_depth=n - 1, num_nodes=n)
        return tree

    @classmethod
    def from_paths(cls, paths: Sequence[Sequence[int]], max_nodes: int | None = None) -> DraftTree:
        """Merge token sequences into a trie; see :func:`from_paths`."""
        return from_paths(paths, max_nodes)

    @cached_property
    def num_nodes(self) -> int:
        return int(self.tokens.numel())

    def validate(self, max_nodes: int | None = None, vocab_size: int | None = None,
                 max_depth: int | None = None, check_probs: bool = False,
                 read_tokens: bool = True) -> None:
        """Raise ValueError if the tree is malformed, over ``max_nodes`` nodes or ``max_depth``
        levels, or outside the vocab. ``check_probs`` also checks the values of ``draft_probs``
        (finite, >= 0, every row with mass, mass at the node's own token): a sampled request's
        verifier divides by them. ``read_tokens=False`` leaves unchecked what is not on the host
        (``tokens_on_host``, ``shape_on_host``): the engine checks it once the step's read
        brought it."""
        made = self._made_here()  # (a chain of host ints: its tensors need no check)
        if not made:
            _check_index_tensor("tokens", self.tokens)
            _check_index_tensor("parents", self.parents)
        n = self.num_nodes
        if not made and self.parents.numel() != n:
            raise ValueError(
                f"DraftTree.parents has {self.parents.numel()} entries but tokens has {n}; "
                "each node needs exactly one parent")
        if max_nodes is not None and n > max_nodes:
            raise ValueError(f"DraftTree has {n} nodes, more than the budget max_nodes={max_nodes}")
        shape = read_tokens or made or self.shape_on_host  # (made: tokens, shape on the host)
        if not made and shape:
            _check_parents(self.parents.tolist() if "_parent_list" not in self.__dict__
                           else self._parent_list)
        if read_tokens or made or self.tokens_on_host:
            _check_tokens(self.token_list, vocab_size)
        _check_draft_probs(self.draft_probs, n, vocab_size)
        if max_depth is not None and shape and self.max_depth + 1 > max_depth:
            raise ValueError(f"DraftTree is {self.max_depth + 1} levels deep, more than the "
                             f"budget max_depth={max_depth}")
        if check_probs and self.draft_probs is not None and n:
            _check_draft_prob_values(self.draft_probs, self.tokens)
        if self.path_probs is not None and (not isinstance(self.path_probs, torch.Tensor)
                                            or tuple(self.path_probs.shape) != (n,)):
            raise ValueError(f"DraftTree.path_probs must be a float tensor [n={n}] or None")

    def check_tokens(self, vocab_size: int | None) -> None:
        """Raise ValueError if a token is not an int in [0, vocab_size)."""
        _check_tokens(self.token_list, vocab_size)

    def _made_here(self) -> bool:
        """The tensors are still the ones ``chain`` made of host ints: 1-D int64, parents
        [-1, 0, 1, ...] (checks of them are skipped: every drafted request pays them)."""
        made = self.__dict__.get("_made")
        return made is not None and made[0] is self.tokens and made[1] is self.parents

    # ---- derived structure (cached) ----------------------------------------------------------

    @cached_property
    def _parent_list(self) -> list[int]:
        return [int(p) for p in self.parents.tolist()]

    @cached_property
    def token_list(self) -> list[int]:
        """``tokens`` as host ints (read once)."""
        return self.tokens.tolist()

    @classmethod
    def on_device(cls, tokens: torch.Tensor, parents: torch.Tensor,
                  path_probs: torch.Tensor | None = None) -> DraftTree:
        """A tree whose ``tokens`` (and ``path_probs``) are the engine device's, a drafter's
        model output the host has not read; its ``parents`` too unless they are a host tensor
        whose ints the drafter set (``_parent_list``: a shape the host knows). The engine reads
        them only in the step's one read (the target's forward takes them where they are:
        ``shape_on_host``); on a CPU too, so that the CPU takes the GPU's path."""
        tree = cls(tokens, parents, None, path_probs)
        tree.__dict__["_device"] = True
        return tree

    @property
    def shape_on_host(self) -> bool:
        """``parent_list`` is known without a device -> host read (as ``tokens_on_host``): the
        positions and the tree mask can be made on the host. Otherwise the target's forward
        gets them made on the device (``depths``, ``ancestor_mask``) and the step's read brings
        the parents along."""
        d = self.__dict__
        return "_parent_list" in d or (self.parents.is_cpu and not d.get("_device"))

    @property
    def tokens_on_host(self) -> bool:
        """``token_list`` is known without a device -> host read: the tokens are host ints
        (``chain``), a CPU tensor not made ``on_device``, or were read already. Otherwise the
        engine leaves them where they are until the step's one read: the target's forward takes
        them there, and the verification's read brings them along
        (``specdec.engine.verify_stage``)."""
        d = self.__dict__
        return "token_list" in d or (self.tokens.is_cpu and not d.get("_device"))

    def set_host(self, token_list: list[int], path_probs: torch.Tensor | None,
                 parent_list: list[int] | None = None) -> None:
        """The host copies of ``tokens`` (and of ``path_probs``, replacing the device tensor,
        and of ``parents``) that the step's read brought: later uses read nothing."""
        self.__dict__["token_list"] = token_list
        if parent_list is not None:
            self.__dict__["_parent_list"] = parent_list
        if path_probs is not None:
            self.path_probs = path_probs

    @cached_property
    def parent_list(self) -> list[int]:
        """``parents`` as host ints (read once)."""
        return self._parent_list

    @cached_property
    def is_chain(self) -> bool:
        """Every node the child of the one before (``parents = [-1, 0, 1, ...]``): its tree
        mask is the causal mask, so it attends as plain causal rows do."""
        return all(p == i - 1 for i, p in enumerate(self._parent_list))

    @cached_property
    def _child_lists(self) -> list[list[int]]:
        # slot 0 holds the root's children, slot 1 + i node i's
        lists: list[list[int]] = [[] for _ in range(self.num_nodes + 1)]
        for i, p in enumerate(self._parent_list):
            assert -1 <= p < i, f"parents[{i}] = {p} is not topological; call validate()"
            lists[p + 1].append(i)
        return lists

    @cached_property
    def _depth_list(self) -> list[int]:
        depths: list[int] = []
        for i, p in enumerate(self._parent_list):
            assert -1 <= p < i, f"parents[{i}] = {p} is not topological; call validate()"
            depths.append(0 if p < 0 else depths[p] + 1)
        return depths

    @cached_property
    def depths(self) -> torch.Tensor:
        """[n] int64: 0 for children of the last committed token, parent depth + 1 otherwise
        (a tree shaped on the device: computed there, from ``ancestor_mask``)."""
        if not self.shape_on_host:
            return self.ancestor_mask.sum(-1) - 1
        return torch.tensor(self._depth_list, dtype=torch.int64, device=self.parents.device)

    @cached_property
    def max_depth(self) -> int:
        """Largest node depth; -1 for an empty tree. The longest path has max_depth + 1 nodes."""
        return max(self._depth_list, default=-1)

    def positions(self, offset: int) -> torch.Tensor:
        """[n] int64 sequence positions: ``offset + depths``, offset = committed sequence length."""
        return self.depths + offset

    def position_list(self, offset: int) -> list[int]:
        """``positions(offset)`` as host ints."""
        return [offset + d for d in self._depth_list]

    @cached_property
    def ancestor_mask(self) -> torch.Tensor:
        """[n, n] bool: ``mask[i, j]`` iff j is i or an ancestor of i.

        For parents [-1, -1, 0]::

            1 0 0
            0 1 0
            1 0 1
        """
        n = self.num_nodes
        if not self.shape_on_host:
            return _device_ancestors(self.parents)
        rows: list[list[bool]] = []  # host lists, one tensor at the end (no op per node)
        for i, p in enumerate(self._parent_list):
            assert -1 <= p < i, f"parents[{i}] = {p} is not topological; call validate()"
            row = rows[p].copy() if p >= 0 else [False] * n
            row[i] = True
            rows.append(row)
        return torch.tensor(rows, dtype=torch.bool).reshape(n, n).to(self.parents.device)

    def children(self, i: int) -> list[int]:
        """Child node indices of node i (i = -1: the root) in index order."""
        if not -1 <= i < self.num_nodes:
            raise ValueError(f"node index must be in [-1, {self.num_nodes - 1}], got {i}")
        return list(self._child_lists[i + 1])

    def children_of(self, i: int) -> list[int]:
        """``children(i)`` unchecked and not copied (hot paths; do not modify the list)."""
        return self._child_lists[i + 1]

    def select(self, keep: Sequence[int]) -> DraftTree:
        """The subtree of the nodes ``keep`` (ascending node indices, closed under parents),
        renumbered in the same order; draft and path probabilities follow their nodes.

        For parents [-1, 0, -1, 2], ``select([0, 2, 3])`` has parents [-1, -1, 1]."""
        keep = [int(i) for i in keep]
        new = {old: j for j, old in enumerate(keep)}
        parents = self._parent_list
        if keep != sorted(set(keep)) or any(not 0 <= i < self.num_nodes for i in keep):
            raise ValueError(f"keep must list distinct node indices in ascending order, got {keep}")
        if any(parents[i] >= 0 and parents[i] not in new for i in keep):
            raise ValueError(f"keep {keep} drops a parent of a kept node")
        new_parents = [new[parents[i]] if parents[i] >= 0 else -1 for i in keep]
        host = torch.tensor(keep, dtype=torch.int64)
        if "token_list" in self.__dict__:  # known on the host: the subtree's made there
            token_list = [self.token_list[i] for i in keep]
            tree = DraftTree(
                torch.tensor(token_list, dtype=torch.int64),
                torch.tensor(new_parents, dtype=torch.int64),
                None if self.draft_probs is None else self.draft_probs.index_select(
                    0, host.to(self.draft_probs.device)),
                None if self.path_probs is None else self.path_probs.index_select(
                    0, host.to(self.path_probs.device)))
            tree.__dict__.update(token_list=token_list, _parent_list=new_parents,
                                 _device=self.__dict__.get("_device", False))
            return tree
        index = host.to(self.tokens.device)
        tree = DraftTree(
            self.tokens.index_select(0, index),
            torch.tensor(new_parents, dtype=torch.int64, device=self.parents.device),
            None if self.draft_probs is None else self.draft_probs.index_select(0, index),
            None if self.path_probs is None else self.path_probs.index_select(
                0, index.to(self.path_probs.device)))
        tree.__dict__["_device"] = self.__dict__.get("_device", False)
        return tree

    @property
    def checked_late(self) -> bool:
        """Made ``on_device`` (or selected from such a tree): its values are checked only once
        the step's read brought them, so the engine clamps its tokens into the vocabulary for
        the forward (an unchecked id never indexes past the embedding) and checks them then."""
        return bool(self.__dict__.get("_device"))

    def paths(self) -> list[list[int]]:
        """Root-to-leaf node-index lists, one per leaf, in depth-first (index) order."""
        out: list[list[int]] = []
        stack: list[list[int]] = [[c] for c in reversed(self._child_lists[0])]
        while stack:
            path = stack.pop()
            kids = self._child_lists[path[-1] + 1]
            if not kids:
                out.append(path)
            stack.extend(path + [c] for c in reversed(kids))
        return out


def _device_ancestors(parents: torch.Tensor) -> torch.Tensor:
    """[n, n] bool ancestors-or-self of topological ``parents``, on their device with no read:
    the parent relation closed by squaring (a path of length 2^i after i steps)."""
    n = parents.numel()
    ids = torch.arange(n, device=parents.device)
    reach = (ids[:, None] == ids[None, :]) | (parents[:, None] == ids[None, :])
    for _ in range(max(n - 1, 1).bit_length()):
        r = reach.float()
        reach = (r @ r) > 0
    return reach


def causal_mask(q_len: int, kv_len: int, device=None) -> torch.Tensor:
    """[q_len, kv_len] bool: the q_len new rows are the last q_len of kv_len slots, each sees
    itself and everything before it. Example, q_len 2, kv_len 4::

        1 1 1 0
        1 1 1 1
    """
    cols = torch.arange(kv_len, device=device)
    rows = torch.arange(kv_len - q_len, kv_len, device=device)
    return cols[None, :] <= rows[:, None]


def nodes_mask(tree: DraftTree, prefix_len: int, nodes: torch.Tensor | None = None) -> torch.Tensor:
    """[len(nodes), prefix_len + n] bool: rows of tree nodes (all, or ``nodes`` [r] int64) over a
    prefix of ``prefix_len`` slots followed by the tree's n node slots (node j at prefix_len + j).

    A node sees the whole prefix and its ancestors-or-self. This is the one tree-mask builder:
    verification rows (``verify_mask``), a step's rows (``step_mask``) and drafters expanding a
    tree in their own model all use it. Example, prefix_len 2, parents [-1, -1, 0], nodes [2]::

        1 1 | 1 0 1
    """
    anc = tree.ancestor_mask if nodes is None else tree.ancestor_mask.index_select(0, nodes)
    mask = torch.ones(anc.shape[0], prefix_len + tree.num_nodes, dtype=torch.bool,
                      device=anc.device)
    mask[:, prefix_len:] = anc
    return mask


def verify_mask(tree: DraftTree, prefix_len: int) -> torch.Tensor:
    """[1 + n, prefix_len + n] bool attention mask for one request's verification rows.

    Row 0 is the last committed token (kv column prefix_len - 1): it sees the prefix. Row 1 + i
    is node i: it sees the whole prefix and the tree columns ``prefix_len + j`` for j in
    ancestors-or-self of i. Example, prefix_len = 3, parents = [-1, -1, 0]::

                     kv: 0 1 2 | 3 4 5
        row 0 (last)     1 1 1 | 0 0 0
        row 1 (node 0)   1 1 1 | 1 0 0
        row 2 (node 1)   1 1 1 | 0 1 0
        row 3 (node 2)   1 1 1 | 1 0 1
    """
    if prefix_len < 1:
        raise ValueError(
            f"prefix_len must be >= 1 (it includes the last committed token), got {prefix_len}")
    root = causal_mask(1, prefix_len + tree.num_nodes, tree.parents.device)
    root[:, prefix_len:] = False
    return torch.cat([root, nodes_mask(tree, prefix_len)])


def step_mask(tree: DraftTree, num_computed: int, num_tokens: int) -> torch.Tensor:
    """[q + n, num_tokens + n] bool for one request fed tokens[num_computed:num_tokens] (q rows)
    plus a tree: causal rows for the fed tokens before the last, then ``verify_mask`` rows."""
    q = num_tokens - num_computed
    tree_rows = verify_mask(tree, num_tokens)
    if q == 1:
        return tree_rows
    causal = torch.zeros(q - 1, num_tokens + tree.num_nodes, dtype=torch.bool,
                         device=tree.parents.device)
    causal[:, :num_tokens - 1] = causal_mask(q - 1, num_tokens - 1, tree.parents.device)
    return torch.cat([causal, tree_rows])


def packed_masks(masks: Sequence[torch.Tensor | None], qo_lens: Sequence[int],
                 kv_lens: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """flashinfer's ``packed_custom_mask``: every request's mask (causal where None), row-major,
    its bits packed little-endian from a byte boundary per request: (packed [bytes] uint8, byte
    offsets [B + 1] int32), on the host. Example, a 1-node tree over 2 slots (mask
    [[1, 0], [1, 1]]) then one causal row over 2 slots ([1, 1])::

        bits 1011 | 11  ->  bytes [0b1101, 0b11], offsets [0, 1, 2]
    """
    parts, offsets = [], [0]
    for mask, qo, kv in zip(masks, qo_lens, kv_lens):
        if mask is None:
            mask = causal_mask(qo, kv)
        assert tuple(mask.shape) == (qo, kv), (tuple(mask.shape), qo, kv)
        bits = np.packbits(mask.reshape(-1).cpu().numpy(), bitorder="little")
        parts.append(bits)
        offsets.append(offsets[-1] + len(bits))
    packed = np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint8)
    return torch.from_numpy(packed), torch.tensor(offsets, dtype=torch.int32)


def from_paths(paths: Sequence[Sequence[int]], max_nodes: int | None = None) -> DraftTree:
    """Merge token sequences into a trie: shared prefixes become shared nodes.

    Sequences are inserted in the given order (earlier = higher priority), so the result is
    topological; once ``max_nodes`` nodes exist, further new nodes are dropped. Example::

        from_paths([[5, 6], [5, 7], [8]])  ->  tokens [5, 6, 7, 8], parents [-1, 0, 0, -1]
    """
    if max_nodes is not None and max_nodes < 0:
        raise ValueError(f"max_nodes must be >= 0 or None, got {max_nodes}")
    index: dict[tuple[int, int], int] = {}
    tokens: list[int] = []
    parents: list[int] = []
    for seq in paths:
        cur = -1
        for tok in seq:
            key = (cur, int(tok))
            if key not in index:
                if max_nodes is not None and len(tokens) >= max_nodes:
                    break
                index[key] = len(tokens)
                tokens.append(int(tok))
                parents.append(cur)
            cur = index[key]
    tree = DraftTree(torch.tensor(tokens, dtype=torch.int64),
                     torch.tensor(parents, dtype=torch.int64))
    _check_tokens(tokens, None)
    return tree


def _int64(values) -> torch.Tensor:
    """A 1-d CPU int64 tensor of (a non-empty sequence of) host ints, through a buffer."""
    return torch.frombuffer(array.array("q", values), dtype=torch.int64)


def _check_index_tensor(name: str, t: object) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"DraftTree.{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.int64 or t.dim() != 1:
        raise ValueError(
            f"DraftTree.{name} must be a 1-D int64 tensor [n], got {t.dtype} of shape "
            f"{tuple(t.shape)}")


def _check_parents(parents: list[int]) -> None:
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            raise ValueError(
                f"DraftTree.parents[{i}] = {p}: a parent must be -1 (the last committed token) "
                f"or an earlier node, i.e. in [-1, {i - 1}]; a parent at or after its child "
                "is a forward reference or a cycle")


def _check_tokens(tokens: list[int], vocab_size: int | None) -> None:
    for i, t in enumerate(tokens):
        if t < 0 or (vocab_size is not None and t >= vocab_size):
            allowed = ">= 0" if vocab_size is None else f"[0, {vocab_size - 1}]"
            raise ValueError(f"DraftTree.tokens[{i}] = {t} is outside the vocab; allowed {allowed}")


def _check_draft_probs(q: object, n: int, vocab_size: int | None) -> None:
    if q is None:
        return
    if not isinstance(q, torch.Tensor) or not q.is_floating_point():
        raise ValueError(f"DraftTree.draft_probs must be a float tensor [n, V] or None, got {q!r}")
    if q.dim() != 2 or q.shape[0] != n:
        raise ValueError(
            f"DraftTree.draft_probs must have shape [n={n}, V], got {tuple(q.shape)}")
    if vocab_size is not None and q.shape[1] != vocab_size:
        raise ValueError(
            f"DraftTree.draft_probs has {q.shape[1]} columns but the vocab size is {vocab_size}")


def _check_draft_prob_values(q: torch.Tensor, tokens: torch.Tensor) -> None:
    finite = bool(torch.isfinite(q).all())
    if not finite or bool((q < 0).any()):
        raise ValueError("DraftTree.draft_probs must be finite and non-negative")
    empty = (q.sum(-1) <= 0).nonzero()
    if empty.numel():
        raise ValueError(f"DraftTree.draft_probs row {int(empty[0])} sums to 0; each row must be "
                         "the distribution its node was drawn from")
    at_token = q.gather(1, tokens.to(q.device)[:, None])[:, 0]
    zero = (at_token <= 0).nonzero()
    if zero.numel():
        i = int(zero[0])
        raise ValueError(f"DraftTree.draft_probs[{i}, {int(tokens[i])}] is 0 but node {i} drafted "
                         f"token {int(tokens[i])}: a node's token must have mass in its own row")


def merge_trees(trees: Sequence[DraftTree], max_nodes: int,
                maps: list[list[int]] | None = None) -> DraftTree:
    """One tree holding the nodes of ``trees`` in order (earlier trees, and earlier nodes of a
    tree, first) until ``max_nodes``: nodes with the same token under the same parent become one.

    Draft probabilities are dropped (merged siblings were not drawn from one distribution), so
    the verifier treats every node as deterministic (the q = 1 rule: lossless for any tokens).
    Path probabilities are kept where every kept node has one (the first tree's wins). ``maps``,
    when given, receives per tree its nodes' merged indices (-1: dropped). Example::

        merge([chain [5, 6], tokens [5, 7] parents [-1, -1]], 3) -> tokens [5, 6, 7],
                                                                    parents [-1, 0, -1]
    """
    index: dict[tuple[int, int], int] = {}
    tokens: list[int] = []
    parents: list[int] = []
    probs: list[float | None] = []
    for tree in trees:
        local: list[int] = []  # this tree's node -> merged node
        node_probs = tree.path_probs.tolist() if tree.path_probs is not None else None
        for i, (p, t) in enumerate(zip(tree.parents.tolist(), tree.tokens.tolist())):
            parent = -1 if p < 0 else local[p]
            key = (parent, t)
            if key not in index:
                if len(tokens) >= max_nodes or parent == -2:
                    local.append(-2)  # dropped: so are its descendants
                    continue
                index[key] = len(tokens)
                tokens.append(t)
                parents.append(parent)
                probs.append(node_probs[i] if node_probs is not None else None)
            local.append(index[key])
        if maps is not None:
            maps.append([m if m >= 0 else -1 for m in local])
    path_probs = None
    if probs and all(p is not None for p in probs):
        path_probs = torch.tensor(probs, dtype=torch.float32)
    return DraftTree(torch.tensor(tokens, dtype=torch.int64),
                     torch.tensor(parents, dtype=torch.int64), None, path_probs)
