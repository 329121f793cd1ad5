"""What the GPU's clocks and power did while a benchmark ran. Owns the NVML reads behind
``mlora bench batch``'s machine record.

Why: a GPU at its power limit lowers its clocks, by an amount that depends on the chip, so
the same code and job run slower on one H200 than on another; a timing without the clocks
behind it cannot say whether two machines or two versions of the code differ.

NVML's Python bindings (``pynvml``, from the ``nvidia-ml-py`` package) are the optional extra
``mlora[gpu]``: read on CUDA devices only, where a missing extra is an ImportError naming it.
Off CUDA the functions return None and record no samples; when NVML refuses a query (old
driver, MIG slice) they return None or keep the samples read so far, so a benchmark never
fails on the record of its clocks.
"""

from __future__ import annotations

import bisect
import statistics
import threading
import time

import torch

#: NVML's clocks-event reason bits (``nvmlClocksEventReasons``) that mean a power limit.
POWER_CAP_BITS = 0x4 | 0x80  # software power cap, hardware power brake
INSTALL_HINT = "pip install 'mlora[gpu]'"


def _nvml():
    """The ``pynvml`` module, or ImportError naming the extra that provides it."""
    try:
        import pynvml  # the optional extra mlora[gpu]: only CUDA devices read it
    except ImportError as exc:
        raise ImportError(f"reading the GPU's clocks needs NVML's Python bindings (nvidia-ml-py): {INSTALL_HINT}"
                          ) from exc
    return pynvml


def _handle(pynvml, dev: torch.device):
    """NVML's handle of CUDA device ``dev``, found by UUID: NVML numbers every GPU of the host,
    CUDA only the visible ones."""
    uuid = str(torch.cuda.get_device_properties(dev).uuid)
    return pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")


def gpu_clocks(dev: torch.device) -> dict | None:
    """The GPU's state now, or None (module docstring): SM and memory clocks and their maxima
    (MHz), the enforced power limit and the draw (W), and NVML's bit mask of the reasons the
    clocks are below their maxima (0: none; 1 = idle, 4 = software power cap, 32 / 64 =
    software / hardware thermal slowdown)."""
    if dev.type != "cuda":
        return None
    pynvml = _nvml()
    try:
        pynvml.nvmlInit()
        try:
            h = _handle(pynvml, dev)
            sm, mem = pynvml.NVML_CLOCK_SM, pynvml.NVML_CLOCK_MEM
            return {"sm_mhz": pynvml.nvmlDeviceGetClockInfo(h, sm),
                    "sm_max_mhz": pynvml.nvmlDeviceGetMaxClockInfo(h, sm),
                    "mem_mhz": pynvml.nvmlDeviceGetClockInfo(h, mem),
                    "mem_max_mhz": pynvml.nvmlDeviceGetMaxClockInfo(h, mem),
                    "power_limit_w": pynvml.nvmlDeviceGetEnforcedPowerLimit(h) / 1e3,
                    "power_w": pynvml.nvmlDeviceGetPowerUsage(h) / 1e3,
                    "clock_reasons": int(pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(h))}
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 -- NVML refused a query (module docstring)
        return None


class ClockSampler:
    """A thread that reads the SM clock, the power draw and the clock-reason mask every
    ``period_s`` seconds between :meth:`start` and :meth:`stop`, each sample stamped with
    ``time.perf_counter()`` so that :meth:`summary` can keep the samples inside chosen time
    spans (e.g. a job's full-batch decode iterations). Off CUDA, or with NVML refusing, it
    records nothing; on CUDA without the ``mlora[gpu]`` extra :meth:`start` raises ImportError.
    Three NVML reads 20 times a second, on their own thread (ctypes releases the GIL during
    each), beside an engine whose chained decode graphs run ahead of the host."""

    def __init__(self, dev: torch.device, period_s: float = 0.05):
        self.dev, self.period_s = dev, period_s
        self.samples: list[tuple[float, int, float, int]] = []  # (t, sm_mhz, power_w, reasons)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pynvml = None

    def start(self) -> ClockSampler:
        if self.dev.type == "cuda":
            self._pynvml = _nvml()
            self._thread = threading.Thread(target=self._run, name="mlora-clock-sampler", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        pynvml = self._pynvml
        try:
            pynvml.nvmlInit()
        except Exception:  # noqa: BLE001 -- no NVML: no samples
            return
        try:
            h = _handle(pynvml, self.dev)
            while not self._stop.is_set():
                t = time.perf_counter()
                self.samples.append((t, pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM),
                                     pynvml.nvmlDeviceGetPowerUsage(h) / 1e3,
                                     int(pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(h))))
                self._stop.wait(self.period_s)
        except Exception:  # noqa: BLE001 -- a query NVML refuses: keep what was read
            pass
        finally:
            try:
                pynvml.nvmlShutdown()
            except Exception:  # noqa: BLE001
                pass

    def summary(self, spans: list[tuple[float, float]] | None = None) -> dict | None:
        """Over the samples inside ``spans`` (``(start, end)`` perf_counter pairs; None: all):
        their count, median and lowest SM clock (MHz), median power (W), and the share of
        samples whose reasons include a power limit (:data:`POWER_CAP_BITS`). None without
        samples there."""
        picked = self.samples if spans is None else _inside(self.samples, spans)
        if not picked:
            return None
        sm = [s[1] for s in picked]
        return {"samples": len(picked), "sm_mhz_median": statistics.median(sm), "sm_mhz_min": min(sm),
                "power_w_median": statistics.median(s[2] for s in picked),
                "power_capped_share": sum(1 for s in picked if s[3] & POWER_CAP_BITS) / len(picked)}


def _inside(samples: list[tuple], spans: list[tuple[float, float]]) -> list[tuple]:
    """The samples whose time lies in one of ``spans`` (any order; they may touch)."""
    spans = sorted(spans)
    starts = [a for a, _ in spans]
    out = []
    for s in samples:
        i = bisect.bisect_right(starts, s[0]) - 1
        if i >= 0 and s[0] <= spans[i][1]:
            out.append(s)
    return out
