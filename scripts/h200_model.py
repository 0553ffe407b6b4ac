"""A MODEL of one training step's time on an NVIDIA H200, not a measurement: the ATen path
eager, the ATen path under CUDA graphs and the fused core, at batch 16, 128 and 512 and at
a config's own batch.

Every figure here is arithmetic on stated numbers; none was timed on a GPU.

Peaks (NVIDIA H200 Tensor Core GPU datasheet, H200 SXM column; its tensor-core figures are
with 2:4 sparsity, halved here for dense work): bf16 tensor 989 TFLOP/s dense, tf32
tensor 494 dense, fp32 (no tensor cores) 67 TFLOP/s; HBM3e 4.8 TB/s. The ATen path trains
under bf16 autocast (``precision: auto``), so its matmuls are counted at the bf16 peak; the
fused core's ``tl.dot`` is IEEE fp32 (no TF32), so at the fp32 peak, as are the weight-
gradient matmuls after its sweep (torch's default: no TF32 for matmuls). 132 SMs and
60 MB of L2 (what PyTorch reported on this workplace's H200s). L2 bandwidth is not on the
datasheet: 10 TB/s is an ASSUMPTION (a lead from third-party H100 microbenchmarks), to be
measured on the first GPU.

Floors: the host queues an eager launch every 5 us (PyTorch's dispatch plus
cudaLaunchKernel, the figure issue 32 and docs/performance.md use); a graph replay costs
the host 10 us (assumed); every kernel, inside a graph or not, costs the device at least
2 us (the middle of the 1.5-3 us that issue 32 states for a tiny kernel's start, run and
drain).

The model of a step: ``step = max(host, device)`` (the host queues ahead of the device, so
the slower of the two sets the pace). ``host = host launches x 5 us + replays x 10 us``.
Device, ATen path: ``kernels x 2 us + max(FLOPs / peak, HBM bytes / 4.8 TB/s)``, the work
assumed spread over the whole GPU (generous to the ATen path: its kernels are tiny).
Device, fused core: a token-layer is eight Triton kernels (fbtrain/models/core/fused/
forward.py and backward.py), each a grid of ``ceil(B / 16)`` batch tiles by heads or by
column tiles of 32 (:func:`fused_kernels` gives each one's programs, FLOPs and bytes for
one launch, averaged over a call), so a launch can use ``a = min(1, programs / 132)`` of the GPU:
``max(2 us, FLOPs / (67 TFLOP/s x a), L2 bytes / (10 TB/s x a), HBM bytes / 4.8 TB/s)``.
Every batch tile reads the kernel's weight matrix from L2 (from HBM once a launch when the
weights cannot stay in L2) and every column program its rows' inputs; the step's records
are split evenly over the launches; the counted launches are split evenly over the eight
kinds. The weight-gradient matmuls and the rest of the step (embedding, logits, loss,
optimizer) add ``kernels x 2 us + their work over the whole GPU``.

The latency term (issue 37): the fused core's kernels run with ``num_stages=1``, so every
iteration of a kernel's inner loops issues its loads and waits for them before its FMAs
(the sm_90 SASS of ``ff_out``: loads, barrier, shared store, barrier, shared load, FFMA;
nothing prefetched), and a program cannot go faster than its chain of dependent memory
round trips, whatever the FLOPs and bytes. :func:`round_trips` counts each kernel's from
its loop structure (forward.py, backward.py: one a chunk of each loop, the prologue's and
the record loads' one each; the memory's projection averaged over the layers); a launch
then takes at least ``LAUNCH_LATENCY_US + round trips x latency``, times its waves
(``programs / (132 x RESIDENT)``), at a round trip's latency of 0.15-0.35 us (an HBM or L2
miss under light load on Hopper: third-party microbenchmarks; to be measured: gpu_check's
kernel section times each kernel alone). A launch takes the larger of the throughput and
the latency terms; the step's latency-aware figure is reported as a range (at 0.15 and at
0.35 us). An ATen kernel is one launch and two round trips (read, write) by the same rule,
below its 2 us floor: the latency term moves only the fused core.

Kernel and launch counts come from scripts/launch_count.py, counted on the CPU at tiny
widths, 16 position rows and batch 2 (counts follow the steps and layers) at four (steps,
layers) points and fitted exactly to ``a T L + b T + c L + d``; at the main job's sizes the
fit gives back the ATen path's counts measured there (7,426 kernels and 570 host launches
graphed at commit ca3970d; 7,454 eager once the fused branch's core contract was merged).

    python scripts/h200_model.py                       # main job and configs/gpu.yaml
    python scripts/h200_model.py --counts counts.json  # counts from an earlier --save-counts
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

# NVIDIA H200 datasheet, SXM, dense (tensor-core figures: the sparse ones halved).
PEAK_FLOPS = {"bf16": 989e12, "tf32": 494e12, "fp32": 67e12}
HBM_BW = 4.8e12  # bytes/s, HBM3e
L2_BW = 10e12  # bytes/s: ASSUMED (not on the datasheet)
L2_BYTES = 60e6
SMS = 132
HOST_US = 5.0  # host cost of one eager launch
REPLAY_US = 10.0  # host cost of one graph replay (assumed)
DEVICE_FLOOR_US = 2.0  # device cost of any kernel at least (issue 32: 1.5-3 us)
# The latency term (module docstring): a memory round trip's latency range (us), a
# launch's own start and drain inside a graph (us), programs resident an SM at once.
ROUND_TRIP_US = (0.15, 0.35)
LAUNCH_LATENCY_US = 1.0
RESIDENT = 4  # programs of 4-8 warps at ~100-230 registers: 2-8 fit an SM; 4 assumed
BK = 32  # inner-dimension chunk of every fused kernel's loops
WINDOW_TILE = 128  # window slots x head width a chunk of the attention kernels (core.py)
ATEN_ROUND_TRIPS = 2  # an ATen kernel: read its inputs, write its output
BLOCK_B = 16  # batch rows per program of the fused core's kernels
BN = 32  # columns per program of its column-split kernels
SPLIT = 32  # window slots per program of its attention kernels
FP32 = 4  # bytes
VOCAB = 65
BATCHES = (16, 128, 512)
PATHS = ("aten eager", "aten graphed", "whole-step graphs", "fused graphed")
# (steps, layers) where the counts are taken: enough for the fit a T L + b T + c L + d.
FIT_POINTS = ((6, 2), (8, 2), (6, 3), (8, 3))


@dataclass(frozen=True)
class Sizes:
    """One training step's shapes (``window``: memory slots a step may attend to)."""

    d_model: int
    n_heads: int
    d_ff: int
    n_layers: int
    batch: int
    seq_len: int
    window: int
    kind: str = "feedback_kv"
    dropout: float = 0.0
    vocab: int = VOCAB

    @property
    def n_kv(self) -> int:
        """Key/value sets: one shared (feedback_kv) or one per layer (feedback)."""
        return 1 if self.kind == "feedback_kv" else self.n_layers

    def attended(self) -> int:
        """Memory slots attended over a call, summed over its steps (step t sees the
        min(t, window) slots before it; no carried memory)."""
        return sum(min(t, self.window) for t in range(self.seq_len))

    def layer_params(self) -> int:
        """Weights one layer's kernel reads: Wq, Wo, W1, W2 (the rest is small)."""
        return 2 * self.d_model ** 2 + 2 * self.d_model * self.d_ff

    def params(self) -> int:
        """The model's weights (matrices; biases, norms and position tables left out)."""
        return (self.n_layers * self.layer_params() + 2 * self.n_kv * self.d_model ** 2
                + 2 * self.vocab * self.d_model)


def step_flops(s: Sizes) -> dict[str, float]:
    """FLOPs of one training step (multiply-adds count two): the core's ``sweep``
    (forward and backward activation work), its ``weight_grads`` (the matmuls after the
    sweep) and the ``rest`` (logits forward, backward and their weight gradient)."""
    D, F, L, B, T = s.d_model, s.d_ff, s.n_layers, s.batch, s.seq_len
    attending = sum(1 for t in range(T) if min(t, s.window) > 0)  # steps with memory
    # Per row, forward: q and output projections where there is memory to attend to,
    # scores (content and position terms) and the weighted sum over the attended slots,
    # the feed-forward always, and each step's key/value projection.
    matmul_fwd = B * (L * (attending * 4 * D * D + T * 4 * D * F) + T * 4 * s.n_kv * D * D)
    window_fwd = B * L * s.attended() * 6 * D
    # Backward: activation gradients cost as much as the forward's matmuls (and twice its
    # window work: scores' and values' gradients); weight gradients the forward's matmuls.
    sweep = matmul_fwd + window_fwd + matmul_fwd + 2 * window_fwd
    rest = 3 * B * T * 2 * D * s.vocab
    return {"sweep": float(sweep), "weight_grads": float(matmul_fwd), "rest": float(rest)}


def step_hbm_bytes(s: Sizes) -> dict[str, float]:
    """HBM bytes of one step: ``records`` (what the forward writes for the backward and the
    backward reads, and the backward's own gradient records), ``weights`` (read once a
    step where all fit in L2, else once per step of each sweep and once more for the
    weight gradients: 2T + 1 times) and ``optimizer`` (AdamW in fp32: parameter, gradient
    and two moments read, three written)."""
    D, F, H, B, T, L = s.d_model, s.d_ff, s.n_heads, s.batch, s.seq_len, s.n_layers
    per_token_layer = 8 * D + 2 * F  # LayerNorm outputs, query, attention out, residuals...
    records = 3 * B * (T * L * per_token_layer + L * s.attended() * H) * FP32
    weights = s.params() * FP32
    if weights > L2_BYTES:  # cannot stay resident: every step streams them again
        weights *= 2 * T + 1
    return {"records": float(records), "weights": float(weights),
            "optimizer": float(7 * s.params() * FP32)}


@dataclass(frozen=True)
class Counts:
    """Per step: ``kernels`` the device runs, ``host`` launches the host queues, graph
    ``replays`` among them, and ``triton`` (the fused core's sweep kernels) among the
    kernels."""

    kernels: float
    host: float
    replays: float = 0.0
    triton: float = 0.0


@dataclass(frozen=True)
class Row:
    """One modelled step."""

    path: str
    batch: int
    host_ms: float
    device_ms: float
    step_ms: float
    tokens_per_s: float
    bound: str  # "host", "device" (throughput) or "latency"
    latency_ms: tuple[float, float] = (0.0, 0.0)  # device time by the latency term, at
    # ROUND_TRIP_US's low and high end
    step_hi_ms: float = 0.0  # the step at the high end (step_ms: at the low end)


def _row(path: str, s: Sizes, host_ms: float, device_ms: float,
         latency_ms: tuple[float, float] = (0.0, 0.0)) -> Row:
    step = max(host_ms, device_ms, latency_ms[0])
    step_hi = max(host_ms, device_ms, latency_ms[1])
    bound = ("host" if host_ms >= max(device_ms, latency_ms[0]) else
             "device" if device_ms >= latency_ms[0] else "latency")
    return Row(path, s.batch, host_ms, device_ms, step, s.batch * s.seq_len / step * 1000,
               bound, latency_ms, step_hi)


def host_ms(c: Counts) -> float:
    """The host's time to queue a step: eager launches and replays."""
    return ((c.host - c.replays) * HOST_US + c.replays * REPLAY_US) / 1000


def aten_row(path: str, s: Sizes, c: Counts) -> Row:
    """The ATen path (eager or graphed, by its counts): see the module docstring."""
    f = step_flops(s)
    flops = sum(f.values())
    hbm = sum(step_hbm_bytes(s).values())
    work_ms = max(flops / PEAK_FLOPS["bf16"], hbm / HBM_BW) * 1000
    latency = tuple(c.kernels * (LAUNCH_LATENCY_US + ATEN_ROUND_TRIPS * rt) / 1000
                    for rt in ROUND_TRIP_US)
    return _row(path, s, host_ms(c), c.kernels * DEVICE_FLOOR_US / 1000 + work_ms, latency)


@dataclass(frozen=True)
class Launch:
    """One fused-core kernel's launch, averaged over a call: its programs, FLOPs and the
    bytes it reads from L2 and from HBM."""

    name: str
    programs: int
    flops: float
    l2_bytes: float
    hbm_bytes: float


def fused_kernels(s: Sizes) -> list[Launch]:
    """The fused core's eight kernels of a token-layer at ``s`` (see the module docstring):
    the window averaged over a call's steps, the memory's projection (done by layer 0's
    attend forward and q_back backward) averaged over the layers. The attention kernels
    run a program per batch tile, head and split of ``SPLIT`` window slots, each split
    computing its head's query (forward) or do (backward) again; out_proj and q_back read
    every split's partial results."""
    D, F, H, L, B, T = s.d_model, s.d_ff, s.n_heads, s.n_layers, s.batch, s.seq_len
    tiles = math.ceil(B / BLOCK_B)
    ell = s.attended() / T  # slots a step attends, on average
    splits = sum(max(1, math.ceil(min(t, s.window) / SPLIT)) for t in range(T)) / T
    C = 2 * s.n_kv * D  # the memory projection's columns

    def cols(n: int) -> int:
        return tiles * math.ceil(n / BN)

    def weights(n: int) -> float:  # a matrix's bytes: HBM where weights cannot stay in L2
        return 0.0 if s.params() * FP32 <= L2_BYTES else n * FP32

    window = B * ell * 6 * D  # scores (content and position) and the weighted sum
    kv_bytes = 2 * B * ell * D * FP32  # the window's keys and values
    memory = 2 * B * D * C / L
    return [
        Launch("attend", round(tiles * H * splits), 2 * B * D * D * splits + window + memory,
               tiles * (D * D * splits + D * C / L) * FP32 + kv_bytes,
               weights(D * D + D * C / L)),
        Launch("out_proj", cols(D), 2 * B * D * D,
               (tiles * D * D + B * D * splits * math.ceil(D / BN)) * FP32, weights(D * D)),
        Launch("ff_in", cols(F), 2 * B * D * F,
               (tiles * D * F + B * D * math.ceil(F / BN)) * FP32, weights(D * F)),
        Launch("ff_out", cols(D), 2 * B * F * D,
               (tiles * F * D + B * F * math.ceil(D / BN)) * FP32, weights(F * D)),
        Launch("ffo_back", cols(F), 2 * B * D * F,  # (and five rows' LayerNorm inputs)
               (tiles * D * F + 5 * B * D * math.ceil(F / BN)) * FP32, weights(D * F)),
        Launch("ffi_back", cols(D), 2 * B * F * D,
               (tiles * F * D + B * F * math.ceil(D / BN)) * FP32, weights(F * D)),
        Launch("att_back", round(tiles * H * splits), 2 * B * D * D * splits + 2 * window,
               tiles * D * D * splits * FP32 + 2 * kv_bytes, weights(D * D)),
        Launch("q_back", cols(D), 2 * B * D * D + memory,
               (tiles * (D * D + D * C / L) + B * (D * splits + C / L) * math.ceil(D / BN))
               * FP32, weights(D * D + D * C / L)),
    ]


def launch_s(k: Launch, records_bytes: float) -> float:
    """One launch's modelled device time (seconds), with its share of the records."""
    a = min(1.0, k.programs / SMS)
    return max(DEVICE_FLOOR_US * 1e-6, k.flops / (PEAK_FLOPS["fp32"] * a),
               k.l2_bytes / (L2_BW * a), (k.hbm_bytes + records_bytes) / HBM_BW)


def round_trips(s: Sizes, stages: int = 1) -> dict[str, float]:
    """Serial memory round trips of one program of each fused kernel at ``s`` (averaged
    over a call's steps, the memory's projection over the layers), counted from the loops
    of forward.py and backward.py: each iteration of a loop that loads waits for its loads
    once; a prologue's or epilogue's loads once. ``nk``: chunks of BK over the width, ``nf``
    over d_ff, ``nw`` window chunks a split (``SPLIT`` slots in chunks of ``WINDOW_TILE /
    d_k``), ``sp`` splits a head's window.

    ``stages``: Triton's ``num_stages`` (the core launches 1). At 2 or more Triton
    pipelines the matmul loops (``tl.dot`` over chunks, no loop inside: the sm_90 SASS then
    holds LDGSTS, cp.async, in ff_in, ff_out, ffo_back, ffi_back, q_back and attend, none in
    out_proj and att_back), ``stages - 1`` chunks in flight: such a loop of n chunks waits
    n / (stages - 1) times (at 2 it hides only the arithmetic, which this term leaves out)."""
    D, F, H, L, T = s.d_model, s.d_ff, s.n_heads, s.n_layers, s.seq_len
    nk, nf = math.ceil(D / BK), math.ceil(F / BK)
    dk = 2 ** math.ceil(math.log2(max(16, D // H)))
    bw = max(1, WINDOW_TILE // dk)
    ells = [min(t, s.window) for t in range(T)]
    nw = sum(math.ceil(min(SPLIT, e) / bw) for e in ells if e) / max(1, sum(1 for e in ells
                                                                             if e))
    sp = sum(max(1, math.ceil(e / SPLIT)) for e in ells) / T
    n_kv_parts = 2 * s.n_kv

    def dot_loop(n: float) -> float:  # a matmul loop's waits at ``stages``
        return n / max(1, stages - 1)

    # attend: the memory (layer 0 only: mix chunks, the norm's two passes, each key/value
    # part's projection chunks), LN1's two passes, the query's chunks, the window's two
    # passes (scores, then the weighted sum), the records' loads.
    memory = (nk + 2 * nk + n_kv_parts * dot_loop(nk)) / L
    cc = math.ceil(n_kv_parts * D / BK)  # q_back's chunks of the memory's projection
    return {
        "attend": memory + 2 * nk + dot_loop(nk) + 2 * nw + 1,
        "out_proj": nk * (2 * sp + 1) + 1,  # per chunk: the splits' maxima, then sums
        "ff_in": 2 * nk + dot_loop(nk) + 1,  # LN2's two passes, the matmul's chunks
        "ff_out": dot_loop(nf) + 1,
        "ffo_back": nk + dot_loop(nk) + 2,  # the LayerNorm backwards' sums, the matmul's
        "ffi_back": dot_loop(nf) + 1,
        "att_back": 2 * nk + 1 + 2 * nw,  # LN2' sums, do's chunks; the window twice: values,
        # scores and dv's chunks, then ds (read back), keys and dk's: a round trip a chunk each
        "q_back": nk * sp + dot_loop(cc) / L + 1,  # per chunk the splits' dqu; the memory's
    }


def launch_latency_s(programs: float, trips: float, round_trip_us: float) -> float:
    """A launch's latency term (seconds): its start and drain, then its programs' chains of
    round trips, one wave of ``SMS x RESIDENT`` programs after another."""
    waves = max(1, math.ceil(programs / (SMS * RESIDENT)))
    return (LAUNCH_LATENCY_US + waves * trips * round_trip_us) * 1e-6


def kernel_predictions(s: Sizes) -> dict[str, dict[str, float]]:
    """Per fused kernel at ``s``, one launch averaged over a call: ``throughput_s`` (the
    throughput term, :func:`launch_s`, with an even share of the step's records) and
    ``latency_s`` (the latency term at the middle of ROUND_TRIP_US), with
    ``latency_lo_s`` / ``latency_hi_s`` at its ends, ``round_trips`` and ``programs``."""
    kernels = fused_kernels(s)
    launches = len(kernels) * s.seq_len * s.n_layers  # eight a token-layer
    records = step_hbm_bytes(s)["records"] / launches
    trips = round_trips(s)
    mid = sum(ROUND_TRIP_US) / 2
    return {k.name: {"throughput_s": launch_s(k, records),
                     "latency_s": launch_latency_s(k.programs, trips[k.name], mid),
                     "latency_lo_s": launch_latency_s(k.programs, trips[k.name],
                                                      ROUND_TRIP_US[0]),
                     "latency_hi_s": launch_latency_s(k.programs, trips[k.name],
                                                      ROUND_TRIP_US[1]),
                     "round_trips": trips[k.name], "programs": float(k.programs)}
            for k in kernels}


def fused_row(path: str, s: Sizes, c: Counts, stages: int = 1) -> Row:
    """The fused core (graphed, by its counts): see the module docstring. Each launch takes
    the larger of its throughput and latency terms (the latter's range: ``latency_ms``);
    ``stages``: as :func:`round_trips`."""
    f = step_flops(s)
    n = max(1.0, c.triton)
    hbm = step_hbm_bytes(s)
    kernels = fused_kernels(s)
    trips = round_trips(s, stages)
    each = n / len(kernels)
    through = {k.name: launch_s(k, hbm["records"] / n) for k in kernels}
    sweep_s = sum(each * t for t in through.values())
    other = c.kernels - c.triton
    other_s = (other * DEVICE_FLOOR_US * 1e-6
               + max((f["weight_grads"] + f["rest"]) / PEAK_FLOPS["fp32"],
                     hbm["optimizer"] / HBM_BW))
    latency = tuple(
        (sum(each * max(through[k.name], launch_latency_s(k.programs, trips[k.name], rt))
             for k in kernels) + other_s) * 1000
        for rt in ROUND_TRIP_US)
    return _row(path, s, host_ms(c), (sweep_s + other_s) * 1000, latency)


def model_rows(s: Sizes, counts: dict[str, Counts]) -> list[Row]:
    """The three paths at ``s`` from their counts (keys: PATHS; a missing one is left out)."""
    rows = []
    for path in PATHS:
        if path in counts:
            make = fused_row if path.startswith("fused") else aten_row
            rows.append(make(path, s, counts[path]))
    return rows


# --- counts, from scripts/launch_count.py -------------------------------------------


def fit(values: dict[tuple[int, int], float]) -> tuple[float, float, float, float]:
    """(a, b, c, d) of ``a T L + b T + c L + d`` through the four FIT_POINTS."""
    (t0, l0), (t1, _), (_, l1), _ = FIT_POINTS
    n00, n10, n01, n11 = (values[p] for p in FIT_POINTS)
    a = (n11 - n01 - n10 + n00) / ((t1 - t0) * (l1 - l0))
    b = (n10 - n00) / (t1 - t0) - a * l0
    c = (n01 - n00) / (l1 - l0) - a * t0
    d = n00 - a * t0 * l0 - b * t0 - c * l0
    return a, b, c, d


def predict(coef: tuple[float, float, float, float], seq_len: int, n_layers: int) -> float:
    a, b, c, d = coef
    return a * seq_len * n_layers + b * seq_len + c * n_layers + d


def measure_coefficients(kind: str, dropout: float, fused: bool) -> dict[str, dict]:
    """Per path, the fitted coefficients of kernels, host launches, replays and Triton
    kernels per step (launch_count at its TINY_WIDTHS, batch 2, at the FIT_POINTS)."""
    import launch_count

    runs = {"aten eager": ("aten", False, False), "aten graphed": ("aten", True, False),
            "whole-step graphs": ("aten", False, True)}
    if fused:
        runs["fused graphed"] = ("fused", True, False)
    out = {}
    for path, (core, graphed, step_graph) in runs.items():
        per_point: dict[str, dict] = {"kernels": {}, "host": {}, "replays": {}, "triton": {}}
        for T, L in FIT_POINTS:
            counts = launch_count.count_step(kind, 2, T, dropout,
                                             {**launch_count.TINY_WIDTHS, "max_rel_pos": 16,
                                              "n_layers": L},
                                             core=core, graphed=graphed,
                                             step_graph=step_graph)
            launches = [c for c in counts["launches"].values()]
            host = [c for c in counts["host_launches"].values()]
            per_point["kernels"][T, L] = sum(sum(c.values()) for c in launches)
            per_point["host"][T, L] = sum(sum(c.values()) for c in host)
            per_point["replays"][T, L] = sum(c[launch_count.GRAPH_REPLAY] for c in host)
            per_point["triton"][T, L] = sum(n for c in launches for op, n in c.items()
                                            if op.startswith(launch_count.TRITON_PREFIX))
        out[path] = {k: fit(v) for k, v in per_point.items()}
    return out


def counts_at(coefficients: dict[str, dict], s: Sizes) -> dict[str, Counts]:
    """Each path's Counts at ``s``'s steps and layers."""
    return {path: Counts(**{k: predict(v, s.seq_len, s.n_layers) for k, v in coef.items()})
            for path, coef in coefficients.items()}


def config_sizes(path: Path) -> Sizes:
    """A config's model at its last curriculum stage (batch and length there, the window
    its max_rel_pos, its dropout)."""
    from fbtrain.config import load_config

    cfg = load_config(path)
    m = cfg.model
    seq_len = cfg.curriculum[-1].seq_len
    return Sizes(m.d_model, m.n_heads, m.d_ff, m.n_layers, cfg.train.batch_size, seq_len,
                 min(m.max_rel_pos, seq_len), m.kind, m.dropout)


def fused_available() -> str | None:
    """Why the fused core cannot be counted here (one line), or None."""
    try:
        import triton  # noqa: F401

        from fbtrain.models.core import fused  # noqa: F401
    except ImportError as e:
        return f"the fused core cannot run here ({e})"
    return None


def format_rows(title: str, rows: list[Row]) -> list[str]:
    lines = [f"### {title}", "",
             "| path | batch | host ms | device ms (throughput) | device ms (latency) | "
             "step ms (MODEL) | tokens/s (MODEL) | bound |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lo, hi = r.latency_ms
        step = (f"{r.step_ms:.2f}" if abs(r.step_hi_ms - r.step_ms) < 0.005
                else f"{r.step_ms:.2f}-{r.step_hi_ms:.2f}")
        tok_hi = r.tokens_per_s * r.step_ms / r.step_hi_ms if r.step_hi_ms else r.tokens_per_s
        tokens = (f"{r.tokens_per_s:,.0f}" if step.count("-") == 0
                  else f"{tok_hi:,.0f}-{r.tokens_per_s:,.0f}")
        lines.append(f"| {r.path} | {r.batch} | {r.host_ms:.2f} | {r.device_ms:.2f} | "
                     f"{lo:.2f}-{hi:.2f} | {step} | {tokens} | {r.bound} |")
    return lines


CONFIGS = {"main job (configs/tiny_shakespeare.yaml)": ROOT / "configs" / "tiny_shakespeare.yaml",
           "configs/gpu.yaml": ROOT / "configs" / "gpu.yaml"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--counts", type=Path,
                        help="coefficients from --save-counts (skips counting)")
    parser.add_argument("--save-counts", type=Path, help="write the fitted coefficients")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    if args.counts:
        saved = json.loads(args.counts.read_text())
    else:
        why = fused_available()
        if why:
            print(f"note: {why}: the fused core's rows are left out", flush=True)
        saved = {}
        for path in CONFIGS.values():
            s = config_sizes(path)
            key = f"{s.kind}/dropout={s.dropout:g}"
            if key not in saved:
                saved[key] = measure_coefficients(s.kind, s.dropout, fused=why is None)
        if args.save_counts:
            from fbtrain.io import atomic_write_text

            atomic_write_text(args.save_counts, json.dumps(saved, indent=2))
    print("MODEL of an H200 training step, not a measurement (scripts/h200_model.py: "
          f"peaks bf16 {PEAK_FLOPS['bf16'] / 1e12:.0f} / fp32 {PEAK_FLOPS['fp32'] / 1e12:.0f} "
          f"TFLOP/s dense, HBM {HBM_BW / 1e12:.1f} TB/s, L2 {L2_BW / 1e12:.0f} TB/s assumed; "
          f"{HOST_US:g} us a host launch, {REPLAY_US:g} us a replay, {DEVICE_FLOOR_US:g} us "
          f"a kernel's device floor; latency term: {ROUND_TRIP_US[0]:g}-{ROUND_TRIP_US[1]:g} "
          f"us a memory round trip, {LAUNCH_LATENCY_US:g} us a launch)")
    report = {}
    for title, path in CONFIGS.items():
        s0 = config_sizes(path)
        coefficients = saved[f"{s0.kind}/dropout={s0.dropout:g}"]
        rows = []
        for batch in dict.fromkeys((*BATCHES, s0.batch)):
            s = Sizes(**{**asdict(s0), "batch": batch})
            rows += model_rows(s, counts_at(coefficients, s))
        c = counts_at(coefficients, s0)
        counted = "; ".join(f"{p}: {v.kernels:,.0f} kernels, {v.host:,.0f} host launches"
                            for p, v in c.items())
        heading = (f"{title}: {s0.kind}, d_model {s0.d_model}, {s0.n_layers} layers, length "
                   f"{s0.seq_len}, dropout {s0.dropout:g} (own batch {s0.batch})")
        print("\n".join(["", *format_rows(heading, rows), "", f"per step: {counted}"]))
        if "fused graphed" in c:  # what pipelining would move (round_trips: stages)
            now, piped = (fused_row("fused graphed", s0, c["fused graphed"], stages)
                          for stages in (1, 3))
            print(f"what-if, num_stages 3 (the core launches 1): fused graphed at batch "
                  f"{s0.batch}, latency term {piped.latency_ms[0]:.1f}-"
                  f"{piped.latency_ms[1]:.1f} ms (at 1: {now.latency_ms[0]:.1f}-"
                  f"{now.latency_ms[1]:.1f}); round trips a token-layer "
                  f"{sum(round_trips(s0, 3).values()):.0f} (at 1: "
                  f"{sum(round_trips(s0).values()):.0f})")
        report[title] = {"sizes": asdict(s0), "rows": [asdict(r) for r in rows],
                         "counts": {p: asdict(v) for p, v in c.items()}}
    if args.json:
        from fbtrain.io import atomic_write_text

        atomic_write_text(args.json, json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
