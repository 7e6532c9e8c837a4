"""User input is rejected early with a message naming the field (audit regressions).

SamplingParams, bench datasets, `specdec generate` flags and prompt, plugins.create's keyword
forwarding, EngineConfig's drafter_args / controller_args. No model is loaded here.
"""

from __future__ import annotations

import json
import math
import re

import pytest

from specdec import plugins
from specdec.bench.data import load_questions, to_question
from specdec.cli import main, parse_args
from specdec.config import EngineConfig
from specdec.hookspecs import hookimpl
from specdec.sampling_params import GREEDY_TEMPERATURE_EPS, MAX_SEED, SamplingParams

# ---- SamplingParams ---------------------------------------------------------------------------


@pytest.mark.parametrize("field", ["temperature", "top_k", "top_p", "min_p", "max_tokens", "seed"])
@pytest.mark.parametrize("value", [True, False])
def test_bools_are_not_numbers(field, value):
    with pytest.raises(ValueError, match=rf"^{field} must .*got {value} \(a bool\)"):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("seed", [2**64, MAX_SEED + 1, -1, -(2**63)])
def test_seed_out_of_range(seed):
    with pytest.raises(ValueError, match=r"^seed must be None or an int in \[0, 2\*\*63 - 1\]"):
        SamplingParams(seed=seed)


@pytest.mark.parametrize("seed", [None, 0, 1, MAX_SEED])
def test_seed_in_range(seed):
    assert MAX_SEED == 2**63 - 1
    assert SamplingParams(seed=seed).seed == seed


@pytest.mark.parametrize("field, value", [
    ("temperature", math.inf), ("temperature", math.nan), ("temperature", -math.inf),
    ("temperature", 10**400), ("temperature", -1e-9),
    ("top_p", math.nan), ("top_p", math.inf), ("top_p", 0.0),
    ("min_p", math.nan), ("min_p", math.inf), ("min_p", -0.1),
])
def test_non_finite_or_out_of_range_floats(field, value):
    with pytest.raises(ValueError, match=rf"^{field} must"):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("ids", [[True], [1, False], [-1], [1.0], 5])
def test_stop_token_ids_must_be_ints(ids):
    with pytest.raises(ValueError, match="^stop_token_ids must"):
        SamplingParams(stop_token_ids=ids)


def test_tiny_temperature_is_greedy():
    assert GREEDY_TEMPERATURE_EPS == 1e-5
    for t in (0, 0.0, 1e-39, 5e-324, GREEDY_TEMPERATURE_EPS / 2):
        assert SamplingParams(temperature=t).greedy, t
    for t in (GREEDY_TEMPERATURE_EPS, 0.7, 1, 2.0):
        assert not SamplingParams(temperature=t).greedy, t


def test_tiny_temperature_samples_the_argmax():
    """The reason for the epsilon: float32 logits / 1e-39 overflow and softmax gives NaN."""
    import torch

    logits = torch.tensor([1.0, 3.0, 2.0])
    assert torch.softmax(logits / 1e-39, -1).isnan().any()
    from specdec.sampling import params_to_tensors  # greedy rows never divide by temperature

    temperature = params_to_tensors([SamplingParams(temperature=1e-39)], "cpu")[0]
    assert temperature.tolist() == [1.0]


# ---- bench datasets ---------------------------------------------------------------------------


@pytest.mark.parametrize("record, field", [
    ({"question_id": 1, "turns": [""]}, "turns[0]"),
    ({"question_id": 1, "turns": ["ok", "  \n\t"]}, "turns[1]"),
    ({"question_id": 1, "turns": ["ok", 3]}, "turns[1]"),
    ({"task_id": "HumanEval/0", "prompt": ""}, "prompt"),
    ({"task_id": "HumanEval/0", "prompt": "   "}, "prompt"),
    ({"task_id": "HumanEval/0", "prompt": None}, "prompt"),
    ({"question": ""}, "question"),
    ({"question": "\n"}, "question"),
])
def test_blank_dataset_text(record, field):
    with pytest.raises(ValueError, match=rf"record 7: '{re.escape(field)}' must be a non-blank string"):
        to_question(record, 7)


def test_empty_turns_list():
    with pytest.raises(ValueError, match=r"record 0: 'turns' must be a non-empty list"):
        to_question({"turns": []}, 0)


def test_blank_record_names_its_index_in_a_file(tmp_path):
    path = tmp_path / "gsm8k.jsonl"
    path.write_text(json.dumps({"question": "two plus two?"}) + "\n"
                    + json.dumps({"question": " "}) + "\n")
    with pytest.raises(ValueError, match=r"--dataset: record 1: 'question'"):
        load_questions(path, None)


def test_bench_blank_turn_exits_1(tmp_path, capsys):
    """run_bench reads the dataset before it loads a model; main turns the ValueError into 1."""
    path = tmp_path / "mt.jsonl"
    path.write_text(json.dumps({"question_id": 1, "category": "x", "turns": ["hi", ""]}) + "\n")
    assert main(["bench", "--dataset", str(path), "--warmup", "0"]) == 1
    err = capsys.readouterr().err
    assert "error: --dataset: record 0: 'turns[1]'" in err


# ---- specdec generate: prompt and sampling flags ------------------------------------------------


@pytest.mark.parametrize("prompt", ["", "   ", "\n\t"])
@pytest.mark.parametrize("mode", [[], ["--no-chat"]])
def test_generate_empty_prompt_exits_2(prompt, mode, capsys):
    assert main(["generate", prompt, *mode]) == 2
    err = capsys.readouterr().err
    assert "specdec generate: error: argument prompt:" in err and "usage:" in err


@pytest.mark.parametrize("flag, value, field", [
    ("--temperature", "-1", "temperature"), ("--temperature", "inf", "temperature"),
    ("--temperature", "nan", "temperature"), ("--top-p", "0", "top_p"),
    ("--top-p", "2", "top_p"), ("--top-p", "nan", "top_p"), ("--top-k", "-2", "top_k"),
    ("--seed", "-1", "seed"), ("--seed", str(2**64), "seed"),
])
def test_generate_sampling_flags_checked_at_parse_time(flag, value, field, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(["generate", "hi", flag, value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"error: argument {flag}: {field} must" in err


def test_generate_sampling_flags_accepted():
    args = parse_args(["generate", "hi", "--temperature", "0.7", "--top-p", "0.9", "--top-k", "5",
                       "--seed", str(MAX_SEED)])
    assert (args.temperature, args.top_p, args.top_k, args.seed) == (0.7, 0.9, 5, MAX_SEED)


# ---- plugins.create forwards every keyword ------------------------------------------------------


class _Recorded:
    def __init__(self, **kwargs):
        self.kwargs = kwargs


class _RecordingPlugin:
    @hookimpl
    def specdec_controllers(self):
        return {"recording": _Recorded}


def test_create_forwards_keys_named_like_its_parameters():
    pm = plugins.get_plugin_manager((_RecordingPlugin(),))
    user = {"name": "n", "kind": "k", "pm": 1, "hook_name": "h", "budget": 3}
    obj = plugins.create(pm, "specdec_controllers", "controller", "recording", **user)
    assert obj.kwargs == user and obj.plugin_name == "_RecordingPlugin"


@pytest.mark.parametrize("key", ["name", "kind", "pm", "hook_name"])
def test_create_reports_unknown_key_of_the_factory(key):
    pm = plugins.get_plugin_manager()
    with pytest.raises(ValueError, match=rf"controller 'static' .*unexpected keyword.*'{key}'"):
        plugins.create(pm, "specdec_controllers", "controller", "static", **{key: 1})


# ---- EngineConfig drafter_args / controller_args ----------------------------------------------


@pytest.mark.parametrize("field, owner", [("drafter_args", "the drafter"),
                                          ("controller_args", "the controller")])
def test_kwargs_must_be_a_dict(field, owner):
    with pytest.raises(TypeError) as exc:
        EngineConfig(**{field: [1]})
    assert str(exc.value) == f"{field} must be a dict of keyword arguments for {owner}, got list [1]"
    with pytest.raises(TypeError, match=rf"^{field} must be a dict .*str keys"):
        EngineConfig(**{field: {1: 2}})
    assert getattr(EngineConfig(**{field: {"budget": 2}}), field) == {"budget": 2}
