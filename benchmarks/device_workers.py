"""The processes of ``device_check.py``: one model variant, or the cp attention function, per process.

Started by the check as ``python benchmarks/device_workers.py SPEC`` (``SPEC``: JSON); each answers on
stdout, one line tagged ``@@device_check`` + JSON per message: ``ready`` once loaded (or ``error``),
then one answer per command read from stdin (``{"op": ..., "args": {...}}``; ``quit`` ends it). A
command that raises answers ``error`` with its first line (the traceback goes to stderr) and the
process stays up: one failure costs one row of the table, not the run.

  model   (``ModelWorker``) loads its checkpoint (bf16 weights on CUDA, fp32 on the CPU) — through
          ``hp_lazy.activate("auto", <axis>=1)`` + ``parallelize`` or plain transformers — and warms up;
          ``time``: forward with labels + backward + SGD step; ``parity``: a fresh load's loss and
          logits; ``explain``: ``torch._dynamo.explain`` of the training forward
  cp      (``CpWorker``) ``cp``: hp_lazy's ``cp_attention`` with a ``CallState`` at world 1, and plain
          SDPA ``is_causal``, forward + backward: peak CUDA memory, time, and the new tensors of at
          least S x S elements (``allocation_recorder``)

Every process first initialises a 1-rank default process group (nccl on CUDA when available, else
gloo; a ``HashStore``, so no address or port).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import traceback
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PREFIX = "@@device_check "


def _say(**msg: Any) -> None:
    print(PREFIX + json.dumps(msg), flush=True)


def first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:300] if text else ''}"


def _init_world_one(device: str) -> str:
    """A 1-rank default process group (no env, no port): nccl on CUDA when available, else gloo."""
    import torch
    import torch.distributed as dist

    backend = "gloo"
    if device == "cuda":
        torch.cuda.set_device(0)
        backend = "nccl" if dist.is_nccl_available() else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return backend


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


class ModelWorker:
    """One variant in its own process: loads its model, then answers ``time``, ``parity``, ``explain``."""

    def __init__(self, spec: dict[str, Any]) -> None:
        import torch

        self.spec, self.device = spec, spec["device"]
        if self.device == "cpu":
            torch.set_num_threads(1)
        backend = _init_world_one(self.device)
        if spec["axis"]:
            import hp_lazy

            hp_lazy.activate("auto", **{spec["axis"]: 1})
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        self.dtype = torch.bfloat16 if self.device == "cuda" else torch.float32
        self.model = self._load(self.dtype).train()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-4)
        self.ids = self._ids(spec["batch"], spec["seq"])
        for _ in range(spec["warmup"]):
            self._step()
        _sync(self.device)
        module = sys.modules[type(self.model).__module__]
        self.info = dict(
            backend=backend, attention=self.model.config._attn_implementation,
            hooked=getattr(module, "__hp_lazy__", None) is not None,
            lowered=sorted(n for n, c in vars(module).items() if isinstance(c, type) and hasattr(c, "_hp_form")),
            params=sum(p.numel() for p in self.model.parameters()),
        )

    def _load(self, dtype: Any) -> Any:
        import transformers

        model = transformers.AutoModelForCausalLM.from_pretrained(self.spec["path"], dtype=dtype).to(self.device)
        if self.spec["axis"]:
            import hp_lazy

            model = hp_lazy.parallelize(model)
        return model

    def _ids(self, batch: int, seq: int) -> Any:
        import torch

        gen = torch.Generator().manual_seed(1)
        return torch.randint(0, self.spec["vocab"], (batch, seq), generator=gen).to(self.device)

    def _step(self) -> None:
        self.model(input_ids=self.ids, labels=self.ids).loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def time(self, steps: int) -> dict[str, Any]:
        import torch

        if self.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        _sync(self.device)
        start = time.perf_counter()
        for _ in range(steps):
            self._step()
        _sync(self.device)
        peak = torch.cuda.max_memory_allocated() if self.device == "cuda" else None
        return dict(s=(time.perf_counter() - start) / steps, peak=peak)

    def parity(self, dtype: str, seq: int, file: str) -> dict[str, Any]:
        """A fresh load in ``dtype`` (the timed model has taken SGD steps): loss, and logits saved to ``file``."""
        import torch

        model = self._load(getattr(torch, dtype)).eval()
        ids = self._ids(1, seq)
        with torch.no_grad():
            out = model(input_ids=ids, labels=ids)
        torch.save(out.logits.float().cpu(), file)
        loss = float(out.loss)
        del model, out
        if self.device == "cuda":
            torch.cuda.empty_cache()
        return dict(loss=loss)

    def explain(self, seq: int) -> dict[str, Any]:
        import torch

        torch._dynamo.reset()
        ids = self._ids(1, seq)
        found = torch._dynamo.explain(self.model)(input_ids=ids, labels=ids)
        reasons = [str(getattr(r, "reason", r)).splitlines()[0][:200] for r in found.break_reasons]
        self.opt.zero_grad(set_to_none=True)
        return dict(graphs=found.graph_count, breaks=found.graph_break_count, reasons=reasons[:2])


class CpWorker:
    """hp_lazy's cp attention function at world 1, called as the runtime calls it, and plain SDPA."""

    def __init__(self, spec: dict[str, Any]) -> None:
        import torch
        import torch.distributed as dist

        from hp_lazy.runtime.mesh import Group

        self.device = spec["device"]
        if self.device == "cpu":
            torch.set_num_threads(1)
        backend = _init_world_one(self.device)
        self.group = Group(axis="cp", pg=dist.group.WORLD, size=1, rank=0)
        device = torch.cuda.get_device_name(0) if self.device == "cuda" else None
        self.info = dict(backend=backend, device=device)

    def cp(self, seq: int, heads: int, kv: int, dim: int, steps: int) -> dict[str, Any]:
        import torch

        dtype = torch.bfloat16 if self.device == "cuda" else torch.float32
        gen = torch.Generator(self.device).manual_seed(0)
        q, k, v = (torch.randn(1, h, seq, dim, generator=gen, device=self.device, dtype=dtype).requires_grad_()
                   for h in (heads, kv, kv))
        dout = torch.randn(1, seq, heads, dim, generator=gen, device=self.device, dtype=dtype)
        out = {}
        for kind, step in (("cp", self._cp_step), ("sdpa", self._sdpa_step)):
            try:  # one out of memory must not hide the other
                out[kind] = self._measure(lambda step=step: step(q, k, v, dout), seq, steps)
            except Exception as error:
                traceback.print_exc()
                out[kind] = dict(error=first_line(error))
        return out

    def _cp_step(self, q: Any, k: Any, v: Any, dout: Any) -> None:
        import torch

        from hp_lazy.runtime.cp import attention, state
        from hp_lazy.runtime.cp.zigzag import zigzag

        seq = q.shape[2]
        call = state.CallState(  # what ContextEntry builds per forward of the bound model
            group=self.group, zig=zigzag(seq, 1, 0, q.device), mode="cp_allgather_kv",
            positions=torch.arange(seq, device=q.device)[None], docs=None, key_padding=None)
        token = state.enter(call)
        try:
            out, _ = attention.cp_attention(_Attention(), q, k, v, None, dropout=0.0, scaling=q.shape[-1] ** -0.5)
        finally:
            state.leave(token)
        out.backward(dout)
        q.grad = k.grad = v.grad = None

    @staticmethod
    def _sdpa_step(q: Any, k: Any, v: Any, dout: Any) -> None:
        import torch.nn.functional as F

        groups = q.shape[1] // k.shape[1]
        out = F.scaled_dot_product_attention(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1),
                                             is_causal=True, scale=q.shape[-1] ** -0.5)
        out.transpose(1, 2).backward(dout)
        q.grad = k.grad = v.grad = None

    def _measure(self, step: Any, seq: int, steps: int) -> dict[str, Any]:
        """One step under the allocation recorder (and the peak memory), then ``steps`` timed steps."""
        import torch

        cuda = self.device == "cuda"
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() if cuda else 0
        with allocation_recorder(threshold=seq * seq) as rec:  # [S/C x S] elements at C = 1
            step()
        _sync(self.device)
        peak = torch.cuda.max_memory_allocated() - base if cuda else None
        times = []
        for _ in range(steps):
            _sync(self.device)
            start = time.perf_counter()
            step()
            _sync(self.device)
            times.append(time.perf_counter() - start)
        return dict(peak=peak, s=statistics.median(times), largest=rec.largest, big=rec.big, big_bytes=rec.big_bytes,
                    kernels=sorted(rec.kernels))


class _Attention:
    """The attention module as cp_attention sees it (its class name and ``is_causal``)."""

    is_causal = True


def allocation_recorder(threshold: int) -> Any:
    """A TorchDispatchMode recording the largest new tensor and those of ``threshold`` elements or more."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Allocations(TorchDispatchMode):
        """Every new tensor an op returns (views and in-place results left out), forward and backward."""

        def __init__(self, threshold: int) -> None:
            super().__init__()
            self.threshold, self.largest, self.big, self.big_bytes = threshold, None, 0, 0
            self.kernels: set[str] = set()
            self._largest_bytes = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = func(*args, **(kwargs or {}))
            name = str(func.overloadpacket.__name__)
            if "scaled_dot_product" in name or "flash" in name or "efficient_attention" in name:
                self.kernels.add(name)
            if any(r.alias_info is not None for r in func._schema.returns):
                return out
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self._record(name, t)
            return out

        def _record(self, name: str, t: torch.Tensor) -> None:
            try:
                nbytes = t.untyped_storage().nbytes()
            except (RuntimeError, NotImplementedError):  # a tensor without storage
                return
            if nbytes > self._largest_bytes:
                self._largest_bytes = nbytes
                self.largest = dict(op=name, dtype=str(t.dtype).removeprefix("torch."), shape=list(t.shape),
                                    bytes=nbytes)
            if nbytes // t.element_size() >= self.threshold:
                self.big += 1
                self.big_bytes += nbytes

    return Allocations(threshold)


def main(spec: dict[str, Any]) -> None:
    sys.path.insert(0, ROOT)
    try:
        worker = CpWorker(spec) if spec["role"] == "cp" else ModelWorker(spec)
    except Exception as error:
        traceback.print_exc()
        _say(error=first_line(error))
        return
    _say(ready=worker.info)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        try:
            _say(**getattr(worker, cmd["op"])(**cmd["args"]))
        except Exception as error:
            traceback.print_exc()
            _say(error=first_line(error))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
