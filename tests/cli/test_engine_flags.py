"""Every engine flag docs/cli.md lists reaches the engine config of every command that takes it,
and every command but train takes them all (bench-prefix: all but the cache and tier flags, which
its workloads set). A drafter composition is one more value of --drafter on each command.

The engines are caught where LLM hands its EngineConfig to LLMEngine: each config is kept and the
command stops at the first use of an engine, so no model loads and several engines a command
builds side by side (bench's engine and plain reference, a sweep's systems) are all seen.
"""

from __future__ import annotations

import re
from pathlib import Path

import cli_helpers
import pytest

from specdec.cli import build_parser, main

dataset = cli_helpers.dataset  # fixture

DOCS = Path(__file__).parents[2] / "docs" / "cli.md"
TIER, MODEL = "kv.tier", "tiny/model"  # nothing is loaded or opened

# flag -> (argv that sets it, EngineConfig field, the value it must reach); a row that names a
# drafter is checked on the command's speculative engines (a plain reference has none)
TABLE = {
    "--model": (["--model", MODEL], "model", MODEL),
    "--dtype": (["--dtype", "float64"], "dtype", "float64"),
    "--device": (["--device", "cuda:0"], "device", "cuda:0"),
    "--tensor-parallel-size": (["--tensor-parallel-size", "3"], "tensor_parallel_size", 3),
    "--tensor-parallel-reduce": (["--tensor-parallel-reduce", "library"],
                                 "tensor_parallel_reduce", "library"),
    "--weights": (["--weights", "dequantized"], "weights", "dequantized"),
    "--activations": (["--activations", "q8"], "activations", "q8"),
    "--quantize": (["--quantize", "q8_0"], "quantize", "q8_0"),
    "--attention-backend": (["--attention-backend", "flex"], "attention_backend", "flex"),
    "--no-cuda-graphs": (["--no-cuda-graphs"], "cuda_graphs", False),
    "--no-prefix-caching": (["--no-prefix-caching"], "enable_prefix_caching", False),
    "--kv-tier-path": (["--kv-tier-path", TIER], "kv_tier_path", TIER),
    "--kv-tier-bytes": (["--kv-tier-bytes", "12345"], "kv_tier_bytes", 12345),
    "--kv-host-tier-bytes": (["--kv-host-tier-bytes", "4096"], "kv_host_tier_bytes", 4096),
    "--drafter": (["--drafter", "ngram+suffix"], "drafter", "ngram+suffix"),
    "--drafter-args": (["--drafter", "ngram", "--drafter-args", '{"min_ngram": 1}'],
                       "drafter_args", {"min_ngram": 1}),
    "--controller": (["--drafter", "ngram", "--controller", "static"], "controller", "static"),
    "--budget": (["--drafter", "ngram", "--budget", "3"], "controller_args", {"budget": 3}),
    "--controller-args": (["--drafter", "ngram", "--controller-args", '{"budget": 2}'],
                          "controller_args", {"budget": 2}),
    "--verifier": (["--verifier", "greedy"], "verifier", "greedy"),
    "--draft-weights": (["--draft-weights", "float"], "draft_weights", "float"),
    "--linear-kernels": (["--linear-kernels", "plain"], "linear_kernels", "plain"),
}
CACHE_FLAGS = {"--no-prefix-caching", "--kv-tier-path", "--kv-tier-bytes", "--kv-host-tier-bytes"}

# each command's way in, with what it needs to build its engines; DATASET is the fixture's file
COMMANDS = {
    "generate": ["generate", "hi", "--no-chat", "--drafter", "none"],
    "bench": ["bench", "--dataset", "DATASET", "--baseline", "plain"],  # engine and plain
    "bench sweep": ["bench", "--dataset", "DATASET", "--batch-sizes", "1", "--drafter", "ngram"],
    "bench-prefix": ["bench-prefix", "--dataset", "DATASET", "--num-prompts", "4"],  # +- cache
    "serve": ["serve", "--port", "0"],
    "bench-serve": ["bench-serve", "--dataset", "DATASET", "--num-prompts", "4"],
}


def documented_flags() -> set[str]:
    """The flags of the list that opens docs/cli.md's "Engine flags" section."""
    text = DOCS.read_text()
    listing = text[text.index("## Engine flags"):].split("\n\n")[1]
    return set(re.findall(r"`(--[a-z][a-z-]*)", listing))


def accepted(command: str) -> set[str]:
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return set(sub.choices[command.split()[0]]._option_string_actions) & set(TABLE)


class Built(BaseException):
    """The command's first use of an engine: what it built is in ``configs`` by then."""


class CaughtEngine:
    def __init__(self, configs: list, config, plugins=()) -> None:
        configs.append(config)

    def __getattr__(self, name: str):
        raise Built(name)


@pytest.fixture
def built_configs(monkeypatch) -> list:
    """The EngineConfig of every engine the command under test builds, none of them loaded."""
    import torch

    configs: list = []
    monkeypatch.setattr("specdec.engine.llm.LLMEngine",
                        lambda config, plugins=(): CaughtEngine(configs, config, plugins))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # --device cuda:0 parses
    return configs


def run_command(command: str, extra: list[str], dataset: str, configs: list) -> list:
    argv = [dataset if a == "DATASET" else a for a in COMMANDS[command]] + extra
    with pytest.raises(Built):
        main(argv)
    assert configs, f"{command}: no engine built"
    return configs


def test_docs_list_the_table_and_every_command_takes_them():
    assert documented_flags() == set(TABLE)
    for command in COMMANDS:
        missing = set(TABLE) - accepted(command)
        assert missing == (CACHE_FLAGS if command == "bench-prefix" else set()), command


CASES = [(c, f) for c in COMMANDS for f in TABLE if f in accepted(c)]


@pytest.mark.parametrize("command, flag", CASES, ids=[f"{c}:{f}" for c, f in CASES])
def test_engine_flag_reaches_every_engine(command, flag, dataset, built_configs):
    argv, field, value = TABLE[flag]
    configs = run_command(command, argv, dataset, built_configs)
    if "--drafter" in argv:
        configs = [c for c in configs if c.drafter is not None]
        assert configs, f"{command} {argv}: no speculative engine"
    got = [getattr(c, field) for c in configs]
    if field == "kv_tier_path":  # engines alive side by side each own a file: FILE, FILE.1, ...
        assert got == [value] + [f"{value}.{i}" for i in range(1, len(got))], (command, got)
    else:
        assert got == [value] * len(got), (command, flag, got)


@pytest.mark.parametrize("command, argv, drafters", [
    ("bench sweep", ["--drafters", "ngram+suffix,ngram", "--drafter", "none"], ["ngram+suffix"]),
    ("bench-serve", ["--drafters", "ngram+suffix,none"], ["ngram+suffix"]),
    ("bench-serve", ["--drafter", "suffix+ngram"], ["suffix+ngram"]),
])
def test_compositions_in_drafters_lists(command, argv, drafters, dataset, built_configs):
    """--drafters entries are compositions too; bench-serve serves --drafter's system (it used
    to bench plain decoding only unless --drafters named it)."""
    configs = run_command(command, argv, dataset, built_configs)
    assert [c.drafter for c in configs if c.drafter is not None] == drafters


@pytest.mark.parametrize("argv, message", [
    (["--drafter", "ngram+nope"], "argument --drafter: unknown name 'nope' (a member of "
                                  "'ngram+nope'); registered: block_diffusion, draft_model"),
    (["--drafter", "ngram+ngram"], "argument --drafter: drafter 'ngram+ngram': name each "
                                   "drafter once"),
    (["--drafter", "ngram+"], "name each drafter once"),
], ids=["unknown member", "member twice", "empty member"])
@pytest.mark.parametrize("command", ["generate", "bench", "serve", "bench-serve"])
def test_bad_composition_exits_2_naming_the_registered(command, argv, message, dataset, capsys):
    base = [dataset if a == "DATASET" else a for a in COMMANDS[command]]
    assert main(base + argv) == 2
    assert message in capsys.readouterr().err


def test_bad_drafters_entry_and_drafter_with_drafters(dataset, capsys, built_configs):
    """--drafters entries are checked as --drafter is, at parse time; the two together are a
    usage error (bench-serve used to drop --drafter without a word)."""
    for command in ("bench", "bench-serve"):
        base = [command, "--dataset", dataset]
        assert main(base + ["--drafters", "none,eagle3+nope"]) == 2
        assert "argument --drafters: unknown name 'nope' (a member of 'eagle3+nope')" in (
            capsys.readouterr().err)
        assert main(base + ["--drafters", "ngram+suffix", "--drafter", "suffix"]) == 2
        assert "give --drafter or --drafters, not both" in capsys.readouterr().err
    assert not built_configs
