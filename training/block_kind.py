"""The block_diffusion kind of `specdec train` (see training/kinds.py and block_loss.py)."""

from __future__ import annotations

import torch

from specdec.training.kinds import Kind, calibration
from specdec.training.target import target_batch


class BlockDiffusionKind(Kind):
    name = "block_diffusion"
    bar_metric = "tau_chain"

    def build(self, config, cfg, target, hf, used):
        from specdec.models.block_diffusion import BlockDiffusionConfig, BlockDiffusionModel

        ids = tuple(config.target_layer_ids) if config.target_layer_ids else None
        c = BlockDiffusionConfig.for_target(cfg, used.numel(), config.num_layers or 1,
                                            config.block_size, ids)
        c.check_target(cfg)
        model = BlockDiffusionModel(c, target.embed, hf, trainable=True)
        model.init_from_target(target, used)
        return model

    def load(self, folder, cfg, target, hf):
        from specdec.models.block_diffusion_io import load_block_diffusion

        return load_block_diffusion(folder, cfg, target.embed, hf, trainable=True)

    def _batch(self, target, model, ids, valid, loss_mask):
        return target_batch(target, model.config.target_layer_ids, model.token_map, ids, valid,
                            loss_mask, teacher=False)

    def loss(self, config, target, model, ids, valid, loss_mask):
        from specdec.training.block_loss import block_loss

        tb = self._batch(target, model, ids, valid, loss_mask)
        return block_loss(model, tb, ids, valid, loss_mask, config.num_anchors,
                          config.loss_gamma)

    def calibrate(self, config, target, model, batches):
        from specdec.training.block_loss import RANKS, block_rank_hits

        d = model.config.block_size - 1
        hits, rows = torch.zeros(d, RANKS, dtype=torch.int64), torch.zeros(d, dtype=torch.int64)
        for ids, valid, loss_mask in batches:
            tb = self._batch(target, model, ids, valid, loss_mask)
            h, r = block_rank_hits(model, tb, ids, valid, loss_mask, config.num_anchors)
            hits += h
            rows += r
        return calibration(hits, rows)

    def save(self, model, folder, hf, dtype, extra):
        from specdec.models.block_diffusion_io import save_block_diffusion

        save_block_diffusion(model, folder, hf, dtype=dtype, overwrite=True, extra=extra)
