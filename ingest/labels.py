"""Your own labelled lines: what the classifier could not name, taught once.

``rca diagnose`` lists the lines that read like faults but that no code names
("could not name"). ``rca label FILE:LINE --code CODE`` keeps such a line,
redacted, with the code you chose, in ``$RCA_HOME/labels.jsonl`` (or
``RCA_LABELS``). From then on every :class:`ingest.classify.Normalizer` built
for the shipped corpus

* names a line equal to a labelled one, up to its numbers, hex ids, log level
  and a path's directories (the text the model sees), with that code
  (``method: "label"``, confidence 1.0), where no catalog pattern does;
* trains its fallback on the labelled lines too, so other phrasings of the same
  message move towards the code (the fitted model is cached per label set).

The file stays on this machine; nothing is sent anywhere. A line that cannot be
read (not JSON, unknown code) is skipped and counted, never fatal.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from graph.catalog import Catalog
from graph.errors import InputError
from ingest.paths import rca_home

__all__ = ["LabelSet", "labels_path", "load_labels", "add_label", "remove_label", "line_of"]

#: One label's text is cut to this many characters (a log line, not a dump).
MAX_CHARS = 2000


def labels_path() -> Path:
    if env := os.environ.get("RCA_LABELS"):
        return Path(env).expanduser()
    return rca_home() / "labels.jsonl"


@dataclass
class LabelSet:
    """The labelled lines that could be read, and how many could not."""

    labels: list[dict[str, Any]] = field(default_factory=list)
    skipped: int = 0
    #: the raw text of the lines that could not be used: kept when the file is
    #: rewritten (a code a later catalog drops comes back with it)
    unusable: list[str] = field(default_factory=list)

    def pairs(self) -> list[tuple[str, str]]:
        """(text, code) for the classifier."""
        return [(lab["text"], lab["code"]) for lab in self.labels]


def load_labels(catalog: Catalog, path: str | Path | None = None) -> LabelSet:
    """The labels in ``path`` (default :func:`labels_path`) whose code is in
    ``catalog``; unreadable lines and unknown codes are counted in ``skipped``."""
    p = Path(path) if path is not None else labels_path()
    out = LabelSet()
    try:
        raw = p.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return out
    for line in raw.splitlines():
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            text, code = obj["text"], obj["code"]
            usable = isinstance(text, str) and bool(text.strip()) and code in catalog
        except (ValueError, KeyError, TypeError):
            usable = False
        if not usable:
            out.skipped += 1
            out.unusable.append(line)
            continue
        out.labels.append(obj)
    return out


def line_of(spec: str) -> tuple[str, str]:
    """``FILE:LINE`` -> (the file's line, "FILE:LINE"); a clear error otherwise."""
    path, sep, num = spec.rpartition(":")
    if not sep or not num.isdigit() or int(num) < 1:
        raise InputError(f"expected FILE:LINE (line numbers from 1), got {spec!r}")
    target = int(num)
    try:
        with open(path, "rb") as fh:
            for n, raw in enumerate(fh, 1):
                if n == target:
                    return raw[: MAX_CHARS * 4].decode("utf-8", "replace").rstrip("\r\n"), spec
    except OSError as exc:
        raise InputError(f"cannot read {path}: {exc.strerror or exc}") from None
    raise InputError(f"{path} has fewer than {target} lines")


def add_label(
    catalog: Catalog,
    text: str,
    code: str,
    *,
    origin: str | None = None,
    path: str | Path | None = None,
) -> dict[str, Any]:
    """Keep ``text`` (redacted, cut) labelled with ``code``; returns the label.
    A line already labelled (same model text) is relabelled, not repeated."""
    from ingest.classify import label_key
    from ingest.normalize import redact

    if code not in catalog:
        raise InputError(f"unknown code {code!r}: `rca codes` lists them")
    clean = redact(text.strip())[:MAX_CHARS]
    if not clean:
        raise InputError("an empty line cannot be labelled")
    p = Path(path) if path is not None else labels_path()
    label = {
        "text": clean,
        "code": code,
        "family": catalog[code].family,
        "origin": origin,
        "added": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    key = label_key(clean)
    have = load_labels(catalog, p)
    kept = [lab for lab in have.labels if label_key(lab["text"]) != key]
    _write(p, [*kept, label], have.unusable)
    return label


def remove_label(catalog: Catalog, index: int, *, path: str | Path | None = None) -> dict:
    """Drop label number ``index`` (1-based, as ``rca label --list`` shows it)."""
    p = Path(path) if path is not None else labels_path()
    have = load_labels(catalog, p)
    labels = have.labels
    if not 1 <= index <= len(labels):
        raise InputError(f"no label {index}: there are {len(labels)}")
    gone = labels.pop(index - 1)
    _write(p, labels, have.unusable)
    return gone


def _write(path: Path, labels: list[dict[str, Any]], unusable: list[str]) -> None:
    """Whole file, atomically (temp file + rename); unusable lines kept as they were."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    body = [json.dumps(lab, ensure_ascii=False) for lab in labels] + unusable
    tmp.write_text("".join(line + "\n" for line in body), encoding="utf-8")
    os.replace(tmp, path)
