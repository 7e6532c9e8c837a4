"""The recipes in recipes/ stay valid settings (they are what the README tells users to run)."""

from __future__ import annotations

from pathlib import Path

import pytest

from specdec.training.config import TrainConfig

RECIPES = sorted((Path(__file__).parents[2] / "recipes").glob("*.yaml"))


@pytest.mark.parametrize("recipe", RECIPES, ids=[r.stem for r in RECIPES])
def test_recipe_is_valid(recipe):
    config = TrainConfig.from_sources(str(recipe), {"out": "runs/x"})
    assert config.data and all(d.startswith("../shared/data/train/") for d in config.data)


def test_there_are_recipes():
    assert len(RECIPES) >= 2
