"""Calibration across ranks with torch.distributed (``torchrun ... -m lowbit quantize``).

Every rank reads each decoder layer and runs its own shard of the calibration batches
through it; the statistics a method reads (GPTQ's xᵀx, AWQ's activation means and its
grid and clipping losses) are summed across ranks, the Linears of a layer are spread over
the ranks (each quantizes the ones it owns and broadcasts the result), and each rank keeps
its own shard of the layer's outputs as the next layer's inputs. Rank 0 writes the
checkpoint. One process is a world of size 1, where every collective here is a no-op, so
the pipeline has one code path.

A rank that fails records its error in the process group's store before it exits; a rank
whose collective then breaks (gloo notices the closed connection) reads it there and stops
with the failing rank named (:class:`RankFailure`). torchrun stops the remaining ranks.
"""

from __future__ import annotations

import hashlib
import math
import os
import time
import zlib
from contextlib import contextmanager
from datetime import timedelta

import torch

FAILED_KEY = "lowbit/failed/"


class RankFailure(RuntimeError):
    """Another rank failed (or vanished) while this one waited for it in a collective."""


class World:
    """This process's place among the ranks; a world of size 1 without torch.distributed."""

    def __init__(self, rank: int = 0, size: int = 1, comm_device: torch.device | None = None):
        self.rank, self.size = rank, size
        self.comm_device = comm_device or torch.device("cpu")  # where the backend takes tensors (NCCL: the GPU)
        self.comm_seconds = 0.0  # time inside collectives, waiting for slower ranks included

    @property
    def main(self) -> bool:
        return self.rank == 0

    def __repr__(self) -> str:
        return f"World(rank={self.rank}, size={self.size})"

    # ------------------------------------------------------------ collectives

    @contextmanager
    def _collective(self):
        start = time.perf_counter()
        try:
            yield
        except RankFailure:
            raise
        except (RuntimeError, ConnectionError) as e:  # gloo: "Connection closed by peer", timeouts
            raise RankFailure(self.failure_note(e)) from None
        finally:
            self.comm_seconds += time.perf_counter() - start

    def sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` summed over the ranks, in place (every rank gets the same bits)."""
        if self.size == 1:
            return tensor
        import torch.distributed as dist

        with self._collective():
            staged = tensor.to(self.comm_device)
            dist.all_reduce(staged)
            if staged is not tensor:
                tensor.copy_(staged)
        return tensor

    def total(self, value: float) -> float:
        """A number summed over the ranks (row counts, losses)."""
        return float(self.sum_(torch.tensor([value], dtype=torch.float64))[0]) if self.size > 1 else value

    def mean_rows(self, x: torch.Tensor) -> torch.Tensor:
        """The mean over the rows of ``x`` [n, k] of every rank together."""
        if self.size == 1:
            return x.mean(0)
        rows = self.total(x.shape[0])
        return self.sum_(x.sum(0)) / rows

    def broadcast_object(self, obj, src: int = 0):
        """``obj`` as rank ``src`` has it (pickled: small things only)."""
        if self.size == 1:
            return obj
        import torch.distributed as dist

        box = [obj]
        with self._collective():
            dist.broadcast_object_list(box, src=src, device=self.comm_device)
        return box[0]

    def broadcast_tensors(self, tensors: dict | None, src: int) -> dict:
        """A dict of tensors (and small values) as rank ``src`` has it: names, shapes and dtypes go
        pickled, the data through the backend, so large weights are not pickled."""
        if self.size == 1:
            return tensors
        import torch.distributed as dist

        meta = None
        if self.rank == src:
            meta = {k: (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else ("value", v)
                    for k, v in tensors.items()}
        meta = self.broadcast_object(meta, src)
        out = {}
        for key, (shape, kind) in meta.items():
            if shape == "value":
                out[key] = kind
                continue
            source = tensors[key] if self.rank == src else torch.empty(shape, dtype=kind)
            staged = source.to(self.comm_device).contiguous()
            with self._collective():
                dist.broadcast(staged, src=src)
            out[key] = source if self.rank == src else staged.cpu()
        return out

    def share_quantized(self, result: tuple | None, src: int) -> tuple:
        """``(QuantizedWeight, stats)`` of one Linear, made on rank ``src``, on every rank."""
        if self.size == 1:
            return result
        from quant.format import QuantizedWeight

        payload = None
        if self.rank == src:
            qw, stats = result
            fields = {"q": qw.q, "scale": qw.scale, "zero": qw.zero, "g_idx": qw.g_idx}
            payload = {**{k: v for k, v in fields.items() if v is not None}, "scheme": qw.scheme, "stats": stats}
        got = self.broadcast_tensors(payload, src)
        return QuantizedWeight(got["q"], got["scale"], got.get("zero"), got["scheme"], got.get("g_idx")), got["stats"]

    def barrier(self) -> None:
        if self.size == 1:
            return
        self.sum_(torch.zeros(1))  # an all-reduce: the same failure path as every other collective

    def agree(self, what: str, text: str) -> None:
        """Refuse to go on unless every rank passes the same ``text`` (compared by sha256)."""
        if self.size == 1:
            return
        import torch.distributed as dist

        digest = hashlib.sha256(text.encode()).hexdigest()
        digests = [None] * self.size
        with self._collective():
            dist.all_gather_object(digests, digest)
        differ = [r for r, d in enumerate(digests) if d != digests[0]]
        if differ:
            raise ValueError(f"{what} differs between ranks: rank(s) {', '.join(map(str, differ))} run another than "
                             f"rank 0 (sha256 {digests[0][:12]} vs {digests[differ[0]][:12]}); every rank must get "
                             "the same recipe, model and options")

    @contextmanager
    def rank0_first(self):
        """Rank 0 runs the block, then the others (a download or a conversion into a shared cache)."""
        if not self.main:
            self.barrier()
        yield
        if self.main:
            self.barrier()

    # ------------------------------------------------------------ work split

    def shard(self, samples: torch.Tensor, batch_size: int) -> list[torch.Tensor]:
        """This rank's calibration batches: the samples in global batches of ``batch_size`` (rounded
        up to a multiple of the ranks), each split across the ranks by interleaving, so rank r holds
        samples r, r + size, r + 2 size, ... and the ranks' first batches together are the first
        global batch. With one rank: ``samples.split(batch_size)``."""
        if samples.shape[0] < self.size:
            raise ValueError(f"calibration.samples is {samples.shape[0]}, fewer than the {self.size} ranks: "
                             f"every rank needs at least one; raise calibration.samples or use fewer ranks")
        step = self.size * math.ceil(batch_size / self.size)
        local = [b[self.rank::self.size] for b in samples.split(step)]
        return [b for b in local if b.shape[0]]

    def local_rows(self, rows: torch.Tensor, row_len: int) -> torch.Tensor:
        """Of the global row indices ``rows`` (samples of ``row_len`` rows, in global sample order),
        the ones this rank holds, as indices into its own rows (see :meth:`shard`)."""
        sample, offset = rows // row_len, rows % row_len
        mine = sample % self.size == self.rank
        return (sample[mine] // self.size) * row_len + offset[mine]

    def owners(self, costs: dict[str, float]) -> dict[str, int]:
        """Which rank quantizes each of ``costs`` (name -> work): the largest first, each to the
        least loaded rank, so Linears quantized together finish together. Ties go round from a
        rank the names choose, so single Linears (o, down) do not all land on rank 0."""
        load = [0.0] * self.size
        first = zlib.crc32(",".join(sorted(costs)).encode()) % self.size
        owner = {}
        for name in sorted(costs, key=lambda n: -costs[n]):
            rank = min(range(self.size), key=lambda r: (load[r], (r - first) % self.size))
            owner[name] = rank
            load[rank] += costs[name]
        return owner

    # ------------------------------------------------------------ failures

    def _store(self):
        from torch.distributed import distributed_c10d as c10d

        return c10d._get_default_store()

    def report_failure(self, error: BaseException) -> str:
        """Record this rank's error where the others look when their collective breaks; return the
        message this rank shows."""
        message = f"rank {self.rank} of {self.size} failed: {type(error).__name__}: {error}"
        if self.size > 1 and not isinstance(error, RankFailure):
            try:
                self._store().set(f"{FAILED_KEY}{self.rank}", message)
            except Exception:  # the store went with a dead rank 0: the message still goes to this rank's output
                pass
        return str(error) if isinstance(error, RankFailure) else message

    def failure_note(self, error: BaseException) -> str:
        """Why a collective broke: the failed rank's own message when it left one."""
        deadline = time.monotonic() + 3.0  # the failing rank records its error just before it exits
        while True:
            try:
                store = self._store()
                for r in range(self.size):
                    if r != self.rank and store.check([f"{FAILED_KEY}{r}"]):
                        return f"stopped on rank {self.rank}: {store.get(f'{FAILED_KEY}{r}').decode()}"
            except Exception:
                break  # the store is gone too (it lived in rank 0)
            if time.monotonic() > deadline:
                break
            time.sleep(0.2)
        return (f"stopped on rank {self.rank}: another rank vanished without reporting an error (killed? out of "
                f"memory? torchrun's summary names it): {type(error).__name__}: {error}")


_current = World()


def current() -> World:
    """The world the running calibration belongs to (size 1 unless :func:`use` set another)."""
    return _current


@contextmanager
def use(world: World):
    global _current
    previous, _current = _current, world
    try:
        yield world
    finally:
        _current = previous


def launched_by_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def init_from_env(device: str | None) -> tuple[World, str | None]:
    """Join the process group torchrun describes in the environment (NCCL for a CUDA device, gloo on
    CPU); return the world and this rank's device. Without torchrun: a world of size 1."""
    if not launched_by_torchrun():
        return World(), device
    import torch.distributed as dist

    rank, size, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))
    wants_cuda = device is None and torch.cuda.is_available() or (device or "").startswith("cuda")
    if wants_cuda:
        if local >= torch.cuda.device_count():
            raise ValueError(f"rank {rank} is local rank {local}, but this machine has {torch.cuda.device_count()} "
                             "GPU(s): start at most one rank per GPU (--nproc-per-node)")
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    if not dist.is_initialized():
        dist.init_process_group("nccl" if wants_cuda else "gloo", timeout=timedelta(minutes=30))
    return World(rank, size, torch.device(device) if wants_cuda else None), device or "cpu"


def close(world: World) -> None:
    if world.size > 1:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
