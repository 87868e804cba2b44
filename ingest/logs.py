"""Log files -> ErrorContext rows, streamed in bounded memory.

Per batch of lines: the vectorized classifier (``ingest.classify``) finds the
evidence lines; tracebacks are reassembled into chains (deepest cause first);
``NVRM: Xid`` lines get their Xid number, SM error registers and, through the
driver's ``GPU at PCI:... : GPU-<uuid>`` lines, their GPU. Lines that are not
evidence are counted, never stored (they may hold user data). Lines that
cannot be read (invalid UTF-8, NUL bytes, over 1 MiB, absurd timestamps) go to
quarantine with the reason.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import os
import re
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from ingest import schema as S
from ingest.classify import Normalizer, default_normalizer
from ingest.normalize import redact
from ingest.schema import quarantine_row
from ingest.tracebacks import Traceback, find_tracebacks
from ingest.xid import parse_sm_error, parse_xid_line

__all__ = [
    "LogParseResult",
    "iter_log_batches",
    "parse_log_lines",
    "parse_log_file",
    "iter_bounded_lines",
    "pci_key",
    "parse_timestamp",
    "MAX_LINE",
]

MAX_LINE = 1 << 20  # longer lines are quarantined (first 64 KiB kept)
_RAW_KEEP = 64 * 1024
_MONTHS = {
    m: i + 1
    for i, m in enumerate(
        ["Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"]
    )
}
_ISO = re.compile(r"(\d{4})-(\d{2})-(\d{2})[T ](\d{2}):(\d{2}):(\d{2})(?:[.,](\d{1,9}))?")
_SYSLOG = re.compile(r"^([A-Z][a-z]{2}) +(\d{1,2}) (\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,9}))? (\S+) ")
_VLLM = re.compile(
    r"^(?:\(\w+ pid=\d+\) )?(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) (\d{2})-(\d{2}) "
    r"(\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,9}))?"
)
_DMESG_T = re.compile(  # dmesg -T / journalctl --dmesg: "[Sun Feb 23 16:24:18 2025] NVRM: ..."
    r"^\[(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun) ([A-Z][a-z]{2}) +(\d{1,2}) "
    r"(\d{2}):(\d{2}):(\d{2}) (\d{4})\]"
)
_GLOG = re.compile(r"^[IWEF](\d{2})(\d{2}) (\d{2}):(\d{2}):(\d{2})\.(\d{1,9})")
_GPU_AT = re.compile(
    r"NVRM: GPU at PCI:(?P<pci>[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2})(?:\.\d)?: "
    r"(?P<uuid>GPU-[0-9a-fA-F-]{36})"
)
_REQ = re.compile(r"\b(?P<rid>(?:chatcmpl|cmpl|req)-[0-9A-Za-z_-]{6,})")
_MIN_TS = int(dt.datetime(2000, 1, 1, tzinfo=dt.UTC).timestamp()) * 1_000_000_000


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


def _mk(y: int, mo: int, d: int, h: int, mi: int, s: int, frac: str | None) -> int | None:
    try:
        t = dt.datetime(y, mo, d, h, mi, s, tzinfo=dt.UTC)
    except ValueError:
        return None
    return int(t.timestamp()) * 1_000_000_000 + _frac_ns(frac)


def parse_timestamp(
    line: str, year: int, *, not_after_ns: int | None = None
) -> tuple[int | None, str | None]:
    """(ns since epoch UTC, host) from the common log prefixes, else (None, None).

    Formats: syslog (``Nov 29 10:14:02 host``), ``dmesg -T`` (``[Sun Nov 29
    10:14:02 2026]``), vLLM (``INFO 11-29 10:14:02``), glog/Triton
    (``I1129 10:14:02.123``), ISO 8601 anywhere in the first 64 characters.
    Formats without a year take ``year``, or the year before when that would
    put the line after ``not_after_ns`` (a log written in January about
    December).
    """
    host = None
    if m := _SYSLOG.match(line):
        mon = _MONTHS.get(m[1])
        if not mon:
            return None, None
        parts, host = (mon, int(m[2]), int(m[3]), int(m[4]), int(m[5]), m[6]), m[7]
    elif (m := _VLLM.match(line)) or (m := _GLOG.match(line)):
        parts = (int(m[1]), int(m[2]), int(m[3]), int(m[4]), int(m[5]), m[6])
    elif m := _DMESG_T.match(line):
        mon = _MONTHS.get(m[1])
        ts = _mk(int(m[6]), mon, int(m[2]), int(m[3]), int(m[4]), int(m[5]), None) if mon else None
        return ts, None
    elif m := _ISO.search(line[:64]):
        return _mk(int(m[1]), int(m[2]), int(m[3]), int(m[4]), int(m[5]), int(m[6]), m[7]), None
    else:
        return None, None
    ts = _mk(year, *parts)
    if ts is not None and not_after_ns is not None and ts > not_after_ns + 86_400 * 10**9:
        ts = _mk(year - 1, *parts)
    return ts, host


#: Lines that read like faults but that no code names, kept per file for the
#: user to read (``rca diagnose``): at most this many, each cut to this length.
UNCLASSIFIED_KEEP = 20
UNCLASSIFIED_CHARS = 300


@dataclass
class LogParseResult:
    records: list[S.ErrorContext] = field(default_factory=list)
    quarantine: list[dict[str, Any]] = field(default_factory=list)
    tracebacks: list[dict[str, Any]] = field(default_factory=list)
    lines: int = 0
    no_timestamp: int = 0
    last_line: int = 0  # every record of lines <= this one is in this or an earlier batch
    gpu_map: dict[tuple[int, int, int], str] = field(default_factory=dict)
    #: lines that read like faults but that no code names (Batch.unclassified):
    #: how many, and the first UNCLASSIFIED_KEEP of them (redacted, cut)
    unclassified: int = 0
    unclassified_lines: list[dict[str, Any]] = field(default_factory=list)

    def extend(self, other: LogParseResult) -> None:
        self.records += other.records
        self.quarantine += other.quarantine
        self.tracebacks += other.tracebacks
        self.lines += other.lines
        self.no_timestamp += other.no_timestamp
        self.gpu_map.update(other.gpu_map)
        self.unclassified += other.unclassified
        room = UNCLASSIFIED_KEEP - len(self.unclassified_lines)
        self.unclassified_lines += other.unclassified_lines[: max(0, room)]


def iter_bounded_lines(fh: BinaryIO, max_len: int = MAX_LINE) -> Iterator[tuple[bytes, bool]]:
    """(line, too_long) from a binary stream; a line over ``max_len`` yields its
    first ``max_len`` bytes and True, and never needs more memory than that."""
    chunk_size = 1 << 20
    buf = b""
    skipping = False
    while True:
        chunk = fh.read(chunk_size)
        if not chunk:
            if buf and not skipping:
                yield buf, False
            return
        buf += chunk
        start = 0
        while True:
            nl = buf.find(b"\n", start)
            if nl < 0:
                break
            if skipping:
                skipping = False
            else:
                yield buf[start : nl + 1], False
            start = nl + 1
        buf = buf[start:]
        if len(buf) > max_len and not skipping:
            yield buf[:max_len], True
            skipping = True
            buf = b""
        elif skipping:
            buf = b""


def _event_id(source: str, line_no: int, text: str) -> str:
    """Deterministic id for a log-derived row: same file line, same id."""
    h = hashlib.blake2b(f"{source}\0{line_no}\0{text}".encode(), digest_size=16).hexdigest()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


class _LogState:
    """What carries from one batch to the next."""

    def __init__(self, year: int, base_ns: int, gpu_map: dict[tuple[int, int, int], str]):
        self.year = year
        self.base_ns = base_ns
        self.last_ts: int | None = None
        self.gpu_map = gpu_map
        self.carry: list[tuple[int, str]] = []  # (line number, text) of an open traceback


def iter_log_batches(
    lines: Iterable[bytes | tuple[bytes, bool]],
    *,
    source: str,
    host: str | None = None,
    year: int | None = None,
    base_ns: int | None = None,
    normalizer: Normalizer | None = None,
    gpu_map: dict[tuple[int, int, int], str] | None = None,
    batch_size: int = 50_000,
) -> Iterator[LogParseResult]:
    """Parse a stream of lines in batches; memory stays bounded by the batch."""
    norm = normalizer or default_normalizer()
    now = dt.datetime.now(dt.UTC)
    state = _LogState(year or now.year, base_ns or time.time_ns(), dict(gpu_map or {}))
    batch: list[tuple[int, str]] = []
    pending_q: list[dict[str, Any]] = []
    n_lines = 0
    name = Path(source).name
    for n, item in enumerate(lines, start=1):
        raw, too_long = item if isinstance(item, tuple) else (item, len(item) > MAX_LINE)
        n_lines += 1
        if too_long:
            pending_q.append(quarantine_row(source, f"line {n}", "line longer than 1 MiB", raw))
            continue
        if b"\x00" in raw:
            pending_q.append(quarantine_row(source, f"line {n}", "binary data (NUL bytes)", raw))
            continue
        try:
            text = raw.decode("utf-8").rstrip("\r\n")
        except UnicodeDecodeError as exc:
            pending_q.append(
                quarantine_row(source, f"line {n}", f"invalid UTF-8 at byte {exc.start}", raw)
            )
            continue
        batch.append((n, text))
        if len(batch) >= batch_size:
            res = _parse_batch(batch, state, norm, source, name, host, final=False)
            res.quarantine = pending_q + res.quarantine
            res.lines = n_lines
            pending_q, n_lines = [], 0
            batch = []
            yield res
    res = _parse_batch(batch, state, norm, source, name, host, final=True)
    res.quarantine = pending_q + res.quarantine
    res.lines = n_lines
    yield res


def _parse_batch(
    batch: list[tuple[int, str]],
    st: _LogState,
    norm: Normalizer,
    source: str,
    name: str,
    host: str | None,
    *,
    final: bool,
) -> LogParseResult:
    res = LogParseResult()
    items = st.carry + batch
    st.carry = []
    if not items:
        res.gpu_map = dict(st.gpu_map)
        return res
    texts = [t for _, t in items]
    tbs = find_tracebacks(texts)
    if not final and tbs and not tbs[-1].complete:
        cut = tbs.pop().start
        st.carry = items[cut:]
        items, texts = items[:cut], texts[:cut]
    res.last_line = items[-1][0] if items else (st.carry[0][0] - 1 if st.carry else 0)
    for text in texts:
        if "GPU at PCI:" in text and (m := _GPU_AT.search(text)):
            key = pci_key(m["pci"])
            if key:
                st.gpu_map[key] = m["uuid"]
    # frames and source lines inside a traceback are code, never evidence
    # (classify_batch leaves them out)
    classified = norm.classify_batch(texts)
    matches = classified.matches
    tb_of: dict[int, tuple[Traceback, int]] = {}
    for tb in tbs:
        for pos, exc in enumerate(tb.exceptions):
            tb_of[exc.line] = (tb, pos)
        res.tracebacks.append({**tb.to_dict(), "first_line": items[tb.start][0]})
    res.unclassified = len(classified.unclassified)
    for idx in sorted(classified.unclassified)[:UNCLASSIFIED_KEEP]:
        line_no, text = items[idx]
        family, p = classified.unclassified[idx]
        unnamed: dict[str, Any] = {
            "file": source,
            "line": line_no,
            "text": redact(text)[:UNCLASSIFIED_CHARS],
            "family_hint": family,
            "p": round(p, 3),
        }
        if idx in tb_of:  # where it was raised: the first thing one reads
            tb, pos = tb_of[idx]
            unnamed["raised_at"] = tb.exceptions[pos].raised_at
        res.unclassified_lines.append(unnamed)
    ts_cache: dict[int, int | None] = {}
    last_ts_in_batch = st.last_ts
    for idx in sorted(matches):
        code, conf, fields, method = matches[idx]
        line_no, text = items[idx]
        ts, line_host, inferred = _timestamp_for(idx, texts, st, ts_cache)
        if ts is not None and not inferred and not (_MIN_TS <= ts <= time.time_ns() + 86_400e9):
            res.quarantine.append(
                quarantine_row(
                    source,
                    f"line {line_no}",
                    "absurd timestamp (before 2000 or in the future)",
                    text,
                )
            )
            ts, inferred = None, True
        if ts is None:
            ts = st.base_ns + line_no * 1000  # keeps the file's order
            res.no_timestamp += 1
        fields = dict(fields)
        xid_info = parse_xid_line(text) if "NVRM: Xid" in text else None
        sm_error = None
        if xid_info:
            fields.update(xid_info)
            if not isinstance(fields.get("pid"), int):
                fields.pop("pid", None)
            sm_error = parse_sm_error(text)
        gpu_uuid = None
        if pci := fields.get("pci"):
            key = pci_key(str(pci))
            gpu_uuid = st.gpu_map.get(key) if key else None
        rid = fields.get("request_id") or ((r := _REQ.search(text)) and r["rid"])
        attrs: dict[str, Any] = {
            "file": source,
            "line": line_no,
            "fields": fields,
            "method": method,
        }
        if inferred:
            attrs["ts_inferred"] = True
        if idx in tb_of:
            tb, pos = tb_of[idx]
            attrs["traceback"] = {
                "first_line": items[tb.start][0],
                "position": pos,
                "of": len(tb.exceptions),
                "chain": [e.type for e in tb.exceptions],
            }
            if raised := tb.exceptions[pos].raised_at:
                attrs["traceback"]["raised_at"] = raised
        clean = redact(text)
        xid = fields.get("xid")
        pid = fields.get("pid")
        res.records.append(
            S.ErrorContext.from_catalog(
                code,
                source=f"log:{name}",
                ts=ts,
                event_id=_event_id(source, line_no, clean),
                host=line_host or host,
                pid=pid if isinstance(pid, int) and pid < 2**31 else None,
                gpu_uuid=gpu_uuid,
                request_id=str(rid) if rid else None,
                xid=xid if isinstance(xid, int) else None,
                sm_error=sm_error,
                confidence=conf,
                message=clean[:512],
                attrs=attrs,
                raw=clean,
            )
        )
        last_ts_in_batch = ts
    # carry the last real timestamp of the batch for continuation lines
    for i in range(len(texts) - 1, -1, -1):
        t, _ = parse_timestamp(texts[i], st.year, not_after_ns=st.base_ns)
        if t is not None:
            st.last_ts = t
            break
    else:
        st.last_ts = last_ts_in_batch if st.last_ts is None else st.last_ts
    # Xid lines can precede the "GPU at PCI" line: map them afterwards
    for rec in res.records:
        if rec.gpu_uuid is None and rec.attrs and (pci := rec.attrs["fields"].get("pci")):
            key = pci_key(str(pci))
            if key and key in st.gpu_map:
                rec.gpu_uuid = st.gpu_map[key]
    res.gpu_map = dict(st.gpu_map)
    return res


def _timestamp_for(
    idx: int, texts: list[str], st: _LogState, cache: dict[int, int | None], limit: int = 2000
) -> tuple[int | None, str | None, bool]:
    """The line's own timestamp, else the nearest one above (continuation
    lines), else - a file that starts without one, as a pasted crash log's
    traceback often does - just before the nearest one below, so the file's
    order holds (inferred). Before round 10 such a line took the time of
    ingest and came after everything the file went on to say."""
    own, host = parse_timestamp(texts[idx], st.year, not_after_ns=st.base_ns)
    if own is not None:
        return own, host, False

    def stamp(j: int) -> int | None:
        if j not in cache:
            cache[j] = parse_timestamp(texts[j], st.year, not_after_ns=st.base_ns)[0]
        return cache[j]

    for j in range(idx - 1, max(-1, idx - limit - 1), -1):
        if (t := stamp(j)) is not None:
            return t, None, False
    if st.last_ts is not None:
        return st.last_ts, None, False
    for j in range(idx + 1, min(len(texts), idx + limit + 1)):
        if (t := stamp(j)) is not None:
            return t - (j - idx) * 1000, None, True
    return None, None, True


def parse_log_lines(lines: Iterable[bytes], **kw: Any) -> LogParseResult:
    """Parse everything into one result (for small inputs; see iter_log_batches)."""
    out = LogParseResult()
    for res in iter_log_batches(lines, **kw):
        out.extend(res)
    return out


def file_year(path: Path) -> int:
    return dt.datetime.fromtimestamp(os.stat(path).st_mtime, dt.UTC).year


def parse_log_file(path: str | Path, **kw: Any) -> LogParseResult:
    p = Path(path)
    kw.setdefault("year", file_year(p))
    kw.setdefault("base_ns", os.stat(p).st_mtime_ns)
    with open(p, "rb") as fh:
        return parse_log_lines(iter_bounded_lines(fh), source=str(p), **kw)
