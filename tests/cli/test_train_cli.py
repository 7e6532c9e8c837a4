"""`specdec train` argument handling (the training itself: tests/training)."""

from __future__ import annotations

import json

from specdec.cli import main


def test_missing_data_file_exits_2(tmp_path, capsys):
    assert main(["train", "eagle3", "--data", str(tmp_path / "nope.json"), "--out",
                 str(tmp_path / "o")]) == 2
    assert "file not found" in capsys.readouterr().err


def test_unknown_kind_exits_2(capsys):
    assert main(["train", "medusa"]) == 2
    assert "invalid choice" in capsys.readouterr().err


def test_bad_config_is_a_clear_error(tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "hello"}\n')
    config = tmp_path / "c.yaml"
    config.write_text("learning_rat: 0.1\n")
    assert main(["train", "eagle3", "--config", str(config), "--data", str(data), "--out",
                 str(tmp_path / "o")]) == 1
    assert "unknown training settings ['learning_rat']" in capsys.readouterr().err
    config.write_text("- a list\n")
    assert main(["train", "eagle3", "--config", str(config), "--data", str(data), "--out",
                 str(tmp_path / "o")]) == 1
    assert "expected a mapping" in capsys.readouterr().err


def test_out_required(tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "hello"}\n')
    assert main(["train", "eagle3", "--data", str(data)]) == 1
    assert "out: give the output folder" in capsys.readouterr().err


TINY = dict(regen_max_tokens=24, regen_batch_size=4, aux_layer_ids=[1, 1, 1],
            draft_vocab_size=24, max_length=64, ttt_steps=3, batch_size=4, learning_rate=3e-3,
            warmup_ratio=0.0, eval_max_tokens=24, eval_budget=6, checkpoint_every=1)


def _tiny_config(tmp_path, **kw):
    """A YAML of tiny-run settings (tests/training/test_trainer.py's)."""
    import yaml

    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump({**TINY, **kw}))
    return str(path)


def test_train_prints_what_eval_json_says(chat_target, prompts_file, tmp_path, capsys):
    """Issue 52 item 4: `--limit 10 --max-steps 2` printed `tau 1.00 speedup vs plain 3.82x`
    (a ratio of summed times, with a goodput controller that never drafted). Now: the head's
    quality at a static tree (it drafts every step), the speed as the spread of per-prompt
    ratios, a warning that one conversation was trained on, and the printed lines are
    eval.json's."""
    out = tmp_path / "run"
    assert main(["train", "eagle3", "--target", chat_target, "--data", str(prompts_file),
                 "--out", str(out), "--regenerate", "--limit", "10", "--max-steps", "2",
                 "--config", _tiny_config(tmp_path)]) == 0
    err = capsys.readouterr().err
    report = json.loads((out / "eval.json").read_text())
    printed = [line for line in err.splitlines() if line.startswith(("quality", "speed",
                                                                     "warning"))]
    assert printed == report["summary"] and len(printed) >= 3
    assert "speedup_vs_plain" not in report and "tokens_per_s" not in report
    quality, speed = report["quality"], report["speed"]
    assert quality["controller"] == "static" and quality["budget"] == 6
    assert quality["draft_tokens_proposed"] > 0 and quality["acceptance_by_depth"]
    assert f"tau {quality['tau']:.2f}" in printed[0] and "6-node tree" in printed[0]
    ratios = speed["prompt_speedups"]
    assert len(ratios) == report["num_prompts"] == 9  # 10 drawn, 9 held out, 1 trained on
    assert speed["min"] <= speed["q1"] <= speed["median"] <= speed["q3"] <= speed["max"]
    assert f"median {speed['median']:.2f}x" in printed[1]
    assert f"range {speed['min']:.2f}-{speed['max']:.2f}x" in printed[1]
    assert report["split"]["train_conversations"] == 1
    assert any("trained on 1 conversation (9 held out" in w for w in report["warnings"])
    assert report["greedy_match_rate"] == 1.0


def test_resume_takes_the_recorded_settings(chat_target, prompts_file, tmp_path, monkeypatch,
                                            capsys):
    """Issue 52 item 7: `--resume` demanded `--data` although the run recorded it, and trained
    on other data given with it. Now the recorded settings are used, a differing one is an
    error naming it (both values) unless --allow-changed names it, and the same file spelt
    otherwise is no change."""
    import specdec.training.trainer as trainer
    from specdec.training.config import TrainConfig
    from specdec.training.record import write_record

    out = tmp_path / "run"
    out.mkdir()
    first = TrainConfig(target=chat_target, data=[str(prompts_file)], out=str(out),
                        regenerate=True, max_steps=7, eval_budget=5)
    write_record(out, first.to_dict(), {})
    seen = []
    monkeypatch.setattr(trainer, "train", lambda config: seen.append(config) or {"summary": []})
    resume = ["train", "eagle3", "--out", str(out), "--resume"]
    assert main(resume) == 0
    config = seen[-1]
    assert config.data == [str(prompts_file.resolve())] and config.target == chat_target
    assert (config.regenerate, config.max_steps, config.eval_budget, config.resume) == (
        True, 7, 5, True)
    other = tmp_path / "other.jsonl"
    other.write_text(prompts_file.read_text())
    assert main([*resume, "--data", str(other), "--limit", "10"]) == 1
    err = capsys.readouterr().err
    assert f"data: recorded ['{prompts_file.resolve()}'], given ['{other.resolve()}']" in err
    assert "limit: recorded None, given 10" in err and "--allow-changed data limit" in err
    assert main(["train", "mtp", "--out", str(out), "--resume"]) == 1
    assert "kind: recorded 'eagle3', given 'mtp'" in capsys.readouterr().err
    assert main([*resume, "--max-steps", "9", "--allow-changed", "max-steps"]) == 0
    assert (seen[-1].max_steps, seen[-1].data) == (9, config.data)
    monkeypatch.chdir(prompts_file.parent)
    assert main([*resume, "--data", prompts_file.name]) == 0  # the same file
    assert len(seen) == 3
    assert main([*resume, "--allow-changed", "learning_rat"]) == 1
    assert "allow_changed must list training settings" in capsys.readouterr().err
