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
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def reference(path: str, data: dict[str, Any]) -> dict[str, Any]:
    return run(load(path), data)


def train(rank: int, world: int, path: str, data: dict[str, Any]) -> dict[str, Any]:
    import hp_lazy

    result = run(load(path), data, gather=hp_lazy.gather_sequence, full_grads=hp_lazy.full_grads,
                 full_state_dict=hp_lazy.full_state_dict)
    return result if rank == 0 else {"loss": result["loss"], "logits": result["logits"]}


def count(rank: int, world: int, path: str, data: dict[str, Any]) -> dict[str, dict[str, int]]:
    import hp_lazy

    model = hp_lazy.parallelize(load(path))
    with hp_lazy.collective_counter() as counter:
        model(**data).loss.backward()
    return {phase: counter.by_phase(phase) for phase in ("forward", "backward")}


def error(rank: int, world: int, path: str, data: dict[str, Any]) -> str:
    model = load(path)
    try:
        model(**data)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "ok"


def activate(rank: int, world: int, cp: int, tp: int) -> None:
    import hp_lazy

    hp_lazy.activate("auto", cp=cp, tp=tp)
