"""Parity with the external reference, NVIDIA NeMo AutoModel 0.7.0 (`model.md` §14).

NeMo runs in its own venv (it pins transformers 5.18): set `DEEPINFER_NEMO_PYTHON` to that venv's
python (`bash tests/reference/setup_nemo_venv.sh` makes `.venv-nemo`); otherwise these tests skip.
Both sides run fp32 on a `tiny` checkpoint written by our writer, our side with
`Numerics.nemo_reference()`: the same rounding points as NeMo where the spec leaves them open or
where NeMo deliberately differs (§14):

* FP8 window-row scale floor (§14 item 2): NeMo's rule (`kv_nemo_variant`).
* Routing weight applied before the down projection (§14 item 4, `moe_weight_before_down`).
* DSpark confidence input (§14 item 6): ours is the pre-norm state (spec); compared with the
  runner's `confidence_logit_prenorm`, which applies NeMo's head to that state.
* Image token id in text (NeMo treats a bare id as text, we as an image row): prompts avoid it.

With those, every stored FP8/FP4 row is computed from bit-identical inputs in the early layers,
so even 256-token prompts (16× the candidate threshold) agree without rounding flips.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from engine import envs
from engine.models import Numerics, load_model, sequential_batch
from kernels.moe_combine import moe_combine_reference

pytestmark = pytest.mark.parity

RUNNER = Path(__file__).resolve().parents[1] / "reference" / "nemo_runner.py"
QUANT_PROMPTS = [(11, 64), (12, 96), (13, 33), (14, 200)]
# Logits only: at this length one stored row of layer 3 flips its FP4 rounding step, which
# moves that layer's output by ~4e-4 relative but not the final argmax.
LONG_QUANT_PROMPT = (15, 256)
EXACT_PROMPTS = [(21, 256), (22, 64)]


def _prompt(seed: int, length: int, avoid: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 1000, (length - 1,), generator=g)
    ids[ids == avoid] = 3
    return [0] + ids.tolist()


# The reference runs ATen's AVX2 kernels on every host: on AVX-512 its fp32 last-dim softmax
# (NeMo's eager attention) rounds ~1/3 of elements differently (<= 2e-7), and on prompt 1 that
# flips the FP8 rounding of one SWA KV row at layer 5 (4.96e-4 relative there), so the verdict
# depended on the CI host. Ours passes against either kernel set; what the reference computes is
# pinned (docs/nemo_reference_notes.md §10).
REFERENCE_CPU_CAPABILITY = "avx2"


def _run_nemo(checkpoint: Path, prompts: list[list[int]], cache_quant: str, out_dir: Path) -> dict:
    python = envs.nemo_python()
    if python is None or not python.exists():
        pytest.skip("DEEPINFER_NEMO_PYTHON is not set to the NeMo reference venv's python")
    prompt_file = out_dir / f"prompts-{cache_quant}.json"
    prompt_file.write_text(json.dumps(prompts))
    out = out_dir / f"nemo-{cache_quant}.pt"
    subprocess.run(
        [
            str(python),
            str(RUNNER),
            "--checkpoint",
            str(checkpoint),
            "--prompts",
            str(prompt_file),
            "--out",
            str(out),
            "--cache-quant",
            cache_quant,
            "--dspark",
            "last",
            "--threads",
            "1",
        ],
        check=True,
        capture_output=True,
        timeout=900,
        env={**os.environ, "ATEN_CPU_CAPABILITY": REFERENCE_CPU_CAPABILITY},
    )
    return torch.load(out, weights_only=False)


def _rel(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours.float() - ref.float()).norm() / ref.float().norm().clamp(min=1e-30)).item()


def _moe_output(parts) -> torch.Tensor:
    """The FFN's output as the block adds it (the block asks `MoE.forward` for it unreduced)."""
    y, slots = parts
    return y if slots is None else moe_combine_reference(y, slots)


def _ours(model, prompt: list[int]) -> dict:
    record: dict = {}
    hooks = []
    for block in model.layers:
        lid = block.layer_id
        hooks.append(
            block.attn.register_forward_hook(
                lambda _m, _i, out, lid=lid: record.__setitem__(f"layers.{lid}.attn_out", out)
            )
        )
        hooks.append(
            block.ffn.register_forward_hook(
                lambda _m, _i, out, lid=lid: record.__setitem__(
                    f"layers.{lid}.moe_out", _moe_output(out)
                )
            )
        )
    try:
        record["logits"] = model.logits([prompt], record=record)[0]
    finally:
        for h in hooks:
            h.remove()
    return record


def _selected_sets(sel: torch.Tensor) -> list[set[int]]:
    return [set(row[row >= 0].tolist()) for row in sel]


def _compare(
    model,
    ref: dict,
    prompt: list[int],
    layer_rtol: float | None,
    logit_atol: float,
    flip_rtol: float | None = None,
) -> None:
    """Layer by layer within `layer_rtol`, then the logits within `logit_atol` and the same
    predictions. `flip_rtol` (stored KV codes): the first layer past `layer_rtol` may be one
    rounding flip of a near-tie code, whose side the host's summation order decides (the
    reference's own verdict moved with its CPU kernels, `REFERENCE_CPU_CAPABILITY`): every
    output of that layer within `flip_rtol`, the layers after it unchecked, and the logits
    held to `_after_a_flip`."""
    ours = _ours(model, prompt)
    cfg = model.config
    flipped = False
    for lid in range(cfg.num_hidden_layers if layer_rtol is not None else 0):
        layer = ref["layers"][lid]
        errors = {
            key: _rel(ours[f"layers.{lid}.{key}"], layer[ref_key])
            for key, ref_key in (
                ("residual", "out_streams"),
                ("attn_out", "attn_out"),
                ("moe_out", "moe_out"),
            )
        }
        if flip_rtol is not None and max(errors.values()) >= layer_rtol:
            assert max(errors.values()) < flip_rtol, f"layer {lid}: relative errors {errors}"
            flipped = True
            break
        for key, err in errors.items():
            assert err < layer_rtol, f"layer {lid} {key}: relative error {err:.2e}"
        if lid in cfg.index_source_layer_ids:
            assert _selected_sets(ours[f"layers.{lid}.selection"]) == _selected_sets(
                layer["topk_indices"]
            ), f"layer {lid}: top-k selections differ"
        if f"layers.{lid}.candidates" in ours and "candidates" in layer:
            published = ours[f"layers.{lid}.candidates"]  # whole blocks; NeMo's is visible-only
            num_j = layer["candidates"].shape[1]
            ratio = cfg.ratio(lid)
            visible = (
                torch.arange(num_j)[None, :] < (torch.arange(len(prompt))[:, None] + 1) // ratio
            )
            assert torch.equal(published[:, :num_j] & visible, layer["candidates"].bool())
    logits, ref_logits = ours["logits"], ref["logits"].float()
    if flipped:
        _after_a_flip(logits, ref_logits)
        return
    assert (logits - ref_logits).abs().max().item() <= logit_atol
    assert torch.equal(logits.argmax(-1), ref_logits.argmax(-1))


def _after_a_flip(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    """Logits downstream of one flipped KV rounding: within 3 % of the reference's norm, the
    predictions (nearly all) the same. A flip at an early layer of a long prompt can move
    single logits by more than one (prompt 3 of `QUANT_PROMPTS`, flipped at layer 3 on an
    AVX-512 host, 2026-12-07: 1.36 at most, 2.3e-2 relative, 99.5 % of the predictions)."""
    assert (ours.argmax(-1) == theirs.argmax(-1)).float().mean() >= 0.99
    assert _rel(ours, theirs) < 3e-2


@pytest.fixture(scope="module")
def quant_reference(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory):
    model = load_model(tiny_checkpoint, numerics=Numerics.nemo_reference())
    avoid = model.config.image_token_id
    prompts = [_prompt(s, n, avoid) for s, n in [*QUANT_PROMPTS, LONG_QUANT_PROMPT]]
    ref = _run_nemo(tiny_checkpoint, prompts, "nemo", tmp_path_factory.mktemp("nemo-q"))
    return model, prompts, ref


@pytest.fixture(scope="module")
def exact_reference(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory):
    model = load_model(tiny_checkpoint, numerics=Numerics(kv_quantize=False))
    avoid = model.config.image_token_id
    prompts = [_prompt(s, n, avoid) for s, n in EXACT_PROMPTS]
    ref = _run_nemo(tiny_checkpoint, prompts, "none", tmp_path_factory.mktemp("nemo-x"))
    return model, prompts, ref


@pytest.mark.parametrize("index", range(len(QUANT_PROMPTS)))
def test_parity_with_kv_encodings(quant_reference, index: int) -> None:
    model, prompts, ref = quant_reference
    _compare(
        model, ref["results"][index], prompts[index], layer_rtol=1e-4, logit_atol=5e-2,
        flip_rtol=1e-3,
    )  # fmt: skip


def test_parity_long_prompt_after_a_rounding_flip(quant_reference) -> None:
    """One stored row flips one FP4 rounding step at layer 3 (a ~1e-7 input difference): the
    logits of later positions move by up to a few tenths, the predictions stay the same."""
    model, prompts, ref = quant_reference
    index = len(QUANT_PROMPTS)
    ours = model.logits([prompts[index]])[0]
    theirs = ref["results"][index]["logits"].float()
    assert (ours - theirs).abs().max() < 1.0
    _after_a_flip(ours, theirs)


@pytest.mark.parametrize("index", range(len(EXACT_PROMPTS)))
def test_parity_without_kv_round_trip(exact_reference, index: int) -> None:
    model, prompts, ref = exact_reference
    _compare(model, ref["results"][index], prompts[index], layer_rtol=1e-4, logit_atol=1e-3)


def test_dspark_draft_parity(quant_reference) -> None:
    model, prompts, ref = quant_reference
    prompt = prompts[0]
    dspark = ref["results"][0]["dspark"]
    batch, state = model.fresh_batch([prompt + [0] * 8])
    step = sequential_batch([prompt], [0], [0], batch.block_tables)
    with torch.no_grad():
        out = model.forward_step(step, state)
        model.inject_draft_context(step, out.dspark_features, state)
        anchor = out.logits[-1].argmax().view(1)
        draft = model.draft(anchor, torch.tensor([len(prompt)]), torch.tensor([0]), state)
    assert _rel(out.dspark_features, dspark["target_features"]) < 1e-4
    assert int(anchor) == int(dspark["anchor_tokens"][0])
    assert (draft.base_logits[0] - dspark["base_logits"][0].float()).abs().max() <= 5e-2
    assert torch.equal(draft.drafts[0], dspark["greedy_drafts"][0])
    ref_conf = torch.sigmoid(dspark["confidence_logit_prenorm"][0].float())
    assert torch.allclose(draft.confidence[0], ref_conf, atol=1e-4)
