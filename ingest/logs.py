"""Log files -> ErrorContext rows: timestamps, hosts, PCI-to-GPU mapping.

Lines that are not evidence of a fault are counted, not stored (they may hold
user data). Lines that cannot be decoded go to quarantine with the reason.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ingest import schema as S
from ingest.normalize import LineClassifier, default_classifier, redact

__all__ = ["LogParseResult", "parse_log_lines", "parse_log_file", "pci_key"]

_MONTHS = {
    m: i + 1
    for i, m in enumerate(
        ["Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"]
    )
}
_ISO = re.compile(r"(\d{4})-(\d{2})-(\d{2})[T ](\d{2}):(\d{2}):(\d{2})(?:[.,](\d{1,9}))?")
_SYSLOG = re.compile(r"^([A-Z][a-z]{2}) +(\d{1,2}) (\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,9}))? (\S+) ")
_VLLM = re.compile(
    r"^(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) (\d{2})-(\d{2}) "
    r"(\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,9}))?"
)
_GPU_AT = re.compile(
    r"NVRM: GPU at PCI:(?P<pci>[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2})(?:\.\d)?: "
    r"(?P<uuid>GPU-[0-9a-fA-F-]{36})"
)
_PCI = re.compile(r"PCI:(?P<pci>[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2})")
_REQ = re.compile(r"\b(?P<rid>(?:cmpl|chatcmpl|req)-[0-9A-Za-z_-]{6,})")
_MAX_LINE = 1 << 20


def pci_key(text: str) -> tuple[int, int, int] | None:
    """Normalize `0000:19:00`, `00000000:19:00.0` to (domain, bus, device)."""
    parts = text.split(".")[0].split(":")
    if len(parts) != 3:
        return None
    try:
        return int(parts[0], 16), int(parts[1], 16), int(parts[2], 16)
    except ValueError:
        return None


def _frac_ns(frac: str | None) -> int:
    return int((frac or "0").ljust(9, "0")[:9])


def parse_timestamp(line: str, year: int) -> tuple[int | None, str | None]:
    """(ns since epoch UTC, host) from the common log prefixes, else (None, None)."""
    if m := _SYSLOG.match(line):
        mon = _MONTHS.get(m[1])
        if mon:
            t = dt.datetime(year, mon, int(m[2]), int(m[3]), int(m[4]), int(m[5]), tzinfo=dt.UTC)
            return int(t.timestamp()) * 1_000_000_000 + _frac_ns(m[6]), m[7]
    if m := _VLLM.match(line):
        t = dt.datetime(year, int(m[1]), int(m[2]), int(m[3]), int(m[4]), int(m[5]), tzinfo=dt.UTC)
        return int(t.timestamp()) * 1_000_000_000 + _frac_ns(m[6]), None
    if m := _ISO.search(line[:64]):
        t = dt.datetime(
            int(m[1]), int(m[2]), int(m[3]), int(m[4]), int(m[5]), int(m[6]), tzinfo=dt.UTC
        )
        return int(t.timestamp()) * 1_000_000_000 + _frac_ns(m[7]), None
    return None, None


@dataclass
class LogParseResult:
    records: list[S.ErrorContext] = field(default_factory=list)
    quarantine: list[dict[str, Any]] = field(default_factory=list)
    lines: int = 0
    gpu_map: dict[tuple[int, int, int], str] = field(default_factory=dict)


def parse_log_lines(
    lines: Iterable[bytes],
    *,
    source: str,
    host: str | None = None,
    year: int | None = None,
    classifier: LineClassifier | None = None,
    gpu_map: dict[tuple[int, int, int], str] | None = None,
) -> LogParseResult:
    """Classify each line; continuation lines inherit the last timestamp."""
    clf = classifier or default_classifier()
    year = year or dt.datetime.now(dt.UTC).year
    res = LogParseResult(gpu_map=dict(gpu_map or {}))
    last_ts: int | None = None
    for n, raw in enumerate(lines, start=1):
        res.lines += 1
        if len(raw) > _MAX_LINE:
            res.quarantine.append(_q(source, n, "line longer than 1 MiB", raw[:4096]))
            continue
        try:
            line = raw.decode("utf-8").rstrip("\r\n")
        except UnicodeDecodeError:
            res.quarantine.append(_q(source, n, "invalid UTF-8", raw))
            continue
        ts, line_host = parse_timestamp(line, year)
        if ts is not None:
            last_ts = ts
        if m := _GPU_AT.search(line):
            key = pci_key(m["pci"])
            if key:
                res.gpu_map[key] = m["uuid"]
        match = clf.classify(line)
        if match is None:
            continue
        if last_ts is None:
            res.quarantine.append(_q(source, n, "evidence line with no timestamp", raw))
            continue
        fields = dict(match.fields)
        gpu_uuid = None
        pci = fields.get("pci") or ((p := _PCI.search(line)) and p["pci"])
        if pci:
            fields["pci"] = pci
            key = pci_key(str(pci))
            gpu_uuid = res.gpu_map.get(key) if key else None
        rid = fields.get("request_id") or ((r := _REQ.search(line)) and r["rid"])
        text = redact(line)
        code = match.code
        res.records.append(
            S.ErrorContext.from_catalog(
                code,
                source=f"log:{Path(source).name}",
                ts=last_ts,
                event_id=_event_id(source, n, text),
                host=line_host or host,
                pid=fields.get("pid") if isinstance(fields.get("pid"), int) else None,
                gpu_uuid=gpu_uuid,
                request_id=str(rid) if rid else None,
                xid=fields.get("xid") if isinstance(fields.get("xid"), int) else None,
                confidence=1.0,
                message=text[:512],
                attrs={"line": n, "file": source, "fields": fields},
                raw=text,
            )
        )
    # Xid lines can precede the "GPU at PCI" line in a file: map them afterwards.
    for rec in res.records:
        if rec.gpu_uuid is None and rec.attrs and (pci := rec.attrs["fields"].get("pci")):
            key = pci_key(str(pci))
            if key and key in res.gpu_map:
                rec.gpu_uuid = res.gpu_map[key]
    return res


def _event_id(source: str, line_no: int, text: str) -> str:
    """Deterministic id for a log-derived row: same file line, same id."""
    h = hashlib.blake2b(f"{source}\0{line_no}\0{text}".encode(), digest_size=16).hexdigest()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def _q(source: str, n: int, reason: str, raw: bytes) -> dict[str, Any]:
    import time

    now = time.time_ns()
    return {
        "quarantine_id": S.new_event_id(now),
        "ts": now,
        "source": source,
        "origin": f"line {n}",
        "reason": reason,
        "raw": raw[:65536].decode("utf-8", "replace"),
    }


def iter_lines(path: Path) -> Iterator[bytes]:
    with open(path, "rb") as fh:
        yield from fh


def parse_log_file(path: str | Path, **kw: Any) -> LogParseResult:
    p = Path(path)
    return parse_log_lines(iter_lines(p), source=str(p), **kw)
