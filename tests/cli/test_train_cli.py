"""`specdec train` argument handling (the training itself: tests/training)."""

from __future__ import annotations

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
