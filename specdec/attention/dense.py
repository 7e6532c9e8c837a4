"""Dense attention over a padded [B, S] batch with no KV cache: the training path.

The decoder runs on packed rows [B * S, ...]; this backend views them as [B, H, S, D] and
calls SDPA with a [B, 1, S, S] bool mask (True = may attend). It keeps no cache: ``kv_layer`` is
ignored. Gradients flow through it.

Example, B 1, S 3, the last token padding (valid [1, 1, 0]), ``DenseAttention.causal``::

    1 0 0
    1 1 0
    0 0 1     <- a padding row sees only itself (any finite row avoids NaN; it is ignored)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specdec.tree import causal_mask


class DenseAttention:
    name = "dense"

    def __init__(self, mask: torch.Tensor) -> None:
        """mask [B, S, S] or [B, 1, S, S] bool; every row must allow at least one column."""
        self.mask = mask if mask.dim() == 4 else mask.unsqueeze(1)
        self.batch, self.seq = self.mask.shape[0], self.mask.shape[-1]

    @classmethod
    def causal(cls, valid: torch.Tensor) -> DenseAttention:
        """Causal attention over real tokens; valid [B, S] bool (False = padding)."""
        s = valid.shape[1]
        mask = causal_mask(s, s, valid.device)[None] & valid[:, None, :]
        mask |= torch.eye(s, dtype=torch.bool, device=valid.device)
        return cls(mask)

    def plan(self, metadata) -> None:  # the protocol's; the mask is fixed at construction
        return None

    def run(self, q, k, v, kv_layer, scale: float) -> torch.Tensor:
        """q [B*S, H, D], k/v [B*S, Hkv, D] -> [B*S, H, D]."""
        b, s = self.batch, self.seq

        def heads(x):
            return x.view(b, s, x.shape[-2], x.shape[-1]).transpose(1, 2)

        out = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), attn_mask=self.mask,
                                             scale=scale, enable_gqa=True)
        return out.transpose(1, 2).reshape(b * s, q.shape[-2], q.shape[-1])
