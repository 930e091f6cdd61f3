"""Expert-parallel step time on a small MoE: hp_lazy ep against experts tensor parallel and one process.

A Qwen3-MoE (``--experts`` experts, top-2, every layer MoE) is built from a config (random
weights, seed 0, nothing downloaded). Fresh processes run, alternately, ``--repeats`` times:

  one process   plain transformers, world 1, ``--world`` intra-op threads (the same cores), the
                global batch
  ep            ``hp_lazy.activate("auto", ep=W)`` on W ranks, 1 thread each: every rank feeds
                its ``batch / W`` rows and holds ``1 / W`` of the experts (all-to-all dispatch)
  experts-TP    ``hp_lazy.activate("auto", tp=W)``: every rank runs the whole batch through its
                slice of every expert (transformers' ``moe_tp_experts``)

Reported per variant: the median fwd+bwd step (the slowest rank's), its ratio to one process, the
collectives of one step (``hp_lazy.collective_counter``) and the expert parameters held per rank.
transformers' own ``ep_plan`` is not run here (it needs its distributed_config set up; to do).

    python benchmarks/ep_step.py                       # a few minutes on 2 cores
    python benchmarks/ep_step.py --repeats 1 --steps 2
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

VARIANTS = ("one process", "ep", "experts-TP")


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--expert-size", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--repeats", type=int, default=2)
    return p.parse_args(argv)


def _build(args: argparse.Namespace, root: str) -> str:
    import torch
    import transformers

    config = transformers.Qwen3MoeConfig(
        vocab_size=512, hidden_size=args.hidden, intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=args.hidden // 4, num_experts=args.experts,
        num_experts_per_tok=2, moe_intermediate_size=args.expert_size, max_position_embeddings=args.seq,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    path = os.path.join(root, "moe")
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def _run(model, ids, steps: int, barrier) -> float:
    times = []
    for _ in range(steps + 1):  # the first is a warm-up
        barrier()
        start = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        for p in model.parameters():
            p.grad = None
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def _expert_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n)


def _worker(rank: int, world: int, variant: str, path: str, args: argparse.Namespace, port: int, queue: Any) -> None:
    import torch

    torch.manual_seed(1)
    ids = torch.randint(0, 512, (args.batch, args.seq))
    if variant == "one process":
        torch.set_num_threads(world)
        import transformers

        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        queue.put((rank, (_run(model, ids, args.steps, lambda: None), {}, _expert_bytes(model))))
        return
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      LOCAL_RANK=str(rank), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    import hp_lazy

    hp_lazy.activate("auto", **({"ep": world} if variant == "ep" else {"tp": world}))
    import torch.distributed as dist
    import transformers

    model = hp_lazy.parallelize(transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32))
    if variant == "ep":
        per = args.batch // world
        ids = ids[rank * per : (rank + 1) * per]
    with hp_lazy.collective_counter() as counter:
        model(input_ids=ids, labels=ids).loss.backward()
    counts = {phase: counter.by_phase(phase) for phase in ("forward", "backward")}
    step = _run(model, ids, args.steps, dist.barrier)
    slowest = torch.tensor([step])
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    queue.put((rank, (float(slowest), counts, _expert_bytes(model))))
    dist.destroy_process_group()


def _launch(args: argparse.Namespace, variant: str, path: str) -> tuple[float, dict, int]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ranks = 1 if variant == "one process" else args.world
    procs = [ctx.Process(target=_worker, args=(r, args.world, variant, path, args, port, queue)) for r in range(ranks)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=3600) for _ in procs)
    for p in procs:
        p.join()
    return results[0]


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(f"world {args.world}; Qwen3-MoE hidden {args.hidden}, {args.layers} layers, {args.experts} experts top-2 "
          f"(size {args.expert_size}), batch {args.batch} x {args.seq}, fp32, {args.steps} steps x {args.repeats} "
          "repeats (medians)\n")
    print("| variant | step s | step / one process | collectives per step (fwd; bwd) | expert MiB per rank |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as root:
        path = _build(args, root)
        runs: dict[str, list[tuple[float, dict, int]]] = {v: [] for v in VARIANTS}
        for _ in range(args.repeats):
            for variant in VARIANTS:
                runs[variant].append(_launch(args, variant, path))
        base = statistics.median(r[0] for r in runs["one process"])
        for variant in VARIANTS:
            step = statistics.median(r[0] for r in runs[variant])
            counts, experts = runs[variant][0][1], runs[variant][0][2]
            shown = "; ".join(", ".join(f"{k} {v}" for k, v in sorted(counts.get(ph, {}).items())) or "-"
                              for ph in ("forward", "backward"))
            print(f"| {variant} | {step:.3f} | {step / base:.2f} | {shown} | {experts / 2**20:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
