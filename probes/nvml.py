"""NVML probe: GPU Xid events and health readings through pynvml, as evidence.

Two threads once started:

* **events**: one NVML event set; every GPU registers the types it supports out
  of Xid critical error, double-bit ECC, single-bit ECC and single-bit ECC storm
  (``nvmlDeviceGetSupportedEventTypes``); ``nvmlEventSetWait`` blocks for up to
  ``event_timeout_ms`` (``NVMLError_Timeout`` is the normal empty answer).
  Each Xid becomes a ``GPU_XID_<n>`` record (``GPU_XID_OTHER`` when the catalog
  has no such code) with ``xid``, ``gpu_uuid``, ``gpu_index`` and, for MIG, the
  GPU/compute instance ids in ``attrs``;
* **poll**: every ``interval_s`` (default 1 s) per GPU: memory used/total,
  utilization, temperature, power, clocks event reasons; every ``slow_every``
  polls (default every poll): volatile ECC counts, retired pages and pending
  flag, row remapping, PCIe replay counter, NVLink CRC counters per active link.

Readings become ``ingest.schema.METRICS`` rows through ``sink.emit_metric``; a row
is written when the value changed and otherwise once every ``heartbeat_s``
(default 60 s): the last written value holds until the next row.

Transition policy (records): a condition (thermal slowdown, power brake, remap
pending, a counter rising...) gives **one record when it becomes active**
(also when it is already active at the first reading), none while it lasts, and
none when it clears (a record carries a code, and a "cleared" record would read
as one more occurrence); its end is in the metrics (the 0/1 and counter rows).
It gives a new record only after it has been clear for ``rearm_s`` (default
60 s), so a flapping reason is one record, not one per poll. A counter condition
is "active" in a poll where the counter increased; a counter's first reading is
its baseline (counts since driver load carry no time), a decrease a new baseline.

Errors: ``NotSupported`` (and ``FunctionNotFound``, ``NoPermission``,
``InvalidArgument``) is cached per (device, reading): never called or logged
again. ``GpuIsLost`` gives one ``NVML_GPU_IS_LOST`` record and the device is not
polled again. No driver, no library or no ``pynvml`` module: :meth:`start`
returns the one line ``no NVIDIA driver: NVML unavailable (...)`` and the
poller does nothing; no call ever raises into the caller.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from ingest import schema as S
from probes.sink import MemorySink, RateLimitedLog

__all__ = ["NvmlPoller", "run_cli", "NO_DRIVER", "SOURCE"]

log = logging.getLogger("rca.probes.nvml")

SOURCE = "probe:nvml"
NO_DRIVER = "no NVIDIA driver: NVML unavailable"

_ANY_INSTANCE = 0xFFFFFFFF  # NVML_GPU_INSTANCE_ID_ANY / NVML_COMPUTE_INSTANCE_ID_ANY
_NEG_INF = float("-inf")

# (metric label, pynvml name suffix, bit); the bit values are the same under the
# ClocksEventReason and the deprecated ClocksThrottleReason names.
_REASONS: tuple[tuple[str, str, int], ...] = (
    ("gpu_idle", "GpuIdle", 0x1),
    ("sw_power_cap", "SwPowerCap", 0x4),
    ("hw_slowdown", "HwSlowdown", 0x8),
    ("sw_thermal_slowdown", "SwThermalSlowdown", 0x20),
    ("hw_thermal_slowdown", "HwThermalSlowdown", 0x40),
    ("hw_power_brake", "HwPowerBrakeSlowdown", 0x80),
)
_REASON_EXTRA = {label: (("reason", label),) for label, _n, _b in _REASONS}
# reason -> catalog code; a code the catalog lacks gives metrics only (there is
# no code for the generic HwSlowdown bit today: it is recorded only when neither
# the thermal nor the power-brake bit explains it, and only if the code exists).
_REASON_CODES = {
    "hw_thermal_slowdown": "GPU_HW_THERMAL_SLOWDOWN",
    "hw_power_brake": "GPU_HW_POWER_BRAKE",
    "hw_slowdown": "GPU_HW_SLOWDOWN",
}

# NVML errors after which a reading is not tried again on that device
_PERMANENT = ("NotSupported", "FunctionNotFound", "NoPermission", "InvalidArgument")
_NO_DRIVER_ERRORS = ("LibraryNotFound", "DriverNotLoaded")

# every function the poller may call, resolved once per poller
_FUNCTIONS = (
    "nvmlInit",
    "nvmlShutdown",
    "nvmlSystemGetDriverVersion",
    "nvmlDeviceGetCount",
    "nvmlDeviceGetHandleByIndex",
    "nvmlDeviceGetUUID",
    "nvmlDeviceGetName",
    "nvmlDeviceGetPciInfo",
    "nvmlDeviceGetIndex",
    "nvmlEventSetCreate",
    "nvmlEventSetFree",
    "nvmlEventSetWait",
    "nvmlDeviceGetSupportedEventTypes",
    "nvmlDeviceRegisterEvents",
    "nvmlDeviceGetMemoryInfo",
    "nvmlDeviceGetUtilizationRates",
    "nvmlDeviceGetTemperatureV",
    "nvmlDeviceGetTemperature",
    "nvmlDeviceGetPowerUsage",
    "nvmlDeviceGetCurrentClocksEventReasons",
    "nvmlDeviceGetCurrentClocksThrottleReasons",
    "nvmlDeviceGetTotalEccErrors",
    "nvmlDeviceGetRetiredPages",
    "nvmlDeviceGetRetiredPagesPendingStatus",
    "nvmlDeviceGetRemappedRows",
    "nvmlDeviceGetPcieReplayCounter",
    "nvmlDeviceGetNvLinkState",
    "nvmlDeviceGetNvLinkErrorCounter",
)


class _DeviceLost(Exception):
    """Internal: stop polling this device (GpuIsLost)."""


def _handle_key(handle: Any) -> Any:
    """A hashable identity for a device handle: the pointer value for pynvml's
    ctypes handles, the object itself for anything else (fakes)."""
    try:
        return ctypes.cast(handle, ctypes.c_void_p).value
    except (ctypes.ArgumentError, TypeError):
        return handle


def _err_name(exc: BaseException) -> str:
    name = type(exc).__name__
    return name[len("NVMLError_") :] if name.startswith("NVMLError_") else name


def _text(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace").rstrip("\x00")
    return str(value)


class _Dev:
    __slots__ = (
        "index",
        "handle",
        "uuid",
        "name",
        "pci",
        "unsupported",
        "supported",
        "lost",
        "once",
        "last",
        "emitted",
        "conds",
        "_labels",
        "links",
        "link_ids",
        "event_mask",
        "xid_counts",
        "xid_last",
        "xid_suppressed",
        "sbe_events",
        "last_48",
    )

    def __init__(self, index: int, handle: Any) -> None:
        self.index = index
        self.handle = handle
        self.uuid: str | None = None
        self.name: str | None = None
        self.pci: str | None = None
        self.unsupported: set[str] = set()
        self.supported: set[str] = set()
        self.lost = False
        self.once: set[str] = set()  # codes recorded at most once per device
        self.last: dict[Any, float] = {}
        self.emitted: dict[Any, float] = {}
        self.conds: dict[str, list[Any]] = {}  # key -> [active, cleared_at]
        self._labels: dict[tuple[tuple[str, str], ...], str] = {}
        self.links: list[tuple[int, int, str, str, tuple[tuple[str, str], ...]]] = []
        self.link_ids: tuple[int, ...] = ()
        self.event_mask = 0
        self.xid_counts: dict[int, int] = {}
        self.xid_last: dict[int, float] = {}
        self.xid_suppressed: dict[int, int] = {}
        self.sbe_events = 0
        self.last_48 = _NEG_INF

    def labels(self, extra: tuple[tuple[str, str], ...] = ()) -> str:
        text = self._labels.get(extra)
        if text is None:
            d = {"gpu": str(self.index)}
            if self.uuid:
                d["uuid"] = self.uuid
            d.update(extra)
            text = self._labels[extra] = json.dumps(d, sort_keys=True)
        return text


class NvmlPoller:
    """Poll NVML and turn Xid events and state changes into records.

    ``nvml`` is the ``pynvml`` module (imported when ``None``) or any object with
    the same function names, constants and exception classes (tests pass
    :class:`probes.fake_nvml.FakeNvml`).
    """

    def __init__(
        self,
        sink: Any,
        nvml: Any = None,
        interval_s: float = 1.0,
        *,
        slow_every: int = 1,
        heartbeat_s: float = 60.0,
        rearm_s: float = 60.0,
        xid_repeat_s: float = 1.0,
        derived_dedup_s: float = 10.0,
        event_timeout_ms: int = 500,
        catalog: Any = None,
        host: str | None = None,
    ) -> None:
        self.sink = sink
        self._nvml = nvml
        self.interval_s = float(interval_s)
        self.slow_every = max(1, int(slow_every))
        self.heartbeat_s = heartbeat_s
        self.rearm_s = rearm_s
        self.xid_repeat_s = xid_repeat_s
        self.derived_dedup_s = derived_dedup_s
        self.event_timeout_ms = int(event_timeout_ms)
        self._catalog = catalog
        self.host = host or (os.uname().nodename if hasattr(os, "uname") else None)
        self._emit_metric = getattr(sink, "emit_metric", None)

        self.available: bool | None = None  # None: not initialized yet
        self._status = "nvml: not started"
        self.driver_version: str | None = None
        self.devices: list[_Dev] = []
        self._by_handle: dict[Any, _Dev] = {}
        self._fn: dict[str, Callable[..., Any] | None] = {}
        self._es: Any = None
        self._nvml_error: type[BaseException] | tuple[type[BaseException], ...] = ()
        self._timeout_error: type[BaseException] | tuple[type[BaseException], ...] = ()

        self._lock = threading.Lock()  # state shared by the poll and event threads
        self._init_lock = threading.Lock()
        self._current_out: list[S.ErrorContext] | None = None
        self._poll_tid: int | None = None
        self._poll_lock = threading.Lock()
        self._stop = threading.Event()
        self._poll_thread: threading.Thread | None = None
        self._event_thread: threading.Thread | None = None
        self._rlog = RateLimitedLog(30.0, log)
        self._now_ns = 0
        self._now = 0.0

        self.polls = 0
        self.poll_cpu_s = 0.0  # thread CPU time spent inside poll_once
        self.errors = 0
        self.records_emitted = 0
        self.metrics_emitted = 0
        self.recent: deque[S.ErrorContext] = deque(maxlen=256)

    # ------------------------------------------------------------------ public
    def status(self) -> str:
        """One line: what the probe sees (or why it sees nothing)."""
        return self._status

    def start(self) -> str:
        """Initialize NVML and start the poll (and event) threads; never raises.

        Returns :meth:`status`; on a machine without the driver, the one line
        ``no NVIDIA driver: NVML unavailable (...)`` and nothing is started."""
        try:
            if not self._ensure_init():
                return self._status
            self._stop.clear()
            if self._es is not None and self._event_thread is None:
                self._event_thread = threading.Thread(
                    target=self._event_loop, name="rca-nvml-events", daemon=True
                )
                self._event_thread.start()
            if self._poll_thread is None:
                self._poll_thread = threading.Thread(
                    target=self._poll_loop, name="rca-nvml-poll", daemon=True
                )
                self._poll_thread.start()
        except Exception as exc:  # never into the caller
            self._status = f"nvml: failed to start ({type(exc).__name__}: {exc})"
            log.warning("%s", self._status)
        return self._status

    def stop(self) -> None:
        """Stop the threads, free the event set, shut NVML down; idempotent."""
        self._stop.set()
        stuck = False
        for t in (self._poll_thread, self._event_thread):
            if t is not None:
                t.join(timeout=max(2.0, self.event_timeout_ms / 1000 * 4))
                stuck = stuck or t.is_alive()
        self._poll_thread = self._event_thread = None
        if self.available and not stuck:
            if self._es is not None:
                with contextlib.suppress(Exception):
                    self._call("nvmlEventSetFree", self._es)
                self._es = None
            with contextlib.suppress(Exception):
                self._call("nvmlShutdown")
            self.available = None
            self._status = "nvml: stopped"
        flush = getattr(self.sink, "flush", None)
        if flush is not None:
            with contextlib.suppress(Exception):
                flush()

    def poll_once(self) -> list[S.ErrorContext]:
        """Read every device once; return the records this poll produced.

        When the event thread is not running, pending events are drained here
        too (without waiting), so a single poll sees Xids that already happened.
        """
        out: list[S.ErrorContext] = []
        try:
            with self._poll_lock:
                self._current_out, self._poll_tid = out, threading.get_ident()
                try:
                    self._poll_locked(out)
                finally:
                    self._current_out = self._poll_tid = None
        except Exception as exc:  # never into the caller
            self.errors += 1
            self._rlog.warning("nvml:poll", f"poll failed: {type(exc).__name__}: {exc}")
        return out

    def _poll_locked(self, out: list[S.ErrorContext]) -> None:
        if not self._ensure_init():
            return
        t0 = time.thread_time()
        self._now_ns = time.time_ns()
        self._now = time.monotonic()
        slow = self.polls % self.slow_every == 0
        self.polls += 1
        if self._es is not None and self._event_thread is None:
            self._drain_events(out)
        for dev in self.devices:
            if dev.lost:
                self._metric(dev, "nvml_gpu_up", 0)
                continue
            try:
                self._poll_device(dev, slow, out)
                self._metric(dev, "nvml_gpu_up", 1)
            except _DeviceLost:
                self._metric(dev, "nvml_gpu_up", 0)
        self.poll_cpu_s += time.thread_time() - t0

    def readings(self) -> list[dict[str, Any]]:
        """The latest value of every reading, per device (for tables and checks)."""
        out = []
        for dev in self.devices:
            values: dict[str, float] = {}
            for key, value in list(dev.last.items()):
                if isinstance(key, tuple):
                    name, extra = key
                    key = name + "{" + ",".join(f"{k}={v}" for k, v in extra) + "}"
                values[key] = value
            out.append(
                {
                    "index": dev.index,
                    "uuid": dev.uuid,
                    "name": dev.name,
                    "pci_bus_id": dev.pci,
                    "lost": dev.lost,
                    "events": dev.event_mask,
                    "supported": sorted(dev.supported),
                    "unsupported": sorted(dev.unsupported),
                    "values": dict(sorted(values.items())),
                }
            )
        return out

    # ------------------------------------------------------------------ init
    def _ensure_init(self) -> bool:
        if self.available is None:
            with self._init_lock:
                if self.available is None:
                    self.available = self._init()
        return bool(self.available)

    def _init(self) -> bool:
        self.devices = []
        self._by_handle = {}
        self._es = None
        nvml = self._nvml
        if nvml is None:
            try:
                import pynvml as nvml  # type: ignore[import-not-found]
            except ImportError as exc:
                self._status = f"{NO_DRIVER} (pynvml not importable: {exc}; install nvidia-ml-py)"
                return False
            self._nvml = nvml
        self._fn = {name: getattr(nvml, name, None) for name in _FUNCTIONS}
        self._nvml_error = getattr(nvml, "NVMLError", Exception)
        self._timeout_error = getattr(nvml, "NVMLError_Timeout", ())
        init = self._fn["nvmlInit"]
        if init is None:
            self._status = f"{NO_DRIVER} ({type(nvml).__name__} has no nvmlInit)"
            return False
        try:
            init()
        except Exception as exc:
            name = _err_name(exc)
            if name in _NO_DRIVER_ERRORS:
                self._status = f"{NO_DRIVER} ({exc})"
            else:
                self._status = f"NVML unavailable: nvmlInit failed ({name}: {exc})"
                if name == "LibRmVersionMismatch":
                    msg = f"nvmlInit: {exc}"
                    self._record(None, "NVML_DRIVER_LIBRARY_MISMATCH", msg, self._current_out)
            return False
        try:
            self.driver_version = _text(self._call("nvmlSystemGetDriverVersion"))
        except Exception:
            self.driver_version = None
        try:
            count = int(self._call("nvmlDeviceGetCount"))
        except Exception as exc:
            self._status = f"NVML unavailable: nvmlDeviceGetCount failed ({_err_name(exc)}: {exc})"
            with contextlib.suppress(Exception):
                self._call("nvmlShutdown")
            return False
        try:
            self._es = self._call("nvmlEventSetCreate")
        except Exception as exc:
            self._es = None
            log.info("nvml: no event set (%s), Xid events off", exc)
        for i in range(count):
            self._init_device(i)
        if self._es is not None and not any(d.event_mask for d in self.devices):
            with contextlib.suppress(Exception):
                self._call("nvmlEventSetFree", self._es)
            self._es = None
        self._status = self._summary()
        return True

    def _init_device(self, i: int) -> None:
        try:
            handle = self._call("nvmlDeviceGetHandleByIndex", i)
        except Exception as exc:
            dev = _Dev(i, None)
            self.devices.append(dev)
            if _err_name(exc) == "GpuIsLost":
                dev.lost = True
                msg = f"GPU {i}: nvmlDeviceGetHandleByIndex: {exc}"
                self._once(dev, "NVML_GPU_IS_LOST", msg, None)
            else:
                dev.lost = True  # no handle: nothing to poll
                log.warning("nvml: no handle for GPU %d (%s)", i, exc)
            return
        dev = _Dev(i, handle)
        self.devices.append(dev)
        self._by_handle[_handle_key(handle)] = dev
        try:
            dev.uuid = _text(self._read(dev, "uuid", "nvmlDeviceGetUUID")) or None
            dev.name = _text(self._read(dev, "name", "nvmlDeviceGetName")) or None
            pci = self._read(dev, "pci_info", "nvmlDeviceGetPciInfo")
            if pci is not None:
                dev.pci = _text(getattr(pci, "busId", "")) or None
            self._init_events(dev)
            self._init_nvlink(dev)
        except _DeviceLost:
            pass

    def _init_events(self, dev: _Dev) -> None:
        if self._es is None:
            return
        nv = self._nvml
        wanted = 0
        for name in (
            "nvmlEventTypeXidCriticalError",
            "nvmlEventTypeDoubleBitEccError",
            "nvmlEventTypeSingleBitEccError",
            "nvmlEventTypeSingleBitEccErrorStorm",
        ):
            wanted |= int(getattr(nv, name, 0))
        supported = self._read(dev, "event_types", "nvmlDeviceGetSupportedEventTypes")
        mask = wanted & int(supported or 0)
        if not mask:
            return
        try:
            self._call("nvmlDeviceRegisterEvents", dev.handle, mask, self._es)
            dev.event_mask = mask
        except Exception as exc:
            if _err_name(exc) == "GpuIsLost":
                self._lost(dev, "nvmlDeviceRegisterEvents", exc)
            log.info("nvml: GPU %d: cannot register events 0x%x (%s)", dev.index, mask, exc)

    def _init_nvlink(self, dev: _Dev) -> None:
        nv = self._nvml
        fn = self._fn["nvmlDeviceGetNvLinkState"]
        if fn is None:
            return
        max_links = int(getattr(nv, "NVML_NVLINK_MAX_LINKS", 36))
        counters = (
            (int(getattr(nv, "NVML_NVLINK_ERROR_DL_CRC_FLIT", 2)), "crc_flit"),
            (int(getattr(nv, "NVML_NVLINK_ERROR_DL_CRC_DATA", 3)), "crc_data"),
        )
        for link in range(max_links):
            try:
                state = fn(dev.handle, link)
            except self._nvml_error as exc:
                if _err_name(exc) == "GpuIsLost":
                    self._lost(dev, "nvmlDeviceGetNvLinkState", exc)
                break  # no NVLink, or past the last link
            if int(state) != 1:
                continue
            for counter_id, cname in counters:
                extra = (("counter", cname), ("link", str(link)))
                dev.links.append((link, counter_id, cname, f"nvlink_{cname}_l{link}", extra))
        dev.link_ids = tuple(sorted({link for link, *_ in dev.links}))

    def _summary(self) -> str:
        n = len(self.devices)
        names = sorted({d.name for d in self.devices if d.name})
        ev = sum(1 for d in self.devices if d.event_mask)
        lost = [d.index for d in self.devices if d.lost]
        parts = [
            f"nvml: {n} GPU(s)" + (f" ({', '.join(names)})" if names else ""),
            f"driver {self.driver_version or '?'}",
            f"Xid events on {ev}/{n}",
            f"polling every {self.interval_s:g} s",
        ]
        if lost:
            parts.append("lost: " + ",".join(f"gpu{i}" for i in lost))
        return "; ".join(parts)

    # ------------------------------------------------------------------ threads
    def _poll_loop(self) -> None:
        next_t = time.monotonic()
        while not self._stop.is_set():
            self.poll_once()
            next_t += self.interval_s
            delay = next_t - time.monotonic()
            if delay < 0:  # fell behind: skip, do not burst
                next_t = time.monotonic()
                delay = 0.0
            self._stop.wait(delay)

    def _event_loop(self) -> None:
        wait = self._fn["nvmlEventSetWait"]
        if wait is None:
            return
        while not self._stop.is_set():
            try:
                data = wait(self._es, self.event_timeout_ms)
            except self._timeout_error:
                continue
            except Exception as exc:
                self.errors += 1
                self._rlog.warning("nvml:events", f"nvmlEventSetWait failed: {exc}")
                self._stop.wait(1.0)
                continue
            try:
                self._on_event(data, None)
            except Exception as exc:
                self.errors += 1
                self._rlog.warning("nvml:events", f"event handling failed: {exc}")

    def _drain_events(self, out: list[S.ErrorContext]) -> None:
        wait = self._fn["nvmlEventSetWait"]
        if wait is None:
            return
        for _ in range(10_000):  # bounded: a storm cannot pin one poll forever
            try:
                data = wait(self._es, 0)
            except self._timeout_error:
                return
            except Exception as exc:
                self.errors += 1
                self._rlog.warning("nvml:events", f"nvmlEventSetWait failed: {exc}")
                return
            self._on_event(data, out)

    # ------------------------------------------------------------------ events
    def _on_event(self, data: Any, out: list[S.ErrorContext] | None) -> None:
        nv = self._nvml
        dev = self._by_handle.get(_handle_key(data.device))
        if dev is None:
            with contextlib.suppress(Exception):
                idx = int(self._call("nvmlDeviceGetIndex", data.device))
                dev = next((d for d in self.devices if d.index == idx), None)
        if dev is None:
            return
        etype = int(data.eventType)
        now = time.monotonic()
        attrs: dict[str, Any] = {"via": "nvml_event", "event_type": f"0x{etype:x}"}
        gi = getattr(data, "gpuInstanceId", _ANY_INSTANCE)
        ci = getattr(data, "computeInstanceId", _ANY_INSTANCE)
        if gi is not None and int(gi) != _ANY_INSTANCE:
            attrs["gpuInstanceId"] = int(gi)
        if ci is not None and int(ci) != _ANY_INSTANCE:
            attrs["computeInstanceId"] = int(ci)
        if etype & int(getattr(nv, "nvmlEventTypeXidCriticalError", 0x8)):
            xid = int(data.eventData)
            with self._lock:
                dev.xid_counts[xid] = dev.xid_counts.get(xid, 0) + 1
                last = dev.xid_last.get(xid, _NEG_INF)
                if now - last < self.xid_repeat_s:
                    dev.xid_suppressed[xid] = dev.xid_suppressed.get(xid, 0) + 1
                    return
                dev.xid_last[xid] = now
                repeats = dev.xid_suppressed.pop(xid, 0)
                if xid == 48:
                    dev.last_48 = now
            if repeats:
                attrs["repeats_suppressed"] = repeats
            code = f"GPU_XID_{xid}" if f"GPU_XID_{xid}" in self._catalog_obj() else "GPU_XID_OTHER"
            self._record(dev, code, f"Xid {xid} on GPU {dev.index}", out, xid=xid, attrs=attrs)
        elif etype & int(getattr(nv, "nvmlEventTypeDoubleBitEccError", 0x2)):
            if self._derived_48_ok(dev, now):
                self._record(
                    dev,
                    "GPU_XID_48",
                    f"double-bit ECC error event on GPU {dev.index}",
                    out,
                    attrs={**attrs, "event": "DoubleBitEccError"},
                    confidence=0.9,
                )
        elif etype & int(getattr(nv, "nvmlEventTypeSingleBitEccErrorStorm", 0x200)):
            with self._lock:
                fire = self._edge(dev, "sbe_storm_event", True, now)
                self._edge(dev, "sbe_storm_event", False, now)
            if fire:
                self._record(
                    dev,
                    "GPU_ECC_SBE_STORM",
                    f"single-bit ECC error storm on GPU {dev.index}",
                    out,
                    attrs={**attrs, "event": "SingleBitEccErrorStorm"},
                )
        elif etype & int(getattr(nv, "nvmlEventTypeSingleBitEccError", 0x1)):
            with self._lock:
                dev.sbe_events += 1

    def _derived_48_ok(self, dev: _Dev, now: float) -> bool:
        """A GPU_XID_48 not from an Xid event: skip it when one was just recorded."""
        with self._lock:
            if now - dev.last_48 < self.derived_dedup_s:
                return False
            dev.last_48 = now
            return True

    # ------------------------------------------------------------------ polling
    def _poll_device(self, dev: _Dev, slow: bool, out: list[S.ErrorContext]) -> None:
        nv = self._nvml
        read = self._read
        metric = self._metric

        mem = read(dev, "memory", "nvmlDeviceGetMemoryInfo")
        if mem is not None:
            metric(dev, "nvml_fb_used_bytes", mem.used)
            metric(dev, "nvml_fb_total_bytes", mem.total)
        util = read(dev, "utilization", "nvmlDeviceGetUtilizationRates")
        if util is not None:
            metric(dev, "nvml_gpu_util_pct", util.gpu)
            metric(dev, "nvml_mem_util_pct", util.memory)
        sensor = int(getattr(nv, "NVML_TEMPERATURE_GPU", 0))
        temp = read(dev, "temperature_v", "nvmlDeviceGetTemperatureV", sensor)
        if temp is None:
            temp = read(dev, "temperature", "nvmlDeviceGetTemperature", sensor)
        if temp is not None:
            metric(dev, "nvml_gpu_temp_c", temp)
        power = read(dev, "power", "nvmlDeviceGetPowerUsage")
        if power is not None:
            metric(dev, "nvml_power_w", power / 1000.0)
        reasons = read(dev, "clocks_event_reasons", "nvmlDeviceGetCurrentClocksEventReasons")
        if reasons is None:
            reasons = read(
                dev, "clocks_throttle_reasons", "nvmlDeviceGetCurrentClocksThrottleReasons"
            )
        if reasons is not None:
            self._clock_reasons(dev, int(reasons), out)

        if slow:
            self._ecc(dev, out)
            self._retired_pages(dev, out)
            self._remapped_rows(dev, out)
            self._pcie(dev, out)
            self._nvlink(dev, out)

        with self._lock:
            sbe = dev.sbe_events
            xids = list(dev.xid_counts.items()) if dev.xid_counts else ()
        if dev.event_mask:
            metric(dev, "nvml_ecc_sbe_events_total", sbe)
        for xid, n in xids:
            metric(dev, "nvml_xid_events_total", n, (("xid", str(xid)),))

    def _clock_reasons(self, dev: _Dev, reasons: int, out: list[S.ErrorContext]) -> None:
        self._metric(dev, "nvml_clocks_event_reasons", reasons)
        hw_specific = reasons & 0xC0
        for label, _name, bit in _REASONS:
            active = bool(reasons & bit)
            self._metric(dev, "nvml_clocks_event_active", int(active), _REASON_EXTRA[label])
            code = _REASON_CODES.get(label)
            if code is None:
                continue
            if label == "hw_slowdown":
                active = active and not hw_specific
            if self._edge(dev, label, active, self._now) and code in self._catalog_obj():
                self._record(
                    dev,
                    code,
                    f"{label.replace('_', ' ')} active on GPU {dev.index} "
                    f"(clocks event reasons 0x{reasons:x})",
                    out,
                    attrs={"via": "clocks_event_reasons", "reasons": f"0x{reasons:x}"},
                )

    def _ecc(self, dev: _Dev, out: list[S.ErrorContext]) -> None:
        nv = self._nvml
        volatile = int(getattr(nv, "NVML_VOLATILE_ECC", 0))
        corrected = int(getattr(nv, "NVML_MEMORY_ERROR_TYPE_CORRECTED", 0))
        uncorrected = int(getattr(nv, "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", 1))
        c = self._read(dev, "ecc_corrected", "nvmlDeviceGetTotalEccErrors", corrected, volatile)
        if c is not None:
            self._metric(dev, "nvml_ecc_corrected_volatile_total", c)
        u = self._read(dev, "ecc_uncorrected", "nvmlDeviceGetTotalEccErrors", uncorrected, volatile)
        if u is not None:
            delta = self._counter(dev, "nvml_ecc_uncorrected_volatile_total", u)
            if self._edge(dev, "ecc_uncorrected", delta > 0, self._now) and self._derived_48_ok(
                dev, self._now
            ):
                self._record(
                    dev,
                    "GPU_XID_48",
                    f"uncorrected ECC count rose by {delta} to {u} on GPU {dev.index}",
                    out,
                    attrs={"via": "ecc_volatile_uncorrected_counter", "count": u, "delta": delta},
                    confidence=0.8,
                )

    def _retired_pages(self, dev: _Dev, out: list[S.ErrorContext]) -> None:
        nv = self._nvml
        sbe = int(getattr(nv, "NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS", 0))
        dbe = int(getattr(nv, "NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR", 1))
        for cause, label in ((sbe, "sbe"), (dbe, "dbe")):
            pages = self._read(dev, f"retired_pages_{label}", "nvmlDeviceGetRetiredPages", cause)
            if pages is not None:
                self._metric(dev, "nvml_retired_pages", len(pages), (("cause", label),))
        pending = self._read(dev, "retired_pending", "nvmlDeviceGetRetiredPagesPendingStatus")
        if pending is not None:
            pending = int(pending)
            self._metric(dev, "nvml_retired_pages_pending", pending)
            if self._edge(dev, "retired_pending", pending == 1, self._now):
                self._record(
                    dev,
                    "GPU_XID_63",
                    f"page retirement pending on GPU {dev.index} (reboot to apply)",
                    out,
                    attrs={"via": "retired_pages_pending"},
                )

    def _remapped_rows(self, dev: _Dev, out: list[S.ErrorContext]) -> None:
        rows = self._read(dev, "remapped_rows", "nvmlDeviceGetRemappedRows")
        if rows is None:
            return
        corr, unc, pending, failure = (int(x) for x in rows)
        self._metric(dev, "nvml_remapped_rows", corr, (("kind", "correctable"),))
        self._metric(dev, "nvml_remapped_rows", unc, (("kind", "uncorrectable"),))
        self._metric(dev, "nvml_remap_pending", pending)
        self._metric(dev, "nvml_remap_failure", failure)
        attrs = {"via": "remapped_rows", "correctable": corr, "uncorrectable": unc}
        if self._edge(dev, "remap_pending", bool(pending), self._now):
            self._record(
                dev,
                "GPU_XID_63",
                f"row remapping pending on GPU {dev.index} (reset the GPU to apply)",
                out,
                attrs=attrs,
            )
        if self._edge(dev, "remap_failure", bool(failure), self._now):
            self._record(
                dev, "GPU_XID_64", f"row remapping failure on GPU {dev.index}", out, attrs=attrs
            )

    def _pcie(self, dev: _Dev, out: list[S.ErrorContext]) -> None:
        n = self._read(dev, "pcie_replay", "nvmlDeviceGetPcieReplayCounter")
        if n is None:
            return
        delta = self._counter(dev, "nvml_pcie_replay_total", n)
        if self._edge(dev, "pcie_replay", delta > 0, self._now):
            self._record(
                dev,
                "PCIE_REPLAY_RISING",
                f"PCIe replay counter rose by {delta} to {n} on GPU {dev.index}",
                out,
                attrs={"via": "pcie_replay_counter", "count": n, "delta": delta},
            )

    def _nvlink(self, dev: _Dev, out: list[S.ErrorContext]) -> None:
        if not dev.links:
            return
        rising: dict[int, list[tuple[str, int, int]]] = {}
        for link, counter_id, cname, key, extra in dev.links:
            v = self._read(dev, key, "nvmlDeviceGetNvLinkErrorCounter", link, counter_id)
            if v is None:
                continue
            delta = self._counter(dev, "nvml_nvlink_errors_total", v, extra)
            if delta > 0:
                rising.setdefault(link, []).append((cname, int(v), delta))
        for link in dev.link_ids:
            hits = rising.get(link)
            if self._edge(dev, f"nvlink_crc_l{link}", bool(hits), self._now) and hits:
                self._record(
                    dev,
                    "NVLINK_CRC_ERRORS_RISING",
                    f"NVLink {link} CRC errors rising on GPU {dev.index}",
                    out,
                    attrs={
                        "via": "nvlink_error_counter",
                        "link": link,
                        "counters": {c: {"count": v, "delta": d} for c, v, d in hits},
                    },
                )

    # ------------------------------------------------------------------ helpers
    def _call(self, name: str, *args: Any) -> Any:
        fn = self._fn.get(name)
        if fn is None:
            raise AttributeError(f"{name} not available")
        return fn(*args)

    def _read(self, dev: _Dev, key: str, fn_name: str, *args: Any) -> Any:
        """One reading, or None; NotSupported and the like are cached per key."""
        if key in dev.unsupported:
            return None
        fn = self._fn.get(fn_name)
        if fn is None:
            dev.unsupported.add(key)
            return None
        try:
            value = fn(dev.handle, *args)
        except self._nvml_error as exc:
            self._on_error(dev, key, fn_name, exc)
            return None
        except Exception as exc:  # e.g. NVMLLibraryMismatchError, ctypes errors
            self.errors += 1
            self._rlog.warning(f"nvml:{key}", f"GPU {dev.index}: {fn_name}: {exc!r}")
            return None
        if key not in dev.supported:
            dev.supported.add(key)
        return value

    def _on_error(self, dev: _Dev, key: str, fn_name: str, exc: BaseException) -> None:
        name = _err_name(exc)
        if name in _PERMANENT:
            dev.unsupported.add(key)
            log.debug("nvml: GPU %d: %s: %s (not asked again)", dev.index, fn_name, name)
            return
        if name == "GpuIsLost":
            self._lost(dev, fn_name, exc)
        if name == "CorruptedInforom":
            dev.unsupported.add(key)
            self._once(dev, "GPU_INFOROM_CORRUPTED", f"GPU {dev.index}: {fn_name}: {exc}", None)
            return
        self.errors += 1
        self._rlog.warning(f"nvml:{key}:{name}", f"GPU {dev.index}: {fn_name}: {exc}")

    def _lost(self, dev: _Dev, fn_name: str, exc: BaseException) -> None:
        dev.lost = True
        self._once(
            dev,
            "NVML_GPU_IS_LOST",
            f"GPU {dev.index} is lost ({fn_name}: {exc})",
            None,
            attrs={"via": fn_name},
        )
        self._status = self._summary() if self.devices else self._status
        raise _DeviceLost

    def _once(
        self,
        dev: _Dev | None,
        code: str,
        message: str,
        out: list[S.ErrorContext] | None,
        **kw: Any,
    ) -> None:
        if dev is not None:
            with self._lock:
                if code in dev.once:
                    return
                dev.once.add(code)
        if out is None and self._poll_tid == threading.get_ident():
            out = self._current_out
        self._record(dev, code, message, out, **kw)

    def _edge(self, dev: _Dev, key: str, active: bool, now: float) -> bool:
        """True when ``key`` turns active and has been clear for ``rearm_s``."""
        c = dev.conds.get(key)
        if c is None:
            if not active:
                dev.conds[key] = [False, _NEG_INF]
                return False
            c = dev.conds[key] = [False, _NEG_INF]
        if active:
            if c[0]:
                return False
            c[0] = True
            return now - c[1] >= self.rearm_s
        if c[0]:
            c[0] = False
            c[1] = now
        return False

    def _counter(
        self, dev: _Dev, name: str, value: Any, extra: tuple[tuple[str, str], ...] = ()
    ) -> int:
        """Write the counter's metric row; return its increase since the last read."""
        prev = self._metric(dev, name, value, extra)
        if prev is None or value < prev:
            return 0
        return int(value - prev)

    def _metric(
        self, dev: _Dev, name: str, value: Any, extra: tuple[tuple[str, str], ...] = ()
    ) -> Any:
        """Remember the value; emit a METRICS row if it changed or the heartbeat is due.
        Returns the previous value (None at the first reading)."""
        key: Any = (name, extra) if extra else name
        last = dev.last
        prev = last.get(key)
        last[key] = value
        now = self._now
        if prev == value and now - dev.emitted.get(key, _NEG_INF) < self.heartbeat_s:
            return prev
        dev.emitted[key] = now
        if self._emit_metric is not None:
            row = {
                "ts": self._now_ns,
                "host": self.host,
                "gpu_uuid": dev.uuid,
                "name": name,
                "labels": dev.labels(extra),
                "value": float(value),
                "source": SOURCE,
            }
            try:
                self._emit_metric(row)
                self.metrics_emitted += 1
            except Exception as exc:
                self.errors += 1
                self._rlog.warning("nvml:sink", f"emit_metric failed: {exc}")
        return prev

    def _catalog_obj(self) -> Any:
        if self._catalog is None:
            from graph.catalog import default_catalog

            self._catalog = default_catalog()
        return self._catalog

    def _record(
        self,
        dev: _Dev | None,
        code: str,
        message: str,
        out: list[S.ErrorContext] | None,
        **kw: Any,
    ) -> S.ErrorContext | None:
        catalog = self._catalog_obj()
        entry = catalog.get(code)
        if entry is None:
            return None
        attrs = kw.pop("attrs", None) or {}
        if dev is not None and dev.pci:
            attrs.setdefault("pci_bus_id", dev.pci)
        if dev is not None and dev.name:
            attrs.setdefault("gpu_name", dev.name)
        rec = S.ErrorContext.from_catalog(
            entry,
            source=SOURCE,
            gpu_uuid=dev.uuid if dev is not None else None,
            gpu_index=dev.index if dev is not None else None,
            host=self.host,
            pid=None,
            message=message,
            attrs=attrs or None,
            **kw,
        )
        try:
            self.sink.emit(rec)
        except Exception as exc:
            self.errors += 1
            self._rlog.warning("nvml:sink", f"emit failed: {exc}")
        with self._lock:
            self.records_emitted += 1
            self.recent.append(rec)
        if out is not None:
            out.append(rec)
        return rec


# ---------------------------------------------------------------------- CLI


class _PrintingSink:
    """Forward to a sink and print one line per record (for `rca probe nvml`)."""

    def __init__(self, inner: Any, out: TextIO, as_json: bool) -> None:
        self.inner = inner
        self.out = out
        self.as_json = as_json
        self._lock = threading.Lock()

    def emit(self, record: Any) -> None:
        self.inner.emit(record)
        if isinstance(record, S.ErrorContext):
            with self._lock:
                print(_record_line(record, self.as_json), file=self.out, flush=True)

    def emit_metric(self, row: dict[str, Any]) -> None:
        self.inner.emit_metric(row)

    def flush(self) -> None:
        flush = getattr(self.inner, "flush", None)
        if flush is not None:
            flush()


def _record_line(rec: S.ErrorContext, as_json: bool) -> str:
    if as_json:
        return json.dumps({"record": rec.to_row()}, sort_keys=True, default=str)
    xid = f" xid={rec.xid}" if rec.xid is not None else ""
    gpu = f"gpu{rec.gpu_index} {rec.gpu_uuid or ''}"
    return f"{rec.severity:<8} {rec.code:<26} {gpu}{xid}  {rec.message}"


def _print_once(poller: NvmlPoller, sink: MemorySink, out: TextIO, as_json: bool) -> None:
    recs = [r for r in sink.records if isinstance(r, S.ErrorContext)]
    if as_json:
        for row in sink.metrics:
            print(json.dumps({"metric": row}, sort_keys=True), file=out)
        for rec in recs:
            print(_record_line(rec, True), file=out)
        return
    for dev in poller.readings():
        head = f"GPU {dev['index']}  {dev['uuid'] or '?'}  {dev['name'] or '?'}"
        head += f"  {dev['pci_bus_id'] or ''}"
        print(head + ("  LOST" if dev["lost"] else ""), file=out)
        for key, value in dev["values"].items():
            shown = f"{value:g}" if isinstance(value, float) else str(value)
            if key == "nvml_clocks_event_reasons":
                shown = f"0x{int(value):x}"
            print(f"  {key:<52} {shown}", file=out)
        if dev["unsupported"]:
            print(f"  not supported: {', '.join(dev['unsupported'])}", file=out)
    for rec in recs:
        print(_record_line(rec, False), file=out)


def run_cli(
    once: bool = False,
    interval: float = 1.0,
    db: str | Path | None = None,
    spool: str | Path | None = None,
    *,
    as_json: bool = False,
    nvml: Any = None,
    out: TextIO | None = None,
    duration: float | None = None,
) -> int:
    """`rca probe nvml [--once] [--interval S]`: returns the exit code.

    ``--once``: one poll, printed (a table, or JSON lines with ``as_json``), nothing
    written. Otherwise: poll every ``interval`` seconds into the spool (beside
    ``db``, or ``spool``) until Ctrl-C/SIGTERM (or ``duration`` seconds), printing
    each record. No driver: print the one line and return 0.
    """
    out = out or sys.stdout
    if interval <= 0:
        print("--interval must be > 0", file=sys.stderr)
        return 2
    if once:
        mem = MemorySink()
        poller = NvmlPoller(mem, nvml=nvml, interval_s=interval)
        poller.poll_once()
        if not poller.available:
            print(poller.status(), file=out)
            return 0
        print(poller.status(), file=sys.stderr if as_json else out)
        _print_once(poller, mem, out, as_json)
        poller.stop()
        return 0

    from ingest.paths import default_db_path, spool_dir_for
    from probes.sink import SpoolSink

    target = Path(spool) if spool else spool_dir_for(Path(db) if db else default_db_path())
    sink = _PrintingSink(SpoolSink(target), out, as_json)
    poller = NvmlPoller(sink, nvml=nvml, interval_s=interval)
    line = poller.start()
    if not poller.available:
        print(line, file=out)
        return 0
    print(f"{line}; spool {target}", file=sys.stderr if as_json else out, flush=True)
    previous = None
    if threading.current_thread() is threading.main_thread():

        def _term(signum: int, frame: Any) -> None:
            raise KeyboardInterrupt

        previous = signal.signal(signal.SIGTERM, _term)
    try:
        deadline = None if duration is None else time.monotonic() + duration
        while deadline is None or time.monotonic() < deadline:
            time.sleep(0.2 if deadline is None else min(0.2, max(0.0, deadline - time.monotonic())))
    except KeyboardInterrupt:
        pass
    finally:
        poller.stop()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    print(
        f"nvml: {poller.polls} poll(s), {poller.records_emitted} record(s), "
        f"{poller.metrics_emitted} metric row(s) -> {target}",
        file=sys.stderr if as_json else out,
    )
    return 0
