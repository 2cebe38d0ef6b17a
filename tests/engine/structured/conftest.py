"""The real V4.1 tokenizer and one grammar compiler for it, built once per session."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer

from engine.structured import GrammarCompiler

V41_VOCAB_SIZE = 129280
EOS_ID = 1


@pytest.fixture(scope="session")
def v41_tokenizer(v41_tokenizer_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(v41_tokenizer_dir / "tokenizer.json"))


@pytest.fixture(scope="session")
def compiler(v41_grammar_compiler: GrammarCompiler) -> GrammarCompiler:
    return v41_grammar_compiler
