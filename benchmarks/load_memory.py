"""Memory and time of ``from_pretrained`` per rank: hp_lazy's shard-on-read against a plain load and
against transformers' own tensor parallel (``tp_plan="auto"``), on a Llama built from a config.

The checkpoint (random weights, fp32 safetensors, ``--params`` millions of parameters) is written once
into a temp dir; each variant then runs in fresh processes (one per rank, gloo on 127.0.0.1) that load it
as ``--dtype`` while a thread samples ``RssAnon`` (anonymous resident memory, not the page cache the
memory-mapped files use) every 2 ms. Reported per variant, the worst rank: the peak anonymous memory
during the load over the process's baseline before it, the anonymous memory still held after it, the
bytes of the parameters the rank holds, and the wall time of the call; ratios are to the plain load.

    python benchmarks/load_memory.py                    # ~190M params, tp 2 and 4 (a few minutes, 2 cores)
    python benchmarks/load_memory.py --params 50 --tp 2
"""

from __future__ import annotations

import argparse
import os
import socket
import tempfile
import threading
import time
from typing import Any

import _spawn


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--params", type=int, default=190, help="millions of parameters (approximately)")
    p.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--variants", nargs="+", default=["plain", "hp_lazy", "tp_plan"])
    p.add_argument("--smoke", action="store_true", help="a 2M-parameter model at tp=2: does every variant run?")
    args = p.parse_args(argv)
    if args.smoke:
        args.params, args.tp = 2, [2]
    return args


def _config(millions: int) -> Any:
    import transformers

    hidden, vocab = 1024, 32000
    per_layer = 4 * hidden * hidden + 3 * hidden * 2816
    layers = max(1, round((millions * 1e6 - 2 * vocab * hidden) / per_layer))
    return transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2816, num_hidden_layers=layers,
        num_attention_heads=16, num_key_value_heads=16, tie_word_embeddings=False,
    )


def _build(millions: int, root: str) -> str:
    import torch
    import transformers

    path = os.path.join(root, "llama")
    torch.manual_seed(0)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(_config(millions))
    model = model.to_empty(device="cpu")
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(std=0.02)
    model.save_pretrained(path)
    return path


def _rss_anon() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


class _Peak:
    """Highest RssAnon seen while the block runs (sampled every 2 ms)."""

    def __enter__(self) -> _Peak:
        self.peak, self._stop = _rss_anon(), threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, _rss_anon())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_anon())


def _rank(rank: int, world: int, port: int, variant: str, path: str, dtype: str, out: Any) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    kwargs: dict[str, Any] = {"dtype": getattr(torch, dtype)}
    if variant == "hp_lazy":
        import hp_lazy

        hp_lazy.activate("auto", tp=world)
    elif variant == "tp_plan":
        kwargs["tp_plan"] = "auto"
    import transformers
    from transformers.models.llama import modeling_llama  # noqa: F401  (imported, lowered, before the baseline)

    base = _rss_anon()
    start = time.perf_counter()
    with _Peak() as peak:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, **kwargs)
    seconds = time.perf_counter() - start
    held = _rss_anon() - base
    local = sum(_local(p).numel() * _local(p).element_size() for p in model.parameters())
    out.put((rank, {"peak": peak.peak - base, "held": held, "params": local, "seconds": seconds}))
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def _local(param: Any) -> Any:
    return param.to_local() if hasattr(param, "to_local") else param


def _run(variant: str, world: int, path: str, dtype: str) -> dict[str, float]:

    ctx = _spawn.context()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, world, port, variant, path, dtype, out)) for r in range(world)]
    for proc in procs:
        proc.start()
    results = dict(out.get(timeout=1800) for _ in procs)
    for proc in procs:
        proc.join()
    return {key: max(r[key] for r in results.values()) for key in ("peak", "held", "params", "seconds")}


def main(argv: list[str] | None = None) -> None:
    args = _args(argv)
    _spawn.context()  # the ranks' forkserver imports torch and transformers while the checkpoint is built
    with tempfile.TemporaryDirectory() as root:
        path = _build(args.params, root)
        plain = _run("plain", 1, path, args.dtype)
        rows = [("plain", 1, plain)]
        for tp in args.tp:
            rows += [(v, tp, _run(v, tp, path, args.dtype)) for v in args.variants if v != "plain"]
    mib = 1 << 20
    print(f"Llama ~{args.params}M params, fp32 safetensors loaded as {args.dtype}; worst rank; ratios to plain")
    print("| variant | tp | peak anon MiB | x plain | held anon MiB | param MiB | held/param | load s | x plain |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for variant, tp, r in rows:
        print(f"| {variant} | {tp} | {r['peak'] / mib:.0f} | {r['peak'] / plain['peak']:.2f} | {r['held'] / mib:.0f} | "
              f"{r['params'] / mib:.0f} | {r['held'] / max(r['params'], 1):.2f} | {r['seconds']:.1f} | "
              f"{r['seconds'] / plain['seconds']:.2f} |")


if __name__ == "__main__":
    main()
