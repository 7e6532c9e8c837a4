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
