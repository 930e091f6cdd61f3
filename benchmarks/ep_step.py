"""Expert-parallel step time on a small MoE: hp_lazy ep against experts tensor parallel and one process.

A Qwen3-MoE (``--experts`` experts, top-2, every layer MoE) is built from a config (random
weights, seed 0, nothing downloaded). Fresh processes run, alternately, ``--repeats`` times:

  one process   plain transformers, world 1, ``--world`` intra-op threads (the same cores), the
                global batch
  ep            ``hp_lazy.activate("auto", ep=W)`` on W ranks, 1 thread each: every rank feeds
                its ``batch / W`` rows and holds ``1 / W`` of the experts (all-to-all dispatch)
  ep x tp       (W >= 4) ``hp_lazy.activate("auto", ep=W/2, tp=2)``: W/2 data-parallel groups of
                2 tp ranks, each group its ``batch / (W/2)`` rows; each tp rank dispatches half of
                its group's rows and the outputs are gathered over tp (5.25's plans leave the
                experts whole on tp; ep splits them)
  ep x tp+sp    (W >= 4) the same with ``sequence_parallel=True``: between the boundaries each tp
                rank holds half its group's sequence, and dispatches those rows (nothing gathered
                over tp at the experts; the attention and MLP boundaries gather and reduce-scatter)
  ep + FSDP2     ``hp_lazy.activate("auto", ep=E, data_parallel=False)`` (E = W/2 at W >= 4, else W)
                with FSDP2 owning dp, torchtitan's layout: each experts module ``fully_shard``-ed over
                its expert-data-parallel ranks (``hp_lazy.mesh().edp_mesh()``, W/E of them), each
                layer and the root over dp; every rank its ``batch / W`` rows, ``1 / W`` of the
                experts and of the dense weights
  experts-TP    ``hp_lazy.activate("auto", tp=W)``: every rank runs the whole batch through its
                ``1 / W`` of the experts, whole (region ``tp_experts``; the exit all-reduce sums the
                ranks' parts; the same bytes as cutting every expert's width)
  transformers ep_plan
                no hp_lazy: ``from_pretrained(path, distributed_config=DistributedConfig(ep_size=W,
                fsdp_size=W))``, transformers 5.24's own expert parallel (the config's
                ``base_model_ep_plan``, ``ep_dispatch_experts`` with all-to-all token dispatch,
                experts DTensors ``Shard(0)`` on ep) with FSDP2 over the dense parameters on the same
                W ranks; the same batch split as ``ep`` (every rank its ``batch / W`` rows)

transformers accepts no EP-only layout at world W > 1: ``DistributedConfig(ep_size=W)`` raises
``ValueError: `ep_size` must divide `fsdp_size * tp_size`.`` (EP is carved out of fsdp x tp, and
both default to 1); ``from_pretrained(path, tp_plan="auto", distributed_config=DistributedConfig(
enable_expert_parallel=True))`` raises ``ValueError: Pass either `distributed_config` or the
standalone `tp_plan`/`tp_size` arguments, not both.``; the deprecated ``enable_expert_parallel=True``
alone resolves ``ep_size = tp_size = 1`` (no EP); ``DistributedConfig(ep_size=W, tp_size=W,
tp_plan={})`` is refused for a config with a TP plan left empty. The layouts it accepts at world 2
on gloo/CPU are ``ep_size=2, fsdp_size=2`` (run here: data parallel like hp_lazy's ep) and
``tp_plan="auto", enable_expert_parallel=True`` (tp=2 and ep=2 on the same ranks, every rank the
whole batch: experts-TP's layout, not run).

Reported per variant: the median fwd+bwd step (the slowest rank's), its ratio to one process, the
relative error of the step's loss against one process's (the mean of the ranks' losses; each rank's
rows hold the same number of tokens), the collectives of one step (``hp_lazy.collective_counter``;
transformers' DTensor/FSDP2 collectives are not counted: "-"), their payload per rank (the bytes a
rank hands to the all-to-alls, all-reduces and all-gathers of one step: for an all-to-all, the rows
it sends to other ranks; ``CollectiveCounter.payload``; FSDP2's own all-gathers and
reduce-scatters are not counted), the expert parameters held per rank and all parameters held per
rank (local shards and FSDP2 chunks; the optimizer's state of them scales the same).

    python benchmarks/ep_step.py                       # a few minutes on 2 cores
    python benchmarks/ep_step.py --repeats 1 --steps 2
    python benchmarks/ep_step.py --smoke               # tiny, one repeat of one step: does every variant run?
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
from _spawn import collect

VARIANTS = ("one process", "ep", "ep x tp", "ep x tp+sp", "ep + FSDP2", "experts-TP", "transformers ep_plan")
TP_GROUPS = ("ep x tp", "ep x tp+sp")  # W/2 data-parallel groups of 2 tp ranks
PAYLOAD = ("all_to_all", "all_reduce", "all_gather", "reduce_scatter")  # the payload column's ops, in order
SPLIT = ("ep", "ep + FSDP2", "transformers ep_plan")  # variants where every rank feeds its batch / W rows


def variants(world: int, chosen: str = "") -> tuple[str, ...]:
    """The variants to run (``chosen``, a comma list, or all; "one process" always, the baseline);
    ``ep x tp`` (ep = W/2, tp = 2; with or without sp) needs W >= 4."""
    names = [v.strip() for v in chosen.split(",") if v.strip()]
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    return tuple(v for v in VARIANTS if (not names or v in names or v == "one process")
                 and (v not in TP_GROUPS or (world >= 4 and world % 2 == 0)))


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
    p.add_argument("--variants", default="", help="comma list of variants to run (default: all at this world)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, one repeat of one step (overrides the sizes)")
    args = p.parse_args(argv)
    if args.smoke:
        args.hidden, args.experts, args.expert_size, args.layers = 32, 4, 32, 1
        args.batch, args.seq, args.steps, args.repeats = max(2, args.world), 16, 1, 1  # a row per rank at least
    return args


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


def _run(model, ids, steps: int, barrier) -> tuple[float, float]:
    """(median step time, the first step's loss): no optimizer step, so every step's loss is the same."""
    times, losses = [], []
    for _ in range(steps + 1):  # the first is a warm-up
        barrier()
        start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        for p in model.parameters():
            p.grad = None
        times.append(time.perf_counter() - start)
        losses.append(float(loss.detach()))
    return statistics.median(times[1:]), losses[0]


def _held_bytes(model) -> tuple[int, int]:
    """(expert, all) parameter bytes this rank holds: local shards, FSDP2's chunks."""
    local = {n: getattr(p, "to_local", lambda p=p: p)() for n, p in model.named_parameters()}
    size = {n: t.numel() * t.element_size() for n, t in local.items()}
    return sum(v for n, v in size.items() if ".experts." in n), sum(size.values())


def _fsdp_over_ep(model):
    """FSDP2 owning dp under ep: the experts over their edp ranks, the layers and the root over dp."""
    from torch.distributed.fsdp import fully_shard

    import hp_lazy

    mesh = hp_lazy.mesh()
    for layer in model.model.layers:
        fully_shard(layer.mlp.experts, mesh=mesh.edp_mesh())
        fully_shard(layer, mesh=mesh.device_mesh["dp"])
    fully_shard(model, mesh=mesh.device_mesh["dp"])
    return model


def _load_transformers_ep(path: str, world: int):
    """transformers' own expert parallel: ep=W over W data-parallel (FSDP2) ranks."""
    import torch
    import transformers
    from transformers.distributed import DistributedConfig

    config = DistributedConfig(ep_size=world, fsdp_size=world)
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, distributed_config=config)


def _worker(rank: int, world: int, variant: str, path: str, args: argparse.Namespace, port: int, queue: Any) -> None:
    import torch

    torch.manual_seed(1)
    ids = torch.randint(0, 512, (args.batch, args.seq))
    if variant == "one process":
        torch.set_num_threads(world)
        import transformers

        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        step, loss = _run(model, ids, args.steps, lambda: None)
        queue.put((rank, (step, {}, _held_bytes(model), loss)))
        return
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      LOCAL_RANK=str(rank), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    if variant in SPLIT:
        per = args.batch // world
        ids = ids[rank * per : (rank + 1) * per]
    if variant in TP_GROUPS:  # dp = W/2 groups of 2 tp ranks (tp innermost): each group its batch / (W/2) rows
        per = args.batch // (world // 2)
        ids = ids[rank // 2 * per : (rank // 2 + 1) * per]
    if variant == "transformers ep_plan":
        import torch.distributed as dist

        dist.init_process_group("gloo")
        model = _load_transformers_ep(path, world)
        _report(queue, rank, world, _run(model, ids, args.steps, dist.barrier), {}, _held_bytes(model))
        return
    import hp_lazy

    axes = {"ep": {"ep": world}, "ep x tp": {"ep": world // 2, "tp": 2},
            "ep x tp+sp": {"ep": world // 2, "tp": 2, "sequence_parallel": True},
            "ep + FSDP2": {"ep": world // 2 if world >= 4 else world, "data_parallel": False}}.get(variant, {"tp": world})
    hp_lazy.activate("auto", **axes)
    import torch.distributed as dist
    import transformers

    model = hp_lazy.parallelize(transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32))
    if variant == "ep + FSDP2":
        model = _fsdp_over_ep(model)
    with hp_lazy.collective_counter() as counter:
        model(input_ids=ids, labels=ids).loss.backward()
    counts = {phase: counter.by_phase(phase) for phase in ("forward", "backward")}
    counts["MiB"] = {op: counter.bytes_of(op) / 2**20 for op in PAYLOAD}
    _report(queue, rank, world, _run(model, ids, args.steps, dist.barrier), counts, _held_bytes(model))


def _report(queue: Any, rank: int, world: int, run: tuple[float, float], counts: dict, held: tuple[int, int]) -> None:
    """Send (the slowest rank's step, counts, expert bytes, the mean of the ranks' losses)."""
    import torch
    import torch.distributed as dist

    slowest, loss = torch.tensor([run[0]]), torch.tensor([run[1]], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    dist.all_reduce(loss)
    queue.put((rank, (float(slowest), counts, held, float(loss) / world)))
    dist.destroy_process_group()


def _launch(args: argparse.Namespace, variant: str, path: str) -> tuple[float, dict, tuple[int, int], float]:

    ctx = _spawn.context()
    queue = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ranks = 1 if variant == "one process" else args.world
    procs = [ctx.Process(target=_worker, args=(r, args.world, variant, path, args, port, queue)) for r in range(ranks)]
    for p in procs:
        p.start()
    results = collect(procs, queue, variant)
    for p in procs:
        p.join()
    return results[0]


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    _spawn.context()  # the ranks' forkserver imports torch and transformers while the checkpoint is built
    print(f"world {args.world}; Qwen3-MoE hidden {args.hidden}, {args.layers} layers, {args.experts} experts top-2 "
          f"(size {args.expert_size}), batch {args.batch} x {args.seq}, fp32, {args.steps} steps x {args.repeats} "
          "repeats (medians)\n")
    print("| variant | step s | step / one process | loss rel err vs one process | collectives per step (fwd; bwd) "
          "| payload MiB per rank per step (a2a / ar / ag / rs) | expert MiB per rank | all params MiB per rank |")
    print("|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as root:
        path = _build(args, root)
        runs: dict[str, list[tuple[float, dict, tuple[int, int], float]]] = {
            v: [] for v in variants(args.world, args.variants)}
        for _ in range(args.repeats):
            for variant in runs:
                runs[variant].append(_launch(args, variant, path))
        base = statistics.median(r[0] for r in runs["one process"])
        ref_loss = runs["one process"][0][3]
        for variant in runs:
            step = statistics.median(r[0] for r in runs[variant])
            counts, (experts, held) = runs[variant][0][1], runs[variant][0][2]
            loss_err = max(abs(r[3] - ref_loss) for r in runs[variant]) / abs(ref_loss)
            shown = "; ".join(", ".join(f"{k} {v}" for k, v in sorted(counts.get(ph, {}).items())) or "-"
                              for ph in ("forward", "backward"))
            mib = counts.get("MiB", {})
            volume = " / ".join(f"{mib[op]:.2f}" for op in PAYLOAD) if mib else "-"
            print(f"| {variant} | {step:.3f} | {step / base:.2f} | {loss_err:.1e} | {shown} | {volume} "
                  f"| {experts / 2**20:.2f} | {held / 2**20:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
