"""Shared fixtures: checkpoints written once per test session by our own writer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)  # tiny tensors: threads only add overhead on 2 cores


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA device")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engine.models import write_random_checkpoint

    return write_random_checkpoint("tiny", tmp_path_factory.mktemp("tiny") / "ckpt", seed=0)


@pytest.fixture(scope="session")
def tiny_model(tiny_checkpoint: Path):
    from engine.models import load_model

    return load_model(tiny_checkpoint)


@pytest.fixture(scope="session")
def tiny_model_exact_kv(tiny_checkpoint: Path):
    from engine.models import Numerics, load_model

    return load_model(tiny_checkpoint, numerics=Numerics(kv_quantize=False))


@pytest.fixture(scope="session")
def default_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The `default` structure with random weights (seed 0), written once per session: the
    live server's model and the engine tests on the `default` structure share it."""
    from engine.models import write_random_checkpoint

    return write_random_checkpoint("default", tmp_path_factory.mktemp("default") / "ckpt", seed=0)


@pytest.fixture(scope="session")
def default_model_exact_kv(default_checkpoint: Path):
    """The `default` checkpoint with exact KV storage (token equality needs batch-invariant
    numerics, see `tests/engine/speculative/test_lossless.py`)."""
    from engine.models import Numerics, load_model

    return load_model(default_checkpoint, numerics=Numerics(kv_quantize=False))


@pytest.fixture(scope="session")
def v41_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with the reconstructed V4.1 tokenizer.json, written once per session."""
    from engine.models.deepseek_v41.tokenizer_files import write_v41_tokenizer

    folder = tmp_path_factory.mktemp("v41_tokenizer")
    write_v41_tokenizer(folder)
    return folder


@pytest.fixture(scope="session")
def v41_grammar_compiler(v41_tokenizer_dir: Path):
    """A grammar compiler for the V4.1 vocabulary (129,280 logits, EOS 1)."""
    from tokenizers import Tokenizer

    from engine.structured import GrammarCompiler

    tokenizer = Tokenizer.from_file(str(v41_tokenizer_dir / "tokenizer.json"))
    return GrammarCompiler.for_tokenizer(tokenizer, 129280, 1)
