"""Data-parallel step time: hp_lazy's own gradient reduction against torch DDP, same model, same ranks.

Every rank builds the same Llama from a config (random weights, seed 0, ``save_pretrained`` into a temp dir
and loaded back; nothing is downloaded) under ``hp_lazy.activate("auto", tp=1)`` (so every rank is a dp rank),
and feeds its own batch. Variants, loaded in the same ranks and timed interleaved, round by round, order
rotated each round; a round's time is the slowest rank's:

  hp_lazy    ``parallelize(model)``: hp_lazy averages gradients over dp itself (buckets of --bucket-mb,
             all-reduces launched during backward as buckets fill)
  ddp        ``DistributedDataParallel(parallelize(model, data_parallel=False), process_group=dp)``,
             ``bucket_cap_mb`` = --bucket-mb
  local      ``parallelize(model, data_parallel=False)``: no reduction at all (the floor of backward)

Reported: median step and backward time, the ratio of each step to DDP's (median of per-round ratios), and
how much of the reduction overlaps backward: ``exposed = backward - local's backward`` against ``comm`` (the
same buckets all-reduced on their own, outside backward); ``overlap = 1 - exposed / comm``. Then the max
relative gradient difference between hp_lazy and DDP after one backward (they must agree).

    python benchmarks/dp_step.py                       # world 2, ~25M params, 20 rounds (~2 min, 2 cores)
    python benchmarks/dp_step.py --world 4 --hidden 256 --layers 4 --rounds 30
    python benchmarks/dp_step.py --smoke               # tiny, one round: does every variant run?
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time
from typing import Any

import _spawn

VARIANTS = ("hp_lazy", "ddp", "local")


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, one round, one warm-up (overrides the sizes)")
    args = p.parse_args(argv)
    if args.smoke:
        args.hidden, args.layers, args.vocab, args.batch, args.seq = 32, 1, 256, 1, 16
        args.rounds, args.warmup, args.bucket_mb = 1, 1, 0.01
    return args


def _build(args: argparse.Namespace, root: str) -> str:
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=8,
        max_position_embeddings=max(args.seq, 128), tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    path = os.path.join(root, "llama")
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def _load(path: str):
    import torch
    import transformers

    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def _step(model, ids) -> tuple[float, float]:
    """(step seconds, backward seconds) of forward with labels + backward + zero_grad."""
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    loss = model(input_ids=ids, labels=ids).loss
    mid = time.perf_counter()
    loss.backward()
    end = time.perf_counter()
    for p in model.parameters():
        p.grad = None
    return end - start, end - mid


def _slowest(values: list[float]) -> list[float]:
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _comm_alone(model, bucket_mb: float, repeats: int = 5) -> float:
    """Seconds to all-reduce the model's gradient bytes in buckets of ``bucket_mb``, outside backward."""
    import torch
    import torch.distributed as dist

    numel = sum(p.numel() for p in model.parameters())
    per = max(1, int(bucket_mb * 2**20 // 4))
    buckets = [torch.zeros(min(per, numel - i)) for i in range(0, numel, per)]
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        works = [dist.all_reduce(b, async_op=True) for b in buckets]
        for w in works:
            w.wait()
        times.append(time.perf_counter() - start)
    return statistics.median(_slowest(times))


def _grad_agreement(models: dict[str, Any], ids) -> float:
    out = {}
    for name in ("hp_lazy", "ddp"):
        model = models[name]
        model(input_ids=ids, labels=ids).loss.backward()
        out[name] = {n: p.grad.detach().clone() for n, p in _inner(model).named_parameters()}
        for p in model.parameters():
            p.grad = None
    worst = 0.0
    for n, g in out["ddp"].items():
        worst = max(worst, float((out["hp_lazy"][n] - g).abs().max() / g.abs().max().clamp_min(1e-12)))
    return worst


def _inner(model):
    return getattr(model, "module", model)


def _worker(rank: int, args: argparse.Namespace, path: str, port: int, queue: Any) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(args.world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      LOCAL_RANK=str(rank), GLOO_SOCKET_IFNAME="lo")
    import torch

    torch.set_num_threads(args.threads)
    import hp_lazy
    from hp_lazy.runtime.grads import owner_of

    hp_lazy.activate("auto", tp=1, bucket_cap_mb=args.bucket_mb)
    from torch.nn.parallel import DistributedDataParallel

    dp = hp_lazy.mesh().group("dp")
    models = {
        "hp_lazy": hp_lazy.parallelize(_load(path)),
        "ddp": DistributedDataParallel(hp_lazy.parallelize(_load(path), data_parallel=False), process_group=dp.pg,
                                       bucket_cap_mb=args.bucket_mb),
        "local": hp_lazy.parallelize(_load(path), data_parallel=False),
    }
    gen = torch.Generator().manual_seed(100 + rank)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
    for _ in range(args.warmup):
        for model in models.values():
            _step(model, ids)
    rounds: dict[str, list[tuple[float, float]]] = {v: [] for v in VARIANTS}
    for r in range(args.rounds):
        order = VARIANTS[r % 3:] + VARIANTS[: r % 3]
        for name in order:
            rounds[name].append(tuple(_slowest(list(_step(models[name], ids)))))  # type: ignore[arg-type]
    comm = _comm_alone(models["local"], args.bucket_mb)
    owner = owner_of(models["hp_lazy"])
    agreement = _grad_agreement(models, ids)
    if rank == 0:
        params = sum(p.numel() for p in models["local"].parameters())
        queue.put({"rounds": rounds, "comm": comm, "buckets": owner.all_reduces_per_step, "params": params,
                   "agreement": agreement})
    # an orderly end: DDP's reducer and the process group torn down before the interpreter exits
    # (left to exit, a rank aborted now and then: "terminate called without an active exception")
    import torch.distributed as dist

    dist.barrier()
    del models
    dist.destroy_process_group()


def _table(result: dict[str, Any], args: argparse.Namespace) -> str:
    rounds, comm = result["rounds"], result["comm"]
    local_bwd = statistics.median(b for _, b in rounds["local"])
    lines = [
        f"world {args.world}, {result['params'] / 1e6:.1f}M params, batch {args.batch}x{args.seq} per rank, "
        f"{args.rounds} rounds, bucket {args.bucket_mb} MB (hp_lazy: {result['buckets']} buckets); "
        f"buckets all-reduced alone: {comm * 1e3:.1f} ms",
        "",
        "| variant | step ms | step / ddp | backward ms | exposed comm ms | overlap |",
        "|---|---|---|---|---|---|",
    ]
    for name in VARIANTS:
        steps = [s for s, _ in rounds[name]]
        bwd = statistics.median(b for _, b in rounds[name])
        ratio = statistics.median(s / d for (s, _), (d, _) in zip(rounds[name], rounds["ddp"], strict=True))
        exposed = bwd - local_bwd
        overlap = "-" if name == "local" else f"{max(0.0, 1 - exposed / comm):.0%}"
        exposed_text = "-" if name == "local" else f"{exposed * 1e3:.1f}"
        lines.append(f"| {name} | {statistics.median(steps) * 1e3:.1f} | {ratio:.3f} | {bwd * 1e3:.1f} | "
                     f"{exposed_text} | {overlap} |")
    lines += ["", f"max relative gradient difference hp_lazy vs ddp after one backward: {result['agreement']:.2e}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    _spawn.context()  # the ranks' forkserver imports torch and transformers while the checkpoint is built
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as root:
        path = _build(args, root)
        ctx = _spawn.context()
        queue = ctx.SimpleQueue()
        procs = [ctx.Process(target=_worker, args=(r, args, path, port, queue)) for r in range(args.world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode for p in procs):
            print(f"a rank failed: exit codes {[p.exitcode for p in procs]}", file=sys.stderr)
            return 1
        print(_table(queue.get(), args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
