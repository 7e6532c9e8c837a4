"""The drafter kinds `specdec train` builds: one pipeline, a model and a loss per kind.

A kind says how to make a new trainable drafter (from the target and the draft vocabulary), how
to start from a saved one (``init_from``), its loss on a batch, what to calibrate after training
(stored with the checkpoint), and how to save it in its serving format. Everything else — data,
self-distillation, vocabulary, accelerate, checkpoints, wandb, export, evaluation — is the
trainer's, the same for every kind.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from specdec.training.config import TrainConfig
from specdec.training.target import target_batch


class Kind:
    name = ""
    # the metric shown beside the loss on the progress bar
    bar_metric = "acceptance_0"
    # keeps ``calibration_examples`` sequences out of training for ``calibrate``
    calibrates = False

    def build(self, config: TrainConfig, cfg, target, hf, used: torch.Tensor) -> nn.Module:
        raise NotImplementedError

    def load(self, folder: Path, cfg, target, hf) -> nn.Module:
        raise NotImplementedError

    def vocab(self, model: nn.Module) -> torch.Tensor:
        """The draft vocabulary's target ids, ascending."""
        return model.token_map

    def loss(self, config: TrainConfig, target, model, ids, valid, loss_mask):
        """(loss with grad, metrics dict)."""
        raise NotImplementedError

    def calibrate(self, config: TrainConfig, target, model, batches) -> dict:
        """Metadata measured on held-out batches after training (saved with the drafter)."""
        return {}

    def save(self, model, folder: Path, hf, dtype: torch.dtype, extra: dict,
             formats: tuple[str, ...] = ()) -> None:
        """Write the serving folder; ``formats``: engines it must load in besides specdec
        (ValueError naming the kind and the engine where its format cannot)."""
        raise NotImplementedError


class Eagle3Kind(Kind):
    name = "eagle3"

    def build(self, config, cfg, target, hf, used):
        from specdec.models.heads.eagle3 import Eagle3Config, Eagle3Head

        aux = tuple(config.aux_layer_ids) if config.aux_layer_ids else None
        head = Eagle3Head(Eagle3Config.for_target(cfg, used.numel(), aux), target.embed, hf,
                          trainable=True)
        head.reset_parameters()
        head.set_vocab(used)
        return head

    def load(self, folder, cfg, target, hf):
        from specdec.models.heads.eagle3_io import load_eagle3

        return load_eagle3(folder, cfg, target.embed, hf, trainable=True)

    def vocab(self, model):
        from specdec.models.heads.eagle3_io import vocab_ids

        return vocab_ids(model.d2t.cpu(), model.t2d.cpu())

    def loss(self, config, target, model, ids, valid, loss_mask):
        from specdec.training.ttt import target_batch as eagle3_batch
        from specdec.training.ttt import ttt_loss

        tb = eagle3_batch(target, model, ids, valid, loss_mask)
        res = ttt_loss(model, ids, valid, loss_mask, tb, config.ttt_steps, config.ttt_decay)
        metrics = {}
        for j, (acc, top1) in enumerate(zip(res.step_acceptance, res.step_top1)):
            metrics[f"acceptance_{j}"] = acc
            metrics[f"top1_{j}"] = top1
        return res.loss, metrics

    def save(self, model, folder, hf, dtype, extra, formats=()):
        from specdec.models.heads.eagle3_io import save_eagle3

        save_eagle3(model, folder, hf, dtype=dtype, overwrite=True, extra=extra, formats=formats)


class MTPKind(Kind):
    name = "mtp"
    calibrates = True

    def build(self, config, cfg, target, hf, used):
        from specdec.models.heads.mtp import MTPConfig, MTPHeads

        c = MTPConfig.for_target(cfg, used.numel(), config.num_heads, config.num_layers or 1)
        heads = MTPHeads(c, target.embed.dtype, target.embed.device, trainable=True)
        heads.init_from_target(target.head_weight, used)
        return heads

    def load(self, folder, cfg, target, hf):
        from specdec.models.heads.mtp_io import load_mtp

        return load_mtp(folder, cfg, target.embed.dtype, target.embed.device, trainable=True)

    def loss(self, config, target, model, ids, valid, loss_mask):
        from specdec.training.mtp_loss import mtp_loss

        tb = target_batch(target, (), model.token_map, ids, valid, loss_mask)
        return mtp_loss(model, tb, valid, loss_mask, config.head_decay)

    def calibrate(self, config, target, model, batches):
        from specdec.training.mtp_loss import RANKS, mtp_rank_hits

        def hits(ids, valid, loss_mask):
            tb = target_batch(target, (), model.token_map, ids, valid, loss_mask, teacher=False)
            return mtp_rank_hits(model, tb, valid, loss_mask)

        return calibration(*summed((hits(*b) for b in batches), model.config.num_heads, RANKS))

    def save(self, model, folder, hf, dtype, extra, formats=()):
        from specdec.models.heads.mtp_io import save_mtp

        save_mtp(model, folder, hf, dtype=dtype, overwrite=True, extra=extra, formats=formats)


class BlockDiffusionKind(Kind):
    name = "block_diffusion"
    bar_metric = "tau_chain"
    calibrates = True

    def build(self, config, cfg, target, hf, used):
        from specdec.models.heads.block_diffusion import BlockDiffusionConfig, BlockDiffusionModel

        ids = tuple(config.target_layer_ids) if config.target_layer_ids else None
        c = BlockDiffusionConfig.for_target(cfg, used.numel(), config.num_layers or 1,
                                            config.block_size, ids)
        c.check_target(cfg)
        model = BlockDiffusionModel(c, target.embed, hf, trainable=True)
        model.init_from_target(target, used)
        return model

    def load(self, folder, cfg, target, hf):
        from specdec.models.heads.block_diffusion_io import load_block_diffusion

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

        def hits(ids, valid, loss_mask):
            tb = self._batch(target, model, ids, valid, loss_mask)
            return block_rank_hits(model, tb, ids, valid, loss_mask, config.num_anchors)

        return calibration(*summed((hits(*b) for b in batches), model.config.block_size - 1,
                                   RANKS))

    def save(self, model, folder, hf, dtype, extra, formats=()):
        from specdec.models.heads.block_diffusion_io import save_block_diffusion

        save_block_diffusion(model, folder, hf, dtype=dtype, overwrite=True, extra=extra, formats=formats)


def summed(parts, depth: int, ranks: int) -> list[torch.Tensor]:
    """The element-wise sum of (hits [depth, ranks], rows [depth], conditional hits,
    conditional rows) tuples, one per calibration batch; zeros for none."""
    totals = [torch.zeros(depth, ranks, dtype=torch.int64), torch.zeros(depth, dtype=torch.int64)]
    totals = totals + [t.clone() for t in totals]
    for part in parts:
        totals = [a + b for a, b in zip(totals, part)]
    return totals


def calibration(hits: torch.Tensor, rows: torch.Tensor, cond_hits: torch.Tensor | None = None,
                cond_rows: torch.Tensor | None = None) -> dict:
    """The stored calibration: [depth][rank] acceptance rates (rounded) and the rows they come
    from, unconditional and (when given) given the depths above were right; nothing when no
    depth has rows (the drafter then uses its default shape). A depth whose condition never
    held keeps its unconditional rates in the conditional table."""
    if not bool((rows > 0).all()):
        return {}

    def table(h: torch.Tensor, n: torch.Tensor) -> list[list[float]]:
        return [[round(float(v), 4) for v in row] for row in h.double() / n.double()[:, None]]

    out = {"rank_acceptance": table(hits, rows), "calibration_rows": rows.tolist()}
    if cond_hits is not None:
        have = cond_rows > 0
        h = torch.where(have[:, None], cond_hits, hits)
        n = torch.where(have, cond_rows, rows)
        out["rank_acceptance_conditional"] = table(h, n)
        out["calibration_rows_conditional"] = cond_rows.tolist()
    return out


def kind(name: str) -> Kind:
    """The kind named ``name`` (one of ``training.config.KINDS``)."""
    return {k.name: k for k in (Eagle3Kind, MTPKind, BlockDiffusionKind)}[name]()
