"""Recipe fixtures: the reconstructed V4.1 tokenizer, written once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest

from recipe import ModelTokenizer, Recipe, RecipeConfig, load_tokenizer

MODEL = "default"
CONTEXT_LEN = 65536


@pytest.fixture(scope="session")
def tokenizer(v41_tokenizer_dir: Path) -> ModelTokenizer:
    return load_tokenizer(v41_tokenizer_dir)


@pytest.fixture(scope="session")
def recipe(tokenizer: ModelTokenizer) -> Recipe:
    return Recipe(tokenizer, RecipeConfig(model_names=(MODEL,), context_len=CONTEXT_LEN))
