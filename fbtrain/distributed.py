"""DistributedDataParallel plumbing: one small context that the trainer asks about ranks.

``torchrun --nproc_per_node=N -m fbtrain train ...`` sets ``WORLD_SIZE``, ``RANK`` and
``LOCAL_RANK``; with ``WORLD_SIZE > 1`` :func:`session` joins the process group (NCCL on
GPUs, gloo on CPUs), pins each rank to ``cuda:LOCAL_RANK`` on a GPU machine and leaves the
group on exit. Without those variables everything here is a no-op single process.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from fbtrain.device import resolve_device
from fbtrain.errors import EXIT_FAILED, UserError


@dataclass
class DistContext:
    """Where this process sits: ``rank`` of ``world_size`` processes, on ``device``."""

    device: torch.device
    world_size: int = 1
    rank: int = 0
    local_rank: int = 0
    # The DistributedDataParallel wrappers made by :meth:`wrap`, for :meth:`release`.
    wrapped: list[DistributedDataParallel] = field(default_factory=list, repr=False)

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Rank 0: the one process that writes logs and checkpoints."""
        return self.rank == 0

    def barrier(self) -> None:
        if not self.enabled:
            return
        if self.device.type == "cuda":
            dist.barrier(device_ids=[self.device.index])
        else:
            dist.barrier()

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over ranks in place (identity for one process); returns it."""
        if self.enabled:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def wrap(self, model: nn.Module) -> nn.Module:
        """The model in DistributedDataParallel (which broadcasts rank 0's weights), or as is."""
        if not self.enabled:
            return model
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        wrapped = DistributedDataParallel(model, device_ids=device_ids)
        self.wrapped.append(wrapped)
        return wrapped

    def release(self) -> None:
        """Free each wrapper's Reducer (and the Logger that holds it) while the process group
        still lives; the wrappers cannot train after this.

        A Reducer holds the group. Freed last, after ``destroy_process_group``, it destroys
        the group itself, inside a Python decref, holding the GIL: the gloo group's
        destructor joins its worker thread, and a worker still freeing a finished
        collective's tensor waits for the GIL (a rank hung at exit so, now and then). Freed
        first, it leaves the group to ``destroy_process_group``, whose binding releases the
        GIL while the group is destroyed."""
        for wrapper in self.wrapped:
            for name in ("logger", "reducer"):  # the Logger holds the Reducer
                wrapper.__dict__.pop(name, None)
        self.wrapped.clear()


class PeerLost(UserError):
    """Another rank of the group died (killed, out of memory, its machine gone): this one
    cannot go on either. Exit 1, like a failed run; the line names the rank and the last
    checkpoint, from which ``--resume auto`` continues."""

    exit_code = EXIT_FAILED
    # With a peer gone, the gloo group can deadlock the interpreter's teardown: freeing the
    # DDP Reducer destroys the group, whose destructor joins its worker threads holding the
    # GIL, while a worker needs the GIL to free a failed collective's tensors (seen as a
    # hang after the line was printed). Nothing is left to save by then.
    skip_teardown = True


# What a collective raises when the other end of its connection has gone: gloo's TCP
# transport ("Connection reset by peer", "Connection closed by peer", a broken pipe), and
# NCCL's abort once its watchdog finds a rank missing.
PEER_FAILURES = ("Connection reset by peer", "Connection closed by peer", "Broken pipe",
                 "gloo/transport", "NCCL communicator was aborted")


def is_peer_failure(error: BaseException) -> bool:
    """Whether ``error`` (from a collective) means another rank is gone."""
    return isinstance(error, RuntimeError) and (
        isinstance(error, dist.DistNetworkError)
        or any(text in str(error) for text in PEER_FAILURES))


def peer_lost(ctx: DistContext, last: Path, complete: bool) -> PeerLost:
    """The one line for a rank whose peer died: which rank (with two, the other one; gloo
    does not say which of several), whether training had finished, the last checkpoint."""
    who = f"rank {1 - ctx.rank}" if ctx.world_size == 2 else "another rank"
    when = "after training finished" if complete else "during training"
    saved = f"last checkpoint: {last}" if last.is_file() else "no checkpoint was saved yet"
    then = "; resume with --resume auto" if last.is_file() and not complete else ""
    return PeerLost(f"{who} of {ctx.world_size} stopped {when} (its connection closed: "
                    f"killed or crashed; see its own output), so rank {ctx.rank} stops too; "
                    f"{saved}{then}")


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else default


def _import_before_the_group() -> None:
    """Import ``torch._dynamo``, which DistributedDataParallel imports when it is built, before
    the process group exists.

    Among the modules it pulls in, ``torch.distributed.nn.functional`` takes ``group.WORLD`` as
    default arguments: imported once a group exists, it holds that group for good, so
    ``destroy_process_group`` cannot free it and the group's gloo threads outlive the session.
    At exit such a thread can still be freeing a tensor Python let go of: it reaches for the GIL
    of an interpreter that is shutting down and the rank aborts ("terminate called without an
    active exception", SIGABRT; the failure pytorch/pytorch#179291 describes for a group never
    destroyed): once in 58 runs here of tests/test_step.py's two-rank driver.
    Imported first, the defaults hold nothing and the group ends with the session.
    """
    import torch._dynamo  # noqa: F401


@contextlib.contextmanager
def session(device_name: str) -> Iterator[DistContext]:
    """Yield the :class:`DistContext` for this process; joins/leaves the process group.

    ``device_name`` is ``run.device``. Under torchrun on a CUDA device every rank uses
    ``cuda:LOCAL_RANK`` (an explicit ``cuda:N`` is overridden: one GPU per rank).
    A group that someone else already initialised is used and left in place.
    """
    device = resolve_device(device_name)
    world_size = _env_int("WORLD_SIZE", 1)
    if world_size <= 1:
        yield DistContext(device=device)
        return
    rank, local_rank = _env_int("RANK", 0), _env_int("LOCAL_RANK", 0)
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    owns_group = not dist.is_initialized()
    if owns_group:
        _import_before_the_group()
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    context = DistContext(device=device, world_size=world_size, rank=rank, local_rank=local_rank)
    lost = False
    try:
        yield context
    except PeerLost:
        lost = True
        raise
    finally:
        context.release()
        if owns_group and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except RuntimeError:
                if not lost:  # with a peer gone, ending the group may fail: the line is out
                    raise
