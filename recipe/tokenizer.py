"""The model's tokenizer as the recipe needs it: special-token spellings read by id, and
injection-safe prompt encoding (`recipe.md` §1, §4).

A rendered prompt is a string plus `special_ranges`, the code-point ranges that the *template*
produced as special tokens. Only those ranges become special ids; every plain segment between
them is encoded on its own by a copy of the tokenizer without the added vocabulary, so text that
spells `<｜User｜>`, `</think>` or `｜DSML｜` stays ordinary byte-level tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import deepseek_recipe as dr
from tokenizers import Tokenizer

TOKENIZER_FILE = "tokenizer.json"

V41_SPECIAL_TOKEN_IDS: MappingProxyType[str, int] = MappingProxyType(
    {
        "bos": 0,
        "eos": 1,
        "system": 128799,
        "user": 128803,
        "assistant": 128804,
        "thinking_start": 128821,
        "thinking_end": 128822,
        "dsml": 128825,
        "latest_reminder": 128828,
        "image": 129264,
        "ref": 129278,
        "ref_end": 129277,
        "box": 129276,
        "box_end": 129275,
        "point": 129274,
        "point_end": 129273,
        "polygon": 129272,
        "polygon_end": 129271,
    }
)
"""`SpecialTokens` keyword -> id in the V4.1 vocabulary (`recipe.md` §1). The spellings are read
from the tokenizer at these ids, so a checkpoint that spells a token differently (the image
token) renders and parses with its own spelling."""


@dataclass(frozen=True)
class ModelTokenizer:
    """One model's tokenizer in the three forms the recipe uses.

    full: the checkpoint's tokenizer (decoding, `/tokenize`); plain: the same without the added
    vocabulary (prompt plain segments); native: the package's tokenizer (stream decoding);
    special_tokens: spellings read by id; special_ids: spelling -> id of those tokens.
    """

    full: Tokenizer
    plain: Tokenizer
    native: dr.Tokenizer
    special_tokens: dr.SpecialTokens
    special_ids: MappingProxyType[str, int]
    eos_token_id: int

    @property
    def dsml_token_id(self) -> int:
        """The `｜DSML｜` marker token that opens every piece of tool-call markup."""
        return self.special_ids[self.special_tokens.token(dr.SpecialToken.Dsml)]

    @property
    def thinking_end_token_id(self) -> int:
        """The `</think>` token that ends the reasoning."""
        return self.special_ids[self.special_tokens.token(dr.SpecialToken.ThinkingEnd)]

    def encode_prompt(self, rendered: dr.RenderedPrompt) -> list[int]:
        """Token ids of a rendered prompt: special ids only for `rendered.special_ranges`.

        Raises:
            ValueError: a special range spells no known special token.
        """
        prompt = rendered.prompt
        plain: list[str] = []
        specials: list[int] = []
        position = 0
        for start, end in rendered.special_ranges:
            plain.append(prompt[position:start])
            spelling = prompt[start:end]
            token_id = self.special_ids.get(spelling)
            if token_id is None:
                raise ValueError(f"rendered special range {spelling!r} is not a special token")
            specials.append(token_id)
            position = end
        plain.append(prompt[position:])
        # NOTE: `encode_batch` releases the GIL (`encode` does not), so a long prompt tokenized
        # in a worker thread leaves the event loop free; each segment is still encoded alone.
        encoded = self.plain.encode_batch(plain, add_special_tokens=False)
        ids: list[int] = list(encoded[0].ids)
        for token_id, segment in zip(specials, encoded[1:], strict=True):
            ids.append(token_id)
            ids.extend(segment.ids)
        return ids

    def encode_text(self, text: str, add_bos: bool) -> tuple[list[int], list[str]]:
        """Ids and token strings of `text` as a prompt's plain text encodes it: every special
        spelling (`<｜User｜>`, `</think>`, ...) stays ordinary tokens; `add_bos` puts BOS
        first, as every rendered prompt starts.

        Raises:
            ValueError: `text` is not valid Unicode (a lone surrogate).
        """
        check_text(text)
        # `encode_batch`: it releases the GIL (see `encode_prompt`)
        encoding = self.plain.encode_batch([text], add_special_tokens=False)[0] if text else None
        ids = list(encoding.ids) if encoding else []
        tokens = list(encoding.tokens) if encoding else []
        if add_bos:
            bos_id = V41_SPECIAL_TOKEN_IDS["bos"]
            ids.insert(0, bos_id)
            tokens.insert(0, self.special_tokens.token(dr.SpecialToken.Bos))
        return ids, tokens

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (an added token: its spelling)."""
        piece = self.full.id_to_token(token_id)
        if piece is None:
            return b""
        if token_id in self.full.get_added_tokens_decoder():
            return piece.encode("utf-8")
        return bytes(_BYTE_OF_CHAR.get(char, 0) for char in piece)

    def decode(self, token_ids: list[int]) -> str:
        """Text of `token_ids` with special tokens spelled out."""
        return self.full.decode(token_ids, skip_special_tokens=False)


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-in character -> the byte it stands for (printable
    Latin-1 bytes stand for themselves, the others map to U+0100 on, in byte order)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    alphabet = {chr(b): b for b in printable}
    alphabet.update({chr(0x100 + n): b for n, b in enumerate(others)})
    return alphabet


_BYTE_OF_CHAR = _byte_level_alphabet()


def check_text(text: str) -> None:
    """Raises ValueError when `text` cannot be UTF-8 encoded (a lone surrogate such as the
    JSON escape `\\ud800`), the same 400 the generation routes give."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"text is not valid Unicode: {exc}") from exc


def load_tokenizer(folder: Path | str) -> ModelTokenizer:
    """Load `folder/tokenizer.json` and read the recipe's special-token spellings by id.

    Raises:
        FileNotFoundError: the folder has no tokenizer.json.
        ValueError: an id of `V41_SPECIAL_TOKEN_IDS` is not in the vocabulary.
    """
    path = Path(folder) / TOKENIZER_FILE
    text = path.read_text(encoding="utf-8")
    full = Tokenizer.from_str(text)
    data = json.loads(text)
    data["added_tokens"] = []
    plain = Tokenizer.from_str(json.dumps(data))
    spellings: dict[str, str] = {}
    for name, token_id in V41_SPECIAL_TOKEN_IDS.items():
        spelling = full.id_to_token(token_id)
        if spelling is None:
            raise ValueError(f"{path}: no token with id {token_id} (special token {name})")
        spellings[name] = spelling
    return ModelTokenizer(
        full=full,
        plain=plain,
        native=dr.Tokenizer.from_str(text),
        special_tokens=dr.SpecialTokens(**spellings),
        special_ids=MappingProxyType(
            {spellings[name]: token_id for name, token_id in V41_SPECIAL_TOKEN_IDS.items()}
        ),
        eos_token_id=V41_SPECIAL_TOKEN_IDS["eos"],
    )
