"""Fake CUDA: fbtrain's GPU path run on a CPU-only torch, computing nothing.

Import this module before torch. It loads the no-op CUDA plumbing (guard.cpp; not needed
with a CUDA build of torch), and gives:

- :func:`fake_cuda`: torch.cuda's Python calls answered as one H200 would, inside a
  FakeTensorMode. Tensors on device ``cuda`` then dispatch every op as on a GPU (shapes,
  dtypes, devices, autocast's CUDA kernels), a tensor on the wrong device raises, and
  nothing is computed.
- :class:`HostSyncs`: a dispatch mode that records every read a GPU would make the host
  wait for (``.item()``, ``.tolist()``, ``bool(t)``, a copy to the host, a blocking copy to
  the device) with the fbtrain file and line that asked, and answers it with a dummy value
  so the run goes on; it also records the dtype and matmul precision of each matmul,
  softmax, LayerNorm and loss.
- :func:`seams`: the trainer's :class:`fbtrain.train.setup.Seams` for fake CUDA: data read
  for real on the CPU, a model initialised for real and copied to fake CUDA,
  checkpoint payloads checked (every tensor of the training state on the device) instead
  of written.

What fake CUDA cannot tell: CUDA-graph capture, kernels' numerics, speed, NCCL.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import sys
import traceback
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import build  # noqa: E402

if "torch" not in sys.modules and not build.cuda_build():
    ctypes.CDLL(str(build.build()), mode=ctypes.RTLD_GLOBAL)
elif "torch" in sys.modules and not build.cuda_build():
    raise ImportError("import scripts/fakecuda/harness.py before torch: the CUDA plumbing "
                      "must be loaded first")

import torch  # noqa: E402
import torch.cuda  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode  # noqa: E402
from torch._subclasses.fake_tensor import unset_fake_temporarily as real_tensors  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

aten = torch.ops.aten
DEVICE = torch.device("cuda", 0)
H200_MEMORY = 141 * 2**30  # bytes, as torch.cuda reports an H200's total memory


class FakeCudaMode(FakeTensorMode):
    """FakeTensorMode that never tries a real CUDA device, even while torch.cuda says one
    is there (its constant propagation asks torch.cuda.is_available)."""

    @property
    def avoid_device_init(self) -> bool:
        return True


@contextlib.contextmanager
def fake_cuda() -> Iterator[FakeCudaMode]:
    """Within: a fake-tensor mode, and torch.cuda's calls answered as one H200 would."""
    props = type("Properties", (), {"total_memory": H200_MEMORY, "name": "fake H200",
                                    "major": 9, "minor": 0})()
    answers = {
        "is_available": lambda: True, "device_count": lambda: 1,
        "is_bf16_supported": lambda including_emulation=True: True,
        "current_device": lambda: 0, "get_device_name": lambda device=None: props.name,
        "get_device_properties": lambda device=None: props,
        "get_device_capability": lambda device=None: (9, 0),
        "device": lambda device=None: contextlib.nullcontext(),
        "max_memory_allocated": lambda device=None: 0,
        "reset_peak_memory_stats": lambda device=None: None,
        "memory_allocated": lambda device=None: 0,
        "mem_get_info": lambda device=None: (H200_MEMORY, H200_MEMORY),
        "get_rng_state": lambda device="cuda": torch.zeros(16, dtype=torch.uint8),
        "get_rng_state_all": lambda: [torch.zeros(16, dtype=torch.uint8)],
        "set_rng_state": lambda state, device="cuda": None,
        "set_rng_state_all": lambda states: None,
        "manual_seed": lambda seed: None, "manual_seed_all": lambda seed: None,
        "synchronize": lambda device=None: None, "empty_cache": lambda: None,
    }
    saved = {name: getattr(torch.cuda, name) for name in answers}
    mode = FakeCudaMode(allow_non_fake_inputs=True)
    try:
        for name, answer in answers.items():
            setattr(torch.cuda, name, answer)
        with mode:
            yield mode
    finally:
        for name, value in saved.items():
            setattr(torch.cuda, name, value)


# ----------------------------------------------------------------------------- host syncs

WATCHED = {  # ops whose dtype flow is recorded: matmuls, softmax, LayerNorm, the loss
    aten.mm.default: "matmul", aten.addmm.default: "matmul", aten.bmm.default: "matmul",
    aten.baddbmm.default: "matmul", aten.mm.out: "matmul", aten.addmm.out: "matmul",
    aten.bmm.out: "matmul", aten.baddbmm.out: "matmul", aten._addmm_activation.out: "matmul",
    aten._addmm_activation.default: "matmul", aten.addmm_.default: "matmul",
    aten.baddbmm_.default: "matmul",
    aten._softmax.default: "softmax", aten._softmax.out: "softmax",
    aten._log_softmax.default: "softmax",
    aten.native_layer_norm.default: "layer_norm",
    aten.nll_loss_forward.default: "loss", aten.nll_loss2d_forward.default: "loss",
    # Under inference_mode composite ops reach the modes whole:
    aten.linear.default: "matmul", aten.matmul.default: "matmul",
    aten.softmax.int: "softmax", aten.log_softmax.int: "softmax",
    aten.layer_norm.default: "layer_norm", aten.cross_entropy_loss.default: "loss",
}
HARNESS_FILES = (str(Path(__file__).resolve().parent), "/torch/", "contextlib", "<frozen")


def caller() -> str:
    """``fbtrain/<path>:<line>`` of the innermost fbtrain frame on the stack, else the
    innermost frame outside torch and this harness."""
    frames = traceback.extract_stack()
    for frame in reversed(frames):
        if "/fbtrain/" in frame.filename and "/scripts/" not in frame.filename:
            return "fbtrain/" + frame.filename.rsplit("/fbtrain/", 1)[1] + f":{frame.lineno}"
    for frame in reversed(frames):
        if not any(part in frame.filename for part in HARNESS_FILES):
            return f"{Path(frame.filename).name}:{frame.lineno}"
    return "?"


PHASES = (  # the first of these on the stack, from the innermost frame, names the phase
    ("fbtrain/sample.py", None, "sample"), ("fbtrain/evaluate.py", None, "eval"),
    ("fbtrain/scoring.py", None, "eval"), ("fbtrain/checkpoint/contents.py", None, "load"),
    ("fbtrain/checkpoint/", None, "save"),
    ("fbtrain/train/trainer.py", "_save", "save"), ("fbtrain/train/setup.py", None, "setup"),
    ("fbtrain/train/data.py", None, "setup"),
    ("fbtrain/train/step", None, "step"), ("fbtrain/train/", None, "trainer"),
)


def phase() -> str:
    """What the run was doing when it synced: setup, step, eval, sample, save, trainer (the
    loop and its reports) or other."""
    for frame in reversed(traceback.extract_stack()):
        for part, function, name in PHASES:
            if part in frame.filename and function in (None, frame.name):
                return name
    return "other"


def _on_cuda(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.device.type == "cuda"


@dataclasses.dataclass(frozen=True)
class Sync:
    phase: str  # see phase()
    kind: str  # item, tolist, to host, blocking to device
    where: str  # fbtrain/<path>:<line>


class HostSyncs(TorchDispatchMode):
    """Records each host sync of fake CUDA tensors (:class:`Sync`, counted) and the dtype
    flow of the watched ops; enter it inside :func:`fake_cuda`'s mode."""

    def __init__(self) -> None:
        super().__init__()
        self.syncs: Counter[Sync] = Counter()
        # (op family, input dtypes, CUDA's float32 matmul precision, fbtrain file:line)
        self.dtypes: Counter[tuple[str, tuple[str, ...], str, str]] = Counter()
        self._in_tolist = False

    def __enter__(self) -> HostSyncs:
        self._tolist = FakeTensor.tolist
        recorder = self

        def tolist(t: torch.Tensor) -> Any:  # one read, however many elements
            outer = recorder._in_tolist
            if _on_cuda(t) and not outer:
                recorder.syncs[Sync(phase(), "tolist", caller())] += 1
            recorder._in_tolist = True
            try:
                return recorder._tolist(t)
            finally:
                recorder._in_tolist = outer

        FakeTensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc: Any) -> Any:
        FakeTensor.tolist = self._tolist
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if func in (aten._local_scalar_dense.default, aten.item.default,
                    aten.is_nonzero.default):
            t = args[0]
            if _on_cuda(t) and not self._in_tolist:
                self.syncs[Sync(phase(), "item", caller())] += 1
            # Dummy answers: a check passes (True), a count or a loss is 1.
            if t.dtype == torch.bool or func is aten.is_nonzero.default:
                return True
            return 1.0 if t.is_floating_point() else 1
        if func in (aten.to.dtype_layout, aten.to.device) and isinstance(args[0], torch.Tensor):
            # Under inference_mode .to() reaches the modes undecomposed, and the fake mode
            # would run a constant host tensor's copy on the real (absent) CUDA backend.
            return self._to(func, args, kwargs)
        if func in (aten._to_copy.default, aten.copy_.default):
            src = args[1] if func is aten.copy_.default else args[0]
            dst = (args[0].device if func is aten.copy_.default
                   else torch.device(kwargs.get("device") or src.device))
            if _on_cuda(src) and dst.type == "cpu":
                if not self._in_tolist:
                    self.syncs[Sync(phase(), "to host", caller())] += 1
            elif isinstance(src, torch.Tensor) and src.device.type == "cpu" \
                    and dst.type == "cuda":
                non_blocking = (args[2] if func is aten.copy_.default and len(args) > 2
                                else kwargs.get("non_blocking", False))
                if not non_blocking:  # CUDA's blocking copy ends in a stream synchronize
                    self.syncs[Sync(phase(), "blocking to device", caller())] += 1
        # fbtrain's own ops (the C++ core) reach the mode whole under inference_mode.
        family = "core" if func.namespace == "fbtrain" else WATCHED.get(func)
        if family is not None:
            dtypes = tuple(str(a.dtype).removeprefix("torch.") for a in args
                           if isinstance(a, torch.Tensor))
            precision = torch.backends.cuda.matmul.fp32_precision
            self.dtypes[(family, dtypes, precision, caller())] += 1
        return func(*args, **kwargs)


    def _to(self, func, args, kwargs):  # noqa: ANN001, ANN202
        t = args[0]
        if func is aten.to.device:
            kwargs = dict(kwargs, device=args[1], dtype=args[2])
        device = torch.device(kwargs.get("device") or t.device)
        dtype = kwargs.get("dtype") or t.dtype
        if device.type == "cuda" and device.index is None:
            device = DEVICE
        if device == t.device and dtype == t.dtype and not kwargs.get("copy"):
            return t
        copy_kwargs = {"device": device, "dtype": dtype,
                       "non_blocking": kwargs.get("non_blocking", False)}
        return self.__torch_dispatch__(aten._to_copy.default, (), (t,), copy_kwargs)


# ----------------------------------------------------------------------------- the trainer


def to_fake_cuda(model: torch.nn.Module, mode: FakeCudaMode) -> torch.nn.Module:
    """``model`` (real, on the CPU) with every parameter and buffer replaced by a fake CUDA
    copy registered with ``mode``. (Module.to would make copies that autograd's engine
    cannot take through a backward on a CPU-only build.)"""
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, t in list(table.items()):
                if t is None:
                    continue
                with mode:
                    fake = mode.from_tensor(t.detach()).to(DEVICE)
                table[name] = (torch.nn.Parameter(fake, requires_grad=t.requires_grad)
                               if isinstance(t, torch.nn.Parameter) else fake)
    return model


@dataclasses.dataclass
class Checkpoints:
    """What the fake trainer would have written: each payload's step, and the training
    state's tensors that are not on the device (parameters, gradients' moments)."""

    steps: list[int] = dataclasses.field(default_factory=list)
    off_device: list[str] = dataclasses.field(default_factory=list)

    def write(self, path: Path, payload: dict[str, Any]) -> None:
        self.steps.append(payload["progress"]["step"])
        for part in ("model", "optimizer"):
            for name, t in _tensors(payload[part], part):
                if t.device != DEVICE and not (part == "optimizer" and t.dim() == 0):
                    self.off_device.append(f"{name} on {t.device}")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"fake CUDA: not a checkpoint")  # what keep-last-N and copies read


def _tensors(tree: Any, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(tree, torch.Tensor):
        yield prefix, tree
    elif isinstance(tree, dict):
        for key, value in tree.items():
            yield from _tensors(value, f"{prefix}.{key}")
    elif isinstance(tree, (list, tuple)):
        for i, value in enumerate(tree):
            yield from _tensors(value, f"{prefix}[{i}]")


@contextlib.contextmanager
def for_real(module: Any, name: str) -> Iterator[None]:
    """Within: ``module.name`` (a function) runs on real tensors, fake mode or not."""
    function = getattr(module, name)

    def real(*args: Any, **kwargs: Any) -> Any:
        with real_tensors():
            return function(*args, **kwargs)

    setattr(module, name, real)
    try:
        yield
    finally:
        setattr(module, name, function)


def seams(mode: FakeCudaMode, checkpoints: Checkpoints) -> Any:
    """The trainer's Seams for fake CUDA (see the module's docstring)."""
    from fbtrain.train import data as train_data
    from fbtrain.train import setup

    def load_data(cfg, ctx, vocab, source):  # noqa: ANN001, ANN202
        with real_tensors():  # the text is read and tokenized for real, on the CPU
            data = train_data.load_data(
                cfg, dataclasses.replace(ctx, device=torch.device("cpu")), vocab, source)
        with mode:
            val_x, val_y, token_chars = (
                None if t is None else mode.from_tensor(t).to(ctx.device, non_blocking=True)
                for t in (data.val_x, data.val_y, data.token_chars))
        return dataclasses.replace(data, val_x=val_x, val_y=val_y, token_chars=token_chars)

    def build_model(model_cfg, vocab_size, device):  # noqa: ANN001, ANN202
        with real_tensors():  # initialised for real on the CPU, then fake copies
            return to_fake_cuda(setup.build_model(model_cfg, vocab_size), mode)

    return setup.Seams(load_data=load_data, build_model=build_model,
                       write_checkpoint=checkpoints.write)
