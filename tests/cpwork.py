"""Context-parallel runs shared by the cp test modules: the same function trains a model in a pool
worker (under an active cp plan) and in the pytest process (plain transformers, the reference).

A batch is a dict of full-sequence tensors (``input_ids``, ``labels``, optional ``position_ids``,
``attention_mask``): every rank of a cp group passes it whole, as to one process.
"""

from __future__ import annotations

from typing import Any

import models


def batch(kind: str = "plain", seq: int = 16) -> dict[str, Any]:
    import torch

    ids = models.batch(seq=seq)
    labels = ids.clone()
    labels[0, :5] = -100  # uneven numbers of ignored labels across the sequence's shards
    labels[1, -3:] = -100
    out: dict[str, Any] = {"input_ids": ids, "labels": labels}
    if kind in ("packed", "packed_cached"):  # two documents in row 0, three in row 1: positions restart
        out["position_ids"] = torch.tensor([list(range(7)) + list(range(seq - 7)),
                                            list(range(4)) + list(range(5)) + list(range(seq - 9))])
        if kind == "packed":
            out["use_cache"] = False  # transformers separates packed documents only without a cache
    elif kind in ("padded", "left_padded"):  # right padding in row 1 (left: row 0's first 3 tokens)
        mask = torch.ones_like(ids)
        if kind == "padded":
            mask[1, -4:] = 0
        else:
            mask[0, :3] = 0
        out["attention_mask"] = mask
        out["labels"] = labels.masked_fill(mask == 0, -100)
    return out


def run(model, data: dict[str, Any], *, steps: int = 3, gather=None, full_grads=None, full_state_dict=None) -> dict:
    """One fwd+bwd (logits, loss, grads), then ``steps`` SGD steps with weight decay."""
    import torch

    gather = gather or (lambda t: t)
    grads_of = full_grads or (lambda m: {n: p.grad.detach().clone() for n, p in m.named_parameters() if p.grad is not None})
    state_of = full_state_dict or (lambda m: {k: v.detach().clone() for k, v in m.state_dict().items()})
    out = model(**data)
    out.loss.backward()
    result = {"logits": gather(out.logits.detach()), "loss": out.loss.detach().clone(), "grads": grads_of(model)}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=0.01)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = model(**data).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.detach().clone())
    result["losses"] = torch.stack(losses)
    result["state"] = state_of(model)
    return result


def load(path: str):
    import torch
    import transformers

    torch.manual_seed(0)
    architecture = transformers.AutoConfig.from_pretrained(path).architectures[0]  # a base model for BASE_ONLY ones
    return getattr(transformers, architecture).from_pretrained(path, dtype=torch.float32)


def reference(path: str, data: dict[str, Any]) -> dict[str, Any]:
    return run(load(path), data)


def check(pool, path: str, data: dict[str, Any], floor: dict[str, float] | None = None, compile: str | None = None
          ) -> list[dict[str, Any]]:
    """``train`` on every rank of ``pool`` against one process: rank 0 everything (``parity.compare``,
    with one process's own ``floor``), every other rank the global loss and the gathered logits.
    ``compile``: the model ``model.compile(backend=compile)``d first (one process runs eagerly)."""
    import parity

    ref = reference(path, data)
    results = pool.run(train, path, data, compile)
    parity.compare(results[0], ref, floor)
    for other in results[1:]:
        assert models.rel_err(other["loss"], ref["loss"]) <= parity.TOL
        assert models.rel_err(other["logits"], ref["logits"]) <= parity.TOL
    return results


def train(rank: int, world: int, path: str, data: dict[str, Any], compile: str | None = None) -> dict[str, Any]:
    import hp_lazy

    model = load(path)
    breaks = compiled(model, compile)
    result = run(model, data, gather=hp_lazy.gather_sequence, full_grads=hp_lazy.full_grads,
                 full_state_dict=hp_lazy.full_state_dict)
    if compile:
        result["graph_breaks"] = dict(breaks)
    return result if rank == 0 else {"loss": result["loss"], "logits": result["logits"]}


def compiled(model, backend: str | None) -> Any:
    """``model.compile(backend=backend)`` (nothing for None; dynamo reset first); returns dynamo's
    graph-break counter (reason -> count), filled as the model runs."""
    import torch
    from torch._dynamo.utils import counters

    if backend is None:
        return {}
    torch._dynamo.reset()
    counters.clear()
    model.compile(backend=backend)
    return counters["graph_break"]


def count(rank: int, world: int, path: str, data: dict[str, Any]) -> dict[str, dict[str, int]]:
    import hp_lazy

    model = hp_lazy.parallelize(load(path))
    with hp_lazy.collective_counter() as counter:
        model(**data).loss.backward()
    return {phase: counter.by_phase(phase) for phase in ("forward", "backward")}


def error(rank: int, world: int, path: str, data: dict[str, Any]) -> str:
    """What loading the model and one forward raise (a model cp cannot split is refused at load)."""
    try:
        model = load(path)
        model(**data)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "ok"


def attention_implementations(rank: int, world: int, path: str) -> dict[str, str]:
    """The attention implementation of each top-level submodule's config, once bound."""
    model = load(path)
    return {f"model.{name}": child.config._attn_implementation for name, child in model.model.named_children()
            if hasattr(child, "config")}


def activate(rank: int, world: int, cp: int, tp: int, mode: str = "allgather", sp: bool = False) -> None:
    import hp_lazy

    hp_lazy.activate("auto", cp=cp, tp=tp, cp_mode=mode, sequence_parallel=sp)


def train_broken(rank: int, world: int, path: str, data: dict[str, Any], how: str) -> dict[str, Any]:
    """Negative controls: the train run with one part of context parallel done the naive way."""
    import torch

    from hp_lazy.runtime.comm import reduce_from
    from hp_lazy.runtime.cp import entry, state

    undo = []

    def patch(owner, name, value):
        undo.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    if how == "local positions":  # each rank numbers its own rows 0..S/C-1
        build = state.CallState.__init__

        def init(self, **kw):
            build(self, **kw)
            local = torch.zeros_like(self.positions)
            local[:, self.zig.local] = torch.arange(self.zig.local_len)
            self.positions = local

        patch(state.CallState, "__init__", init)
    elif how == "upper-left causal":  # the local query rows against the keys by row number
        from hp_lazy.runtime.cp.zigzag import Zigzag

        patch(Zigzag, "runs", lambda self: [(0, 0, self.local_len)])
    elif how == "mean of means":  # each rank's mean loss, averaged over ranks
        split = entry.ContextEntry._split

        def local_count(self, values, use_cache):
            call, st, has_labels = split(self, values, use_cache)
            call["num_items_in_batch"] = (call["labels"] != -100).sum()
            return call, st, has_labels

        patch(entry.ContextEntry, "_split", local_count)
        patch(entry, "reduce_from", lambda x, g: reduce_from(x, g) / g.size)
    elif how == "indexer keys in rank order":  # DSA: the top-k then indexes (and breaks ties over) other keys
        from hp_lazy.runtime.cp import indexed

        gather = indexed._GatheredKeys.update_indexer
        patch(indexed._GatheredKeys, "update_indexer",
              lambda self, k, i: gather(self, k, i).index_select(1, self.state.zig.gathered))
    elif how == "mask indexer keys in rank order":  # Kolibri 1.1: the pool's blocks and the top-k over other keys
        from hp_lazy.runtime.cp import indexed

        gather_keys = indexed._gather_keys

        def rank_order(arguments, st):
            gather_keys(arguments, st)
            arguments[indexed.KEYS] = arguments[indexed.KEYS].index_select(2, st.zig.gathered)

        patch(indexed, "_gather_keys", rank_order)
    elif how in ("temperature of the local rows", "chunks ignored"):  # Llama 4 as its code runs on local rows
        from hp_lazy.runtime.cp import positions

        patch(positions, "query_rescale" if how.startswith("temperature") else "chunk_of", lambda *a: None)
    try:
        return train(rank, world, path, data)
    finally:
        for owner, name, value in reversed(undo):
            setattr(owner, name, value)


def saved_shapes(rank: int, world: int, path: str, data: dict[str, Any]) -> list[tuple[int, ...]]:
    """Shapes of every tensor autograd saves for backward during one forward."""
    import torch

    import hp_lazy

    model = hp_lazy.parallelize(load(path))
    shapes: list[tuple[int, ...]] = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(**data).loss
    loss.backward()
    return shapes


def train_dp(rank: int, world: int, path: str, data: dict[str, Any]) -> dict[str, Any]:
    """dp x cp: each dp group feeds its own rows (every cp rank of it the same rows)."""
    import hp_lazy

    dp = hp_lazy.mesh().group("dp")
    mine = {k: v.chunk(dp.size)[dp.rank] if hasattr(v, "chunk") else v for k, v in data.items()}
    result = run(load(path), mine, gather=hp_lazy.gather_sequence, full_grads=hp_lazy.full_grads,
                 full_state_dict=hp_lazy.full_state_dict)
    return {**result, "dp_rank": dp.rank}


def balanced(seq: int = 16) -> dict[str, Any]:
    """Every row with the same number of valid labels after the shift (11 of 16): hp_lazy's dp average
    (DDP's) is then the global mean."""
    ids = models.batch(seq=seq)
    labels = ids.clone()
    labels[0, 1:5] = -100
    labels[1, -4:] = -100
    return {"input_ids": ids, "labels": labels}


def grad_norm(rank: int, world: int, path: str, data: dict[str, Any]) -> float:
    """torch's stock clip_grad_norm_ after one backward (the total norm it returns)."""
    import torch

    from hp_lazy.hook.api import active_plan

    model = load(path)
    if active_plan() is not None:
        import hp_lazy

        hp_lazy.parallelize(model)
    model(**data).loss.backward()
    return float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9))


def traffic(rank: int, world: int, path: str, data: dict[str, Any], latent: bool = True) -> dict[str, Any]:
    """Elements each rank sends into all-gathers and reduce-scatters over one fwd+bwd, and the loss
    and gradients; ``latent=False`` takes MLA's latent gather off (K/V gathered as for any attention)."""
    import hp_lazy
    from hp_lazy.runtime.comm import wire

    model = hp_lazy.parallelize(load(path))
    if not latent:
        for module in model.modules():
            module.__dict__.pop("expand_kv", None)
    sent: dict[str, int] = {}
    originals = wire.all_gather, wire.reduce_scatter

    def all_gather(x, g, dim, phase):
        sent["all_gather"] = sent.get("all_gather", 0) + x.numel()
        return originals[0](x, g, dim, phase)

    def reduce_scatter(x, g, dim, phase):
        sent["reduce_scatter"] = sent.get("reduce_scatter", 0) + x.numel() // g.size
        return originals[1](x, g, dim, phase)

    wire.all_gather, wire.reduce_scatter = all_gather, reduce_scatter
    try:
        out = model(**data)
        out.loss.backward()
    finally:
        wire.all_gather, wire.reduce_scatter = originals
    return {"sent": sent, "loss": out.loss.detach(), "grads": hp_lazy.full_grads(model)}


def checkpointed(rank: int, world: int, path: str, data: dict[str, Any], reentrant: bool) -> dict[str, Any]:
    """``train`` with transformers' gradient checkpointing on (every layer recomputed in backward);
    on one process (world 1, no plan) the reference."""
    import hp_lazy
    from hp_lazy.api import active_plan

    model = load(path)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.train()
    if active_plan() is None:
        return run(model, data)
    result = run(model, data, gather=hp_lazy.gather_sequence, full_grads=hp_lazy.full_grads,
                 full_state_dict=hp_lazy.full_state_dict)
    return result if rank == 0 else {"loss": result["loss"], "logits": result["logits"]}


def chunking_floor(path: str, data: dict[str, Any], chunk_size: int = 2) -> dict[str, float]:
    """How far one process is from itself when the gated delta rule runs in chunks of
    ``chunk_size`` instead of 64 (the same sum in another order; the kernel computes in float32):
    the round-off floor of the entries ``parity.compare`` checks."""
    import functools

    import parity
    from transformers.models.qwen3_next import modeling_qwen3_next as m

    ref = reference(path, data)
    original = m.torch_chunk_gated_delta_rule
    m.torch_chunk_gated_delta_rule = functools.partial(original, chunk_size=chunk_size)
    try:
        other = reference(path, data)
    finally:
        m.torch_chunk_gated_delta_rule = original
    return parity.relative_errors(other, ref)


KERNELS = {  # which -> (modeling module, function, hp_lazy wrapper)
    "gdn": ("qwen3_next", "torch_chunk_gated_delta_rule", "_rule"),
    "kda": ("kimi_linear", "chunk_kimi_delta_attention", "_rule"),
    "ssd": ("bamba", "mamba2_chunk_scan", "_ssd"),
    "mamba1": ("jamba", "mamba_selective_scan", "_selective"),
}


def _kernel_inputs(which: str, seq: int):  # type: ignore[no-untyped-def]
    """(sequence inputs [B, S, ...], parameters, keyword names of the sequence inputs after the
    third, fixed keywords, the output's trailing shape) for one kernel."""
    import torch

    gen = torch.Generator().manual_seed(0)
    b, h, dk, dv = 2, 3, 8, 6

    def rnd(*shape: int):  # type: ignore[no-untyped-def]
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    if which == "mamba1":  # x, dt, gate [B, S, D]; B and C [B, S, N] (the kernel takes them [B, *, S]); A [D, N]
        d, n = h * dv, dk
        seqs = [rnd(b, seq, d), rnd(b, seq, d), rnd(b, seq, n), rnd(b, seq, n), rnd(b, seq, d)]
        params = {"A": -torch.rand(d, n, generator=gen, dtype=torch.float64) - 0.1, "D": rnd(d),
                  "delta_bias": rnd(d)}
        return seqs, params, (), {"delta_softplus": True}, (d,)
    if which == "ssd":  # x [B, S, H, P], dt [B, S, H], B and C [B, S, G, N]; A, D, dt_bias per head
        seqs = [rnd(b, seq, h, dv), rnd(b, seq, h), rnd(b, seq, 1, dk), rnd(b, seq, 1, dk)]
        params = {"A": -torch.rand(h, generator=gen, dtype=torch.float64) - 0.1, "D": rnd(h), "dt_bias": rnd(h)}
        return seqs, params, (), {"chunk_size": 4, "dt_softplus": True}, (h, dv)
    g = -torch.rand(b, seq, h, *((dk,) if which == "kda" else ()), generator=gen, dtype=torch.float64)
    seqs = [rnd(b, seq, h, dk), rnd(b, seq, h, dk), rnd(b, seq, h, dv), g,
            torch.rand(b, seq, h, generator=gen, dtype=torch.float64)]
    return seqs, {}, ("g", "beta"), {"chunk_size": 4, "use_qk_l2norm_in_kernel": True}, (h, dv)


def _call(fn, which: str, seqs, params, names, fixed):  # type: ignore[no-untyped-def]
    if which == "mamba1":
        x, dt, b_in, c_in, z = (t.transpose(1, 2) for t in seqs)
        return fn(x, dt, params["A"], b_in, c_in, D=params["D"], z=z, delta_bias=params["delta_bias"],
                  **fixed).transpose(1, 2)
    if which == "ssd":
        x, dt, b_in, c_in = seqs
        return fn(x, dt, params["A"], b_in, c_in, D=params["D"], dt_bias=params["dt_bias"], **fixed)
    return fn(*seqs[:3], **dict(zip(names, seqs[3:], strict=True)), **fixed)[0]


def recurrent_rule(rank: int, world: int, seq: int, naive: bool = False, which: str = "gdn") -> dict[str, Any]:
    """transformers' torch kernel ``which`` (:data:`KERNELS`) on this rank's zigzag rows through
    :mod:`hp_lazy.runtime.cp.recurrent` against one call over the whole sequence (each rank
    computes that too): the output rows, every input's gradient (parameters summed over the ranks)
    and the bytes gathered. ``naive``: every chunk starts from a zero state (the negative control)."""
    import importlib

    import torch

    import hp_lazy
    from hp_lazy.runtime.cp import recurrent, state
    from hp_lazy.runtime.cp.zigzag import zigzag
    from hp_lazy.runtime.mesh import Group

    family, name, wrapper = KERNELS[which]
    m = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    kernel = getattr(getattr(m, name), recurrent.WRAPPED, getattr(m, name))
    seqs, params, names, fixed, tail = _kernel_inputs(which, seq)
    dout = torch.randn(seqs[0].shape[0], seq, *tail, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    whole = [t.clone().requires_grad_() for t in seqs]
    whole_params = {k: v.clone().requires_grad_() for k, v in params.items()}
    ref = _call(kernel, which, whole, whole_params, names, fixed)
    ref.backward(dout)
    group = hp_lazy.mesh().group("cp") if world > 1 else Group.solo("cp")
    zig = zigzag(seq, world, rank, seqs[0].device)
    mine = [t.index_select(1, zig.local).clone().requires_grad_() for t in seqs]
    mine_params = {k: v.clone().requires_grad_() for k, v in params.items()}
    if naive:  # each chunk from a zero state, as a cp that passed no state would
        out = torch.cat([_call(kernel, which, [t.narrow(1, at, n) for t in mine], mine_params, names, fixed)
                         for at, _, n in zig.runs()], dim=1)
        return {"errors": {"out": models.rel_err(out.detach(), ref.detach().index_select(1, zig.local))}}
    call = state.CallState(group=group, zig=zig, mode="cp_allgather_kv", positions=torch.arange(seq)[None],
                           docs=None, key_padding=None)
    token = state.enter(call)
    try:
        with hp_lazy.collective_counter() as counter:
            out = _call(getattr(recurrent, wrapper)(kernel), which, mine, mine_params, names, fixed)
            out.backward(dout.index_select(1, zig.local))
    finally:
        state.leave(token)
    errors = {"out": models.rel_err(out.detach(), ref.detach().index_select(1, zig.local))}
    for i, (got, want) in enumerate(zip(mine, whole, strict=True)):
        full = torch.zeros_like(want)
        full.index_copy_(1, zig.local, got.grad)
        errors[f"grad input {i}"] = models.rel_err(gather_sequence_sum(full, world), want.grad)
    for key, got in mine_params.items():
        errors[f"grad {key}"] = models.rel_err(gather_sequence_sum(got.grad, world), whole_params[key].grad)
    return {"errors": errors, "gathered": counter.bytes_of("all_gather")}


def gather_sequence_sum(x, world: int):
    """Every rank's rows of a ``[B, S, ...]`` gradient placed in a zero tensor, summed over the ranks."""
    import torch
    import torch.distributed as dist

    if world > 1:
        x = x.clone()
        dist.all_reduce(x)
    return torch.as_tensor(x)


def lora_train(rank: int, world: int, path: str, data: dict[str, Any], targets: list[str]) -> dict[str, Any]:
    """:func:`run` on PEFT's LoRA of the model's ``targets`` (one process at world 1)."""
    import test_peft

    import hp_lazy

    model = test_peft._peft(load(path), targets=targets)
    if world == 1:
        return run(model, data)
    result = run(model, data, gather=hp_lazy.gather_sequence, full_grads=hp_lazy.full_grads,
                 full_state_dict=hp_lazy.full_state_dict)
    return result if rank == 0 else {"loss": result["loss"]}
