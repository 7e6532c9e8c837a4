"""What the processes of a distributed training run share (training/trainer.py):
which one does a piece of work first, how their gradients agree, and a trace to check both.

``torchrun --nproc_per_node N -m specdec.cli train ...`` (or ``accelerate launch`` on GPUs)
starts N processes; the trainer gives each its share of the prompts and batches
(``batches.process_batches``) and these helpers keep them in step.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch


def engine_device(accelerator) -> str:
    """This process's device as the engine names it (accelerate's CPU processes say cpu:N)."""
    d = accelerator.device
    return "cpu" if d.type == "cpu" else str(d)


def on_main_first(accelerator, make):
    """``make()`` on the main process, then on the others (which then find its files: the
    regenerated answers, the draft vocabulary, and do not write them again)."""
    result = make() if accelerator.is_main_process else None
    accelerator.wait_for_everyone()
    return result if accelerator.is_main_process else make()


def trace_step(folder: str, accelerator, step: int, rows: list[int], head) -> None:
    """``SPECDEC_TRAIN_TRACE=DIR`` (debugging a distributed run): each process appends, per
    step, the examples it trained on and a checksum of its head's weights after the step to
    DIR/rank{i}.jsonl; the processes of a sound run train on disjoint examples and agree on
    the weights after every step."""
    total = sum(float(p.detach().double().sum()) for p in head.parameters())
    line = json.dumps({"step": step, "rows": rows, "weights": total})
    with open(Path(folder) / f"rank{accelerator.process_index}.jsonl", "a") as f:
        f.write(line + "\n")


def average_gradients(accelerator, module) -> None:
    """Every trainable parameter's gradient -> its mean over the processes (a parameter with
    no gradient on this process counts as zero there)."""
    for p in module.parameters():
        if p.requires_grad:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            p.grad.copy_(accelerator.reduce(p.grad, reduction="mean"))
