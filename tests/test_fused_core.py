"""The fused core (``FBTRAIN_CORE=fused``, Triton kernels) checked without a GPU: its kernels
run in Triton's interpreter on CPU tensors (``TRITON_INTERPRET=1``, read at each call, so it
need not be set before Triton is imported), through ``build_model``
like every core, against tests/reference.py in float64 (logits, loss and every gradient to
1e-9, the bound every core is held to: the sums run in another order, so results differ by
float64 rounding: measured at most 5e-14), and against the PyTorch core where the reference
has nothing to say (dropout with the masks both draw, carried memory). Plus the selection
and its notices, the launch counts, and the interface tools compile the kernels through.

The interpreter is slow (numpy under every tl op): the sizes are tiny.
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="the fused core needs Triton (pip install triton: "
                                     "Linux x86_64; in the dev extra there)")

import inspect  # noqa: E402
import random  # noqa: E402

import torch  # noqa: E402
from reference import keep_relus_clear_of_zero, reference_forward  # noqa: E402
from test_models import grads, loss_of, randomized, small  # noqa: E402

from fbtrain.config import ModelConfig  # noqa: E402
from fbtrain.models import build_model  # noqa: E402
from fbtrain.models.core import fused, native, python, select  # noqa: E402
from fbtrain.models.core.fused import core as fused_core  # noqa: E402
from fbtrain.models.core.fused import launch as fused_launch  # noqa: E402
from fbtrain.models.core.masks import draw_masks  # noqa: E402
from fbtrain.models.core.spec import CoreSpec  # noqa: E402

TOL = 1e-9  # float64, as for every core (test_models.py)


@pytest.fixture
def use_core(monkeypatch):
    """``use_core(name)``: FBTRAIN_CORE=name from now on, the interpreter on, and the core
    resolved afresh (select caches it per process)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv("FBTRAIN_CORE_ATEN", raising=False)

    def use(name: str) -> None:
        monkeypatch.setenv("FBTRAIN_CORE", name)
        select._resolve.cache_clear()

    yield use
    select._resolve.cache_clear()


def _step(model: torch.nn.Module, tokens: torch.Tensor, state=None):
    """Logits and every parameter's gradient of one call (a fixed random loss)."""
    model.zero_grad(set_to_none=True)
    logits, state = model(tokens, state)
    loss = loss_of(logits)
    loss.backward()
    return logits, loss, state, grads(model)


def _core_inputs(model: torch.nn.Module, x0: torch.Tensor, n_kv: int, n_heads: int):
    """A core call's inputs on embeddings x0 [B, T, D] from empty memory, with ``model``'s
    own weights (detached), as the model hands them to its core."""
    from fbtrain.models.core.autograd import flatten_layers
    from fbtrain.models.core.spec import CoreInputs

    B, T, D = x0.shape
    layers, wkv, bkv = model.core_params(T)
    empty = x0.new_zeros(n_kv, B * n_heads, 0, D // n_heads)
    return CoreInputs(x0, empty, empty, model.memory_weights().detach(), wkv.detach(),
                      None if bkv is None else bkv.detach(),
                      [t.detach() for t in flatten_layers(layers)])


def _assert_close(got: dict, want: dict, tol: float) -> None:
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=tol,
                                   msg=lambda m, n=name: f"{n}: {m}")


def _assert_matches_reference(model: torch.nn.Module, tokens: torch.Tensor) -> None:
    """One call of ``model`` (float64, its core the fused one) against tests/reference.py:
    logits and every parameter's gradient of a fixed random loss to ``TOL``."""
    ref_logits = reference_forward(model, tokens)
    loss_of(ref_logits).backward()
    ref_grads = grads(model)
    logits, _, _, got = _step(model, tokens)
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=TOL)
    _assert_close(got, ref_grads, TOL)


@pytest.mark.parametrize(("kind", "memory_norm", "mem_len", "split"), [
    ("feedback_kv", "none", None, 32), ("feedback_kv", "layernorm", 3, 2),
    ("feedback", "none", 3, 32), ("feedback", "layernorm", None, 2)])
def test_fused_matches_reference_float64(kind, memory_norm, mem_len, split, use_core,
                                         monkeypatch):
    """Both kinds, memory norm on and off, a window shorter than the steps (3 of 7) and one
    as long; a batch of 3 (the tile is 16 rows); a head's window in one program (32 slots
    a program) or split over up to three (2 slots a program: the splits' partial sums
    combined in out_proj, their gradients summed in q_back)."""
    monkeypatch.setattr(fused_core, "SPLIT", split)
    use_core("fused")
    assert isinstance(select.core(), fused.FusedCore)
    model = randomized(small(kind, n_layers=2, memory_norm=memory_norm, mem_len=mem_len))
    tokens = torch.randint(0, 11, (3, 7))
    ref_logits = reference_forward(model, tokens)
    ref_loss = loss_of(ref_logits)
    ref_loss.backward()
    ref_grads = grads(model)
    logits, loss, _, got = _step(model, tokens)
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=TOL)
    assert abs(loss.item() - ref_loss.item()) < TOL
    _assert_close(got, ref_grads, TOL)
    assert got["mem_weights"].abs().sum() > 0


@pytest.mark.parametrize(("d_model", "n_heads", "d_ff", "batch", "steps"), [
    (24, 3, 40, 17, 11), (32, 4, 70, 2, 5), (80, 2, 72, 3, 6)])
def test_fused_widths_and_heads_match_reference(d_model, n_heads, d_ff, batch, steps,
                                                use_core, monkeypatch):
    """Widths and head sizes that are not powers of two (24/3 = 8, 80/2 = 40, d_ff 40, 70,
    72: the tiles are padded and masked), 17 rows (two batch tiles, the second nearly
    empty), a width of several column tiles and inner chunks (80: three tiles of 32, the
    last partial; d_ff 72: three), and windows of up to 10 slots (in chunks of 8, or 4 at
    d_k 40), each split over programs of 4 slots (the last split partial)."""
    monkeypatch.setattr(fused_core, "SPLIT", 4)
    use_core("fused")
    model = randomized(small("feedback_kv", d_model=d_model, n_heads=n_heads, d_ff=d_ff,
                             n_layers=1, mem_len=10))
    tokens = torch.randint(0, 11, (batch, steps))
    _assert_matches_reference(model, tokens)


@pytest.mark.parametrize("kind", ["feedback_kv", "feedback"])
def test_a_window_chunk_of_one_slot_matches_reference(kind, use_core, monkeypatch):
    """At head width 128 the attention kernels take the window one slot a chunk (BW =
    WINDOW_TILE / d_k = 1: [16, 1, d_k] tiles); here a 16-wide tile forces that at d_k 16,
    with windows of 4 slots split over programs of 3 (the last split one slot)."""
    monkeypatch.setattr(fused_core, "WINDOW_TILE", 16)
    monkeypatch.setattr(fused_core, "SPLIT", 3)
    assert fused_core._blocks(32, 2)["BW"] == 1
    use_core("fused")
    model = randomized(small(kind, d_model=32, n_heads=2, n_layers=2,
                             memory_norm="layernorm", mem_len=4))
    tokens = torch.randint(0, 11, (3, 6))
    _assert_matches_reference(model, tokens)


@pytest.fixture
def program_order(monkeypatch):
    """``program_order(kind)``: from now on the interpreter runs each launch's programs in
    ``"reverse"`` or ``"shuffled"`` order (a fixed seed) instead of its row-major loop, by
    remapping the grid index it sets before each program; returns the launches seen, each
    as the list of program indices in the order they ran."""
    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    set_dim, set_idx = builder.set_grid_dim, builder.set_grid_idx
    runs: list[list[tuple[int, int, int]]] = []

    def use(kind: str) -> list[list[tuple[int, int, int]]]:
        rng = random.Random(37)
        state = {}

        def grid_dim(nx: int, ny: int, nz: int) -> None:
            order = [(x, y, z) for x in range(nx) for y in range(ny) for z in range(nz)]
            if kind == "reverse":
                order.reverse()
            else:
                rng.shuffle(order)
            state.update(order=order, ny=ny, nz=nz)
            runs.append([])
            set_dim(nx, ny, nz)

        def grid_idx(x: int, y: int, z: int) -> None:
            idx = state["order"][(x * state["ny"] + y) * state["nz"] + z]
            runs[-1].append(idx)
            set_idx(*idx)

        monkeypatch.setattr(builder, "set_grid_dim", grid_dim)
        monkeypatch.setattr(builder, "set_grid_idx", grid_idx)
        return runs

    return use


@pytest.mark.parametrize("order", ["reverse", "shuffled"])
@pytest.mark.parametrize(("kind", "memory_norm", "d_model", "n_heads", "batch", "split"), [
    ("feedback_kv", "layernorm", 24, 3, 17, 2), ("feedback", "none", 16, 2, 3, 2)])
def test_programs_of_a_launch_exchange_nothing(order, kind, memory_norm, d_model, n_heads,
                                               batch, split, use_core, program_order,
                                               monkeypatch):
    """On a GPU a launch's programs run in no set order (and at once): no program may read
    what another of the same launch writes. The interpreter runs them one by one in row-
    major order, which would hide such a dependence, so here it runs them reversed or
    shuffled, and the float64 checks against the reference still hold to 1e-9. Launches of
    several batch tiles (17 rows), heads and window splits (2 slots a program), both kinds,
    the memory norm on and off."""
    monkeypatch.setattr(fused_core, "SPLIT", split)
    use_core("fused")
    model = randomized(small(kind, d_model=d_model, n_heads=n_heads, n_layers=2,
                             memory_norm=memory_norm, mem_len=4))
    tokens = torch.randint(0, 11, (batch, 6))
    runs = program_order(order)
    _assert_matches_reference(model, tokens)
    # The order really was another: many launches of several programs, each program once.
    multi = [r for r in runs if len(r) > 1]
    assert len(multi) > 20
    assert all(len(set(r)) == len(r) for r in multi)
    if order == "reverse":
        assert all(r == sorted(r, reverse=True) for r in multi)
    else:  # (a shuffle of two programs keeps their order half the time)
        assert sum(r != sorted(r) for r in multi) > len(multi) / 3


@pytest.mark.parametrize("kind", ["feedback_kv", "feedback"])
def test_fused_agrees_with_python_core_on_dropout_and_carried_memory(kind, use_core,
                                                                    monkeypatch):
    """Dropout (the masks drawn before the sweep, as the PyTorch core draws them, then read
    by the kernels) and memory carried over from a first call, re-projected with the
    current weights (memory norm on): two calls, the same logits, carried keys and values
    and every gradient as the PyTorch core from one seed. Windows of up to 4 slots split
    over programs of 3 (dropout's masks read by split)."""
    monkeypatch.setattr(fused_core, "SPLIT", 3)
    model = randomized(small(kind, dropout=0.3, n_layers=2, mem_len=4,
                             memory_norm="layernorm")).train()
    tokens = torch.randint(0, 11, (3, 5))
    runs = []
    for name in ("python", "fused"):
        use_core(name)
        torch.manual_seed(5)
        model.zero_grad(set_to_none=True)
        logits, state = model(tokens)
        logits2, state2 = model(tokens[:, :3], state.detached())
        loss_of(torch.cat([logits, logits2], 1)).backward()
        runs.append((logits, logits2, state2.keys, state2.values, grads(model)))
    (*want, want_grads), (*got, got_grads) = runs
    for a, b in zip(got, want, strict=True):  # other masks would differ by O(1)
        torch.testing.assert_close(a, b, rtol=0, atol=TOL)
    _assert_close(got_grads, want_grads, TOL)


def test_the_memory_is_made_by_the_split_that_reads_it(use_core):
    """On a GPU a launch's programs run at once: step t-1's memory keys and values (made by
    layer 0's attend at step t) must come from the split whose share of the window holds
    that slot (the last), which reads them after its barrier. The interpreter runs programs
    one after another, so a race would not show as wrong numbers: here the first of two
    splits runs alone and must write nothing, and a lone split (the last) must write."""
    use_core("fused")
    spec = CoreSpec(n_layers=1, n_heads=2, shared_kv=True, window=8, dropout=0.0)
    model = build_model(small("feedback_kv", n_layers=1), 11).double()
    inputs = _core_inputs(model, torch.randn(2, 3, 16, dtype=torch.float64), 1, 2)
    with fused_launch.recording() as launches:
        fused_core._forward(spec, inputs, keep_tape=True)
    launch = next(x for x in launches if x.name == "attend" and x.args["mem"])
    args = {**launch.args, "ell": 0}  # the memory alone
    args["hid_ptr"].normal_()
    kv, slot = args["kv_ptr"], args["slot"]
    for n_split, writes in ((2, False), (1, True)):
        kv.fill_(7.0)
        fused_launch._INTERPRETED["attend"][(1, 2, 1)](**{**args, "n_split": n_split},
                                                    **launch.constexprs)
        assert bool((kv[:, :, :, slot] != 7.0).any()) == writes, n_split
        assert bool((kv[:, :, :, slot] == 7.0).any()) != writes  # every head's, whole


def test_key_value_buffers_past_32_bit_offsets_are_refused():
    """The kernels' offsets into the whole key/value buffer are 32-bit: a call that would
    need more is refused in one line (no device: the host side on meta tensors)."""
    spec = CoreSpec(n_layers=6, n_heads=8, shared_kv=False, window=1024, dropout=0.0)
    with pytest.raises(fused_core.CoreError, match="past its 32-bit offsets"):
        fused.kernels_per_step(spec, batch=1024, steps=1024, d_model=512, d_ff=64)
    fused.kernels_per_step(spec, batch=16, steps=4, d_model=64, d_ff=64)  # (well within)


def test_fused_tape_holds_the_masks_the_python_core_draws(use_core):
    """The test mode for dropout: the tape of a forward holds the masks its kernels read,
    and they are the PyTorch core's (same generator, shapes and order)."""
    use_core("fused")
    model = randomized(small("feedback", dropout=0.5, n_layers=2))
    spec = CoreSpec(n_layers=2, n_heads=2, shared_kv=False, window=32, dropout=0.5)
    x0 = torch.randn(3, 4, 16, dtype=torch.float64)
    inputs = _core_inputs(model, x0, 2, 2)
    torch.manual_seed(9)
    tape = fused_core.FusedTape(*select.core().core_forward(spec, inputs, keep_tape=True).tape)
    torch.manual_seed(9)
    masks = draw_masks(spec, x0, 0, 24)
    for name in ("att", "prob", "h", "ff"):
        assert torch.equal(getattr(tape, f"mask_{name}"), getattr(masks, name)), name
    assert 0 < (tape.mask_h == 0).double().mean() < 1


def _assert_float32_agreement(want_run: tuple, got_run: tuple) -> None:
    """Two float32 steps (``_step``'s results) agree to float32 rounding: logits within
    1e-4, each gradient within 1e-4 of its largest entry."""
    (want_logits, _, _, want), (got_logits, _, _, got) = want_run, got_run
    torch.testing.assert_close(got_logits, want_logits, rtol=0, atol=1e-4)
    for name in want:
        scale = want[name].abs().max().item()
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-4 * scale,
                                   msg=lambda m, n=name: f"{n}: {m}")


def test_fused_float32_step_matches_the_cpp_core(use_core):
    """One float32 training step at the main job's width (d_model 128, 4 heads, d_ff 512)
    with 2 layers, batch 16, 4 steps, dropout 0.1, against the C++ core (in the interpreter
    every step costs seconds; the main job's 4 layers and 64 steps would take minutes).
    Both sum in float32 in other orders (the kernels' tl.dot in IEEE float32, no TF32), so
    they agree to float32 rounding: logits within 1e-4 (they are O(1)) and each gradient
    within 1e-4 of its largest entry, the bound test_models.py holds float32 to against
    float64. Every relu input is kept clear of zero (reference.keep_relus_clear_of_zero):
    as drawn, one lay within rounding of it (on an AVX2 CPU) and took its gate one way
    in each core, which put ff1's gradients far past the bound."""
    cfg = ModelConfig(kind="feedback_kv", d_model=128, n_heads=4, d_ff=512, n_layers=2,
                      dropout=0.1, max_rel_pos=64)
    torch.manual_seed(0)
    model = build_model(cfg, 11).train()
    keep_relus_clear_of_zero(model)
    tokens = torch.randint(0, 11, (16, 4))
    runs = []
    for name in ("native", "fused"):
        use_core(name)
        torch.manual_seed(3)
        runs.append(_step(model, tokens))
    _assert_float32_agreement(*runs)


@pytest.fixture
def matmul_precision():
    """``matmul_precision(p)``: torch.set_float32_matmul_precision(p) for this test only
    (torch's per-backend flags put back as they were after)."""
    from fbtrain.models.core.fused import precision

    legacy, flags = precision._state()
    yield torch.set_float32_matmul_precision
    torch.set_float32_matmul_precision(legacy or "highest")
    for owner, value in flags:
        owner.fp32_precision = value


def test_fused_gradients_stay_ieee_float32_under_high_matmul_precision(use_core, monkeypatch,
                                                                       matmul_precision):
    """A user's torch.set_float32_matmul_precision("high") lets cuBLAS run float32 matmuls
    in TF32 (10-bit mantissas), which would put the fused core's weight gradients (torch
    matmuls after the sweep) past its 1e-4 bound. The core runs them in IEEE float32: they
    see "highest" whatever the caller set, and the caller's "high" is back after; the
    float32 step still agrees with the C++ core within the bound."""
    seen = []
    real = fused_core.weight_grads

    def spy(*args, **kwargs):
        seen.append(torch.get_float32_matmul_precision())
        return real(*args, **kwargs)

    monkeypatch.setattr(fused_core, "weight_grads", spy)
    matmul_precision("high")
    model = build_model(ModelConfig(kind="feedback_kv", d_model=32, n_heads=2, d_ff=48,
                                    n_layers=2, max_rel_pos=8), 11).train()
    keep_relus_clear_of_zero(model)
    tokens = torch.randint(0, 11, (3, 5))
    runs = []
    for name in ("native", "fused"):
        use_core(name)
        runs.append(_step(model, tokens))
    assert seen == ["highest"]
    assert torch.get_float32_matmul_precision() == "high"
    _assert_float32_agreement(*runs)


@pytest.mark.parametrize("setup", ["default", "legacy high", "legacy medium", "new tf32"])
def test_ieee_float32_scope_restores_every_precision_setting(setup, matmul_precision):
    """Inside: IEEE float32 by both of torch's interfaces (the legacy setting and the
    per-backend flags, which torch requires to agree at each matmul); after: exactly the
    caller's settings, whichever interface set them."""
    from fbtrain.models.core.fused import precision

    matmul_precision("highest")
    if setup.startswith("legacy"):
        matmul_precision(setup.split()[1])
    elif setup == "new tf32":
        if not hasattr(torch.backends.cuda.matmul, "fp32_precision"):
            pytest.skip("torch before 2.9 has no per-backend precision flags")
        torch.backends.cuda.matmul.fp32_precision = "tf32"
    before = precision._state()
    with precision.ieee_float32():
        assert torch.get_float32_matmul_precision() == "highest"
        assert getattr(torch.backends.cuda.matmul, "fp32_precision", "ieee") in ("ieee",
                                                                                  "none")
        assert torch.backends.cuda.matmul.allow_tf32 is False
    assert precision._state() == before


def _load_the_cpp_core_uncaptured(capsys) -> None:
    """Load the C++ core (the fallback) before a test reads its notice: a worker's first
    load takes the build folder's lock, and where another process (a CLI test's child)
    holds it for its own load, a "waiting for another process" line would join the one
    line the test expects."""
    native.native_ops()
    capsys.readouterr()


def test_fused_choice_without_cuda_or_interpreter_falls_back_with_one_line(monkeypatch,
                                                                           capsys):
    """No CUDA device and no TRITON_INTERPRET: one line says why, and today's core runs
    (never other numbers silently)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("FBTRAIN_CORE", "fused")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    _load_the_cpp_core_uncaptured(capsys)
    select._resolve.cache_clear()
    try:
        assert select.core() is native.NativeCore
        assert select.core() is native.NativeCore
    finally:
        select._resolve.cache_clear()
    assert capsys.readouterr().err.splitlines() == [
        "fbtrain: FBTRAIN_CORE=fused, but there is no CUDA device (TRITON_INTERPRET=1 runs "
        "its kernels on the CPU, slowly); running on the C++ core instead"]


def test_fused_choice_without_triton_falls_back_with_one_line(monkeypatch, capsys):
    real = select.importlib.util.find_spec
    monkeypatch.setattr(select.importlib.util, "find_spec",
                        lambda name, *a: None if name == "triton" else real(name, *a))
    monkeypatch.setenv("FBTRAIN_CORE", "fused")
    _load_the_cpp_core_uncaptured(capsys)
    select._resolve.cache_clear()
    try:
        assert select.core() is native.NativeCore
    finally:
        select._resolve.cache_clear()
    assert capsys.readouterr().err.splitlines() == [
        "fbtrain: FBTRAIN_CORE=fused, but Triton is not installed (pip install triton; "
        "Linux x86_64); running on the C++ core instead"]


def test_fused_core_hands_cpu_calls_to_its_fallback_without_the_interpreter(monkeypatch):
    """A fused core (chosen on a CUDA machine) given CPU tensors without the interpreter
    (a model moved to the CPU to sample) runs them on today's core."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    calls = []

    class Spy:
        @staticmethod
        def core_forward(spec, inputs, keep_tape=False):
            calls.append("forward")
            return python.core_forward(spec, inputs, keep_tape)

    core = fused.FusedCore(Spy)
    model = build_model(small("feedback_kv", n_layers=1), 11)
    inputs = _core_inputs(model, torch.randn(1, 2, 16), 1, 2)
    spec = CoreSpec(n_layers=1, n_heads=2, shared_kv=True, window=32, dropout=0.0)
    core.core_forward(spec, inputs)
    assert calls == ["forward"]


@pytest.mark.parametrize(("n_layers", "shared_kv", "n0"),
                         [(4, True, 0), (4, False, 0), (6, True, 0), (4, False, 5)])
def test_launches_per_token_layer(n_layers, shared_kv, n0):
    """By count, from the launches themselves (no device): four kernels a token-layer each
    way; a step that attends nothing (the first, from empty memory) skips attend and
    out_proj forward and q_back backward; the last step's memory is one more launch. So at
    most 8 a token-layer for forward and backward together from empty memory (the issue's
    target), and 8 + 1/(T L) with carried memory."""
    spec = CoreSpec(n_layers=n_layers, n_heads=4, shared_kv=shared_kv, window=64,
                    dropout=0.1, memory_norm=True)
    T = 64
    counts = fused.kernels_per_step(spec, batch=16, steps=T, d_model=128, d_ff=512, n0=n0)
    silent = 0 if n0 else 1  # steps that attend nothing
    assert counts == {"forward": 4 * T * n_layers - 2 * n_layers * silent + 1,
                      "backward": 4 * T * n_layers - n_layers * silent}
    per_token_layer = (counts["forward"] + counts["backward"]) / (T * n_layers)
    assert per_token_layer <= 8 + (1 / (T * n_layers) if n0 else 0)


def test_compile_cases_name_every_kernel_with_its_whole_signature():
    """What tools compile (``triton.compile(ASTSource(fn, signature, constexprs))``): the
    eight kernels, each signature naming every parameter of its kernel in order, pointers
    typed by the training dtype, the constants as launched, grids of batch tiles by heads
    or column tiles."""
    cases = fused.compile_cases(128, 4, 512, 4, 16, 64, False, True, 0.1)
    assert [c[0] for c in cases] == ["ff_in", "ff_out", "attend", "out_proj",
                                     "ffo_back", "ffi_back", "att_back", "q_back"]
    for name, fn, signature, constexprs, _ in cases:
        assert fn is fused_launch._JIT[name]
        params = list(inspect.signature(fused_launch.KERNELS[name]).parameters)
        assert list(signature) == params, name
        assert {k for k, v in signature.items() if v == "constexpr"} == set(constexprs)
        assert all(v == "*fp32" for k, v in signature.items() if k.endswith("_ptr")), name
    grids = {name: grid for name, _, _, _, grid in cases}
    # (attend's first launch at step 1 attends 1 slot; att_back's first, at step 63, 63
    # slots: two programs of SPLIT = 32 slots a head)
    assert grids == {"attend": (1, 4, 1), "att_back": (1, 4, 2), "ff_in": (1, 16),
                     "ffo_back": (1, 16), "out_proj": (1, 4), "ff_out": (1, 4),
                     "ffi_back": (1, 4), "q_back": (1, 4)}
    consts = {name: c for name, _, _, c, _ in cases}
    assert consts["attend"]["DROPOUT"] and consts["attend"]["NORM"]
    assert consts["attend"]["NKV"] == consts["q_back"]["NKV"] == 4
    assert fused.compile_cases(128, 4, 512, 4, 40, 64, True, False, 0.0)[0][4] == (3, 16)
