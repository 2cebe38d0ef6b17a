"""Fixtures shared by the speculation tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def default_model_exact_kv(tmp_path_factory: pytest.TempPathFactory):
    """The `default` structure with random weights and exact KV storage (token equality
    needs batch-invariant numerics, see `test_lossless.py`)."""
    from engine.models import Numerics, load_model, write_random_checkpoint

    folder = write_random_checkpoint("default", tmp_path_factory.mktemp("default") / "ckpt")
    return load_model(folder, numerics=Numerics(kv_quantize=False))
