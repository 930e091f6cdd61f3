"""Training-step time of hp_lazy tensor parallel against transformers ``tp_plan``, DTensor and bare Megatron TP.

Every variant runs the same checkpoint (a Llama built from a config with random weights, seed 0, saved with
``save_pretrained`` into a temp dir; nothing is downloaded), the same batch and the same step: forward with
``labels`` (HF loss) + ``backward`` + ``zero_grad``. All variants are loaded in the SAME ranks and timed
interleaved, round by round, the order rotated each round; a variant's per-round time is its slowest rank's,
and its ratio is the median of the per-round ratios to ``ref_solo`` (rank 0 runs the plain model on one
thread while the other ranks wait), which cancels the drift of a shared machine. Variants:

  ref_solo    plain model, one process, one thread (the baseline of every ratio; the numeric reference)
  ref_both    plain model on every rank at once (how much the ranks slow each other down; 2+ ranks)
  hp_lazy     hp_lazy.activate("auto", tp=world), then AutoModelForCausalLM.from_pretrained; the tp ranks'
              inputs are compared by value digest on the first forward and when shapes change (the default)
  hp_lazy_digest  the same model class, loaded again under HP_LAZY_CHECK_INPUTS=1: the input digest on EVERY
              step (one small all-gather + a pass over the ids); its ratio to hp_lazy is what the check costs
  hf_tp       transformers' own TP: from_pretrained(tp_plan="auto") (needs `pip install --no-deps accelerate
              psutil`; skipped with a message without it); on 1 rank its plan is applied to a 1-rank mesh
  dtensor_tp  torch parallelize_module, torchtitan recipe (colwise q/k/v/gate/up, rowwise o/down,
              vocab-parallel embedding, colwise lm_head gathered)
  bare_tp     hand-written Megatron TP: f/g autograd functions with bare all-reduces installed by module hooks
              (one all-reduce per attention and per MLP each way), lm_head colwise + all-gather

hp_lazy lowers ``transformers.models.llama.modeling_llama`` when it is imported, so the plain variants use a
private copy of that module (``transformers.models.llama._plain_modeling_llama``) executed before hp_lazy is
activated. On one rank (``--world 1``) no communication happens: the ratios are pure framework overhead.
Besides wall time the tables give the CPU time of a step summed over the ranks (``time.process_time``, which
leaves out the waits at barriers and in collectives; steadier than wall time when the machine is shared) and
the median per-round ratio to ``bare_tp``. Measured once, after the timing: collectives per fwd+bwd step
(torch's CommDebugMode for every variant, plus hp_lazy's own counter by phase), max |dlogits| and the max
relative gradient error (max over parameters of max|dg| / max|g_ref|) against the plain model.

    python benchmarks/step_time.py          # tiny on 1 and 2 ranks (~2 min) + 160M on 2 ranks (~3 min), 2 cores
    python benchmarks/step_time.py --models tiny --rounds 30 --world 2 --out /tmp/step_time.md
    python benchmarks/step_time.py --models medium --rounds 10 --variants hp_lazy,bare_tp
    python benchmarks/step_time.py --models tiny --world 2 --profile hp_lazy   # + cProfile of 5 steps, rank 0
    python benchmarks/step_time.py --models tiny --world 2 --compile inductor --variants hp_lazy,hf_tp,bare_tp
    python benchmarks/step_time.py --smoke      # the tiny model on 2 ranks, one round: does every variant run?
    python benchmarks/step_time.py --family olmo2 --models tiny --world 2 --variants hp_lazy,hf_tp

``--family olmo2``: OLMo 2, whose q/k norms run over every head. transformers' plan gathers q/k/v for them
(``colwise_gather_output``), so ``hf_tp`` runs attention whole on every rank; hp_lazy splits the heads and
sums the norms' row statistics over tp. ``dtensor_tp`` and ``bare_tp`` are Llama's recipes (skipped).

``--compile BACKEND``: every variant's model (the plain reference too) runs under
``torch.compile(model, backend=BACKEND)`` after it is loaded and bound; collectives are counted and
gradients compared on the model itself (the compiled module shares its parameters).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Family:
    """The modeling module a run times: ``llama`` (every variant) or ``olmo2`` (q/k norms over every head)."""

    name: str
    prefix: str  # class-name prefix: "Llama", "Olmo2"

    @property
    def real_name(self) -> str:
        return f"transformers.models.{self.name}.modeling_{self.name}"

    @property
    def plain_name(self) -> str:
        return f"transformers.models.{self.name}._plain_modeling_{self.name}"


FAMILIES = {"llama": Family("llama", "Llama"), "olmo2": Family("olmo2", "Olmo2")}
FAMILY = FAMILIES["llama"]
"""The family of this process's run (the launcher's ``--family``; the worker's job)."""
ALL_VARIANTS = ("ref_solo", "ref_both", "hp_lazy", "hp_lazy_digest", "hf_tp", "dtensor_tp", "bare_tp")
TP_VARIANTS = ("hp_lazy", "hp_lazy_digest", "hf_tp", "dtensor_tp", "bare_tp")
HP_VARIANTS = ("hp_lazy", "hp_lazy_digest")


@dataclass(frozen=True)
class ModelSpec:
    cfg: dict[str, int | bool]
    batch: int
    seq: int
    rounds: int
    warmup: int
    worlds: tuple[int, ...]


_LLAMA = dict(max_position_embeddings=512, tie_word_embeddings=False)
MODELS: dict[str, ModelSpec] = {
    "tiny": ModelSpec(dict(vocab_size=1024, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                           num_attention_heads=8, num_key_value_heads=4, **_LLAMA), 4, 128, 20, 2, (1, 2)),
    "medium": ModelSpec(dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                             num_attention_heads=16, num_key_value_heads=8, **_LLAMA), 2, 128, 5, 1, (2,)),
}


# ------------------------------------------------------------------------------------------- model loading
def load_plain() -> Any:
    """A private, never-lowered copy of the family's modeling module (must run before hp_lazy.activate)."""
    import importlib
    import importlib.util

    pkg = importlib.import_module(f"transformers.models.{FAMILY.name}")
    if FAMILY.plain_name in sys.modules:
        return sys.modules[FAMILY.plain_name]
    path = os.path.join(pkg.__path__[0], f"modeling_{FAMILY.name}.py")
    spec = importlib.util.spec_from_file_location(FAMILY.plain_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[FAMILY.plain_name] = module
    spec.loader.exec_module(module)
    lowered = [n for n, c in vars(module).items() if isinstance(c, type) and hasattr(c, "_hp_form")]
    if lowered:
        raise RuntimeError(f"{FAMILY.plain_name}: classes {lowered} are lowered; it must be loaded before "
                           "hp_lazy.activate")
    return module


def causal_lm(module: Any) -> Any:
    return getattr(module, f"{FAMILY.prefix}ForCausalLM")


def install_bare_tp(model: Any, rank: int, world: int) -> Callable[[Any], dict[str, Any]]:
    """Megatron TP with plain tensors and bare collectives installed by hooks; returns a full-grads function."""
    import torch
    import torch.distributed as dist

    class _F(torch.autograd.Function):  # identity fwd, all-reduce bwd
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
            g = g.contiguous()
            dist.all_reduce(g)
            return g

    class _G(torch.autograd.Function):  # all-reduce fwd, identity bwd
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            x = x.contiguous()
            dist.all_reduce(x)
            return x

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
            return g

    class _Gather(torch.autograd.Function):  # all-gather last dim fwd, own slice bwd
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            parts = [torch.empty_like(x) for _ in range(world)]
            dist.all_gather(parts, x.contiguous())
            ctx.n = x.shape[-1]
            return torch.cat(parts, dim=-1)

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
            return g[..., rank * ctx.n:(rank + 1) * ctx.n].contiguous()

    dims: dict[str, int] = {}

    def shard(lin: torch.nn.Linear, dim: int, name: str) -> None:
        n = lin.weight.shape[dim] // world
        lin.weight = torch.nn.Parameter(lin.weight.detach().narrow(dim, rank * n, n).clone())
        dims[name + ".weight"] = dim

    def pre(mod: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if "hidden_states" in kwargs:
            kwargs["hidden_states"] = _F.apply(kwargs["hidden_states"])
            return args, kwargs
        return (_F.apply(args[0]),) + tuple(args[1:]), kwargs

    def post(mod: Any, args: tuple, kwargs: dict, out: Any) -> Any:
        return (_G.apply(out[0]),) + tuple(out[1:]) if isinstance(out, tuple) else _G.apply(out)

    for i, layer in enumerate(model.model.layers):
        for block, cols, row in ((layer.self_attn, ("q_proj", "k_proj", "v_proj"), "o_proj"),
                                 (layer.mlp, ("gate_proj", "up_proj"), "down_proj")):
            prefix = f"model.layers.{i}.{'self_attn' if block is layer.self_attn else 'mlp'}"
            for n in cols:
                shard(getattr(block, n), 0, f"{prefix}.{n}")
            shard(getattr(block, row), 1, f"{prefix}.{row}")
            block.register_forward_pre_hook(pre, with_kwargs=True)
            block.register_forward_hook(post, with_kwargs=True)
    shard(model.lm_head, 0, "lm_head")
    model.lm_head.register_forward_pre_hook(lambda m, a: (_F.apply(a[0]),))
    model.lm_head.register_forward_hook(lambda m, a, o: _Gather.apply(o))

    def full_grads(m: Any) -> dict[str, Any]:
        out = {}
        for name, p in m.named_parameters():
            if p.grad is not None and name in dims:
                parts = [torch.empty_like(p.grad) for _ in range(world)]
                dist.all_gather(parts, p.grad.contiguous())
                out[name] = torch.cat(parts, dim=dims[name])
            elif p.grad is not None:
                out[name] = p.grad
        return out

    return full_grads


def install_dtensor_tp(model: Any, world: int) -> None:
    """torchtitan's TP recipe through torch's parallelize_module."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world,))
    parallelize_module(model, mesh, {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
                                     "lm_head": ColwiseParallel(output_layouts=Replicate())})
    col, row = ColwiseParallel, RowwiseParallel
    for layer in model.model.layers:
        parallelize_module(layer, mesh, {
            "self_attn.q_proj": col(), "self_attn.k_proj": col(), "self_attn.v_proj": col(),
            "self_attn.o_proj": row(), "mlp.gate_proj": col(), "mlp.up_proj": col(), "mlp.down_proj": row()})


def plain_or_full_grads(model: Any) -> dict[str, Any]:
    return {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad)
            for n, p in model.named_parameters() if p.grad is not None}


class _Skip(Exception):
    """A variant that cannot run here (its message says what to install)."""


def load_hf_tp(cls: Any, path: str, world: int) -> Any:
    import torch

    try:
        import accelerate  # noqa: F401  (transformers' TP refuses to load without it, even on CPU)
    except ImportError as error:
        raise _Skip("transformers TP needs accelerate: pip install --no-deps accelerate psutil") from error
    if world > 1:
        return cls.from_pretrained(path, tp_plan="auto", dtype=torch.float32)
    # transformers skips TP at tp_size 1: apply its own plan to a 1-rank mesh to measure its overhead
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    model = cls.from_pretrained(path, dtype=torch.float32)
    apply_tensor_parallelism(model, init_device_mesh("cpu", (1,)), model._expand_parallel_plan(model.tp_plan))
    return model


@dataclass(frozen=True)
class Loaded:
    model: Any
    grads: Callable[[Any], dict[str, Any]]


def load_variants(variants: list[str], path: str, rank: int, world: int) -> tuple[dict[str, Loaded], dict[str, str]]:
    """Plain variants from the private module copy first, then hp_lazy; failures are recorded, not raised."""
    import torch

    plain = load_plain()
    if FAMILY.real_name in sys.modules:
        raise RuntimeError(f"{FAMILY.real_name} was imported before hp_lazy.activate; it would not be lowered")
    loaded = {"ref": Loaded(causal_lm(plain).from_pretrained(path, dtype=torch.float32), plain_or_full_grads)}
    failed: dict[str, str] = {}
    for v in sorted((v for v in variants if v in TP_VARIANTS), key=lambda v: (v in HP_VARIANTS, v)):  # hp_lazy last
        try:
            loaded[v] = (_load_hp_lazy(path, world, plain, every_step=v == "hp_lazy_digest") if v in HP_VARIANTS
                         else _load_plain(v, plain, path, rank, world))
        except Exception as error:  # one broken variant must not hide the others
            why = str(error).splitlines()[0][:300] if str(error) else ""
            failed[v] = why if isinstance(error, _Skip) else f"{type(error).__name__}: {why}"
            if rank == 0:
                print(f"[step_time] {v} skipped: {failed[v]}", file=sys.stderr, flush=True)
    for m in loaded.values():
        m.model.train()
    return loaded, failed


def _load_plain(variant: str, plain: Any, path: str, rank: int, world: int) -> Loaded:
    import torch

    if variant == "hf_tp":
        return Loaded(load_hf_tp(causal_lm(plain), path, world), plain_or_full_grads)
    if FAMILY.name != "llama":
        raise _Skip(f"a recipe written for Llama's modules; {FAMILY.prefix}'s q/k norms run over every head")
    model = causal_lm(plain).from_pretrained(path, dtype=torch.float32)
    if variant == "dtensor_tp":
        install_dtensor_tp(model, world)
        return Loaded(model, plain_or_full_grads)
    return Loaded(model, install_bare_tp(model, rank, world))


def _load_hp_lazy(path: str, world: int, plain: Any, *, every_step: bool = False) -> Loaded:
    """hp_lazy's model; ``every_step``: its input check digests the inputs on every forward
    (``HP_LAZY_CHECK_INPUTS=1`` while it binds), not only on the first and on a shape change."""
    import importlib

    import torch
    import transformers

    import hp_lazy
    from hp_lazy.names import INPUT_CHECK
    from hp_lazy.runtime.inputs import VALUES_ENV

    real_name, mlp = FAMILY.real_name, f"{FAMILY.prefix}MLP"
    if real_name not in sys.modules:  # the first hp_lazy variant activates; the second reuses the lowered module
        # --hp-embedding: "vocab" (default, like transformers' tp_plan) or "replicated" (bare_tp's layout)
        vocab = os.environ.get("HP_LAZY_BENCH_EMBEDDING", "vocab") == "vocab"
        hp_lazy.activate(hp_lazy.Plan.auto(tp=world, vocab_parallel_embedding=vocab))
    real = importlib.import_module(real_name)
    if getattr(real, "__hp_lazy__", None) is None:
        raise RuntimeError(f"{real_name} was not imported through hp_lazy's hook")
    if world > 1 and not hasattr(getattr(real, mlp), "_hp_form"):  # at tp=1 every form is identity: no rewrite
        raise RuntimeError(f"{real_name} was not lowered by hp_lazy")
    if hasattr(getattr(plain, mlp), "_hp_form") or getattr(real, mlp) is getattr(plain, mlp):
        raise RuntimeError(f"{FAMILY.plain_name} was lowered too; the plain variants would not be plain")
    before = os.environ.pop(VALUES_ENV, None)
    if every_step:
        os.environ[VALUES_ENV] = "1"
    try:
        model = hp_lazy.parallelize(transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32))
        checks = [m.__dict__[INPUT_CHECK] for m in model.modules() if INPUT_CHECK in m.__dict__]
        if world > 1 and (not checks or any(c.every != every_step for c in checks)):
            raise RuntimeError(f"{real_name}: the input check does not digest {'every' if every_step else 'the first'} "
                               "step as this variant needs")
        return Loaded(model, hp_lazy.full_grads)
    finally:
        os.environ.pop(VALUES_ENV, None)
        if before is not None:
            os.environ[VALUES_ENV] = before


# ---------------------------------------------------------------------------------------------- the worker
def worker(job: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist
    import transformers

    global FAMILY
    FAMILY = FAMILIES[job["family"]]
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    data = torch.load(job["inputs"])
    ids, labels = data["input_ids"], data["labels"]
    variants = [v for v in job["variants"] if not (v == "ref_both" and world == 1)]
    loaded, failed = load_variants(variants, job["model_dir"], rank, world)
    variants = [v for v in variants if v not in failed]
    if job.get("compile"):
        loaded = {k: _compiled(m, job["compile"]) for k, m in loaded.items()}
    models = {v: loaded["ref" if v.startswith("ref_") else v] for v in variants}

    def step(m: Any) -> None:
        m(input_ids=ids, labels=labels).loss.backward()
        m.zero_grad(set_to_none=True)

    def fwd(m: Any) -> None:
        with torch.no_grad():
            m(input_ids=ids)

    times = interleave(variants, models, {"step": step, "fwd": fwd}, job, rank)
    digest_ms = digest_cost(models["hp_lazy_digest"].model, ids) if "hp_lazy_digest" in models else None
    counts = {v: count_collectives(v, _eager(models[v].model), ids, labels) for v in variants if v in TP_VARIANTS}
    ref = numerics_step(loaded["ref"], ids, labels)
    numerics = {v: compare(numerics_step(models[v], ids, labels), ref) for v in variants if v in TP_VARIANTS}
    if job.get("profile") in models:
        profile(job["profile"], models[job["profile"]].model, step, rank)
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, times)
    if rank == 0:
        result = dict(world=world, variants=variants, failed=failed, counts=counts, numerics=numerics, digest_ms=digest_ms,
                      times=summarize(variants, everyone, job["rounds"]), rounds=job["rounds"],
                      at=time.strftime("%H:%M:%S"))
        with open(job["result"], "w") as f:
            json.dump(result, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


def interleave(variants: list[str], models: dict[str, Loaded], fns: dict[str, Callable[[Any], None]],
               job: dict[str, Any], rank: int) -> dict[str, dict[str, list[float]]]:
    """Per variant and kind, this rank's seconds per step in each round (warm-up rounds dropped)."""
    import torch.distributed as dist

    def timed(v: str, fn: Callable[[Any], None]) -> tuple[float, float]:
        dist.barrier()
        t, c = time.perf_counter(), time.process_time()
        if not (v == "ref_solo" and rank != 0):
            for _ in range(job["steps"]):
                fn(models[v].model)
        dt, dc = time.perf_counter() - t, time.process_time() - c
        dist.barrier()
        return dt / job["steps"], dc / job["steps"]

    rec: dict[str, dict[str, list[float]]] = {v: {k: [] for k in (*fns, "cpu")} for v in variants}
    for r in range(job["warmup"] + job["rounds"]):
        order = variants[r % len(variants):] + variants[:r % len(variants)]
        for kind, fn in fns.items():
            for v in order:
                dt, dc = timed(v, fn)
                if r >= job["warmup"]:
                    rec[v][kind].append(dt)
                    if kind == "step":
                        rec[v]["cpu"].append(dc)
    return rec


def digest_cost(model: Any, ids: Any, calls: int = 50) -> float | None:
    """Milliseconds this rank spends in one call of the model's input check (every rank calls it: it
    gathers), given the step's ``input_ids``; None on one rank, where there is no check."""
    import torch.distributed as dist

    from hp_lazy.names import INPUT_CHECK

    checks = [m.__dict__[INPUT_CHECK] for m in model.modules() if INPUT_CHECK in m.__dict__]
    if not checks:
        return None
    dist.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        checks[0]({"input_ids": ids})
    return 1e3 * (time.perf_counter() - start) / calls


def summarize(variants: list[str], everyone: list[dict], rounds: int) -> dict[str, dict[str, Any]]:
    """Per round: wall = the slowest rank (rank 0 for ref_solo), cpu = summed over ranks; then medians."""
    out: dict[str, dict[str, Any]] = {}
    for kind in ("step", "fwd", "cpu"):
        def series(v: str, kind: str = kind) -> list[float]:
            if kind == "cpu":
                return [sum(r[v][kind][i] for r in everyone) for i in range(rounds)]
            return [(everyone[0] if v == "ref_solo" else max(everyone, key=lambda r: r[v][kind][i]))[v][kind][i]
                    for i in range(rounds)]

        per = {v: series(v) for v in variants}
        for v in variants:
            def ratio(base: str, per: dict[str, list[float]] = per, v: str = v) -> float | None:
                return statistics.median(a / b for a, b in zip(per[v], per[base], strict=True)) if base in per else None
            out.setdefault(v, {})[kind] = dict(median_ms=1e3 * statistics.median(per[v]), min_ms=1e3 * min(per[v]),
                                               x_ref=ratio("ref_solo"), x_bare=ratio("bare_tp"),
                                               x_hp=ratio("hp_lazy"))
    return out


def count_collectives(variant: str, model: Any, ids: Any, labels: Any) -> dict[str, Any]:
    """One untimed step under CommDebugMode (and one under hp_lazy's own counter for hp_lazy).

    With transformers 5.25 on torch 2.13, CommDebugMode's module tracker fails inside the model's
    forward for every variant, plain transformers in one process included (an empty parent list in
    its forward hook), so there the row says it was not counted."""
    from torch.distributed.tensor.debug import CommDebugMode

    out: dict[str, Any] = {}
    if variant in HP_VARIANTS:
        import hp_lazy

        with hp_lazy.collective_counter() as counter:
            model(input_ids=ids, labels=labels).loss.backward()
        out["hp_lazy"] = {ph: counter.by_phase(ph) for ph in ("forward", "backward")}
        model.zero_grad(set_to_none=True)
    if not _comm_debug_works():
        out["comm_debug"] = {"not counted (CommDebugMode fails on transformers >= 5.25)": 0}
        return out
    cm = CommDebugMode()
    with cm:
        model(input_ids=ids, labels=labels).loss.backward()
    out["comm_debug"] = {str(k).split(".")[-1]: n for k, n in cm.get_comm_counts().items()}
    model.zero_grad(set_to_none=True)
    return out


def _comm_debug_works() -> bool:
    """CommDebugMode's module tracker breaks inside transformers 5.25's forward (and leaves hooks
    that break the next steps), so it is not entered there."""
    import transformers

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return (major, minor) < (5, 25)


def _compiled(m: Loaded, backend: str) -> Loaded:
    import torch

    return Loaded(torch.compile(m.model, backend=backend), lambda compiled, g=m.grads: g(_eager(compiled)))


def _eager(model: Any) -> Any:
    return getattr(model, "_orig_mod", model)


def numerics_step(m: Loaded, ids: Any, labels: Any) -> tuple[Any, dict[str, Any]]:
    """One step with the gradients kept: (full logits, full gradients); a collective for parallel models."""
    out = m.model(input_ids=ids, labels=labels)
    out.loss.backward()
    logits = out.logits.full_tensor() if hasattr(out.logits, "full_tensor") else out.logits
    grads = {k: g.detach().clone() for k, g in m.grads(m.model).items()}
    m.model.zero_grad(set_to_none=True)
    return logits.detach(), grads


def compare(got: tuple[Any, dict[str, Any]], ref: tuple[Any, dict[str, Any]]) -> dict[str, Any]:
    """max |dlogits|, and the max over parameters of max|dg| / max|g_ref| (missing or misshapen grads listed)."""
    (logits, grads), (ref_logits, ref_grads) = got, ref
    missing = sorted(set(ref_grads) ^ set(grads))
    rel, worst = 0.0, ""
    for name, g in ref_grads.items():
        if name in grads and grads[name].shape == g.shape:
            r = float((grads[name] - g).abs().max()) / max(float(g.abs().max()), 1e-30)
            rel, worst = max((rel, worst), (r, name))
        elif name in grads:
            missing.append(f"{name}: shape {tuple(grads[name].shape)}")
    return dict(dlogits=float((logits - ref_logits).abs().max()), grad_rel=rel, worst=worst, missing=missing[:4])


def profile(variant: str, model: Any, step: Callable[[Any], None], rank: int) -> None:
    """cProfile 5 steps of one variant on every rank; rank 0 prints the top functions by own time."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(5):
        step(model)
    prof.disable()
    if rank == 0:
        print(f"\n## cProfile, {variant}, rank 0, 5 steps (sorted by tottime)\n", flush=True)
        pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(30)
        pstats.Stats(prof, stream=sys.stdout).sort_stats("cumulative").print_stats("hp_lazy", 30)


# ------------------------------------------------------------------------------------------ the launcher
def build_checkpoint(name: str, root: str) -> tuple[str, str]:
    """Random weights (seed 0) saved with save_pretrained, and a fixed batch (labels = inputs)."""
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    spec = MODELS[name]
    model_dir, inputs = os.path.join(root, name), os.path.join(root, f"{name}_inputs.pt")
    torch.manual_seed(0)
    config = getattr(transformers, f"{FAMILY.prefix}Config")(**spec.cfg)
    getattr(transformers, f"{FAMILY.prefix}ForCausalLM")(config).save_pretrained(model_dir)
    ids = torch.randint(0, int(spec.cfg["vocab_size"]), (spec.batch, spec.seq), generator=torch.Generator().manual_seed(1))
    torch.save({"input_ids": ids, "labels": ids.clone()}, inputs)
    return model_dir, inputs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(job: dict[str, Any], world: int, root: str, timeout: int) -> dict[str, Any]:
    """Run the worker on ``world`` ranks (torch.distributed.run, gloo on 127.0.0.1); returns its result."""
    job = dict(job, result=os.path.join(root, f"result_{job['model']}_w{world}.json"))
    job_path = os.path.join(root, f"job_{job['model']}_w{world}.json")
    with open(job_path, "w") as f:
        json.dump(job, f)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world), "--master-addr",
           "127.0.0.1", "--master-port", str(free_port()), os.path.abspath(__file__), "_worker", job_path]
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", TOKENIZERS_PARALLELISM="false")
    print(f"$ OMP_NUM_THREADS=1 GLOO_SOCKET_IFNAME=lo {' '.join(cmd)}", file=sys.stderr, flush=True)
    t = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        log, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as error:
        log, rc = f"timeout after {timeout}s: {error.stderr!r:.2000}", -9
    print(f"  ({world} rank(s), {time.perf_counter() - t:.0f} s, rc={rc})", file=sys.stderr, flush=True)
    if "## cProfile" in log:
        print(log[log.index("## cProfile"):])
    if rc != 0 or not os.path.exists(job["result"]):
        return dict(world=world, error=f"rc={rc}\n{log[-12000:]}")
    with open(job["result"]) as f:
        return json.load(f)


def fmt(x: float | None, spec: str = "{:.2f}") -> str:
    return "-" if x is None else spec.format(x)


def counts_text(c: dict[str, Any] | None) -> str:
    if not c:
        return "-"
    cd = c["comm_debug"]
    text = ", ".join(f"{k} {n}" for k, n in sorted(cd.items())) + f" (**{sum(cd.values())}**)" if cd else "0"
    if "hp_lazy" in c:
        own = c["hp_lazy"]
        text += "; own counter: " + "; ".join(
            f"{ph[0]}wd " + ", ".join(f"{k} {n}" for k, n in ops.items()) for ph, ops in own.items() if ops)
    return text


def render(name: str, res: dict[str, Any]) -> str:
    spec, world = MODELS[name], res["world"]
    params = "3.4M" if name == "tiny" else "160M"
    head = (f"### {name} {FAMILY.prefix} ({params} params, batch {spec.batch} x seq {spec.seq}), {world} rank(s)"
            f"{'' if world > 1 else ' - framework overhead, no communication'}\n\n")
    if "error" in res:
        return head + "run failed:\n\n```\n" + res["error"] + "\n```\n"
    lines = [head + f"{res['rounds']} interleaved rounds at {res['at']}; x = median of per-round ratios "
             "(lower is better)\n",
             "| variant | fwd+bwd ms (median / min) | x ref_solo | x bare_tp | fwd+bwd CPU ms, all ranks | x ref_solo "
             "| fwd no-grad ms | x ref_solo | collectives per fwd+bwd step | max abs dlogits | max rel dgrad |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for v in res["variants"]:
        s, f_, c = res["times"][v]["step"], res["times"][v]["fwd"], res["times"][v]["cpu"]
        num = res["numerics"].get(v, {})
        grad = fmt(num.get("grad_rel"), "{:.1e}") + (f" missing {num['missing']}" if num.get("missing") else "")
        lines.append(f"| {v} | {s['median_ms']:.1f} / {s['min_ms']:.1f} | {fmt(s['x_ref'])} | {fmt(s['x_bare'])} | "
                     f"{c['median_ms']:.1f} | {fmt(c['x_ref'])} | {f_['median_ms']:.1f} | {fmt(f_['x_ref'])} | {counts_text(res['counts'].get(v))} | "
                     f"{fmt(num.get('dlogits'), '{:.1e}')} | {grad} |")
    for v, why in res["failed"].items():
        lines.append(f"| {v} | skipped: {why.replace('|', '/')} |" + " |" * 10)
    if res.get("digest_ms") is not None and "hp_lazy" in res["times"]:
        step = res["times"]["hp_lazy"]["step"]["median_ms"]
        lines.append(f"\nThe input check digesting every step (`HP_LAZY_CHECK_INPUTS=1`; by default only the first step "
                     f"and a shape change): {res['digest_ms']:.3f} ms per call on rank 0, measured alone = "
                     f"{100 * res['digest_ms'] / step:.2f}% of hp_lazy's fwd+bwd median; hp_lazy_digest / hp_lazy, "
                     f"median of per-round ratios: {fmt(res['times']['hp_lazy_digest']['step']['x_hp'])} (wall), "
                     f"{fmt(res['times']['hp_lazy_digest']['cpu']['x_hp'])} (CPU)")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_worker"]:
        with open(argv[1]) as f:
            return worker(json.load(f))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="tiny,medium", help=f"comma list of {sorted(MODELS)}")
    ap.add_argument("--rounds", type=int, help="timed rounds (default: tiny 20, medium 5)")
    ap.add_argument("--steps", type=int, default=1, help="steps per variant per round (default 1)")
    ap.add_argument("--warmup", type=int, help="untimed rounds first (default: tiny 2, medium 1)")
    ap.add_argument("--world", help="comma list of rank counts (default: tiny 1,2; medium 2)")
    ap.add_argument("--variants", default=",".join(ALL_VARIANTS), help="comma list; ref_solo is always added")
    ap.add_argument("--profile", choices=TP_VARIANTS, help="also cProfile 5 steps of this variant on rank 0")
    ap.add_argument("--compile", default="", help="torch.compile backend for every variant (e.g. inductor)")
    ap.add_argument("--timeout", type=int, default=1200, help="seconds per launch")
    ap.add_argument("--out", help="also write the markdown tables to this file")
    ap.add_argument("--hp-embedding", choices=("vocab", "replicated"), default="vocab",
                    help="hp_lazy's embed_tokens: vocab-parallel (default, like tp_plan) or replicated (like bare_tp)")
    ap.add_argument("--family", choices=sorted(FAMILIES), default="llama",
                    help="the modeling module: llama (every variant) or olmo2 (q/k norms over every head: "
                         "transformers' plan gathers q/k/v; dtensor_tp and bare_tp are Llama's recipes)")
    ap.add_argument("--smoke", action="store_true", help="the tiny model on 2 ranks, one round, no warm-up")
    args = ap.parse_args(argv)
    global FAMILY
    FAMILY = FAMILIES[args.family]
    if args.smoke:
        args.models, args.world, args.rounds, args.warmup, args.timeout = "tiny", "2", 1, 0, 300
    os.environ["HP_LAZY_BENCH_EMBEDDING"] = args.hp_embedding
    variants = ["ref_solo"] + [v for v in args.variants.split(",") if v and v != "ref_solo"]
    unknown = sorted(set(variants) - set(ALL_VARIANTS))
    if unknown:
        ap.error(f"unknown variants {unknown}; choose from {ALL_VARIANTS}")
    report = [f"## Training-step time (torch {_version('torch')}, transformers {_version('transformers')}, "
              f"{os.cpu_count()} CPUs, 1 thread per rank, gloo"
              f"{f', torch.compile(backend={args.compile!r})' if args.compile else ''})\n"]
    with tempfile.TemporaryDirectory(prefix="hp_lazy_step_time_") as root:
        for name in args.models.split(","):
            spec = MODELS[name]
            model_dir, inputs = build_checkpoint(name, root)
            job = dict(model=name, model_dir=model_dir, inputs=inputs, variants=variants, steps=args.steps,
                       rounds=args.rounds or spec.rounds, warmup=spec.warmup if args.warmup is None else args.warmup,
                       profile=args.profile, compile=args.compile, family=args.family)
            worlds = [int(w) for w in args.world.split(",")] if args.world else list(spec.worlds)
            for world in worlds:
                report.append(render(name, launch(job, world, root, args.timeout)))
                print(report[-1], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(report))


def _version(dist_name: str) -> str:
    from importlib.metadata import version

    return version(dist_name)


if __name__ == "__main__":
    main()
