"""GPU clock records of the benchmarks (mlora.bench.gpuclocks), on the CPU: NVML is a fake
module, or missing."""

import sys
import types

import pytest
import torch

from mlora.bench import gpuclocks
from mlora.bench.gpuclocks import ClockSampler


def test_gpu_clocks_reads_nvml_by_the_gpus_uuid_and_never_fails(monkeypatch):
    """``gpu_clocks`` asks NVML for the CUDA device's own GPU (by UUID, "GPU-" prefixed as NVML
    names them), converts milliwatts to watts, shuts NVML down; any NVML error gives None."""
    calls = []
    fake = types.SimpleNamespace(
        NVML_CLOCK_SM=1, NVML_CLOCK_MEM=2,
        nvmlInit=lambda: calls.append("init"), nvmlShutdown=lambda: calls.append("shutdown"),
        nvmlDeviceGetHandleByUUID=lambda u: calls.append(u) or "h",
        nvmlDeviceGetClockInfo=lambda h, c: {1: 1755, 2: 3201}[c],
        nvmlDeviceGetMaxClockInfo=lambda h, c: {1: 1980, 2: 3201}[c],
        nvmlDeviceGetEnforcedPowerLimit=lambda h: 700_000, nvmlDeviceGetPowerUsage=lambda h: 412_500,
        nvmlDeviceGetCurrentClocksThrottleReasons=lambda h: 4)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace(uuid="c8ae4ab5-94ab"))
    got = gpuclocks.gpu_clocks(torch.device("cuda", 0))
    assert got == {"sm_mhz": 1755, "sm_max_mhz": 1980, "mem_mhz": 3201, "mem_max_mhz": 3201,
                   "power_limit_w": 700.0, "power_w": 412.5, "clock_reasons": 4}
    assert calls == ["init", "GPU-c8ae4ab5-94ab", "shutdown"]

    def broken(h, c):
        raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")

    fake.nvmlDeviceGetClockInfo = broken
    assert gpuclocks.gpu_clocks(torch.device("cuda", 0)) is None and calls[-1] == "shutdown"
    assert gpuclocks.gpu_clocks(torch.device("cpu")) is None


def test_clock_samples_are_summarised_inside_the_given_spans_only():
    """``ClockSampler.summary`` keeps the samples inside the spans (a span's ends included), takes
    medians and minimum over them, counts power-cap reasons (software cap 4, hardware brake 128,
    not thermal 32), and gives None where no sample falls."""
    s = ClockSampler(torch.device("cpu"))
    s.samples = [(0.5, 1980, 300.0, 0), (1.0, 1890, 690.0, 4), (1.5, 1800, 699.0, 4 | 32), (2.2, 1700, 650.0, 32),
                 (3.0, 1600, 700.0, 128), (9.0, 345, 80.0, 1)]
    got = s.summary([(2.9, 3.5), (1.0, 2.0)])  # out of order: the sampler sorts them
    assert got == {"samples": 3, "sm_mhz_median": 1800, "sm_mhz_min": 1600, "power_w_median": 699.0,
                   "power_capped_share": 1.0}
    assert s.summary([(4.0, 8.0)]) is None
    assert s.summary()["samples"] == 6 and s.summary()["power_capped_share"] == 0.5
    assert s.start() is s and s.samples and (s.stop() is None)  # on the CPU: no thread, samples untouched


def test_a_cuda_device_without_the_gpu_extra_is_an_error_naming_it(monkeypatch):
    """NVML's bindings are the optional extra mlora[gpu]: on CUDA, missing, they are an
    ImportError that says what to install; off CUDA they are never imported."""
    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` now raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'mlora\[gpu\]'"):
        gpuclocks.gpu_clocks(torch.device("cuda", 0))
    with pytest.raises(ImportError, match=r"mlora\[gpu\]"):
        ClockSampler(torch.device("cuda", 0)).start()
    assert gpuclocks.gpu_clocks(torch.device("cpu")) is None
    sampler = ClockSampler(torch.device("cpu")).start()
    sampler.stop()
    assert sampler.samples == [] and sampler.summary() is None
