"""`specdec train eagle3|mtp|block_diffusion`: prompts in, a drafter folder (serving format) out.

    data -> [regenerate: the target answers] -> tokenize (chat template, loss on the assistant)
    -> draft vocabulary -> training with the kind's loss (accelerate: devices, checkpoints,
    resume; wandb logging) -> calibration on held-out sequences (the kinds that store one)
    -> export (atomic) -> evaluation through the real engine on held-out prompts

The kinds (``training/kinds.py``): eagle3 (TTT, EAGLE-3 format), mtp (Medusa-style heads,
Medusa format), block_diffusion (DFlash-style block drafter).

Layout of ``out``::

    out/regenerated.jsonl     the target's answers (resumable)
    out/vocab.pt              the draft vocabulary (target ids, ascending)
    out/checkpoints/step_N/   accelerate states (model, optimizer, scheduler, RNG, progress)
    out/drafter/              the drafter: config.json + model.safetensors
    out/eval.json             evaluation of out/drafter (also in out/drafter/eval.json)
    out/train_config.json     the settings of the run (recorded at its start; --resume reads
                              them, training/record.py)

The same script runs under ``accelerate launch`` on several processes (GPUs, nodes, or
CPU processes: ``torchrun --nproc_per_node N -m specdec.cli train ...``): every process answers
its share of the prompts (``--regenerate``: a part file each, merged by the main process) and
takes its own share of each epoch's batches (one optimizer step = one batch per process), the
gradients are averaged over the processes before the step, and the work that writes ``out``
once (the draft vocabulary, the checkpoint rename, calibration, export, evaluation) runs on the
main process while the others wait for it.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import shutil
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import NamedTuple

import torch

from specdec.models.loader import load_model, resolve_model_path
from specdec.models.tokenizer import load_tokenizer
from specdec.training.batches import calibration_batches, train_batches
from specdec.training.config import TrainConfig
from specdec.training.data import (
    Conversation,
    has_answers,
    load_conversations,
    prompts_of,
    shorten_turns,
    tokenize_all,
)
from specdec.training.evaluate import run_warnings, summary_lines
from specdec.training.kinds import Kind, kind
from specdec.training.processes import (
    average_gradients,
    engine_device,
    on_main_first,
    trace_step,
)
from specdec.training.record import (
    RECORD,
    changed_settings,
    check_changes,
    read_record,
    write_record,
)
from specdec.training.vocab import coverage, draft_vocab

log = logging.getLogger(__name__)


@dataclass
class Progress:
    """Optimizer steps done and the last step's metrics; saved with every checkpoint
    (accelerate custom state), so a run resumed after its last step exports them too."""

    step: int = 0
    metrics: dict = field(default_factory=dict)

    def state_dict(self) -> dict:
        return {"step": self.step, "metrics": self.metrics}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
        self.metrics = dict(state.get("metrics") or {})


def train(config: TrainConfig) -> dict:
    """Run the whole recipe; returns the evaluation report (eval.json): ``summary`` holds the
    lines ``specdec train`` prints, ``warnings`` what its figures need beside them."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    start = time.perf_counter()
    if config.report_to == "wandb":
        _require("wandb", "--report-to wandb")
    _fresh_accelerator_state()
    out = Path(config.out)
    # cpu=True without CUDA: accelerate then joins the processes of a CPU launch (torchrun,
    # mpirun) over gloo; without it each of them would train alone, on the same batches
    accelerator = Accelerator(log_with=None if config.report_to == "none" else config.report_to,
                              project_dir=str(out), mixed_precision=config.mixed_precision,
                              cpu=not torch.cuda.is_available())
    _prepare_out(out, config.resume)  # every process checks before any of them writes
    changes = _resume_changes(out, config)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        write_record(out, config.to_dict(), changes)
    set_seed(config.seed)
    folder = resolve_model_path(config.target)
    dtype = getattr(torch, config.dtype)
    model, cfg, hf = load_model(folder, dtype, accelerator.device, config.max_length + 16)
    tokenizer = load_tokenizer(folder)
    convs = load_conversations([Path(f) for f in config.data], config.limit, config.seed)
    train_convs, held_out, near_dups = held_out_split(convs, config)
    train_convs = _answers(train_convs, config, out, accelerator, tokenizer)
    dataset = tokenize_all(train_convs, tokenizer, config.max_length, config.max_turn_tokens)
    k = kind(config.kind)
    dataset, calibration = _calibration_split(dataset, config, k)
    head = on_main_first(accelerator,
                          lambda: _new_head(k, config, cfg, model, hf, dataset, out))
    metrics = (_fit(accelerator, k, config, model, head, dataset, out) if config.max_steps != 0
               else _recorded_metrics(Path(config.init_from)))
    if accelerator.is_main_process:
        raw = accelerator.unwrap_model(head)
        with torch.no_grad(), accelerator.autocast():
            calibrated = k.calibrate(config, model, raw, calibration_batches(
                calibration, config, accelerator.device))
        drafter = _export(k, raw, hf, config, out, metrics, calibrated)
        report = _evaluate(config, drafter, held_out, engine_device(accelerator))
        report["split"] = {"held_out": len(held_out), "train_conversations": len(train_convs),
                           "near_duplicates_removed": near_dups,
                           "holdout_near_dup": config.holdout_near_dup}
        report["run_seconds"] = time.perf_counter() - start
        report["warnings"] = run_warnings(report, config.max_steps)
        report["summary"] = summary_lines(report)
        for path in (out / "eval.json", drafter / "eval.json"):
            path.write_text(json.dumps(report, indent=2) + "\n")
    accelerator.wait_for_everyone()
    report = json.loads((out / "eval.json").read_text())
    accelerator.end_training()
    return report


def _fresh_accelerator_state() -> None:
    """accelerate keeps one process-wide state and refuses a second Accelerator with other
    settings (mixed precision); a Python caller may train several drafters in one process, so
    each run starts from a fresh state (accelerate's own tests reset it the same way)."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)


def _require(module: str, why: str) -> None:
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise ValueError(f"{why} needs the {module!r} package: pip install 'specdec[train]'")


def _prepare_out(out: Path, resume: bool) -> Path:
    """``out`` made ready. A folder that holds only a run's record (a run that stopped before
    it wrote anything: a missing answer, a bad target) counts as empty: nothing came of it."""
    if out.exists() and {p.name for p in out.iterdir()} - {RECORD} and not resume:
        raise ValueError(f"--out {out} exists and is not empty: pass --resume to continue that "
                         "run, or choose a new folder")
    if resume and not out.exists():
        raise ValueError(f"--resume: {out} does not exist; nothing to resume")
    out.mkdir(parents=True, exist_ok=True)
    return out


def _resume_changes(out: Path, config: TrainConfig) -> dict[str, tuple]:
    """The settings ``config`` changes from those the resumed run recorded (the CLI fills in the
    recorded ones; a Python caller gives every setting): an error unless ``allow_changed``
    names them all."""
    recorded = read_record(out) if config.resume else None
    if recorded is None:
        return {}
    changes = changed_settings(recorded, config.to_dict())
    check_changes(changes, config.allow_changed, out)
    return changes


class Split(NamedTuple):
    train: list[Conversation]
    held_out: list[list[dict]]  # prompts (chats ending with a user turn)
    near_duplicates_removed: int  # training conversations dropped as near a held-out prompt


def held_out_split(convs: list[Conversation], config: TrainConfig) -> Split:
    """(training conversations, held-out prompts, near duplicates removed): a seeded split, the
    same on every rerun. With ``holdout_near_dup`` > 0 the training side loses every
    conversation whose prompt is that near (word 3-gram Jaccard) to a held-out one, so that the
    held-out figures measure prompts the drafter never saw, not paraphrases of its data."""
    order = list(range(len(convs)))
    random.Random(config.seed).shuffle(order)
    k = min(config.holdout, max(0, len(convs) - 1))
    held = [p for p in (prompts_of(convs[i]) for i in order[:k]) if p]
    train = [convs[i] for i in sorted(order[k:])]
    removed: list[int] = []
    if config.holdout_near_dup > 0 and held:
        from specdec.training.near_dup import drop_near_duplicates, prompt_text

        removed = drop_near_duplicates([prompt_text(c.messages) for c in train],
                                       [prompt_text(p) for p in held], config.holdout_near_dup)
        log.info("held-out split: %d training conversations removed as near duplicates "
                 "(word 3-gram Jaccard >= %g) of the %d held-out prompts", len(removed),
                 config.holdout_near_dup, len(held))
        drop = set(removed)
        train = [c for i, c in enumerate(train) if i not in drop]
    return Split(train, held, len(removed))


def _answers(convs: list[Conversation], config: TrainConfig, out: Path, accelerator,
             tokenizer) -> list[Conversation]:
    """The conversations with their answers: the data's, or (--regenerate) the target's, each
    process answering its share on its own device (a part file each, merged by the main one).
    The target answers the prompts as training will show them (``max_turn_tokens``)."""
    if config.regenerate:
        from specdec.training.regenerate import merge_parts, regenerate

        final = out / "regenerated.jsonl"
        shorten = None
        if config.max_turn_tokens is not None:  # the target answers what the drafter sees
            shorten = partial(shorten_turns, tokenizer=tokenizer,
                              max_turn_tokens=config.max_turn_tokens)
        kw = dict(temperature=config.regen_temperature, max_tokens=config.regen_max_tokens,
                  batch_size=config.regen_batch_size, seed=config.seed,
                  device=engine_device(accelerator), activations=config.regen_activations,
                  prompt_of=shorten)
        n, rank = accelerator.num_processes, accelerator.process_index
        if n > 1:
            regenerate(convs[rank::n], config.target, out / f"regenerated.part{rank}.jsonl",
                       skip=final, **kw)
            accelerator.wait_for_everyone()
            if accelerator.is_main_process:
                merge_parts(final, [out / f"regenerated.part{r}.jsonl" for r in range(n)])
            accelerator.wait_for_everyone()
        return on_main_first(accelerator, lambda: regenerate(convs, config.target, final, **kw))
    missing = [c for c in convs if not has_answers(c)]
    if missing:
        c = missing[0]
        raise ValueError(f"{c.source} record {c.index} (and {len(missing) - 1} more) has no "
                         "assistant answer to train on: pass --regenerate so that the target "
                         "answers the prompts")
    return convs


def _calibration_split(dataset, config: TrainConfig, k: Kind):
    """(training rows, calibration rows): the last ``calibration_examples`` tokenized sequences
    (at most a tenth of them) are kept out of training for the kinds that calibrate."""
    if not k.calibrates or config.calibration_examples == 0:
        return dataset, None
    if config.max_steps == 0:  # nothing is trained: calibrate on all of it
        n = min(config.calibration_examples, len(dataset))
        return dataset.select([]), dataset.select(range(n))
    n = min(config.calibration_examples, len(dataset) // 10)
    if n == 0:
        return dataset, None
    return dataset.select(range(len(dataset) - n)), dataset.select(range(len(dataset) - n,
                                                                            len(dataset)))


def _new_head(k: Kind, config: TrainConfig, cfg, model, hf, dataset, out: Path):
    """A fresh head with the draft vocabulary of the data (saved, so a resumed run keeps it),
    or, with ``init_from``, that drafter's weights and vocabulary (fine-tuning, e.g. a domain
    drafter that starts from the general one)."""
    if config.init_from is not None:
        return _head_from(k, Path(config.init_from), cfg, model, hf, dataset)
    vocab_file = out / "vocab.pt"
    size = min(config.draft_vocab_size, cfg.vocab_size)
    if vocab_file.exists():
        used = torch.load(vocab_file)
    else:
        used = draft_vocab(dataset, size, cfg.vocab_size)
        torch.save(used, vocab_file)
    log.info("draft vocabulary: %d tokens cover %.1f%% of the trained tokens", size,
             100 * coverage(used, dataset))
    torch.manual_seed(config.seed)
    return k.build(config, cfg, model, hf, used.to(model.embed.device))


def _head_from(k: Kind, folder: Path, cfg, model, hf, dataset):
    if not (folder / "config.json").is_file():
        raise ValueError(f"init_from: {folder} is not a drafter folder (no config.json)")
    head = k.load(folder, cfg, model, hf)
    used = k.vocab(head).cpu()
    if len(dataset):  # none to train on: a recalibration (max_steps 0)
        log.info("starting from %s; its %d-token draft vocabulary covers %.1f%% of the trained "
                 "tokens", folder, used.numel(), 100 * coverage(used, dataset))
    return head


def _recorded_metrics(folder: Path) -> dict:
    """An untrained run's metrics: those the drafter it starts from recorded, and its origin."""
    meta = json.loads((folder / "config.json").read_text()).get("specdec") or {}
    return {**(meta.get("train") or {}), "steps_here": 0, "recalibrated_from": str(folder)}


def _fit(accelerator, k: Kind, config: TrainConfig, model, head, dataset, out: Path) -> dict:
    from tqdm.auto import tqdm
    from transformers import get_cosine_schedule_with_warmup

    # one step: a batch on every process
    per_epoch = math.ceil(math.ceil(len(dataset) / config.batch_size)
                          / accelerator.num_processes)
    total = config.max_steps or config.epochs * per_epoch
    params = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.learning_rate,
                                  weight_decay=config.weight_decay)
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(config.warmup_ratio * total), total)
    head, optimizer, scheduler = accelerator.prepare(head, optimizer, scheduler)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    if config.resume:
        _load_latest(accelerator, out)
    if config.report_to != "none":
        os.environ.setdefault("WANDB_MODE", "offline")
        accelerator.init_trackers("specdec-train", config=config.to_dict())
    metrics = dict(progress.metrics)  # a resumed run keeps its first loss and last metrics
    trace = os.environ.get("SPECDEC_TRAIN_TRACE")  # a folder: see _trace
    bar = tqdm(total=total, initial=progress.step, desc=f"train {k.name}", unit="step",
               disable=not accelerator.is_local_main_process)
    while progress.step < total:
        epoch, skip = divmod(progress.step, per_epoch)
        for rows, batch in train_batches(dataset, config, epoch, skip, accelerator.device,
                                    accelerator.process_index, accelerator.num_processes):
            metrics = {**_train_step(accelerator, k, config, model, head, batch, optimizer,
                                     scheduler), "first_loss": metrics.get("first_loss")}
            if trace:
                trace_step(trace, accelerator, progress.step + 1, rows, head)
            metrics["first_loss"] = metrics["first_loss"] or metrics["loss"]
            progress.step += 1
            progress.metrics = metrics
            bar.update(1)
            bar.set_postfix(loss=f"{metrics['loss']:.3f}",
                            **{k.bar_metric: f"{metrics.get(k.bar_metric, 0.0):.2f}"})
            accelerator.log(metrics, step=progress.step)
            if progress.step % config.checkpoint_every == 0 or progress.step == total:
                _save_checkpoint(accelerator, out, progress.step)
            if progress.step >= total:
                break
    bar.close()
    metrics["steps"] = progress.step
    return metrics


def _train_step(accelerator, k: Kind, config, model, head, batch, optimizer, scheduler) -> dict:
    ids, valid, loss_mask = batch
    raw = accelerator.unwrap_model(head)
    with accelerator.autocast():  # mixed_precision: the target's features and the head's steps
        loss, terms = k.loss(config, model, raw, ids, valid, loss_mask)
    accelerator.backward(loss)
    if accelerator.num_processes > 1:
        # the kinds' losses call the head's own methods, not the DDP wrapper's forward, so
        # DDP's reducer never arms: average the gradients over the processes here
        average_gradients(accelerator, raw)
        loss = accelerator.reduce(loss.detach(), reduction="mean")
    accelerator.clip_grad_norm_(head.parameters(), config.max_grad_norm)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
    return {"loss": float(loss.detach()), "lr": scheduler.get_last_lr()[0], **terms}


def _save_checkpoint(accelerator, out: Path, step: int) -> None:
    """accelerate state into a temporary folder, renamed when complete."""
    final = out / "checkpoints" / f"step_{step}"
    tmp = final.with_name(final.name + ".tmp")
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))  # every process: its own RNG state
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
    accelerator.wait_for_everyone()


def _load_latest(accelerator, out: Path) -> None:
    steps = sorted((int(p.name.split("_")[1]), p) for p in (out / "checkpoints").glob("step_*")
                   if p.name.split("_")[1].isdigit())
    if not steps:  # stopped before the first checkpoint (e.g. while regenerating): from step 0
        log.info("--resume: no checkpoint in %s yet; training starts from step 0",
                 out / "checkpoints")
        return
    accelerator.load_state(str(steps[-1][1]))


def _export(k: Kind, head, hf, config: TrainConfig, out: Path, metrics: dict,
            calibrated: dict) -> Path:
    folder = out / "drafter"
    k.save(head, folder, hf, getattr(torch, config.save_dtype),
           {"target": config.target, "train": metrics, **calibrated},
           formats=tuple(config.export_for))
    return folder


def _evaluate(config: TrainConfig, drafter: Path, held_out: list[list[dict]],
              device: str = "cpu") -> dict:
    from specdec.training.evaluate import evaluate

    prompts = held_out + _eval_prompts(config)
    return evaluate(config.target, prompts, config.kind, {"path": str(drafter)},
                    max_tokens=config.eval_max_tokens, budget=config.eval_budget, device=device)


def _eval_prompts(config: TrainConfig) -> list[list[dict]]:
    if not config.eval_files:
        return []
    convs = load_conversations([Path(f) for f in config.eval_files])
    return [p for p in (prompts_of(c) for c in convs) if p]
