"""NVIDIA driver (NVRM) kernel-log lines: Xid numbers, SM error registers, GPU ids.

Xid 13 and 31 lines carry where on the chip a fault happened and what kind it
was; NVIDIA's workflow reads them: the same GPC/TPC/SM faulting again and
again points at the hardware, faults scattered across SMs at the application.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from typing import Any

__all__ = ["parse_xid_line", "parse_sm_error", "sm_fault_verdict"]

_XID = re.compile(
    r"NVRM: Xid \(PCI:(?P<pci>[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2})(?:\.\d)?\): "
    r"(?P<xid>\d+),(?: pid='?(?P<pid>\d+|<unknown>)'?,)?(?: name=(?P<name>[^,]*),)?"
)
_SM_LOC = re.compile(
    r"Graphics (?P<unit>SM Warp|SM Global|SM|TEX|GPC) Exception on \(GPC (?P<gpc>\d+), "
    r"TPC (?P<tpc>\d+)(?:, SM (?P<sm>\d+))?\): (?P<exception>[^\r\n]+?)\s*$"
)
_ESR = re.compile(r"Graphics Exception: (?P<pairs>(?:(?:ESR )?0x[0-9a-fA-F]+=0x[0-9a-fA-F]+\s*)+)")
_PAIR = re.compile(r"(0x[0-9a-fA-F]+)=(0x[0-9a-fA-F]+)")
_MMU = re.compile(
    r"MMU Fault: ENGINE (?P<engine>\w+)(?: GPC(?P<gpc>\d+))?(?: (?P<client>[\w]+))? faulted @ "
    r"(?P<address>0x[0-9a-fA-F_]+)\. Fault is of type (?P<fault_type>\w+)"
    r"(?: (?P<access_type>ACCESS_TYPE_\w+))?"
)


def parse_xid_line(line: str) -> dict[str, Any] | None:
    """Xid number, PCI address, pid and process name of an ``NVRM: Xid`` line."""
    m = _XID.search(line)
    if not m:
        return None
    out: dict[str, Any] = {"xid": int(m["xid"]), "pci": m["pci"]}
    if m["pid"] and m["pid"].isdigit():
        out["pid"] = int(m["pid"])
    if m["name"] and m["name"] != "<unknown>":
        out["process"] = m["name"].strip()
    return out


def parse_sm_error(line: str) -> dict[str, Any] | None:
    """The structured ``sm_error`` of an Xid 13/31 line, or None if it has none."""
    if m := _SM_LOC.search(line):
        d: dict[str, Any] = {
            "kind": "sm_exception",
            "unit": m["unit"],
            "gpc": int(m["gpc"]),
            "tpc": int(m["tpc"]),
            "exception": m["exception"].strip(),
        }
        if m["sm"] is not None:
            d["sm"] = int(m["sm"])
        return d
    if m := _ESR.search(line):
        return {"kind": "esr", "esr": [[a, v] for a, v in _PAIR.findall(m["pairs"])]}
    if m := _MMU.search(line):
        d = {"kind": "mmu_fault", **{k: v for k, v in m.groupdict().items() if v is not None}}
        if "gpc" in d:
            d["gpc"] = int(d["gpc"])
        return d
    return None


def sm_fault_verdict(sm_errors: Iterable[dict[str, Any]], *, min_faults: int = 3) -> dict[str, Any]:
    """NVIDIA's reading of repeated SM faults on one GPU.

    ``hardware`` when at least ``min_faults`` located faults all hit the same
    GPC/TPC/SM; ``application`` when located faults hit two or more SMs;
    ``unknown`` otherwise (too few, or no location).
    """
    locs = [
        (e.get("gpc"), e.get("tpc"), e.get("sm"))
        for e in sm_errors
        if e and e.get("kind") == "sm_exception"
    ]
    count = Counter(locs)
    if len(count) >= 2:
        return {
            "verdict": "application",
            "faults": len(locs),
            "locations": len(count),
            "why": f"faults scattered across {len(count)} SMs",
        }
    if len(locs) >= min_faults:
        gpc, tpc, sm = locs[0]
        return {
            "verdict": "hardware",
            "faults": len(locs),
            "locations": 1,
            "why": f"{len(locs)} faults on the same GPC {gpc} TPC {tpc} SM {sm}",
        }
    return {
        "verdict": "unknown",
        "faults": len(locs),
        "locations": len(count),
        "why": "too few located SM faults",
    }
