"""Compile the fused core's Triton kernels for sm_90 (H100/H200) and sm_80 (A100) on a
machine without a GPU, and read what each would use of the device: registers, stack and
local memory (spills) and shared memory. The compile table, and a check of it.

How: ``triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", arch,
32))`` runs Triton's whole pipeline down to a cubin with the ``ptxas`` that Triton's wheel
bundles (``triton/backends/nvidia/bin``): no GPU, no CUDA toolkit and no network. The cubin
is read with the bundled ``cuobjdump --dump-resource-usage`` (its REG, STACK, LOCAL and
SHARED of the kernel's function); Triton's own metadata adds the dynamic shared memory the
kernel is launched with (``metadata.shared``) and its warps. (``n_regs`` / ``n_spills`` on
a compiled kernel are only filled in when a driver loads it, so they are not read here.)

Triton fixes its mode when ``triton.language`` is imported: under ``TRITON_INTERPRET=1`` its
own library functions (``tl.sum``, ``tl.max``...) are interpreter functions, and nothing can
be compiled in that process (and without it, nothing interpreted). So where this process's
Triton is the interpreter's (a test session that checks kernels in the interpreter, say),
each compile runs in a child process with a compiling Triton (:func:`usage`, ``--worker``),
which imports the kernel from its source file.

What the check holds each kernel to (:meth:`Usage.problems`):
- no stack frame and no local memory: either means registers spilled (or an array indexed
  at run time), which turns register traffic into memory traffic;
- static plus dynamic shared memory within the device's opt-in limit per block
  (``cudaDevAttrMaxSharedMemoryPerBlockOptin``: 232,448 bytes = 227 KiB on compute
  capability 9.0, 166,912 = 163 KiB on 8.0; CUDA C++ Programming Guide, "Technical
  Specifications per Compute Capability"), past which the launch fails;
- at most 232 registers a thread (the hardware's 255 less a margin: a kernel at 248-255
  spills after the next small change or Triton release; the core gives ptxas that ceiling,
  ``launch.MAX_REGISTERS``, so there a kernel that needs more spills), and registers x
  threads within the 65,536 registers of a multiprocessor (else "too many resources
  requested for launch");
- in its SASS (``cuobjdump -sass``): no tensor-core instruction (``HMMA``, ``HGMMA``: the
  kernels are IEEE float32 or float64, no TF32), and in its Triton IR no dot in TF32
  (Triton rewrites a broadcast multiply and sum, ``tl.sum(a[:, :, None] * b[None], 1)``,
  into a dot in TF32, a tensor-core HMMA where the tile allows it); and no load through
  the non-coherent read-only path (``LDG.E...CONSTANT``, PTX ``ld.global.nc``) in a
  kernel that stores: that path may serve stale data for a buffer the same launch
  writes, and the kernels read their own records back (a conservative check: no kernel
  that stores may use it at all).

Variants, each as Triton's launcher would compile it: ``aligned`` (float32; the pointer
arguments 16-byte aligned as the core launches them carry ``tt.divisibility`` 16, which
lets the compiler vectorise their loads: what runs), ``unaligned`` (float32 without that
hint: what runs where a buffer's offset is odd) and ``fp64`` (float64, aligned as launched:
the exact checks that gpu_check runs on the device).

The kernels are the fused core's own, from ``fbtrain.models.core.fused.compile_cases``
(every kernel it launches, with the signature and constexprs it launches with), at the
main job's sizes (configs/tiny_shakespeare.yaml) and at configs/gpu.yaml's last curriculum
stage, for both kinds, with dropout and memory_norm on (every branch compiled in).
Compiled kernels go to Triton's cache (``$TRITON_CACHE_DIR``, default ~/.triton/cache), so
a second run takes seconds.

    python scripts/fused_compile.py                  # the table; exit 1 if a kernel fails
    python scripts/fused_compile.py --jobs 8         # 8 compiles at once (child processes)
    python scripts/fused_compile.py --arch 90 --variant fp64 --json compile.json
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ARCHS = (90, 80)
WARP_SIZE = 32
# cudaDevAttrMaxSharedMemoryPerBlockOptin per compute capability (bytes).
SHARED_LIMIT = {90: 232_448, 80: 166_912}
MAX_REGS_PER_THREAD = 232  # the hardware's 255, less a margin (module docstring)
REGS_PER_SM = 65_536
# Keys of a case's constexprs that are launch options, not kernel arguments.
OPTION_KEYS = frozenset({"num_warps", "num_stages", "num_ctas", "maxnreg"})
CONFIGS = {"main": ROOT / "configs" / "tiny_shakespeare.yaml",
           "gpu.yaml": ROOT / "configs" / "gpu.yaml"}

VARIANTS = ("aligned", "unaligned", "fp64")
# SASS opcodes the check refuses: tensor-core matmuls (sm_80 HMMA, sm_90 HGMMA) and loads
# through the non-coherent read-only path.
_TENSOR_CORE = re.compile(r"\b(HMMA|HGMMA)\b")
_NC_LOAD = re.compile(r"\bLDG\.[A-Z0-9.]*CONSTANT\b")
_STORE = re.compile(r"\b(STG|ST|RED|ATOM|ATOMG)\.")

# A case: (name, kernel, signature, constexprs, grid, divisible), divisible the pointer
# arguments aligned to 16 bytes as launched (fused.launch_variants).
Case = tuple[str, Any, dict, dict, tuple, tuple]


def triton_missing() -> str | None:
    """Why Triton cannot compile here (one line), or None where it can."""
    try:
        import triton  # noqa: F401
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler import ASTSource  # noqa: F401
    except ImportError as e:
        return f"Triton is not installed ({e}); pip install triton (Linux x86_64)"
    if not cuobjdump().is_file():
        return f"Triton's bundled cuobjdump is missing ({cuobjdump()})"
    return None


def cuobjdump() -> Path:
    """The cuobjdump Triton's NVIDIA backend bundles (beside its ptxas)."""
    import triton.backends.nvidia as nvidia

    return Path(nvidia.__file__).parent / "bin" / "cuobjdump"


def triton_interpreting() -> bool:
    """Whether this process's Triton is (or, not imported yet, will be) the interpreter:
    TRITON_INTERPRET=1 when ``triton.language`` is first imported. It then cannot compile,
    and only then can it interpret a kernel that calls Triton's library functions."""
    lang = sys.modules.get("triton.language")
    if lang is None:
        return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "yes",
                                                                          "on")
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(lang.sum, InterpretedFunction)


_USAGE = re.compile(r"^\s*Function (\S+?):\s*$\n\s*(.*)$", re.MULTILINE)


def parse_resource_usage(text: str) -> dict[str, dict[str, int]]:
    """``cuobjdump --dump-resource-usage`` output -> {function: {"REG": n, "STACK": n,
    "SHARED": n, "LOCAL": n, ...}} (every ``KEY:number`` field of its line)."""
    out = {}
    for name, fields in _USAGE.findall(text):
        out[name] = {k: int(v) for k, v in re.findall(r"([A-Z]+(?:\[\d+\])?):(\d+)", fields)}
    return out


@dataclass(frozen=True)
class Usage:
    """What one compiled kernel needs of the device (bytes, except registers and warps)."""

    kernel: str
    arch: int
    registers: int  # per thread
    stack: int  # stack frame per thread: spills (or run-time-indexed arrays)
    local: int  # local memory per thread
    static_shared: int  # from the cubin
    dynamic_shared: int  # what Triton launches it with (metadata.shared)
    num_warps: int
    programs: int | None = None  # grid size at these sizes (None: not given)
    tensor_core: int = 0  # HMMA / HGMMA instructions in its SASS
    tf32_dots: int = 0  # dots in TF32 in its Triton IR (tensor cores, or not, by shape)
    nc_loads: int = 0  # LDG...CONSTANT (non-coherent) loads in its SASS
    stores: int = 0  # global stores (and reductions) in its SASS

    @property
    def shared(self) -> int:
        """Shared memory a block of it takes: static and dynamic."""
        return self.static_shared + self.dynamic_shared

    def problems(self) -> list[str]:
        """Why this kernel would not run well or at all on its architecture (empty: fine)."""
        out = []
        if self.stack or self.local:
            out.append(f"spills: {self.stack} bytes of stack, {self.local} of local memory")
        if self.shared > SHARED_LIMIT[self.arch]:
            out.append(f"{self.shared} bytes of shared memory, over sm_{self.arch}'s "
                       f"{SHARED_LIMIT[self.arch]}")
        if self.registers > MAX_REGS_PER_THREAD:
            out.append(f"{self.registers} registers a thread, over {MAX_REGS_PER_THREAD}")
        if self.tensor_core:
            out.append(f"{self.tensor_core} tensor-core instructions (HMMA/HGMMA): not IEEE")
        if self.tf32_dots:
            out.append(f"{self.tf32_dots} dots in TF32 in the Triton IR: not IEEE")
        if self.nc_loads and self.stores:
            out.append(f"{self.nc_loads} non-coherent loads (LDG...CONSTANT) in a kernel "
                       "that stores")
        threads = self.num_warps * WARP_SIZE
        if self.registers * threads > REGS_PER_SM:
            out.append(f"{self.registers} registers x {threads} threads, over the "
                       f"{REGS_PER_SM} of a multiprocessor")
        return out


def compile_kernel(fn: Any, signature: dict, constexprs: dict, arch: int,
                   divisible: Iterable[str] = ()):
    """``fn`` (a ``triton.jit`` function) compiled to a cubin for sm_``arch`` (a
    ``CompiledKernel``). ``signature``: argument name -> Triton type (``"*fp32"``,
    ``"i32"``, ``"constexpr"``...); ``constexprs``: their values, plus any launch options
    (``num_warps``, ``num_stages``) the kernel is launched with; ``divisible``: the
    arguments Triton's launcher would mark 16-byte divisible (aligned pointers)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    options = {k: v for k, v in constexprs.items() if k in OPTION_KEYS}
    values = {k: v for k, v in constexprs.items() if k not in OPTION_KEYS}
    # What the launcher passes for an argument it specialised as "D" (Triton 3.3 and on).
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in divisible}
    with warnings.catch_warnings():
        # Triton 3.9 warns that its fp-fusion default will change; the default is what
        # the kernels launch with, so it is what is compiled here.
        warnings.filterwarnings("ignore", message=".*TRITON_DEFAULT_FP_FUSION.*")
        return triton.compile(ASTSource(fn, signature, values, attrs),
                              target=GPUTarget("cuda", arch, WARP_SIZE), options=options)


def sass(cubin: bytes) -> str:
    """A cubin's SASS, as the bundled ``cuobjdump -sass`` prints it."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        return subprocess.run([str(cuobjdump()), "-sass", str(path)], capture_output=True,
                              text=True, check=True).stdout


def sass_counts(text: str) -> dict[str, int]:
    """Instructions the check looks for in SASS text: tensor-core matmuls, non-coherent
    loads and global stores."""
    return {"tensor_core": len(_TENSOR_CORE.findall(text)),
            "nc_loads": len(_NC_LOAD.findall(text)), "stores": len(_STORE.findall(text))}


def usage(name: str, fn: Any, signature: dict, constexprs: dict, arch: int,
          grid: Iterable[int] | None = None, isolated: bool | None = None,
          divisible: Iterable[str] = ()) -> Usage:
    """Compile ``fn`` for sm_``arch`` and read its resource use (see the module docstring).
    ``isolated``: compile in a child process (default: where this process's Triton is the
    interpreter's, which cannot compile). ``divisible``: as :func:`compile_kernel`."""
    divisible = tuple(divisible)
    if isolated is None:
        isolated = triton_interpreting()
    if isolated:
        return _usage_in_child(name, fn, signature, constexprs, arch, grid, divisible)
    kernel = compile_kernel(fn, signature, constexprs, arch, divisible)
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        proc = subprocess.run([str(cuobjdump()), "--dump-resource-usage", str(cubin)],
                              capture_output=True, text=True, check=True)
    functions = parse_resource_usage(proc.stdout)
    counts = sass_counts(sass(kernel.asm["cubin"]))
    counts["tf32_dots"] = kernel.asm["ttir"].count("inputPrecision = tf32")
    fields = functions[kernel.metadata.name]
    programs = None
    if grid is not None:
        programs = 1
        for g in grid:
            programs *= g
    return Usage(kernel=name, arch=arch, registers=fields["REG"], stack=fields["STACK"],
                 local=fields["LOCAL"], static_shared=fields["SHARED"],
                 dynamic_shared=kernel.metadata.shared, num_warps=kernel.metadata.num_warps,
                 programs=programs, **counts)


def _usage_in_child(name: str, fn: Any, signature: dict, constexprs: dict, arch: int,
                    grid: Iterable[int] | None, divisible: tuple[str, ...] = ()) -> Usage:
    """:func:`usage` in a child process without TRITON_INTERPRET; the kernel is imported
    there from its source file, by its Python name."""
    py = getattr(fn, "fn", fn)  # a JITFunction / InterpretedFunction wraps the function
    job = {"file": inspect.getsourcefile(py), "attr": py.__name__, "name": name,
           "signature": signature, "constexprs": constexprs, "arch": arch,
           "grid": None if grid is None else list(grid), "divisible": list(divisible)}
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, __file__, "--worker"], input=json.dumps(job),
                          capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"compiling {name} for sm_{arch} failed: "
                           f"{proc.stderr.strip().splitlines()[-1:]}")
    return Usage(**json.loads(proc.stdout.strip().splitlines()[-1]))


def _worker() -> int:
    """The child of :func:`_usage_in_child`: one job (JSON on stdin) -> Usage (JSON)."""
    from triton.runtime.jit import JITFunction

    job = json.loads(sys.stdin.read())
    spec = importlib.util.spec_from_file_location("_fused_compile_kernels", job["file"])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fn = getattr(module, job["attr"])
    if not isinstance(fn, JITFunction):
        fn = JITFunction(getattr(fn, "fn", fn))
    u = usage(job["name"], fn, job["signature"], job["constexprs"], job["arch"],
              job["grid"], isolated=False, divisible=job.get("divisible", ()))
    print(json.dumps(asdict(u)))
    return 0


def run_sizes(config: Path) -> dict:
    """The fused core's sizes at ``config``'s last curriculum stage: the model's widths,
    the batch at that stage's length, and the attention window (``max_rel_pos``)."""
    from fbtrain.config import load_config

    cfg = load_config(config)
    m = cfg.model
    return dict(d_model=m.d_model, n_heads=m.n_heads, d_ff=m.d_ff, n_layers=m.n_layers,
                batch=cfg.train.batch_size, window=m.max_rel_pos)


def _fused_interface() -> str | None:
    """Why the fused core's ``compile_cases`` cannot be had here (one line), or None."""
    try:
        from fbtrain.models.core import fused
    except ImportError as e:
        return f"the fused core is not importable ({e})"
    if not hasattr(fused, "launch_variants"):
        return "the fused core has no launch_variants"
    return None


def fused_cases(sizes: dict, shared_kv: bool, variant: str = "aligned") -> list[Case]:
    """Every kernel the fused core launches at ``sizes``, with dropout and memory_norm on
    (so every branch is compiled), from ``fbtrain.models.core.fused.launch_variants``, with
    the warps per program the core launches them with (``fused.launch_options``), in
    ``variant`` (one of VARIANTS: see the module docstring)."""
    import torch

    from fbtrain.models.core import fused

    dtype = torch.float64 if variant == "fp64" else torch.float32
    cases = fused.launch_variants(shared_kv=shared_kv, memory_norm=True, dropout=0.1,
                                  dtype=dtype, **sizes)
    out, seen = [], set()
    for c in cases:
        divisible = () if variant == "unaligned" else c.divisible
        key = (c.name, tuple(c.signature.items()), tuple(c.constexprs.items()), divisible)
        if key not in seen:  # (unaligned: the launches that differed only in alignment)
            seen.add(key)
            out.append((c.name, c.fn, c.signature,
                        {**c.constexprs, **fused.launch_options(c.name)}, c.grid,
                        divisible))
    return out


def table_rows(cases: dict[str, list[Case]], archs: Iterable[int],
               on_row: Callable[[str, Usage], None] | None = None,
               jobs: int = 1) -> list[tuple[str, Usage]]:
    """(label, Usage) for every case under every label and arch; a kernel compiled once per
    (arch, name, constexprs, alignment) even where two labels share it. ``jobs`` > 1:
    that many compiles at once, each in a child process (rows still come in order)."""
    units: dict[tuple, tuple] = {}
    order = []
    for arch in archs:
        for label, group in cases.items():
            for name, fn, signature, constexprs, grid, *rest in group:
                divisible = tuple(rest[0]) if rest else ()
                key = (arch, name, id(fn), tuple(sorted(signature.items())),
                       tuple(sorted(constexprs.items())), divisible)
                units.setdefault(key, (name, fn, signature, constexprs, arch, grid, divisible))
                order.append((label, key))

    def run(unit: tuple) -> Usage:
        name, fn, signature, constexprs, arch, grid, divisible = unit
        return usage(name, fn, signature, constexprs, arch, grid,
                     isolated=True if jobs > 1 else None, divisible=divisible)

    with ThreadPoolExecutor(max(1, jobs)) as pool:
        futures = {key: pool.submit(run, unit) for key, unit in units.items()}
        rows = []
        for label, key in order:
            row = (label, futures[key].result())
            rows.append(row)
            if on_row:
                on_row(*row)
    return rows


HEADER = (f"  {'sizes':36s} {'kernel':22s} {'arch':>6s} {'regs':>5s} {'warps':>5s} "
          f"{'shared B':>9s} {'stack':>6s} {'local':>6s} {'programs':>8s}  verdict")


def format_row(label: str, u: Usage) -> str:
    """One line of the compile table."""
    problems = u.problems()
    verdict = "ok" if not problems else "FAIL: " + "; ".join(problems)
    programs = "" if u.programs is None else str(u.programs)
    return (f"  {label:36s} {u.kernel:22s} sm_{u.arch:<3d} {u.registers:5d} {u.num_warps:5d} "
            f"{u.shared:9d} {u.stack:6d} {u.local:6d} {programs:>8s}  {verdict}")


def main(argv: list[str] | None = None) -> int:
    """Print the compile table; exit 1 if a kernel fails its check, 2 without Triton or
    without the fused core."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, choices=ARCHS, action="append",
                        help="compute capability x10 (default: 90 and 80)")
    parser.add_argument("--variant", choices=VARIANTS, action="append",
                        help="compile variant (default: all; see the module docstring)")
    parser.add_argument("--config", choices=list(CONFIGS), action="append",
                        help="sizes (default: both)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="compiles at once, each in a child process (default 1)")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return _worker()
    why = triton_missing()
    if why:
        print(f"error: {why}", file=sys.stderr)
        return 2
    why = _fused_interface()
    if why:
        print(f"error: {why}", file=sys.stderr)
        return 2
    import triton

    cases = {}
    for config_name in args.config or CONFIGS:
        path = CONFIGS[config_name]
        sizes = run_sizes(path)
        for variant in args.variant or VARIANTS:
            for kind, shared_kv in (("feedback_kv", True), ("feedback", False)):
                label = f"{config_name} {kind} {variant}"
                cases[label] = fused_cases(sizes, shared_kv, variant)
        print(f"{config_name} ({path.relative_to(ROOT)}, last stage): {sizes}")
    print(f"Triton {triton.__version__}")
    print("Compiled without a GPU (Triton's bundled ptxas; cuobjdump --dump-resource-usage); "
          "dropout and memory_norm on. Limits: shared "
          + ", ".join(f"sm_{a} {SHARED_LIMIT[a]} B" for a in ARCHS)
          + f"; no stack or local memory; <= {MAX_REGS_PER_THREAD} registers; "
          "no HMMA/HGMMA; no non-coherent loads in a kernel that stores")
    print(HEADER)
    rows = table_rows(cases, args.arch or ARCHS,
                      on_row=lambda label, u: print(format_row(label, u), flush=True),
                      jobs=args.jobs)
    failed = [u for _, u in rows if u.problems()]
    most = max((u.registers for _, u in rows), default=0)
    print(f"{len(rows)} rows, {len(failed)} failing; at most {most} registers "
          f"(Triton {triton.__version__})")
    if args.json:
        from fbtrain.io import atomic_write_text

        atomic_write_text(args.json, json.dumps(
            [{"sizes": label, **asdict(u), "shared": u.shared, "problems": u.problems()}
             for label, u in rows], indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
