"""Carried memory across training segments (truncated BPTT): streams, memory flow, detachment."""

from __future__ import annotations

import pytest
import torch
from test_models import ALL_KINDS, randomized, small

from fbtrain.data.errors import DataError
from fbtrain.data.samplers import BatchSampler, SegmentReader
from fbtrain.models import MemoryState
from fbtrain.train.batches import CarriedStreams, RandomWindows

VOCAB = 11


def run_segments(model: torch.nn.Module, streams: CarriedStreams, lengths: list[int]
                 ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Feed consecutive segments as the trainer does; their inputs and logits."""
    inputs, logits = [], []
    for seq_len in lengths:
        (x, _, state), = streams.micro_batches(seq_len, 0, torch.device("cpu"))
        out, new_state = model(x, state)
        streams.keep(0, new_state)
        inputs.append(x)
        logits.append(out)
    return inputs, logits


@pytest.mark.parametrize("kind", ALL_KINDS)
@pytest.mark.parametrize("memory_norm", ["none", "layernorm"])
def test_carried_segments_equal_one_forward(kind: str, memory_norm: str) -> None:
    """Segments 5 + 3 + 6 with carried memory give the logits of one call over all 14."""
    model = randomized(small(kind, memory_norm=memory_norm)).eval()
    data = torch.randint(0, VOCAB, (60,), generator=torch.Generator().manual_seed(0))
    streams = CarriedStreams(SegmentReader(data, n_streams=3), grad_accum=1)
    with torch.no_grad():
        inputs, logits = run_segments(model, streams, [5, 3, 6])
        whole, _ = model(torch.cat(inputs, 1))
    torch.testing.assert_close(torch.cat(logits, 1), whole, rtol=0, atol=1e-10)


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_memory_flows_forward_but_gradients_stop_at_the_boundary(kind: str) -> None:
    """Segment 1's tokens change segment 2's logits (memory flows), but segment 2's loss
    sends no gradient into segment 1 (its embedding rows get none)."""
    # Stream 0 reads tokens 0..4 then 5..9, stream 1 reads 20..24 then 25..29: the
    # embedding rows of segment 1 appear in no later segment.
    data = torch.arange(41)
    model = randomized(small(kind), vocab=41)
    streams = CarriedStreams(SegmentReader(data, n_streams=2), grad_accum=1)
    [first], _ = run_segments(model, streams, [5])
    (x2, _, carried), = streams.micro_batches(5, 0, torch.device("cpu"))
    logits, _ = model(x2, carried)
    logits.square().sum().backward()
    seen_first = first.unique()
    assert model.embed.weight.grad[x2.unique()].abs().sum() > 0
    assert torch.count_nonzero(model.embed.weight.grad[seen_first]) == 0

    with torch.no_grad():  # the same segment 2 after other tokens: other logits
        other = CarriedStreams(SegmentReader((data + 1) % 41, n_streams=2), grad_accum=1)
        run_segments(model, other, [5])
        (_, _, other_memory), = other.micro_batches(5, 0, torch.device("cpu"))
        changed, _ = model(x2, other_memory)
    assert not torch.allclose(changed, logits.detach())


def test_streams_wrap_to_empty_memory_and_accumulation_splits_rows() -> None:
    layout = SegmentReader(torch.arange(25), n_streams=4)  # 4 streams of 6 inputs
    streams = CarriedStreams(layout, grad_accum=2)
    model = randomized(small("feedback_kv"), vocab=25).eval()
    seen = []
    with torch.no_grad():
        for seq_len in (4, 4, 4):  # 4, then the 2 left, then a wrap
            micro = streams.micro_batches(seq_len, 2, torch.device("cpu"))
            seen.append([(x.tolist(), state is None) for x, _, state in micro])
            for m, (x, _, state) in enumerate(micro):
                streams.keep(m, model(x, state)[1])
    assert seen[0] == [([[0, 1, 2, 3], [6, 7, 8, 9]], True), ([[12, 13, 14, 15],
                                                             [18, 19, 20, 21]], True)]
    assert seen[1] == [([[4, 5], [10, 11]], False), ([[16, 17], [22, 23]], False)]
    assert seen[2] == [(seen[0][0][0], True), (seen[0][1][0], True)]  # wrapped: empty memory


def test_random_windows_carry_nothing() -> None:
    windows = RandomWindows(BatchSampler(torch.arange(100), seed=0), grad_accum=3)
    micro = windows.micro_batches(8, 2, torch.device("cpu"))
    assert len(micro) == 3
    assert all(x.shape == (2, 8) and torch.equal(y, x + 1) and state is None
               for x, y, state in micro)


@pytest.mark.parametrize("kind", ALL_KINDS)
@pytest.mark.parametrize("memory_norm", ["none", "layernorm"])
def test_carried_keys_are_reprojected_with_the_current_weights(kind: str,
                                                               memory_norm: str) -> None:
    """A training call keeps what its keys/values were projected from; the next call
    re-projects them with the weights of that moment (as the paper's code and
    Transformer-XL do), so after an optimizer step the carried keys are not last step's.
    With unchanged weights re-projecting changes nothing."""
    model = randomized(small(kind, memory_norm=memory_norm))
    first, second = torch.randint(0, VOCAB, (2, 2, 6))
    _, state = model(first)  # differentiable: keeps sources
    state = state.detached()
    assert state.sources is not None
    as_carried = MemoryState(state.keys, state.values, state.steps)  # no sources
    with torch.no_grad():
        same, _ = model(second, state)
        torch.testing.assert_close(same, model(second, as_carried)[0], rtol=1e-11,
                                   atol=1e-12)
        projections = [m for name, m in model.named_modules()
                       if name.endswith(("key", "value")) and isinstance(m, torch.nn.Linear)]
        for linear in projections:  # an "optimizer step" on the memory projections alone
            linear.weight.add_(0.1)
        moved, _ = model(second, state)
        stale, _ = model(second, as_carried)
    assert not torch.allclose(moved, stale)


def _carried(grad_accum: int, *, restores_memory: bool = True) -> CarriedStreams:
    """4 streams of 6 inputs in ``grad_accum`` micro-batches, after one segment of 4 with a
    memory kept for every micro-batch."""
    streams = CarriedStreams(SegmentReader(torch.arange(25), n_streams=4), grad_accum,
                             restores_memory=restores_memory)
    model = randomized(small("feedback_kv"), vocab=25).eval()
    with torch.no_grad():
        for m, (x, _, state) in enumerate(streams.micro_batches(4, 0, torch.device("cpu"))):
            streams.keep(m, model(x, state)[1])
    return streams


def test_carried_streams_resume_their_memory_and_refuse_memory_that_does_not_fit() -> None:
    saved = _carried(2).state_dict()
    again = CarriedStreams(SegmentReader(torch.arange(25), n_streams=4), 2)
    assert again.state_problem(saved) == ""
    again.load_state_dict(saved)
    assert again.layout.cursor == 4
    assert all(torch.equal(a.keys, b["keys"]) for a, b in zip(again.states, saved["memory"],
                                                              strict=True))
    # The same streams in one micro-batch of 4 rows: two memories of 2 rows cannot be used,
    # and going on from empty memory in silence would train on a different context.
    one = CarriedStreams(SegmentReader(torch.arange(25), n_streams=4), 1)
    problem = one.state_problem(saved)
    assert problem == ("the carried memory of 2 micro-batches does not fit "
                       "train.grad_accum = 1; resume with the grad_accum (and batch_size) it "
                       "was trained with")
    with pytest.raises(DataError, match="^the carried memory of 2 micro-batches"):
        one.load_state_dict(saved)
    assert one.states == [None] and one.layout.cursor == 0  # refused: nothing loaded
    rows = _carried(1).state_dict()
    memory = rows["memory"][0]
    memory["keys"], memory["values"] = memory["keys"][:, :3], memory["values"][:, :3]
    assert one.state_problem(rows) == ("the carried memory of micro-batch 0: keys of 3 rows x "
                                       "heads do not fit 4 rows")
    assert "train.context reset" in one.state_problem(None)  # no streams saved at all


def test_a_rank_that_saved_no_memory_resumes_the_cursor_on_empty_memory() -> None:
    """Only rank 0's memory is in a checkpoint: the other ranks load the cursor alone."""
    saved = _carried(2).state_dict()
    other = CarriedStreams(SegmentReader(torch.arange(25), n_streams=4), 1,
                           restores_memory=False)
    assert other.state_problem(saved) == ""
    other.load_state_dict(saved)
    assert other.layout.cursor == 4 and other.states == [None]
