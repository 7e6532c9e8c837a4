"""A tensor-parallel worker rank (1..N-1): its shard of the target, run as rank 0 says.

``serve(group, config, max_model_len)`` builds this rank's shard (the target only: drafters,
controller and scheduler live on rank 0) and then runs rank 0's messages in order until it
closes (the protocol: ``specdec.distributed.engine_tp``): the KV pages to allocate, every
forward of the target (meeting the other ranks at each layer's reductions), every KV move.
Spawned by rank 0 (``worker_main``, through ``specdec.distributed.launch``) or started by
torchrun (``worker_from_env``, from ``python -m specdec``).
"""

from __future__ import annotations

import itertools

import torch

from specdec.distributed.engine_tp import backend, check_plan, next_message, reducer
from specdec.distributed.group import TPGroup
from specdec.distributed.shard_model import shard_decoder
from specdec.engine.runner import ModelRunner
from specdec.models.decoder.config import model_config_from_hf
from specdec.models.loader import load_hf_config, load_model, resolve_model_path
from specdec.models.weights import prepare_weights


def worker_main(rank: int, world_size: int, address: str, config, max_model_len: int) -> None:
    """A rank rank 0 spawned: join the group, then ``serve``."""
    with TPGroup.init(rank, world_size, init_method=address, backend=backend(config)) as group:
        serve(group, config, max_model_len)


def worker_from_env(config, max_model_len: int) -> None:
    """A rank torchrun started (not rank 0): join through ``env://``, then ``serve``."""
    with TPGroup.from_env(backend=backend(config)) as group:
        serve(group, config, max_model_len)


def build_shard(config, group: TPGroup, max_model_len: int) -> ModelRunner:
    """This rank's shard of the target, with the kernels the engine's options choose, and a
    runner whose KV pages rank 0 allocates."""
    folder = resolve_model_path(config.model)
    plan = check_plan(config, model_config_from_hf(load_hf_config(folder)), folder)
    model, _, _ = load_model(folder, config.torch_dtype, torch.device(config.device),
                             max_model_len, blocks=config.weights != "dequantized",
                             quantize=config.quantize)
    shard_decoder(model, plan, group.rank, reducer(group, config))  # rank 0's mode
    runner = ModelRunner(model, "target", config.attention_backend, config.page_size,
                         torch.device(config.device),
                         invariant=config.linear_kernels == "invariant")
    prepare_weights(config, model, folder, [], [])
    return runner


def serve(group: TPGroup, config, max_model_len: int) -> None:
    """Build this rank's shard and run rank 0's messages until it closes."""
    runner = build_shard(config, group, max_model_len)
    for n in itertools.count():
        message = next_message(group, n)
        kind = message[0]
        if kind == "forward":
            runner.forward(message[1], message[2])
        elif kind == "cache":
            getattr(runner.kv.cache, message[1])(*message[2])
        elif kind == "allocate":
            error = None
            try:
                runner.allocate(message[1])
            except Exception as e:  # said to rank 0, which raises naming this rank
                error = f"{type(e).__name__}: {e}"
            group.all_gather_object(error)
        elif kind == "close":
            return
        else:
            raise RuntimeError(f"rank {group.rank}: unknown message {kind!r} from rank 0")
