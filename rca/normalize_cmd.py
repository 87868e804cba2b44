"""`rca normalize`: stream lines through the classifier, one JSON object per line."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO, TextIO

from graph.errors import InputError
from ingest.classify import Normalizer, default_normalizer
from ingest.logs import iter_bounded_lines

__all__ = ["normalize_streams", "normalize_lines"]

_NULL = (
    '{{"line": {n}, "code": null, "family": null, "layer": null, "severity": null, '
    '"confidence": null, "fields": {{}}}}\n'
)


def normalize_lines(
    raw_lines: Iterator[tuple[bytes, bool]],
    out: TextIO,
    *,
    normalizer: Normalizer,
    first_line: int = 1,
    batch_size: int = 50_000,
) -> int:
    """Classify and print; returns the number of lines read."""
    n = first_line - 1
    batch: list[str] = []
    errors: dict[int, str] = {}

    def flush() -> None:
        matches = normalizer.classify_batch(batch).matches
        start = n - len(batch) + 1
        buf = []
        for i in range(len(batch)):
            ln = start + i
            if ln in errors:
                buf.append(
                    json.dumps(
                        {
                            "line": ln,
                            "code": None,
                            "family": None,
                            "layer": None,
                            "severity": None,
                            "confidence": None,
                            "fields": {},
                            "error": errors[ln],
                        }
                    )
                    + "\n"
                )
            elif i in matches:
                code, conf, fields, _ = matches[i]
                buf.append(
                    json.dumps(
                        {
                            "line": ln,
                            "code": code.name,
                            "family": code.family,
                            "layer": code.layer,
                            "severity": str(code.severity),
                            "confidence": round(conf, 3),
                            "fields": fields,
                        },
                        default=str,
                    )
                    + "\n"
                )
            else:
                buf.append(_NULL.format(n=ln))
        out.write("".join(buf))
        batch.clear()
        errors.clear()

    for raw, too_long in raw_lines:
        n += 1
        if too_long:
            errors[n] = "line longer than 1 MiB"
            batch.append("")
        elif b"\x00" in raw:
            errors[n] = "binary data (NUL bytes)"
            batch.append("")
        else:
            try:
                batch.append(raw.decode("utf-8").rstrip("\r\n"))
            except UnicodeDecodeError as exc:
                errors[n] = f"invalid UTF-8 at byte {exc.start}"
                batch.append("")
        if len(batch) >= batch_size:
            flush()
    if batch:
        flush()
    return n


def normalize_streams(files: list[Path], out: TextIO, *, fallback: bool = True) -> None:
    norm = (
        default_normalizer()
        if fallback
        else Normalizer(default_normalizer().catalog, fallback=False)
    )
    if not files:
        normalize_lines(iter_bounded_lines(sys.stdin.buffer), out, normalizer=norm)
        return
    for path in files:
        if not Path(path).is_file():
            raise InputError(f"{path}: no such file")
    for path in files:
        fh: BinaryIO
        with open(path, "rb") as fh:
            normalize_lines(iter_bounded_lines(fh), out, normalizer=norm)
