"""Data parallelism across GPUs and nodes with torch.distributed, launched by torchrun.

    torchrun --nproc-per-node 2 -m qerl train --profile small ...          # one node, 2 GPUs
    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 8 \\
        --rdzv-backend c10d --rdzv-endpoint HOST0:29500 -m qerl train ...  # node 0 of 2 (node 1: --node-rank 1)

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK (and the rendezvous address); ``init()`` reads them
and starts the default process group (NCCL on CUDA, gloo on the CPU). Without them (a plain
``python -m qerl train``) nothing is started and every helper here is the identity, so a single
process runs exactly the code it ran before.

How the RL step (qerl.step) uses it:
- each rank rolls out a contiguous share of the step's prompts (``shard``), whole groups only, so
  rewards and group advantages need no communication; the per-completion rewards and lengths are
  then gathered (``gather_shards``) so every rank sees the whole batch, as one process would.
- the mini/micro-batch plan is global (the same on every rank); each rank runs its members of each
  micro-batch (``pack_micro_batches``), and the loss of every micro-batch is normalised with GLOBAL
  counts (sequences or tokens of the whole micro/mini-batch over all ranks), so the SUM of the
  ranks' gradients is the single-process gradient. ``all_reduce_grads`` sums the trainable gradients once per optimizer step, in flat
  buckets.
- metrics are reduced here (sums, token-weighted means, max of times); logging, checkpoints and
  evaluation happen on rank 0.

Why not DistributedDataParallel: DDP averages (divides by world size) and needs every rank to run
the same number of backward passes; here ranks can hold different numbers of completions in a
mini-batch (uneven prompt shares, DAPO's dynamic sampling, the random order of policy updates), and
the normaliser is global anyway. Summing the gradients ourselves after the accumulation loop is
exact, has no hook machinery, keeps the model unwrapped (the rollout engine, gradient
checkpointing and adapter export see the plain model), and costs one collective per optimizer
step; LoRA gradients are small, so overlapping their all-reduce with the backward (DDP's gain)
would save little next to a rollout. Full fine-tuning (bf16_full) uses the same path: replicated
weights and optimizer state on every rank (DDP's memory use), not FSDP2 sharding (see the README).
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from qerl.config import env

_OWNS_GROUP = False  # True when init() started the process group (and cleanup() may end it)


# ----------------------------------------------------------------------------- setup
def env_world_size() -> int:
    """WORLD_SIZE as torchrun set it (1 without torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def init(timeout_min: float | None = None) -> bool:
    """Start the default process group from torchrun's environment; True if this call started it.

    Nothing happens with WORLD_SIZE unset or 1, or when a group already exists. NCCL when CUDA is
    available (one GPU per process: cuda:LOCAL_RANK), gloo otherwise. ``timeout_min`` (default
    $QERL_DIST_TIMEOUT_MIN, else 60) bounds how long ranks wait for each other; it must cover an
    evaluation, which runs on rank 0 while the others wait.
    """
    global _OWNS_GROUP
    if dist.is_initialized() or env_world_size() <= 1:
        return False
    if timeout_min is None:
        timeout_min = float(env("QERL_DIST_TIMEOUT_MIN", "60"))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(local_rank())
    kw = {"device_id": torch.device("cuda", local_rank())} if cuda else {}
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(minutes=timeout_min), **kw)
    _OWNS_GROUP = True
    return True


def cleanup() -> None:
    """End the process group if ``init`` started it."""
    global _OWNS_GROUP
    if _OWNS_GROUP and dist.is_initialized():
        dist.destroy_process_group()
    _OWNS_GROUP = False


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def world() -> tuple[int, int]:
    """(rank, world_size); (0, 1) in a single process."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def is_main() -> bool:
    return world()[0] == 0


def print0(*args, **kw) -> None:
    """print on rank 0 only."""
    if is_main():
        print(*args, **kw)


def pick_device() -> torch.device:
    """cuda:LOCAL_RANK under torchrun, "cuda" in a single process, else the CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    if "LOCAL_RANK" in os.environ:
        return torch.device("cuda", local_rank())
    return torch.device("cuda")


def barrier() -> None:
    if is_distributed():
        dist.barrier()


def _comm_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# ----------------------------------------------------------------------------- splitting work
def shard(n: int, rank: int, world_size: int) -> tuple[int, int]:
    """[lo, hi) of ``n`` items for ``rank``: contiguous, the first n % world_size ranks get one more."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} out of range for world size {world_size}")
    base, extra = divmod(n, world_size)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (rank < extra)


def pack_micro_batches(micro: list[torch.Tensor], first: int, n_local: int, capacity: int):
    """This rank's members of each global micro-batch, packed into forwards of up to ``capacity`` rows.

    ``micro`` holds the global completion indices of each micro-batch; this rank holds the
    completions [first, first + n_local). Yields packs, each a list of (j, rows): micro-batch
    ``micro[j]``'s members on this rank as local row indices, in order; micro-batches with no member
    here are skipped. Under data parallelism a rank owns ~capacity / world rows of each micro-batch,
    and packing several micro-batches into one forward keeps the forwards full (half as many on 2
    GPUs) while each micro-batch keeps its own loss normaliser. In a single process each pack is one
    micro-batch.
    """
    pack, size = [], 0
    for j, mi in enumerate(micro):
        own = mi[(mi >= first) & (mi < first + n_local)] - first
        if own.numel() == 0:
            continue
        if pack and size + own.numel() > capacity:
            yield pack
            pack, size = [], 0
        pack.append((j, own))
        size += own.numel()
    if pack:
        yield pack


# ----------------------------------------------------------------------------- reductions
_OPS = {"sum": "SUM", "max": "MAX", "min": "MIN"}


def all_reduce(values, op: str = "sum"):
    """Reduce a float, a list of floats or a tensor over ranks (``op``: sum | max | min).

    Floats travel as float64 (exact for counts); a tensor is reduced in a copy of its own dtype and
    returned on its own device. Identity in a single process.
    """
    if op not in _OPS:
        raise ValueError(f"op must be one of {tuple(_OPS)}, got {op!r}")
    if not is_distributed():
        return values
    if isinstance(values, torch.Tensor):
        t = values.detach().to(_comm_device(), copy=True)
        dist.all_reduce(t, op=getattr(dist.ReduceOp, _OPS[op]))
        return t.to(values.device)
    scalar = not isinstance(values, (list, tuple))
    t = torch.tensor([values] if scalar else list(values), dtype=torch.float64, device=_comm_device())
    dist.all_reduce(t, op=getattr(dist.ReduceOp, _OPS[op]))
    out = t.tolist()
    return out[0] if scalar else out


def weighted_mean(value_sum: float, weight: float) -> float | None:
    """sum over ranks of ``value_sum`` / sum of ``weight`` (e.g. token-weighted entropy); None if no weight."""
    s, w = all_reduce([value_sum, weight], "sum")
    return s / w if w > 0 else None


def any_true(flag: bool) -> bool:
    """True on every rank if ``flag`` is True on any rank."""
    return bool(all_reduce(float(flag), "max"))


def gather_shards(local: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Concatenate every rank's ``local`` (first dim ``counts[rank]``) in rank order, on every rank.

    Done as a sum of zero-padded copies: exact (x + 0 == x), works for uneven shares, and the
    tensors here are per-completion scalars, so the extra traffic is nothing.
    """
    rank, ws = world()
    if len(counts) != ws or local.shape[0] != counts[rank]:
        raise ValueError(f"local has {local.shape[0]} rows, expected counts[{rank}] of {counts}")
    if ws == 1:
        return local
    lo = sum(counts[:rank])
    full = torch.zeros((sum(counts), *local.shape[1:]), dtype=local.dtype, device=_comm_device())
    full[lo:lo + local.shape[0]] = local.to(full.device)
    dist.all_reduce(full)
    return full.to(local.device)


def gather_rows(local: torch.Tensor, counts: list[int], left: bool = False) -> torch.Tensor:
    """``gather_shards`` of [n_rank, W_rank] rows whose widths differ by rank: each padded with zeros to the
    widest, on the left (``left``: left-padded prompts) or on the right."""
    if world()[1] == 1:
        return local
    W = int(all_reduce(float(local.shape[1]), "max"))
    pad = W - local.shape[1]
    if pad:
        local = torch.nn.functional.pad(local, (pad, 0) if left else (0, pad))
    return gather_shards(local, counts)


def balance(rows: torch.Tensor, tokens: torch.Tensor, world_size: int) -> list[torch.Tensor]:
    """``rows`` (global indices) split among ``world_size`` ranks with balanced token counts (``tokens`` [N]
    of every row): longest first, each to the rank with the fewest tokens so far (ties: the lower rank).
    The same split for the same rows in any order, on every rank; each rank's rows in ascending order."""
    order = sorted(rows.tolist(), key=lambda i: (-int(tokens[i]), i))
    load = [0] * world_size
    mine: list[list[int]] = [[] for _ in range(world_size)]
    for i in order:
        r = min(range(world_size), key=lambda k: (load[k], k))
        mine[r].append(i)
        load[r] += int(tokens[i])
    return [torch.tensor(sorted(m), dtype=torch.long) for m in mine]


def all_reduce_grads(params, bucket_numel: int = 1 << 25) -> None:
    """Sum the gradients of ``params`` over ranks, in place, in flat buckets of one dtype.

    A parameter with no gradient on some ranks (no share in this mini-batch) counts as zero there;
    one with no gradient on every rank keeps ``grad=None`` (as in a single process, where AdamW
    then skips it).
    """
    if not is_distributed():
        return
    params = list(params)
    has = all_reduce(torch.tensor([p.grad is not None for p in params], dtype=torch.float32), "sum")
    live = []
    for p, h in zip(params, has.tolist()):
        if h > 0:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            live.append(p)
    bucket: list[torch.Tensor] = []

    def flush():
        if bucket:
            flat = torch.cat([g.reshape(-1) for g in bucket])
            dist.all_reduce(flat)
            for g, r in zip(bucket, flat.split([g.numel() for g in bucket])):
                g.copy_(r.view_as(g))
            bucket.clear()

    for p in live:
        g = p.grad
        if bucket and (g.dtype != bucket[0].dtype or g.device != bucket[0].device
                       or sum(b.numel() for b in bucket) + g.numel() > bucket_numel):
            flush()
        bucket.append(g)
    flush()


def broadcast_params(params, src: int = 0) -> None:
    """Copy rank ``src``'s values of ``params`` to every rank (the same start everywhere)."""
    if not is_distributed():
        return
    with torch.no_grad():
        for p in params:
            t = p.data if p.device.type != "cpu" or dist.get_backend() != "nccl" else p.data.to(_comm_device())
            dist.broadcast(t, src)
            if t is not p.data:
                p.data.copy_(t)
