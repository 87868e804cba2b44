"""A scripted stand-in for the ``pynvml`` module, for tests and demos without a GPU.

``FakeNvml(script)`` has the same function names as pynvml for everything
:class:`probes.nvml.NvmlPoller` calls, and hands out pynvml's own constants and
exception classes (anything it does not define is looked up on ``pynvml``, except
pynvml's functions: an unscripted function is simply missing, as on an old
library). Values are scripted per call, so they change from poll to poll:

.. code-block:: python

    FakeNvml({
        "driver": "550.54.15",
        "init_error": None,             # e.g. "LibraryNotFound": nvmlInit raises it
        "devices": [{
            "uuid": "GPU-...", "name": "NVIDIA H100 80GB HBM3",
            "pci_bus_id": "00000000:19:00.0",
            "supported_events": 0x20B,  # default: Xid | DBE | SBE | SBE storm
            "nvlink_links": 2,          # active links 0..n-1 (default 0)
            "unsupported": {"nvmlDeviceGetRemappedRows"},  # always NotSupported
            "values": {
                # function name -> value, list of per-call values (the last one
                # repeats), or callable(call_index, *args); key a tuple
                # (name, *args) to script one argument combination
                "nvmlDeviceGetCurrentClocksEventReasons": [0, 0, 0x40],
                ("nvmlDeviceGetTotalEccErrors", 1, 0): [0, 0, 2],
                "nvmlDeviceGetPowerUsage": [70000, "GpuIsLost"],
            },
        }],
        "events": [{"device": 0, "type": "xid", "data": 48}],
    })

A scripted value that is an NVML error (a ``pynvml.NVMLError_*`` class or
instance, or its name such as ``"NotSupported"``) is raised for that call. After
``GpuIsLost`` every call on that device raises ``GpuIsLost``, as NVML does.
``calls[(function name, device index)]`` counts every call (None for calls
without a device). Events go out through ``nvmlEventSetWait`` in order, only to
an event set where that device registered that type; :meth:`FakeNvml.push_event`
adds one at any time (thread-safe; a waiting ``nvmlEventSetWait`` wakes up).
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pynvml

__all__ = ["FakeNvml", "FakeHandle", "FakeEventData", "nvml_error"]

_XID = getattr(pynvml, "nvmlEventTypeXidCriticalError", 0x8)
_DBE = getattr(pynvml, "nvmlEventTypeDoubleBitEccError", 0x2)
_SBE = getattr(pynvml, "nvmlEventTypeSingleBitEccError", 0x1)
_SBE_STORM = getattr(pynvml, "nvmlEventTypeSingleBitEccErrorStorm", 0x200)
_EVENT_NAMES = {"xid": _XID, "dbe": _DBE, "sbe": _SBE, "sbe_storm": _SBE_STORM}
_DEFAULT_EVENTS = _XID | _DBE | _SBE | _SBE_STORM
_IDLE = getattr(pynvml, "nvmlClocksThrottleReasonGpuIdle", 0x1)
_GIB = 1 << 30


def nvml_error(spec: Any) -> BaseException | None:
    """The pynvml exception a scripted value stands for, or None."""
    if isinstance(spec, pynvml.NVMLError):
        return spec
    if isinstance(spec, type) and issubclass(spec, pynvml.NVMLError):
        return spec()
    if isinstance(spec, str):
        cls = getattr(pynvml, spec if spec.startswith("NVMLError_") else f"NVMLError_{spec}", None)
        if isinstance(cls, type) and issubclass(cls, pynvml.NVMLError):
            return cls()
    return None


@dataclass(frozen=True, eq=False)
class FakeHandle:
    index: int


@dataclass
class FakeEventData:
    """Same fields as ``pynvml.c_nvmlEventData_t``."""

    device: FakeHandle
    eventType: int
    eventData: int
    gpuInstanceId: int = pynvml.NVML_GPU_INSTANCE_ID_ANY
    computeInstanceId: int = pynvml.NVML_COMPUTE_INSTANCE_ID_ANY


def _defaults(index: int) -> dict[Any, Any]:
    return {
        "nvmlDeviceGetMemoryInfo": {"total": 80 * _GIB, "used": 2 * _GIB},
        "nvmlDeviceGetUtilizationRates": {"gpu": 0, "memory": 0},
        "nvmlDeviceGetTemperatureV": 35,
        "nvmlDeviceGetTemperature": 35,
        "nvmlDeviceGetPowerUsage": 70_000,
        "nvmlDeviceGetCurrentClocksEventReasons": _IDLE,
        "nvmlDeviceGetCurrentClocksThrottleReasons": _IDLE,
        "nvmlDeviceGetTotalEccErrors": 0,
        "nvmlDeviceGetRetiredPages": [],
        "nvmlDeviceGetRetiredPagesPendingStatus": 0,
        "nvmlDeviceGetRemappedRows": (0, 0, 0, 0),
        "nvmlDeviceGetPcieReplayCounter": 0,
        "nvmlDeviceGetNvLinkErrorCounter": 0,
    }


class _Device:
    def __init__(self, index: int, spec: dict[str, Any]) -> None:
        self.index = index
        self.handle = FakeHandle(index)
        self.uuid = spec.get("uuid", f"GPU-00000000-0000-0000-0000-{index:012d}")
        self.name = spec.get("name", "NVIDIA H100 80GB HBM3")
        self.pci_bus_id = spec.get("pci_bus_id", f"00000000:{0x19 + index:02X}:00.0")
        self.supported_events = int(spec.get("supported_events", _DEFAULT_EVENTS))
        self.nvlink_links = int(spec.get("nvlink_links", 0))
        self.unsupported = set(spec.get("unsupported", ()))
        self.handle_error = spec.get("handle_error")
        self.values = _defaults(index)
        self.values.update(spec.get("values", {}))
        self.lost = False


class FakeNvml:
    """Scripted NVML; see the module docstring for the script format."""

    def __init__(self, script: dict[str, Any] | None = None) -> None:
        script = dict(script or {})
        self.script = script
        specs = script.get("devices")
        if specs is None:
            specs = [{}]
        self._devices = [_Device(i, s) for i, s in enumerate(specs)]
        self._driver = script.get("driver", "550.54.15")
        self._init_error = script.get("init_error")
        self.calls: Counter[tuple[str, int | None]] = Counter()
        self._per_args: Counter[tuple[Any, ...]] = Counter()
        self._events: deque[FakeEventData] = deque()
        self._cond = threading.Condition()
        self._sets: dict[int, dict[int, int]] = {}  # event set id -> {device index: mask}
        self._next_set = 0
        self.initialized = 0
        for ev in script.get("events", ()):
            self.push_event(**ev)

    # pynvml's constants and exception classes; its functions stay missing
    def __getattr__(self, name: str) -> Any:
        value = getattr(pynvml, name)
        if name.startswith("nvml") and callable(value) and not isinstance(value, type):
            raise AttributeError(f"FakeNvml does not script {name}")
        return value

    # ------------------------------------------------------------- scripting
    def push_event(
        self,
        device: int = 0,
        type: str | int = "xid",
        data: int = 0,
        gpu_instance: int = pynvml.NVML_GPU_INSTANCE_ID_ANY,
        compute_instance: int = pynvml.NVML_COMPUTE_INSTANCE_ID_ANY,
    ) -> None:
        etype = _EVENT_NAMES[type] if isinstance(type, str) else int(type)
        handle = self._devices[device].handle
        ev = FakeEventData(handle, etype, data, gpu_instance, compute_instance)
        with self._cond:
            self._events.append(ev)
            self._cond.notify_all()

    def set_value(self, device: int, key: Any, value: Any) -> None:
        """Script one reading from now on (thread-safe enough for a poller that
        reads between steps): ``key`` is a function name or ``(name, *args)``;
        a list value restarts its per-call sequence."""
        dev = self._devices[device]
        dev.values[key] = value
        name = key[0] if isinstance(key, tuple) else key
        for k in [k for k in self._per_args if k[0] == name and k[1] == device]:
            del self._per_args[k]

    def device_calls(self, index: int) -> int:
        """How many device calls were made on device ``index``."""
        return sum(n for (_, d), n in self.calls.items() if d == index)

    # ------------------------------------------------------------- internals
    def _check_init(self) -> None:
        if self.initialized <= 0:
            raise pynvml.NVMLError_Uninitialized()

    def _dev(self, name: str, handle: Any) -> _Device:
        self._check_init()
        if not isinstance(handle, FakeHandle) or not 0 <= handle.index < len(self._devices):
            self.calls[(name, None)] += 1
            raise pynvml.NVMLError_InvalidArgument()
        dev = self._devices[handle.index]
        self.calls[(name, dev.index)] += 1
        if dev.lost:
            raise pynvml.NVMLError_GpuIsLost()
        if name in dev.unsupported:
            raise pynvml.NVMLError_NotSupported()
        return dev

    def _value(self, name: str, handle: Any, *args: Any) -> Any:
        dev = self._dev(name, handle)
        spec = dev.values.get((name, *args), dev.values.get(name)) if args else None
        if spec is None:
            spec = dev.values.get(name)
        idx_key = (name, dev.index, *args)
        call = self._per_args[idx_key]
        self._per_args[idx_key] += 1
        # a list is per-call values, except retired pages (itself a list):
        # there, a list of lists is per-call
        per_call = isinstance(spec, list) and (
            name != "nvmlDeviceGetRetiredPages" or bool(spec) and isinstance(spec[0], list)
        )
        if per_call:
            value = spec[min(call, len(spec) - 1)]
        elif callable(spec) and not isinstance(spec, type):
            value = spec(call, *args)
        else:
            value = spec
        err = nvml_error(value)
        if err is not None:
            if isinstance(err, pynvml.NVMLError_GpuIsLost):
                dev.lost = True
            raise err
        return value

    # ------------------------------------------------------------- init, system
    def nvmlInit(self) -> None:
        self.calls[("nvmlInit", None)] += 1
        err = nvml_error(self._init_error) if self._init_error is not None else None
        if err is not None:
            raise err
        self.initialized += 1

    def nvmlShutdown(self) -> None:
        self.calls[("nvmlShutdown", None)] += 1
        self._check_init()
        self.initialized -= 1

    def nvmlSystemGetDriverVersion(self) -> str:
        self._check_init()
        return self._driver

    def nvmlDeviceGetCount(self) -> int:
        self._check_init()
        self.calls[("nvmlDeviceGetCount", None)] += 1
        return len(self._devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeHandle:
        self._check_init()
        if not 0 <= index < len(self._devices):
            raise pynvml.NVMLError_InvalidArgument()
        dev = self._devices[index]
        self.calls[("nvmlDeviceGetHandleByIndex", index)] += 1
        err = nvml_error(dev.handle_error) if dev.handle_error is not None else None
        if err is not None:
            if isinstance(err, pynvml.NVMLError_GpuIsLost):
                dev.lost = True
            raise err
        return dev.handle

    # ------------------------------------------------------------- identity
    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        return self._dev("nvmlDeviceGetUUID", handle).uuid

    def nvmlDeviceGetName(self, handle: Any) -> str:
        return self._dev("nvmlDeviceGetName", handle).name

    def nvmlDeviceGetIndex(self, handle: Any) -> int:
        return self._dev("nvmlDeviceGetIndex", handle).index

    def nvmlDeviceGetPciInfo(self, handle: Any) -> Any:
        dev = self._dev("nvmlDeviceGetPciInfo", handle)
        return SimpleNamespace(busId=dev.pci_bus_id.encode())

    # ------------------------------------------------------------- events
    def nvmlEventSetCreate(self) -> int:
        self._check_init()
        self.calls[("nvmlEventSetCreate", None)] += 1
        with self._cond:
            self._next_set += 1
            self._sets[self._next_set] = {}
            return self._next_set

    def nvmlEventSetFree(self, event_set: int) -> None:
        self._check_init()
        self.calls[("nvmlEventSetFree", None)] += 1
        with self._cond:
            if self._sets.pop(event_set, None) is None:
                raise pynvml.NVMLError_InvalidArgument()

    def nvmlDeviceGetSupportedEventTypes(self, handle: Any) -> int:
        return self._dev("nvmlDeviceGetSupportedEventTypes", handle).supported_events

    def nvmlDeviceRegisterEvents(self, handle: Any, event_types: int, event_set: int) -> None:
        dev = self._dev("nvmlDeviceRegisterEvents", handle)
        if event_types & ~dev.supported_events:
            raise pynvml.NVMLError_NotSupported()
        with self._cond:
            if event_set not in self._sets:
                raise pynvml.NVMLError_InvalidArgument()
            regs = self._sets[event_set]
            regs[dev.index] = regs.get(dev.index, 0) | int(event_types)

    def nvmlEventSetWait(self, event_set: int, timeoutms: int) -> FakeEventData:
        self._check_init()
        self.calls[("nvmlEventSetWait", None)] += 1

        def match() -> FakeEventData | None:
            regs = self._sets.get(event_set)
            if regs is None:
                raise pynvml.NVMLError_InvalidArgument()
            for ev in self._events:
                if regs.get(ev.device.index, 0) & ev.eventType:
                    return ev
            return None

        with self._cond:
            ev = match()
            if ev is None and timeoutms > 0:
                self._cond.wait_for(lambda: match() is not None, timeout=timeoutms / 1000)
                ev = match()
            if ev is not None:
                self._events.remove(ev)
        if ev is None:
            raise pynvml.NVMLError_Timeout()
        return ev

    # ------------------------------------------------------------- readings
    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: Any = None) -> Any:
        v = self._value("nvmlDeviceGetMemoryInfo", handle)
        total, used = (v["total"], v["used"]) if isinstance(v, dict) else v
        return SimpleNamespace(total=total, used=used, free=total - used)

    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any:
        v = self._value("nvmlDeviceGetUtilizationRates", handle)
        gpu, memory = (v["gpu"], v["memory"]) if isinstance(v, dict) else v
        return SimpleNamespace(gpu=gpu, memory=memory)

    def nvmlDeviceGetTemperatureV(self, handle: Any, sensor: int, version: Any = None) -> int:
        return self._value("nvmlDeviceGetTemperatureV", handle, sensor)

    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int:
        return self._value("nvmlDeviceGetTemperature", handle, sensor)

    def nvmlDeviceGetPowerUsage(self, handle: Any) -> int:
        return self._value("nvmlDeviceGetPowerUsage", handle)

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: Any) -> int:
        return self._value("nvmlDeviceGetCurrentClocksEventReasons", handle)

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: Any) -> int:
        return self._value("nvmlDeviceGetCurrentClocksThrottleReasons", handle)

    def nvmlDeviceGetTotalEccErrors(self, handle: Any, errorType: int, counterType: int) -> int:
        return self._value("nvmlDeviceGetTotalEccErrors", handle, errorType, counterType)

    def nvmlDeviceGetRetiredPages(self, handle: Any, sourceFilter: int) -> list[int]:
        return list(self._value("nvmlDeviceGetRetiredPages", handle, sourceFilter))

    def nvmlDeviceGetRetiredPagesPendingStatus(self, handle: Any) -> int:
        return self._value("nvmlDeviceGetRetiredPagesPendingStatus", handle)

    def nvmlDeviceGetRemappedRows(self, handle: Any) -> tuple[int, int, int, int]:
        return tuple(self._value("nvmlDeviceGetRemappedRows", handle))  # type: ignore[return-value]

    def nvmlDeviceGetPcieReplayCounter(self, handle: Any) -> int:
        return self._value("nvmlDeviceGetPcieReplayCounter", handle)

    def nvmlDeviceGetNvLinkState(self, handle: Any, link: int) -> int:
        dev = self._dev("nvmlDeviceGetNvLinkState", handle)
        if not 0 <= link < pynvml.NVML_NVLINK_MAX_LINKS:
            raise pynvml.NVMLError_InvalidArgument()
        if dev.nvlink_links == 0:
            raise pynvml.NVMLError_NotSupported()
        if link >= dev.nvlink_links:
            raise pynvml.NVMLError_InvalidArgument()
        return pynvml.NVML_FEATURE_ENABLED

    def nvmlDeviceGetNvLinkErrorCounter(self, handle: Any, link: int, counter: int) -> int:
        return self._value("nvmlDeviceGetNvLinkErrorCounter", handle, link, counter)
