"""``python -m hp_lazy demo``: train a tiny Llama at tp=2 next to one process, step by step.

Spawns ``--tp`` CPU processes with torch's launcher API (gloo on 127.0.0.1), builds a tiny Llama
from a config (or ``--model-config``), trains on the text bundled with the package with a
byte-level tokenizer, and prints the loss of each step next to the single-process loss.
No downloads, no GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
import uuid
from importlib import resources
from typing import Any

DEFAULT_CONFIG: dict[str, Any] = {
    "model_type": "llama",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m hp_lazy demo", description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2, help="tensor parallel degree = processes (default 2)")
    parser.add_argument("--sequence-parallel", action="store_true", help="also shard activations on the sequence")
    parser.add_argument("--model-config", help="JSON file of a transformers config (default: a tiny Llama)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    return parser.parse_args(argv)


def batches(args: argparse.Namespace) -> list[list[list[int]]]:
    """Deterministic byte-level batches from the bundled text."""
    import random

    data = resources.files("hp_lazy").joinpath("data/corpus.txt").read_bytes()
    rng = random.Random(0)
    out = []
    for _ in range(args.steps):
        starts = [rng.randrange(0, len(data) - args.seq) for _ in range(args.batch)]
        out.append([list(data[s : s + args.seq]) for s in starts])
    return out


def build_model(config_dict: dict[str, Any], path: str) -> None:
    import torch
    import transformers

    config = transformers.AutoConfig.for_model(**config_dict)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)


def train(path: str, args: argparse.Namespace, data: list, parallel: bool) -> list[dict[str, float]]:
    """Run the steps; returns per-step loss, ms and collectives (0 when not parallel)."""
    import torch

    if parallel:
        import hp_lazy

        hp_lazy.activate("auto", tp=args.tp, sequence_parallel=args.sequence_parallel)
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if parallel:
        hp_lazy.parallelize(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    rows = []
    for tokens in data:
        ids = torch.tensor(tokens)
        start = time.perf_counter()
        with _counter(parallel) as counter:
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        rows.append({"loss": loss.item(), "ms": 1e3 * (time.perf_counter() - start),
                     "collectives": counter.total if counter is not None else 0})
    return rows


def _counter(parallel: bool):
    import contextlib

    if not parallel:
        return contextlib.nullcontext()
    import hp_lazy

    return hp_lazy.collective_counter()


def _worker(path: str, args: argparse.Namespace, data: list) -> list[dict[str, float]]:
    return train(path, args, data, parallel=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(path: str, args: argparse.Namespace, data: list) -> list[dict[str, float]]:
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=args.tp, run_id=uuid.uuid4().hex,
        rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{_free_port()}", max_restarts=0, monitor_interval=0.1,
    )
    results = elastic_launch(config, _worker)(path, args, data)
    return results[0]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config = DEFAULT_CONFIG
    if args.model_config:
        with open(args.model_config) as fh:
            config = json.load(fh)
    data = batches(args)
    with tempfile.TemporaryDirectory(prefix="hp_lazy_demo_") as path:
        build_model(config, path)
        mode = f"tp={args.tp}" + (" +SP" if args.sequence_parallel else "")
        print(f"hp_lazy demo: {config.get('model_type')} from config, {args.steps} steps, {mode} on "
              f"{args.tp} CPU processes (gloo) vs 1 process", flush=True)
        parallel = launch(path, args, data)
        import torch

        torch.set_num_threads(1)
        solo = train(path, args, data, parallel=False)
    print_table(parallel, solo, mode)
    worst = max(abs(p["loss"] - s["loss"]) for p, s in zip(parallel, solo, strict=True))
    return 0 if worst < 1e-3 else 1


def print_table(parallel: list[dict], solo: list[dict], mode: str) -> None:
    print(f"\n| step | loss {mode} | loss 1 proc | max diff so far | ms/step {mode} | ms/step 1 proc "
          "| collectives/step |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    worst = 0.0
    for step, (p, s) in enumerate(zip(parallel, solo, strict=True), 1):
        worst = max(worst, abs(p["loss"] - s["loss"]))
        print(f"| {step} | {p['loss']:.6f} | {s['loss']:.6f} | {worst:.1e} | {p['ms']:.1f} | {s['ms']:.1f} | "
              f"{p['collectives']} |")
    print(f"\nmax |loss difference| over {len(solo)} steps: {worst:.2e}")
    print("(on a model this small, on CPU, each collective's latency outweighs the halved matmuls; "
          "`python benchmarks/step_time.py` compares speed with transformers' tp_plan, DTensor and a "
          "hand-written baseline)")


if __name__ == "__main__":
    sys.exit(main())
