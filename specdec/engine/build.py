"""Building what a step needs, once: ``build_engine(config) -> EngineParts``.

    model folder -> config, max_model_len, model, tokenizer -> target runner
    -> verifier, drafter and controller (the registries; a drafter may ask for runners)
    -> one KV budget split over every runner -> CUDA graphs (on CUDA)
    -> prepared weights: the GGUF's own blocks or a checkpoint's own bytes / blocks
       quantized at load, quantized draft matrices, the kernels
    -> cache namespace -> second KV tier -> EngineParts -> controller set-up (step costs)

The engine (``specdec.engine.core``) only steps over these parts.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pluggy
import torch

from specdec import plugins
from specdec.config import EngineConfig
from specdec.controllers.base import BaseController, ControllerContext
from specdec.controllers.costs import StepCosts
from specdec.controllers.expert_costs import ExpertCosts
from specdec.distributed.engine_tp import TensorParallel, check_plan, shard_config
from specdec.distributed.shard_model import shard_decoder
from specdec.drafters.base import BaseDrafter, TargetInfo
from specdec.engine.cuda_graphs import scratch_pages
from specdec.engine.drafting.setup import create_drafter_and_controller
from specdec.engine.memory import KVSplit, split_kv
from specdec.engine.runner import ModelRunner
from specdec.engine.step_profile import engine_expert_costs, engine_step_costs
from specdec.engine.tp_worker import worker_main
from specdec.engine.verify_stage import VerifyStage
from specdec.kv.fingerprint import weights_fingerprint
from specdec.kv.host_tier import HostTier
from specdec.kv.tier import DiskTier
from specdec.models.decoder.config import ModelConfig, model_config_from_hf
from specdec.models.loader import load_hf_config, load_model, resolve_model_path
from specdec.models.matmul.linear import LinearKernels
from specdec.models.matmul.prepared import PreparedLinears
from specdec.models.tokenizer import load_tokenizer
from specdec.models.weights import PreparedWeights, check_quantize, prepare_weights

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

    from specdec.models.decoder.llama import LlamaDecoder

DEFAULT_KV_MEMORY_CAP = 1 << 30
logger = logging.getLogger("specdec")


@dataclass(eq=False)
class EngineParts:
    """Everything a step runs with, complete when made (by ``build_engine``; read-only
    afterwards)."""

    config: EngineConfig
    pm: pluggy.PluginManager
    folder: Path  # the model's folder
    model_config: ModelConfig
    hf_config: PretrainedConfig
    max_model_len: int
    model: LlamaDecoder  # the target
    tokenizer: PreTrainedTokenizerBase | None  # None for tokenizer-less test models
    runner: ModelRunner  # the target's
    drafter_runners: list[ModelRunner]
    verifier: VerifyStage
    drafter: BaseDrafter | None  # with the declared contract (specdec.drafters.adapter)
    controller: BaseController  # with the declared contract (specdec.controllers.adapter)
    kv_split: KVSplit
    # the target's: "native" (a GGUF's blocks, a bf16 / fp16 checkpoint's own bytes),
    # "dequantized" (float32 copies), or the quantize mode its blocks were made in ("q8_0" ...)
    weights: str
    draft_weights: str  # "none" | "float" | a quantized mode (draft_weights)
    kernels: LinearKernels | PreparedLinears
    # what the target's blocks multiply: "float" | "q8" (EngineConfig.activations, "auto"
    # resolved by what the weights turned out to be: specdec.models.weights)
    activations: str
    cache_namespace: str  # everything that changes the KV a token sequence leaves
    tier: DiskTier | HostTier | None
    build_seconds: dict[str, float]  # seconds per build stage
    # tensor parallelism (tensor_parallel_size > 1): rank 0's group and workers, which run the
    # target's every forward and KV move on their shards (specdec.distributed.engine_tp)
    tp: TensorParallel | None = None

    @property
    def sources(self) -> tuple[str, ...]:
        """A composed drafter's member names (what DraftBudget.sources may name); () else."""
        return () if self.drafter is None else self.drafter.sources

    @property
    def dtype(self) -> torch.dtype:
        return self.config.torch_dtype

    @property
    def device(self) -> torch.device:
        return torch.device(self.config.device)

    @property
    def weight_bytes_per_forward(self) -> int:
        """Bytes of target and drafter matrices a one-row forward of each streams: the prepared
        panels (native GGUF blocks or fp32/bf16 panels), else the models' weights; of a
        mixture-of-experts target, its experts' bytes counted at top_k / num_experts (a row
        streams only the experts it routes to)."""
        prepared = isinstance(self.kernels, PreparedLinears)
        panels = self.kernels.weight_bytes if prepared else 0

        def nbytes(w: torch.Tensor) -> int:
            return self.kernels.prepared(w).nbytes if panels else w.numel() * w.element_size()

        total = panels or sum(nbytes(w) for r in [self.runner, *self.drafter_runners]
                              for w in r.model.matrices())
        cfg = getattr(self.model, "cfg", None)
        if cfg is None or not cfg.is_moe:
            return total
        experts = sum(nbytes(w) for n, w in self.model.named_matrices().items()
                      if ".experts." in n)
        return total - round(experts * (1 - cfg.num_experts_per_tok / cfg.num_experts))

    def step_costs(self) -> StepCosts:
        """The target's forward seconds by rows on this machine (specdec.engine.step_profile:
        profiled once within what the KV and max_model_len allow, cached)."""
        return engine_step_costs(self)

    def expert_costs(self) -> ExpertCosts | None:
        """A mixture-of-experts target's forward seconds by rows and experts woken
        (specdec.engine.step_profile.engine_expert_costs); None for a dense target."""
        return engine_expert_costs(self)


def build_engine(config: EngineConfig, plugins_: tuple = ()) -> EngineParts:
    clock = _Clock()
    device = torch.device(config.device)
    _check_device(device)
    pm = plugins.get_plugin_manager(plugins_)
    folder = resolve_model_path(config.model)
    cfg = model_config_from_hf(load_hf_config(folder))
    max_model_len = _max_model_len(config, cfg)
    # a GGUF's matrices stay its blocks unless the dequantized ones are asked for (the kernels
    # run the blocks; where they cannot, prepare_weights dequantizes them)
    if config.quantize is not None:
        check_quantize(config)  # before the minutes quantizing takes
    tp = None
    if config.tensor_parallel_size > 1:  # the plan checked before any process starts
        tp = TensorParallel.start(shard_config(config), check_plan(config, cfg, folder),
                                  worker_main, (shard_config(config), max_model_len))
    try:
        return _build(config, pm, folder, cfg, max_model_len, device, clock, tp)
    except BaseException:
        if tp is not None:
            tp.close()
        raise


def _build(config: EngineConfig, pm, folder: Path, cfg: ModelConfig, max_model_len: int,
           device: torch.device, clock: _Clock, tp: TensorParallel | None) -> EngineParts:
    model, _, hf_config = load_model(folder, config.torch_dtype, device, max_model_len,
                                     blocks=config.weights != "dequantized",
                                     quantize=config.quantize)
    if tp is not None:
        shard_decoder(model, tp.plan, 0, tp.reduce)
    tokenizer = load_tokenizer(folder)
    clock.mark("load")
    runner, drafter_runners = _runner(config, model, "target"), []

    def new_runner(model, name: str = "drafter", num_layers: int | None = None) -> ModelRunner:
        """`TargetInfo.new_runner`: a drafter's runner, allocated with the target's."""
        drafter_runners.append(_runner(config, model, name, num_layers))
        return drafter_runners[-1]

    target = TargetInfo(model, cfg, hf_config, tokenizer, str(folder), config.torch_dtype,
                        device, config.page_size, max_model_len, new_runner)
    verifier = VerifyStage.create(pm, config.verifier, cfg.vocab_size)
    drafter, controller = create_drafter_and_controller(pm, config, target)
    clock.mark("runners, drafter")
    kv_split = _allocate_kv(config, max_model_len, [runner, *drafter_runners])
    if tp is not None:
        tp.allocate(runner.kv.num_pages)
    clock.mark("kv")
    prepared = prepare_weights(config, model, folder, [r.model for r in drafter_runners],
                               [] if drafter is None else list(drafter.matmul_models))
    if tp is not None:
        tp.mirror(runner)
    clock.mark("weights, kernels")
    _capture_graphs(runner, drafter)
    clock.mark("cuda graphs")
    namespace = _cache_namespace(config, folder, prepared, runner)
    parts = EngineParts(config, pm, folder, cfg, hf_config, max_model_len, model, tokenizer,
                        runner, drafter_runners, verifier, drafter, controller, kv_split,
                        prepared.weights, prepared.draft_weights, prepared.kernels,
                        prepared.activations, namespace, _open_tier(config, runner, namespace),
                        clock.seconds, tp)
    if drafter is not None:
        controller.setup(ControllerContext(parts.step_costs, str(device), config.max_num_seqs,
                                           config.max_num_batched_tokens, sources=parts.sources,
                                           expert_costs=parts.expert_costs))
        clock.mark("controller setup")
    logger.info("engine built in %.1f s: %s", sum(clock.seconds.values()),
                ", ".join(f"{k} {v:.1f} s" for k, v in clock.seconds.items()))
    return parts


def _cache_namespace(config: EngineConfig, folder: Path, prepared: PreparedWeights,
                     runner: ModelRunner) -> str:
    """Pages are shared only within one namespace (and a tier file of another is re-made): the
    weights (path and fingerprint), the numbers (dtype, weights, activations, kernels) and the
    KV layout of one page."""
    return "|".join(map(str, (
        folder.resolve(), weights_fingerprint(folder), config.torch_dtype, prepared.weights,
        prepared.activations, config.linear_kernels, tuple(runner.kv.cache.tensor[:, 0].shape))))


class _Clock:
    """Seconds per build stage (``EngineParts.build_seconds``: where a slow start goes)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def mark(self, stage: str) -> None:
        now = time.perf_counter()
        self.seconds[stage] = round(now - self._last, 3)
        self._last = now


def _runner(config: EngineConfig, model, name: str, num_layers: int | None = None):
    return ModelRunner(model, name, config.attention_backend, config.page_size,
                       torch.device(config.device), num_layers,
                       invariant=config.linear_kernels == "invariant")


def _allocate_kv(config: EngineConfig, max_model_len: int, runners: list[ModelRunner]
                 ) -> KVSplit:
    """One memory budget, the same pages for the target (``runners[0]``) and every drafter
    runner; on CUDA the runners that replay graphs are set up for them."""
    names = [r.name if i == 0 else f"drafter {r.name}" for i, r in enumerate(runners)]
    per_page = dict(zip(names, (r.bytes_per_page for r in runners)))
    c = config
    memory = c.kv_cache_memory
    if c.num_pages is None and memory is None:
        per_token = sum(per_page.values()) // c.page_size
        one = per_token * max_model_len
        memory = max(one, min(DEFAULT_KV_MEMORY_CAP, one * c.max_num_seqs))
    split = split_kv(per_page, c.page_size, max_model_len, memory, c.num_pages)
    graphed = _graphed_runners(config, runners)
    for runner in runners:
        # a graphed runner's padding dummies get pages of their own, beside the requests'
        extra = scratch_pages(c.max_num_batched_tokens, c.page_size) if runner in graphed else 0
        runner.allocate(split.num_pages + extra)
    logger.info(split.describe())
    for runner in graphed:
        runner.enable_cuda_graphs(c.max_num_seqs, c.max_num_batched_tokens, max_model_len)
    return split


def _graphed_runners(config: EngineConfig, runners: list[ModelRunner]) -> list[ModelRunner]:
    """The runners that replay CUDA graphs: on CUDA (unless ``cuda_graphs`` is off) those whose
    attention backend supports them; the others stay eager."""
    if not config.cuda_graphs or torch.device(config.device).type != "cuda":
        return []
    moe = [r for r in runners if getattr(getattr(r.model, "cfg", None), "is_moe", False)]
    if moe:  # eager until a capture of the gathered experts has run on a GPU
        logger.info("CUDA graphs: none for a mixture-of-experts model; eager (its experts run "
                    "gathered with linear_kernels='invariant': fixed shapes, no host read, but "
                    "a capture of them is not yet verified on a GPU; else over the rows routed "
                    "to each expert, read to the host)")
    return [r for r in runners if r.backend.supports_cuda_graphs and r not in moe]


def _capture_graphs(runner: ModelRunner, drafter: BaseDrafter | None) -> None:
    """The target's graphs captured now, with its kernels in place, for every shape: no step
    pays a capture (a drafter runner's are captured at their first use: they take features)."""
    if runner.graphs is None:
        return
    t0 = time.perf_counter()
    n = runner.capture_graphs(() if drafter is None else tuple(drafter.hidden_layers))
    logger.info("CUDA graphs: %d captured for the target in %.1f s", n, time.perf_counter() - t0)


def _open_tier(config: EngineConfig, runner: ModelRunner, namespace: str
               ) -> DiskTier | HostTier | None:
    """The second KV tier below the target's KV (EngineConfig.kv_tier_path: a file on disk;
    kv_host_tier_bytes: host memory), if asked for. Drafters' own caches have none: after a
    hit they restore what they still hold in memory (specdec.drafters.base, "Prefix
    caching")."""
    c = config
    if c.kv_host_tier_bytes is not None:
        tier = HostTier(runner.bytes_per_page, c.kv_host_tier_bytes, torch.device(c.device))
    elif c.kv_tier_path is not None:
        tier = DiskTier(c.kv_tier_path, runner.bytes_per_page, c.kv_tier_bytes, namespace)
    else:
        return None
    runner.kv.attach_tier(tier)
    return tier


def _check_device(device: torch.device) -> None:
    if device.type != "cuda":
        return
    if not torch.cuda.is_available():
        raise ValueError(f"device {str(device)!r} but CUDA is not available here (torch "
                         f"{torch.__version__}); use device 'cpu'")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"device {str(device)!r} but this machine has "
                         f"{torch.cuda.device_count()} CUDA device(s)")
    # streams, graph captures and flashinfer's JIT follow the current device: make it ours
    # ("cuda" alone names the current one; set_device wants an index)
    torch.cuda.set_device(torch.cuda.current_device() if device.index is None else device.index)


def max_model_len_of(config: EngineConfig) -> int:
    """The engine's max_model_len for ``config`` (its model's config read)."""
    return _max_model_len(config, model_config_from_hf(load_hf_config(
        resolve_model_path(config.model))))


def _max_model_len(config: EngineConfig, cfg) -> int:
    limit = cfg.max_position_embeddings
    if cfg.sliding_window:
        limit = min(limit, cfg.sliding_window)  # attention here is full; stay inside the window
    if config.max_model_len is None:
        return min(limit, 4096)
    if config.max_model_len > limit:
        raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's limit {limit}")
    return config.max_model_len
