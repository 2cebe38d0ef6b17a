"""The real V4.1 tokenizer and one grammar compiler for it, built once per session."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from engine.structured import GrammarCompiler

V41_VOCAB_SIZE = 129280
EOS_ID = 1


@pytest.fixture(scope="session")
def v41_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    from engine.models.deepseek_v41.tokenizer_files import write_v41_tokenizer

    folder = tmp_path_factory.mktemp("v41_tokenizer")
    write_v41_tokenizer(folder)
    return Tokenizer.from_file(str(folder / "tokenizer.json"))


@pytest.fixture(scope="session")
def compiler(v41_tokenizer: Tokenizer) -> GrammarCompiler:
    return GrammarCompiler.for_tokenizer(v41_tokenizer, V41_VOCAB_SIZE, EOS_ID)
