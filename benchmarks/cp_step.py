"""Context-parallel step time and memory on long sequences: hp_lazy cp against one process.

A small-hidden Llama (attention dominates) is built from a config (random weights, seed 0, nothing
downloaded). For each sequence length, fresh processes run, alternately, ``--repeats`` times:

  one process     plain transformers (SDPA), world 1, ``--world`` intra-op threads (the same cores)
  cp              ``hp_lazy.activate("auto", cp=W)`` on W ranks, 1 thread each: K/V all-gathered,
                  only local tensors saved, re-gathered in backward (hp_lazy's default; blockwise
                  attention merged by log-sum-exp, no mask larger than a tile)
  cp ulysses      ``cp_mode="ulysses"``: all-to-all to head shards, the same blockwise attention
                  over the whole sequence
  cp, K/V saved   the allgather mode's collectives, but one SDPA per layer with an [S/C x S] mask
                  through plain autograd, which keeps the gathered K/V of every layer (no
                  re-gather): what the custom function saves, and hp_lazy's previous masked path

With ``--tp 2`` the ranks are cp x tp (``--world`` cp ranks times 2) and the variants are what a
long-context user picks between on one node:

  cp x tp         ``activate("auto", cp=W, tp=2)``: heads split over tp; the layers' norms, residuals
                  and MLP inputs whole on every tp rank (this cp rank's rows)
  cp x tp+sp      ``sequence_parallel=True`` as well: those cut over tp too (``S / (cp * tp)`` rows)

Every rank passes the same full batch (B=1) with labels, of one of three kinds (``--batches``):
``plain``; ``packed``, four documents told apart by ``position_ids`` that restart (what a padding-free
collator passes; one process builds a packed-sequence mask); ``padded``, the first S/8 tokens
left padding (``attention_mask``, labels -100 there). Reported per variant: the median fwd+bwd
step (the slowest rank's), its ratio to one process, the bytes autograd saves for backward during
the forward (``saved_tensors_hooks``, unique storages; per rank) and the peak resident memory the
step adds over the loaded model (``ru_maxrss`` after the steps minus RSS before the first forward).
torch's own ``context_parallel`` needs the flash/efficient SDPA kernels (CUDA) and is not run here.

    python benchmarks/cp_step.py                      # S = 2k, 4k, 8k at cp=2, plain batches (a few minutes, 2 cores)
    python benchmarks/cp_step.py --seqs 8192 --batches packed,padded
    python benchmarks/cp_step.py --seqs 1024,2048 --repeats 1
    python benchmarks/cp_step.py --seqs 8192 --tp 2     # cp=2 x tp=2 on 4 ranks, with and without sequence parallel
    python benchmarks/cp_step.py --smoke              # S = 64, one repeat of one step: does every variant run?
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import statistics
import sys
import tempfile
import time
from typing import Any

import _spawn
from _spawn import collect

VARIANTS = ("one process", "cp", "cp ulysses", "cp, K/V saved")
TP_VARIANTS = ("one process", "cp x tp", "cp x tp+sp")
BATCHES = ("plain", "packed", "padded")


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=2, help="cp ranks")
    p.add_argument("--tp", type=int, default=1, help="2: cp x tp on world * 2 ranks, with and without sequence parallel")
    p.add_argument("--seqs", default="2048,4096,8192")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--batches", default="plain", help="comma list of plain, packed, padded")
    p.add_argument("--model", default="llama", choices=("llama", "qwen3_next", "jamba", "minimax"),
                   help="qwen3_next: a Gated DeltaNet hybrid (layer 0 linear attention, layer 1 full attention); "
                        "jamba: a Mamba1 hybrid (layer 0 Mamba, layer 1 attention); minimax: a lightning "
                        "attention hybrid (layer 0 lightning attention, layer 1 full attention)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, one repeat of one step (overrides the sizes)")
    args = p.parse_args(argv)
    if args.smoke:
        args.seqs, args.hidden, args.layers, args.steps, args.repeats = "64", 32, 1, 1, 1
        args.batches = "padded"  # masked tiles and skipped ones (packed batches: tests/test_cp*.py)
        if args.model in ("qwen3_next", "jamba", "minimax"):
            args.layers, args.batches = 2, "padded"  # both layer kinds; the recurrent layers' padding mask
    if set(args.batches.split(",")) - set(BATCHES):
        p.error(f"--batches: {args.batches!r}: each must be one of {', '.join(BATCHES)}")
    return args


MODELS = {"llama": "Llama", "qwen3_next": "Qwen3-Next-style hybrid (Gated DeltaNet + attention, dense MLPs)",
          "jamba": "Jamba-style hybrid (Mamba1 + attention, dense MLPs)",
          "minimax": "MiniMax-style hybrid (lightning attention + attention, one expert: dense MLPs)"}


def _build(args: argparse.Namespace, root: str, seq: int) -> str:
    import torch
    import transformers

    common = dict(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=seq, tie_word_embeddings=False,
    )
    if args.model == "qwen3_next":  # dense MLPs: the step is the sequence mixers' (alternating GDN, attention)
        head = args.hidden // args.heads
        config = transformers.Qwen3NextConfig(
            **common, head_dim=head, linear_num_key_heads=args.kv_heads, linear_num_value_heads=args.heads,
            linear_key_head_dim=head, linear_value_head_dim=head, mlp_only_layers=list(range(args.layers)),
            layer_types=["linear_attention" if i % 2 == 0 else "full_attention" for i in range(args.layers)],
        )
    elif args.model == "jamba":  # dense MLPs (one expert): the step is the sequence mixers' (Mamba1, attention)
        config = transformers.JambaConfig(
            **common, num_experts=1, attn_layer_period=2, attn_layer_offset=1, mamba_d_state=16, mamba_d_conv=4,
            mamba_expand=2, mamba_dt_rank=max(1, args.hidden // 16),
        )
    elif args.model == "minimax":  # one expert (dense MLPs): the step is the mixers' (lightning, attention)
        config = transformers.MiniMaxConfig(
            **common, head_dim=args.hidden // args.heads, num_local_experts=1, num_experts_per_tok=1,
            block_size=min(256, seq // (2 * args.world)),
            layer_types=["linear_attention" if i % 2 == 0 else "full_attention" for i in range(args.layers)],
        )
    else:
        config = transformers.LlamaConfig(**common)
    torch.manual_seed(0)
    path = os.path.join(root, f"{args.model}{seq}")
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def _rss_kib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def _inputs(batch: str, seq: int) -> dict[str, Any]:
    import torch

    torch.manual_seed(1)
    ids = torch.randint(0, 512, (1, seq))
    inputs = {"input_ids": ids, "labels": ids.clone()}
    if batch == "packed":  # four documents: positions restart at each
        starts = [0, int(seq * 0.3), int(seq * 0.55), int(seq * 0.8), seq]
        inputs["position_ids"] = torch.cat([torch.arange(b - a) for a, b in zip(starts, starts[1:], strict=False)])[None]
    elif batch == "padded":
        mask = torch.ones(1, seq, dtype=torch.long)
        mask[:, : seq // 8] = 0
        inputs["attention_mask"] = mask
        inputs["labels"] = ids.masked_fill(mask == 0, -100)
    return inputs


def _saved_bytes(model, inputs) -> int:
    import torch

    storages: dict[int, int] = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(**inputs).loss
    loss.backward()
    return sum(storages.values())


def _run(model, inputs, steps: int, barrier) -> tuple[float, int, int]:
    base = _rss_kib()
    times = []
    for _ in range(steps + 1):  # the first is a warm-up
        barrier()
        start = time.perf_counter()
        loss = model(**inputs).loss
        loss.backward()
        for p in model.parameters():
            p.grad = None
        times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base
    return statistics.median(times[1:]), _saved_bytes(model, inputs), peak * 1024


def _keep_gathered() -> None:
    """The 'K/V saved' variant: autograd through the gather and one SDPA with the [S/C x S] mask."""
    import torch
    import torch.nn.functional as F

    from hp_lazy.runtime.comm import gather_kv
    from hp_lazy.runtime.cp import blocks
    from hp_lazy.runtime.cp.state import current

    def apply(q, k, v, scale, plan, vis, kernel, exchange, sinks=None):  # BlockAttention.apply's arguments
        state = current()
        assert state is not None and sinks is None, "the K/V-saved variant runs Llama (no sinks)"
        zig = state.zig
        kg, vg = gather_kv(k, v, state.group, 2)
        kg, vg = kg.index_select(2, zig.inverse), vg.index_select(2, zig.inverse)
        groups = q.shape[1] // k.shape[1]
        kg, vg = kg.repeat_interleave(groups, 1), vg.repeat_interleave(groups, 1)
        mask = torch.cat([vis.mask(start, start + n, 0, zig.seq, q.device) for _, start, n in zig.runs()], dim=2)
        return F.scaled_dot_product_attention(q, kg, vg, attn_mask=mask, scale=scale)

    blocks.BlockAttention.apply = staticmethod(apply)  # type: ignore[method-assign]


def _worker(
    rank: int, world: int, variant: str, batch: str, path: str, seq: int, steps: int, port: int, queue: Any,
    tp: int = 1,
) -> None:
    import torch

    inputs = _inputs(batch, seq)
    if variant == "one process":
        torch.set_num_threads(world)
        import transformers

        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        queue.put((rank, _run(model, inputs, steps, lambda: None)))
        return
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      LOCAL_RANK=str(rank), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    import hp_lazy

    hp_lazy.activate("auto", cp=world // tp, tp=tp, sequence_parallel=variant.endswith("+sp"),
                     cp_mode="ulysses" if variant == "cp ulysses" else "allgather")
    import torch.distributed as dist
    import transformers

    if variant == "cp, K/V saved":
        _keep_gathered()
    model = hp_lazy.parallelize(transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32))
    step, saved, peak = _run(model, inputs, steps, dist.barrier)
    slowest = torch.tensor([step])
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    queue.put((rank, (float(slowest), saved, peak)))
    dist.destroy_process_group()


def _launch(args: argparse.Namespace, variant: str, batch: str, path: str, seq: int) -> tuple[float, int, int]:

    ctx = _spawn.context()
    queue = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    world = args.world * args.tp
    ranks = 1 if variant == "one process" else world
    procs = [ctx.Process(target=_worker, args=(r, world, variant, batch, path, seq, args.steps, port, queue, args.tp))
             for r in range(ranks)]
    for p in procs:
        p.start()
    results = collect(procs, queue, f"{variant} at S={seq}, {batch} batch")
    for p in procs:
        p.join()
    return results[0]


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    seqs = [int(s) for s in args.seqs.split(",")]
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    _spawn.context()  # the ranks' forkserver imports torch and transformers while the checkpoints are built
    world = args.world * args.tp
    shape = f"cp={args.world}" + (f" x tp={args.tp}" if args.tp > 1 else "")
    lines = [
        f"{shape} on {world} ranks vs one process ({world} threads); "
        f"{MODELS[args.model]} "
        f"hidden {args.hidden}, "
        f"{args.layers} layers, {args.heads} heads ({args.kv_heads} K/V), batch 1, fp32, {args.steps} steps x "
        f"{args.repeats} repeats (medians); saved = bytes autograd keeps for backward per rank; peak = resident "
        "memory a step adds per rank",
        "",
        "| S | batch | variant | step s | step / one process | saved MiB | saved / one process | peak MiB | "
        "peak / one process |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    with tempfile.TemporaryDirectory() as root:
        for seq in seqs:
            path = _build(args, root, seq)
            for batch in args.batches.split(","):
                variants = list(TP_VARIANTS) if args.tp > 1 else [
                    v for v in VARIANTS if args.model == "llama" or v != "cp, K/V saved"]
                runs: dict[str, list[tuple[float, int, int]]] = {v: [] for v in variants}
                for _ in range(args.repeats):
                    for variant in variants:
                        runs[variant].append(_launch(args, variant, batch, path, seq))
                base = [statistics.median(x[i] for x in runs["one process"]) for i in range(3)]
                for variant in variants:
                    step, saved, peak = (statistics.median(x[i] for x in runs[variant]) for i in range(3))
                    lines.append(
                        f"| {seq} | {batch} | {variant} | {step:.2f} | {step / base[0]:.2f} | {saved / 2**20:.0f} | "
                        f"{saved / base[1]:.2f} | {peak / 2**20:.0f} | {peak / max(base[2], 1):.2f} |"
                    )
                print(lines[-len(variants):], flush=True)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
