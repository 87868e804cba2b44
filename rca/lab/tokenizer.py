"""A byte-level tokenizer shipped in the repo (no download).

Ids 0-255 are the bytes, then ``BOS=256``, ``EOS=257``, ``PAD=258``. The model's
embedding table is padded past the tokenizer (to 320 rows by default): ids from
259 up are valid embedding rows but not tokens, and decoding one raises
:class:`TokenIdError`.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["ByteTokenizer", "DetokenizeError", "TokenIdError", "BOS", "EOS", "PAD"]

BOS = 256
EOS = 257
PAD = 258
_SPECIAL = (BOS, EOS, PAD)


class TokenIdError(ValueError):
    """A token id outside the tokenizer's vocabulary (vLLM's wording)."""

    def __init__(self, token_id: int) -> None:
        super().__init__(f"Token id {token_id} is out of vocabulary")
        self.token_id = token_id


class DetokenizeError(UnicodeDecodeError):
    """Output bytes that are not valid UTF-8 (strict decoding); the message is
    Python's own (``'utf-8' codec can't decode byte 0x.. in position n: ...``)."""


class ByteTokenizer:
    """Bytes in, bytes out; three special tokens after the 256 bytes."""

    bos_token_id = BOS
    eos_token_id = EOS
    pad_token_id = PAD

    @property
    def vocab_size(self) -> int:
        return 259

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [BOS, *ids] if add_bos else ids

    def decode(
        self, ids: Iterable[int], *, errors: str = "strict", skip_special_tokens: bool = True
    ) -> str:
        """Text of ``ids``; with ``errors="strict"`` invalid UTF-8 raises
        :class:`DetokenizeError`, with ``"replace"`` it becomes U+FFFD."""
        out = bytearray()
        for i in ids:
            i = int(i)
            if 0 <= i < 256:
                out.append(i)
            elif i in _SPECIAL:
                if not skip_special_tokens:
                    out += f"<{('bos', 'eos', 'pad')[i - BOS]}>".encode()
            else:
                raise TokenIdError(i)
        try:
            return bytes(out).decode("utf-8", errors=errors)
        except UnicodeDecodeError as exc:
            raise DetokenizeError(
                exc.encoding, exc.object, exc.start, exc.end, exc.reason
            ) from None
