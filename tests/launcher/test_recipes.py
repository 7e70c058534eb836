"""The launch/ recipes parse as bash and document how to use them."""

from __future__ import annotations

import pathlib
import subprocess

import pytest

LAUNCH = pathlib.Path(__file__).resolve().parents[2] / "launch"
RECIPES = sorted(p for p in LAUNCH.iterdir() if p.suffix in (".sh", ".sbatch"))


def test_recipes_exist():
    assert {p.name for p in RECIPES} >= {"slurm_multinode.sbatch", "two_hosts.sh"}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("recipe", RECIPES, ids=[p.name for p in RECIPES])
def test_recipe_is_valid_bash_with_usage(recipe):
    proc = subprocess.run(["bash", "-n", str(recipe)], check=False, capture_output=True, text=True, timeout=20)
    assert proc.returncode == 0, proc.stderr
    text = recipe.read_text()
    assert text.startswith("#!/bin/bash\n")
    header = text.split("\n\n")[0]
    assert "# Usage" in header
    assert "distrun" in text


@pytest.mark.timeout(30)
@pytest.mark.parametrize("recipe", RECIPES, ids=[p.name for p in RECIPES])
def test_recipe_without_arguments_prints_usage(recipe):
    proc = subprocess.run(["bash", str(recipe)], check=False, capture_output=True, text=True, timeout=20)
    assert proc.returncode == 2
    assert proc.stderr.startswith("usage: ")
