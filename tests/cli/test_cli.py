"""The `specdec` CLI in-process: generate streams, prints its stats, bad args fail."""

from __future__ import annotations

import cli_helpers
import pytest
import torch

from specdec.cli import main

chat_model, repeat_drafter = cli_helpers.chat_model, cli_helpers.repeat_drafter  # fixtures


@pytest.mark.parametrize("chat", [True, False])
def test_generate_streams(chat_model, capsys, chat):
    argv = ["generate", "write a poem", "--model", chat_model, "--max-tokens", "6"]
    assert main(argv + ([] if chat else ["--no-chat"])) == 0
    out, err = capsys.readouterr()
    assert out.strip() and "6 tokens" in err and "tokens/s" in err and "TTFT" in err


def test_generate_with_drafter_prints_tau(chat_model, capsys, repeat_drafter):
    argv = ["generate", "write a poem", "--model", chat_model, "--max-tokens", "6",
            "--drafter", "repeat", "--budget", "2", "--temperature", "0.7", "--seed", "1"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "tau" in err and "acceptance" in err


def test_generate_with_a_composition(chat_model, capsys):
    """A composition by name, as docs/drafters.md says (the CLI used to refuse the whole name)."""
    argv = ["generate", "write a poem", "--model", chat_model, "--max-tokens", "6",
            "--drafter", "ngram+suffix", "--drafter-args", '{"ngram": {"min_ngram": 1}}',
            "--controller", "static", "--budget", "2"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "6 tokens" in err and "tau" in err and "acceptance" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_device_without_cuda(chat_model, capsys):
    assert main(["generate", "hi", "--model", chat_model, "--device", "cuda"]) != 0
    assert "--device" in capsys.readouterr().err


def test_generate_bad_args(chat_model, capsys):
    assert main(["generate", "hi", "--model", chat_model, "--max-tokens", "0"]) != 0
    assert "--max-tokens" in capsys.readouterr().err
    assert main(["generate", "hi", "--model", chat_model, "--top-p", "2"]) == 2  # parse time
    assert "argument --top-p: top_p" in capsys.readouterr().err


def test_generate_drafter_auto_and_none():
    from specdec.cli import parse_args

    # auto: measured when generate runs (specdec.engine.drafter_choice), not at parse time
    assert parse_args(["generate", "hi"]).drafter == "auto"
    assert parse_args(["generate", "hi", "--drafter", "none"]).drafter is None
    assert parse_args(["generate", "hi", "--drafter", "ngram"]).drafter == "ngram"
    assert parse_args(["bench", "--dataset", __file__]).drafter is None
    with pytest.raises(SystemExit):
        parse_args(["generate", "hi", "--drafter-args", '{"k": 1}'])


def test_quantize_flag(chat_model, capsys):
    from specdec.cli import parse_args
    from specdec.cli.common import engine_kwargs

    assert engine_kwargs(parse_args(["generate", "hi", "--quantize", "q4_k"]))["quantize"] == "q4_k"
    assert engine_kwargs(parse_args(["generate", "hi"]))["quantize"] is None
    with pytest.raises(SystemExit):
        parse_args(["generate", "hi", "--quantize", "q4_0"])
    assert "--quantize: invalid choice: 'q4_0'" in capsys.readouterr().err
    argv = ["generate", "write a poem", "--model", chat_model, "--max-tokens", "4",
            "--drafter", "none", "--quantize", "q8_0", "--activations", "q8"]
    assert main(argv) == 0
    assert "4 tokens" in capsys.readouterr().err


def test_draft_weights_help_says_what_auto_picks(capsys):
    """--draft-weights auto is each draft model's ``auto_draft_weights`` (the learned heads') or
    Q8_0 (a draft model): the help says so (it used to say q8_0 for all)."""
    from specdec.models.heads.block_diffusion import BlockDiffusionModel
    from specdec.models.heads.eagle3 import Eagle3Head
    from specdec.models.heads.mtp import MTPHeads

    assert main(["generate", "--help"]) == 0
    help_text = " ".join(capsys.readouterr().out.split())
    heads = {m.auto_draft_weights.lower() for m in (Eagle3Head, MTPHeads, BlockDiffusionModel)}
    assert len(heads) == 1
    assert f"{heads.pop()} for the learned heads (eagle3, mtp, block_diffusion) and q8_0 for a " \
           "draft model" in help_text


def test_generate_with_a_tier_reuses_a_previous_runs_prompt_and_says_so(chat_model, tmp_path,
                                                                         capsys):
    """#52: the second run of one prompt on one --kv-tier-path reuses the pages the first one
    wrote (the first run evicted nothing), with the same text; the file is as large as its
    pages, not --kv-tier-bytes; a missing folder is an error naming it, not made."""
    import re

    path = tmp_path / "kv.tier"
    argv = ["generate", "tell me everything about tea, " * 12, "--model", chat_model,
            "--max-tokens", "4", "--drafter", "none", "--kv-tier-path", str(path)]
    runs = []
    for _ in range(2):
        assert main(argv) == 0
        out, err = capsys.readouterr()
        reused, prompt = map(int, re.search(r"(\d+) of (\d+) prompt tokens reused", err).groups())
        runs.append((out, reused, prompt))
    assert runs[0][0] == runs[1][0] and runs[0][1] == 0
    assert runs[1][1] >= runs[1][2] - 16 and runs[1][1] > 0
    assert path.stat().st_size < 64 << 20  # not the 2 GiB limit up front
    missing = tmp_path / "no" / "kv.tier"
    assert main([*argv[:-1], str(missing)]) == 1
    assert f"folder '{missing.parent}' does not exist" in capsys.readouterr().err
    assert not missing.parent.exists()


def test_generate_stats_say_nothing_drafted_rather_than_a_rate_of_nothing():
    from specdec.cli.generate import generate_stats
    from specdec.outputs import RequestMetrics

    line = generate_stats(RequestMetrics(num_output_tokens=4), 1.0, speculative=True)
    assert "nothing drafted" in line and "0/0" not in line and "acceptance" not in line
    drafted = RequestMetrics(num_output_tokens=4, draft_tokens_proposed=4,
                             accepted_by_depth=[2, 1])
    assert "acceptance 75.0% (3/4)" in generate_stats(drafted, 1.0, speculative=True)


def test_bench_commands_read_the_shipped_prompts_without_dataset():
    """#52: the docs' bench commands ran only with a file nobody shipped."""
    from specdec.bench.data import DEFAULT_DATASET
    from specdec.cli import parse_args

    for command in ("bench", "bench-prefix", "bench-serve"):
        assert parse_args([command]).dataset == str(DEFAULT_DATASET), command


def _subparsers():
    import argparse

    from specdec.cli import build_parser

    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return parser, sub.choices


def test_every_flag_of_every_command_says_what_it_does_and_its_default():
    """#52: 20-odd flags had no help (serve --port, bench-serve's, --drafter-args, ...)."""
    import argparse

    parser, commands = _subparsers()
    missing = [f"{name} {'/'.join(a.option_strings) or a.dest}"
               for name, p in commands.items() for a in p._actions
               if not isinstance(a, argparse._HelpAction)
               and (not (a.help or "").strip()
                    or (a.option_strings and "default" not in a.help.lower()))]
    assert not missing, f"flags without a help text naming their default: {missing}"
    assert all((a.help or "").strip() for a in parser._actions)


def test_version(capsys):
    from importlib.metadata import version

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"specdec {version('specdec')}"


def test_budget_follows_the_controller_that_will_run(capsys):
    """#52: --budget 0 passed the parser (>= 0) and failed after loading the model in goodput
    (>= 1); static takes 0 (plain decoding)."""
    from specdec.cli import parse_args

    with pytest.raises(SystemExit):
        parse_args(["generate", "hi", "--drafter", "ngram", "--budget", "0"])
    err = capsys.readouterr().err
    assert "specdec generate: error: argument --budget:" in err and "goodput" in err
    with pytest.raises(SystemExit):
        parse_args(["bench-serve", "--drafters", "none,ngram", "--controller-args",
                    '{"width": 0}'])
    assert "specdec bench-serve: error: argument --controller-args:" in capsys.readouterr().err
    args = parse_args(["generate", "hi", "--drafter", "ngram", "--controller", "static",
                       "--budget", "0"])
    assert args.controller_args == {"budget": 0}
    assert parse_args(["bench", "--controllers", "static:0,goodput", "--budget", "0"])


@pytest.mark.parametrize("argv, flag", [
    (["generate", "hi", "--drafter", "nosuch"], "--drafter"),  # after parsing
    (["generate", "hi", "--max-tokens", "0"], "--max-tokens"),  # argparse's own
    (["bench", "--drafter", "ngram", "--drafters", "ngram"], "--drafters"),
    (["serve", "--budget", "3", "--controller-args", '{"budget": 4}'], "--budget"),
])
def test_usage_errors_all_name_the_command(argv, flag, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"specdec {argv[0]}: error: argument {flag}" in err, err
    assert f"usage: specdec {argv[0]}" in err
