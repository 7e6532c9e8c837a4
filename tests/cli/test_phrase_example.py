"""The phrase plugin's README example fires its phrase (#52: the one it had never did): the
README's `specdec generate` line, run as written with the default model, drafts the phrase and
the model accepts some of it; docs/cli.md shows the same line."""

from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "specdec-phrase-drafter"


def _readme_command() -> list[str]:
    text = (EXAMPLE / "README.md").read_text()
    block = re.search(r"^    (specdec generate .*?)(?=\n\n)", text, re.S | re.M).group(1)
    return shlex.split(block.replace("\\\n", " "))[1:]


def test_the_readme_command_is_the_one_docs_cli_shows():
    argv = _readme_command()
    phrases = json.loads(argv[argv.index("--drafter-args") + 1])["phrases"]
    assert argv[argv.index("--drafter") + 1] == "phrase" and phrases
    assert json.dumps({"phrases": phrases}) in (REPO / "docs" / "cli.md").read_text()


@pytest.mark.slow
def test_the_readme_example_fires_its_phrase(smollm2_dir, monkeypatch, capsys):
    from specdec.cli import main

    monkeypatch.syspath_prepend(str(EXAMPLE))  # the plugin, as `pip install` would give it
    import specdec_phrase.plugin as plugin

    from specdec import plugins

    real = plugins.get_plugin_manager
    monkeypatch.setenv("SPECDEC_DISABLE_PLUGIN_AUTOLOAD", "1")  # only this copy, once
    monkeypatch.setattr(plugins, "get_plugin_manager",
                        lambda extra=(): real((plugin, *extra)))
    argv = _readme_command()
    assert main([*argv, "--model", str(smollm2_dir)]) == 0
    err = capsys.readouterr().err
    accepted, proposed = map(int, re.search(r"acceptance [\d.]+% \((\d+)/(\d+)\)", err).groups())
    assert proposed > 0 and accepted > 0, err
    assert sys.modules["specdec_phrase.plugin"] is plugin
