"""Section a of scripts/gpu_check.py: the environment and the device's ceilings.

What it decides: which machine the later figures come from (GPU, clocks, driver, torch,
CUDA), and the ceilings they are judged against, measured rather than taken from a
datasheet: a large device-to-device copy's bandwidth (bytes read plus written), a large
bf16 matmul's rate (random data: zeros run faster), and the cost of an empty kernel
launched eagerly (the host's queueing cost) and as a node of a CUDA graph (the device's
per-kernel floor). Also the C++ core's build, timed, into the folder the run was given.

On the CPU stand-in each ceiling runs at a toy size (the figures mean nothing there) and
the graph node says ``needs CUDA``.
"""

from __future__ import annotations

import os
import platform
import subprocess
import time
from collections.abc import Callable

import torch
from gpu_check_report import NEEDS_CUDA, SKIPPED, Budget

# Sizes: on a GPU, well past the 60 MB L2 and long enough that launch costs vanish.
COPY_BYTES = {"cuda": 2 << 30, "cpu": 16 << 20}
MATMUL_N = {"cuda": 8192, "cpu": 128}
LAUNCHES = {"cuda": 2000, "cpu": 200}  # empty kernels per timing
SMI_FIELDS = ("name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.draw,"
              "power.limit,temperature.gpu,utilization.gpu")


def versions() -> dict:
    """Python, torch, CUDA (torch's build), the platform."""
    return {"python": platform.python_version(), "torch": torch.__version__,
            "cuda_build": torch.version.cuda, "platform": platform.platform(),
            "machine": platform.machine(), "cpus": os.cpu_count()}


def gpu_info(device: torch.device) -> dict:
    """The GPU as torch sees it, and nvidia-smi's clocks, power and temperature (read, never
    set: the card's settings are left as found)."""
    props = torch.cuda.get_device_properties(device)
    info: dict = {"name": props.name, "capability": f"{props.major}.{props.minor}",
                  "sms": props.multi_processor_count,
                  "memory_gib": round(props.total_memory / 2**30, 1)}
    try:
        proc = subprocess.run(["nvidia-smi", f"--query-gpu={SMI_FIELDS}",
                               "--format=csv,noheader"], capture_output=True, text=True,
                              timeout=20)
        values = proc.stdout.strip().splitlines()[0].split(", ") if proc.stdout else []
        info["nvidia_smi"] = dict(zip(SMI_FIELDS.split(","), values, strict=False))
    except (OSError, subprocess.SubprocessError, IndexError) as e:
        info["nvidia_smi"] = f"unavailable: {e}"
    return info


def _timed(fn: Callable[[], None], device: torch.device, repeats: int) -> float:
    """Median seconds of ``fn`` over ``repeats`` runs (CUDA events on a GPU), after two
    warm-up runs."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def copy_bandwidth(device: torch.device) -> dict:
    """A large float32 copy: (bytes read + bytes written) / seconds."""
    n = COPY_BYTES[device.type] // 4
    src = torch.rand(n, device=device)
    dst = torch.empty_like(src)
    seconds = _timed(lambda: dst.copy_(src), device, 10)
    return {"bytes": 2 * n * 4, "seconds": seconds, "tb_per_s": 2 * n * 4 / seconds / 1e12}


def matmul_rate(device: torch.device) -> dict:
    """An n x n x n bf16 matmul on random data: 2 n^3 / seconds."""
    n = MATMUL_N[device.type]
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    seconds = _timed(lambda: torch.mm(a, b), device, 10)
    return {"n": n, "seconds": seconds, "tflop_per_s": 2 * n**3 / seconds / 1e12}


def empty_kernel_eager(device: torch.device) -> dict:
    """The host's cost of queueing one tiny kernel (a one-element add, PyTorch's dispatch
    plus the launch), from the wall time of many in a row."""
    n = LAUNCHES[device.type]
    x = torch.zeros(1, device=device)
    for _ in range(50):
        x.add_(1)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        x.add_(1)
    sync()
    return {"launches": n, "us_per_launch": (time.perf_counter() - t0) / n * 1e6}


def empty_kernel_graphed(device: torch.device) -> dict:
    """The device's cost of one tiny kernel as a graph node: a graph of many, replayed,
    timed with CUDA events, per node."""
    n = LAUNCHES["cuda"]
    x = torch.zeros(1, device=device)
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(3):
            x.add_(1)
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(n):
            x.add_(1)
    seconds = _timed(graph.replay, device, 5)
    return {"nodes": n, "us_per_node": seconds / n * 1e6}


def core_build() -> dict:
    """The C++ core built (or loaded) into $TORCH_EXTENSIONS_DIR, timed."""
    from fbtrain.models.core import native

    t0 = time.perf_counter()
    try:
        native.native_ops()
        ok, error = True, None
    except native.CoreBuildError as e:
        ok, error = False, str(e)
    return {"ok": ok, "error": error, "seconds": time.perf_counter() - t0,
            "folder": os.environ.get("TORCH_EXTENSIONS_DIR")}


def run(data: dict, device: torch.device, budget: Budget) -> tuple[str, str]:
    """Fill section a's ``data``; its status and one-line summary."""
    data["versions"] = versions()
    cuda = device.type == "cuda"
    data["gpu"] = gpu_info(device) if cuda else NEEDS_CUDA
    units: list[tuple[str, Callable[[], dict], float]] = [
        ("core_build", core_build, 5.0),
        ("copy", lambda: copy_bandwidth(device), 5.0),
        ("bf16_matmul", lambda: matmul_rate(device), 5.0),
        ("empty_kernel_eager", lambda: empty_kernel_eager(device), 2.0),
    ]
    if cuda:
        units.append(("empty_kernel_graph_node", lambda: empty_kernel_graphed(device), 2.0))
    else:
        data["empty_kernel_graph_node"] = NEEDS_CUDA
    for name, fn, need in units:
        if not budget.allows(need):
            data[name] = SKIPPED
            continue
        try:
            data[name] = fn()
        except Exception as e:  # one failed measurement is reported; the rest still run
            data[name] = {"error": f"{type(e).__name__}: {e}"}
        if cuda:
            torch.cuda.empty_cache()
    # A unit the budget left undone is SKIPPED (a string), not a failure; a build that
    # failed or raised is.
    build = data["core_build"]
    failed = isinstance(build, dict) and not build.get("ok", False)
    return ("FAIL" if failed else "ok"), _summary(data)


def _summary(data: dict) -> str:
    def pick(key: str, field: str, fmt: str) -> str:
        value = data.get(key)
        return format(value[field], fmt) if isinstance(value, dict) and field in value else "-"

    gpu = data["gpu"]["name"] if isinstance(data["gpu"], dict) else "CPU"
    v = data["versions"]
    return (f"{gpu}, torch {v['torch']}; copy "
            f"{pick('copy', 'tb_per_s', '.2f')} TB/s, bf16 mm "
            f"{pick('bf16_matmul', 'tflop_per_s', '.0f')} TFLOP/s, launch "
            f"{pick('empty_kernel_eager', 'us_per_launch', '.1f')} us eager / "
            f"{pick('empty_kernel_graph_node', 'us_per_node', '.2f')} us graph node; "
            f"C++ core {pick('core_build', 'seconds', '.0f')} s")
