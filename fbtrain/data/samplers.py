"""Windows drawn from a :class:`~fbtrain.data.streams.Stream`, as batches ``[batch, seq_len]``.

- :class:`BatchSampler`: random training windows, reproducible from ``(seed, rank)``;
- :class:`SegmentReader`: the split cut into contiguous streams, read one segment at a
  time (training with carried memory);
- :func:`fixed_windows`: the same evaluation windows on every call.
"""

from __future__ import annotations

from typing import Any

import torch

from fbtrain.data.errors import DataError
from fbtrain.data.streams import IGNORE_INDEX, Stream, as_stream, require_tokens, window
from fbtrain.messages import a_type, is_int
from fbtrain.rng import generator_problem, sampler_seed


class BatchSampler:
    """Random training windows from one split, reproducible from ``(seed, rank)``.

    ``data`` is a :class:`Stream` (inputs and targets) or a 1-D tensor of ids (its
    next-token stream). It owns a CPU ``torch.Generator`` (not the global RNG), so model
    code that draws random numbers (dropout) cannot shift which batches come next, and
    saving its state is enough to resume the exact batch sequence.
    """

    def __init__(self, data: torch.Tensor | Stream, seed: int, rank: int = 0):
        self.stream = as_stream(data)
        self.seed = int(seed)
        self.rank = int(rank)
        self.generator = torch.Generator(device="cpu")
        self.generator.manual_seed(sampler_seed(self.seed, self.rank))

    def sample(
        self, batch_size: int, seq_len: int, device: torch.device | str = "cpu"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs x and targets y, LongTensors ``[batch_size, seq_len]`` (for a text, y is x
        shifted by one)."""
        if batch_size < 1 or seq_len < 1:
            raise ValueError(f"batch_size and seq_len must be >= 1, got {batch_size}, {seq_len}")
        n = len(self.stream.inputs)  # predictions (a text: tokens - 1)
        require_tokens(n + 1, seq_len, "training text")
        starts = torch.randint(0, n - seq_len + 1, (batch_size,), generator=self.generator)
        index = starts[:, None] + torch.arange(seq_len)
        # One host->device copy; x and y are made contiguous on the device so that callers
        # may .view() them (e.g. flattening targets for cross-entropy).
        inputs, targets = self.stream
        pair = torch.stack([window(inputs, index), window(targets, index)])
        x, y = pair.to(device, non_blocking=True)
        return x.contiguous(), y.contiguous()

    def state_dict(self) -> dict[str, Any]:
        """Generator state (uint8 tensor) plus seed/rank: safe for ``torch.load(weights_only)``."""
        return {"generator": self.generator.get_state(), "seed": self.seed, "rank": self.rank}

    @staticmethod
    def state_problem(state: Any) -> str:
        """What is wrong with a saved :meth:`state_dict` ('' when nothing is): the generator
        state is tried on a scratch generator, so what passes here loads."""
        if state is None:
            return "missing"
        if not isinstance(state, dict) or "generator" not in state:
            return "not a dict holding the batch sampler's 'generator' state"
        problem = generator_problem(state["generator"])
        if problem:
            return f"generator: {problem}"
        for key in ("seed", "rank"):
            if key in state and not is_int(state[key]):
                return f"{key} is {state[key]!r}, not an integer"
        return ""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; the next batches equal those after it was taken."""
        problem = self.state_problem(state)
        if problem:
            raise DataError(f"batch sampler state is corrupt: {problem}")
        # A checkpoint loaded with map_location='cuda' moves it; the generator needs CPU bytes.
        self.generator.set_state(state["generator"].detach().to("cpu", torch.uint8))


def fixed_windows(
    data: torch.Tensor | Stream, seq_len: int, count: int, context: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic evaluation windows: x, y ``[count', context + seq_len]`` spread evenly
    over ``data`` (a :class:`Stream`, or ids: their next-token stream), the first
    ``context`` targets of each set to :data:`IGNORE_INDEX`.

    With ``context`` > 0 every scored prediction runs on memory filled by ``context``
    earlier tokens, as in training with carried memory. ``count' = min(count, n // (context
    + seq_len))`` for ``n`` predictions: the number of windows that do not overlap. Starts
    run from the first prediction to the last possible one, so the windows sample the whole
    split and every call (and every run) sees the same ones.
    """
    stream = as_stream(data)
    if count < 1 or seq_len < 1 or context < 0:
        raise ValueError(f"count and seq_len must be >= 1 and context >= 0, got {count}, "
                         f"{seq_len}, {context}")
    n, span = len(stream.inputs), context + seq_len
    what = "validation text" + (f" (with {context} tokens of context)" if context else "")
    require_tokens(n + 1, span, what)
    k = min(count, n // span)
    last = n - span
    # Integer spacing: floor(i * last / (k - 1)); consecutive starts differ by >= span.
    starts = torch.tensor([i * last // (k - 1) for i in range(k)] if k > 1 else [0])
    index = starts[:, None] + torch.arange(span)
    x, y = window(stream.inputs, index), window(stream.targets, index)
    y[:, :context] = IGNORE_INDEX
    return x, y


class SegmentReader:
    """Reads the split as contiguous streams, one segment of each at a time, for training
    with carried memory (each stream is a contiguous part of the split's :class:`Stream`).

    ``n_streams * world_size`` streams of ``length`` inputs each; rank r owns streams
    ``[r * n_streams, (r + 1) * n_streams)``, so ranks never share a token. Stream s reads
    inputs ``data[s * length : (s + 1) * length]`` and their next tokens as targets (the
    one after its last input is the next stream's first), so one pass over all streams
    feeds every token of ``data[: n_streams * world_size * length]`` exactly once; the
    fewer than ``n_streams * world_size + 1`` tokens left at the end are never read.
    :meth:`segment` walks all streams together; at the end of the streams it wraps to
    their start, and the caller resets the memory there. Where the streams lie is a function
    of the data and the rank alone: the only state is the cursor.
    """

    def __init__(self, data: torch.Tensor | Stream, n_streams: int, rank: int = 0,
                 world_size: int = 1):
        stream = as_stream(data)
        if n_streams < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need n_streams >= 1 and 0 <= rank < world_size, got "
                             f"{n_streams}, {rank}, {world_size}")
        total = n_streams * world_size
        self.length = len(stream.inputs) // total
        if self.length < 1:
            raise DataError(f"training text too short for {total} streams: "
                            f"{len(stream.inputs) + 1} tokens, need at least {total + 1}; "
                            "use a smaller train.batch_size")
        self.stream = stream
        self.starts = (rank * n_streams + torch.arange(n_streams)) * self.length  # [n_streams]
        self.cursor = 0

    def segment(self, seq_len: int, device: torch.device | str = "cpu"
                ) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """The next ``seq_len`` inputs and targets of every stream, x, y ``[n_streams, T]``
        (``T`` shorter at the end of the streams), and whether they start the streams (the
        carried memory must then be empty)."""
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        begin = self.cursor
        end = min(begin + seq_len, self.length)
        self.cursor = end % self.length
        index = self.starts[:, None] + torch.arange(begin, end)
        x, y = torch.stack([window(self.stream.inputs, index),
                            window(self.stream.targets, index)]).to(device, non_blocking=True)
        return x.contiguous(), y.contiguous(), begin == 0

    def state_dict(self) -> dict[str, int]:
        return {"cursor": self.cursor, "length": self.length}

    def state_problem(self, state: Any) -> str:
        """What is wrong with a saved :meth:`state_dict` ('' when it fits these streams)."""
        if not isinstance(state, dict):
            return f"the stream layout is {a_type(state)}, not a dict of cursor and length"
        if state.get("length") != self.length:
            return (f"carried streams of length {state.get('length')} do not fit this data and "
                    f"batch (streams of {self.length} tokens); resume with the same data, "
                    "batch size and number of ranks")
        cursor = state.get("cursor")
        if not (is_int(cursor) and 0 <= cursor < self.length):
            return f"the stream cursor is {cursor!r}, not an integer in [0, {self.length})"
        return ""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the cursor; refuses a state made for streams of another length."""
        problem = self.state_problem(state)
        if problem:
            raise DataError(problem)
        self.cursor = int(state["cursor"])
