"""Worker-side functions and checks shared by the parity test modules.

Workers run these in a :class:`dist.DistPool`; the main pytest process computes the
single-process reference with plain transformers and compares.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import models

TOL = 1e-5


class References:
    """Single-process reference runs, computed once per model in the pytest process."""

    def __init__(self, root: str) -> None:
        self.root = root
        self._cache: dict[str, dict[str, Any]] = {}

    def __call__(self, name: str) -> tuple[str, dict[str, Any]]:
        path = models.build(name, self.root)
        if name not in self._cache:
            self._cache[name] = models.reference(path, models.batch())
        return path, self._cache[name]


def once(pool, fn, *args, **kwargs):
    """``pool`` with ``fn(rank, world, *args, **kwargs)`` (an activation) run on every rank once per
    set of workers (a pool restarts its workers after a worker error)."""
    if getattr(pool, "_hp_activated", None) is not pool._procs or not pool._procs:
        pool.run(fn, *args, **kwargs)
        pool._hp_activated = pool._procs
    return pool


def activated(pool, *, tp: int | None = None, **flags: bool):
    """``pool`` with ``hp_lazy.activate(Plan.auto(tp=tp or world, **flags))`` done on every rank, once."""
    return once(pool, activate, tp or pool.world_size, flags)


def check_parity(pool, refs: References, name: str) -> dict[str, float]:
    path, ref = refs(name)
    results = pool.run(train, path, models.batch())
    errors = compare(results[0], ref)
    for other in results[1:]:  # every rank sees the same full logits and loss
        assert models.rel_err(other["logits"], ref["logits"]) <= TOL
        assert models.rel_err(other["loss"], ref["loss"]) <= TOL
    return errors


def activate(rank: int, world: int, tp: int, flags: dict[str, bool]) -> None:
    import hp_lazy

    hp_lazy.activate(hp_lazy.Plan.auto(tp=tp, **flags))


def _load(path: str):
    import torch
    import transformers

    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def train(rank: int, world: int, path: str, ids) -> dict[str, Any]:
    """The parity run on every rank; rank 0 returns the full tensors."""
    import hp_lazy

    model = _load(path)
    result = models.run_training(model, ids, full_grads=hp_lazy.full_grads, full_state_dict=hp_lazy.full_state_dict)
    return result if rank == 0 else {"loss": result["loss"], "logits": result["logits"]}


def train_loaded(rank: int, world: int, path: str, ids) -> dict[str, Any]:
    """:func:`train` on the model ``models.load`` gives (a seq2seq LM for T5Gemma)."""
    import hp_lazy

    result = models.run_training(models.load(path), ids, full_grads=hp_lazy.full_grads,
                                 full_state_dict=hp_lazy.full_state_dict)
    return result if rank == 0 else {"loss": result["loss"], "logits": result["logits"]}


def users_loss(out, ids):
    """A loss of the user's, computed outside the model from its outputs: next-token cross-entropy
    with label smoothing 0.1 over the whole sequence and vocabulary, plus the mean square of the
    first layer's output (a hidden state)."""
    import torch.nn.functional as F

    logits = out.logits[:, :-1].flatten(0, 1)
    return F.cross_entropy(logits, ids[:, 1:].flatten(), label_smoothing=0.1) + out.hidden_states[1].pow(2).mean()


def whole_outputs_loss(rank: int, world: int, path: str, ids, whole: bool = True,
                       backward: bool = True) -> dict[str, Any]:
    """``with hp_lazy.whole_outputs(): out = model(input_ids=ids, output_hidden_states=True)`` (no
    labels), then :func:`users_loss` of ``out`` on every rank and its backward: the logits, the
    hidden states, the loss, every gradient, and the forward's all-gather payload. ``whole=False``:
    the forward without the block; ``backward=False``: the outputs and the payload only."""
    import hp_lazy

    model = _load(path)
    if world > 1:
        hp_lazy.parallelize(model)  # bound before counting
    with hp_lazy.collective_counter() as counter, hp_lazy.whole_outputs() if whole else contextlib.nullcontext():
        out = model(input_ids=ids, output_hidden_states=True)
    result: dict[str, Any] = {"logits": out.logits.detach(), "hidden": [h.detach() for h in out.hidden_states],
                              "gathered": counter.bytes_of("all_gather")}
    if not backward:
        return result
    loss = users_loss(out, ids)
    loss.backward()
    return {**result, "loss": loss.detach(), "grads": hp_lazy.full_grads(model)}


def compare_whole(got: dict[str, Any], ref: dict[str, Any]) -> None:
    """:func:`whole_outputs_loss` of a rank against one process's: logits, hidden states, loss, every gradient."""
    assert [h.shape for h in got["hidden"]] == [h.shape for h in ref["hidden"]], [h.shape for h in got["hidden"]]
    assert got["logits"].shape == ref["logits"].shape, (got["logits"].shape, ref["logits"].shape)
    errors = {"logits": models.rel_err(got["logits"], ref["logits"]), "loss": models.rel_err(got["loss"], ref["loss"])}
    errors.update({f"hidden {i}": models.rel_err(g, h) for i, (g, h) in enumerate(zip(got["hidden"], ref["hidden"], strict=True))})
    errors.update({f"grad {n}": models.rel_err(got["grads"][n], g) for n, g in ref["grads"].items()})
    bad = {k: v for k, v in errors.items() if not v <= TOL}
    assert not bad, f"relative errors above {TOL}: {bad}"


def count(rank: int, world: int, path: str, ids) -> dict[str, dict[str, int]]:
    """Collectives of one forward and one backward, after the model is bound."""
    import hp_lazy

    model = hp_lazy.parallelize(_load(path))
    with hp_lazy.collective_counter() as counter:
        model(input_ids=ids, labels=ids).loss.backward()
    return {phase: counter.by_phase(phase) for phase in ("forward", "backward")}


def count_bytes(rank: int, world: int, path: str, ids) -> dict[str, Any]:
    """:func:`count`, and the payload of the all-gathers (both phases)."""
    import hp_lazy

    model = hp_lazy.parallelize(_load(path))
    with hp_lazy.collective_counter() as counter:
        model(input_ids=ids, labels=ids).loss.backward()
    return {**{phase: counter.by_phase(phase) for phase in ("forward", "backward")},
            "all_gather_bytes": counter.bytes_of("all_gather")}


def collectives_of(model, suffix: str, inputs: dict[str, Any]) -> dict[str, Any]:
    """The collectives each ``*{suffix}`` module of ``model`` issues in one forward on ``inputs``
    (entry, body and exit: counted between its forward pre-hook and hook), by module:
    ``{op: (count, payload)}``."""
    import hp_lazy

    open_: dict[str, Any] = {}
    counted: dict[str, Any] = {}

    def enter(name: str):  # noqa: ANN202
        def hook(module, args) -> None:  # noqa: ANN001
            open_[name] = hp_lazy.collective_counter()
            counted[name] = open_[name].__enter__()
        return hook

    def leave(name: str):  # noqa: ANN202
        def hook(module, args, out) -> None:  # noqa: ANN001
            open_.pop(name).__exit__(None, None, None)
        return hook

    for name, module in model.named_modules():
        if name.endswith(suffix):
            module.register_forward_pre_hook(enter(name))
            module.register_forward_hook(leave(name))
    model(**inputs)
    return {name: {op: (c.counts[(op, "forward")], c.payload[(op, "forward")]) for op, _ in c.counts}
            for name, c in counted.items()}


def module_collectives(rank: int, world: int, path: str, suffix: str) -> dict[str, Any]:
    """:func:`collectives_of` the model at ``path``, on :func:`models.batch` as inputs and labels."""
    import hp_lazy

    ids = models.batch()
    return collectives_of(hp_lazy.parallelize(_load(path)), suffix, {"input_ids": ids, "labels": ids})


def train_without_mixers(rank: int, world: int, path: str, ids) -> dict[str, Any]:
    """Negative control: no token mixer run on the whole sequence under sequence parallel."""
    from hp_lazy.runtime.sp import mixers

    original = mixers.gather_mixers
    mixers.gather_mixers = lambda ctx: None
    try:
        return train(rank, world, path, ids)
    finally:
        mixers.gather_mixers = original


def train_with_broken_entry(rank: int, world: int, path: str, ids) -> dict[str, Any]:
    """Negative control: the lowered entry op (copy_to) dropped from every boundary."""
    import hp_lazy.runtime.rt as rt

    original = rt.copy_to
    rt.copy_to = lambda x, group: x
    try:
        return train(rank, world, path, ids)
    finally:
        rt.copy_to = original


def compare(got: dict[str, Any], ref: dict[str, Any], floor: dict[str, float] | None = None) -> dict[str, float]:
    """Relative max errors: logits, loss, every gradient, the losses of the SGD steps and every
    parameter after them. Raises AssertionError naming what differs. ``floor``: per entry, how far
    one process is from itself under a mathematically equal computation (a kernel's chunking); an
    entry may then reach twice that where it exceeds TOL."""
    errors = relative_errors(got, ref)
    floor = floor or {}
    bad = {k: v for k, v in errors.items() if not v <= max(TOL, 2 * floor.get(k, 0.0))}
    assert not bad, f"relative errors above {TOL} (or twice one process's own floor {floor}): {bad}"
    return errors


def float64_floor(path: str, ref: dict[str, Any], **options: Any) -> dict[str, float]:
    """One process's own round-off, per entry: its float32 run ``ref`` against its float64 run
    (``options`` go to ``from_pretrained``). ``compare`` lets an entry above TOL reach twice it."""
    wide = models.run_training(models.load(path, "float64", **options), models.batch())
    floor = relative_errors(ref, wide)
    assert max(floor.values()) < 1e-3  # the model's own round-off, and it stays small
    return floor


def relative_errors(got: dict[str, Any], ref: dict[str, Any]) -> dict[str, float]:
    """The entries :func:`compare` checks, by name."""
    errors = {
        "logits": models.rel_err(got["logits"], ref["logits"]),
        "loss": models.rel_err(got["loss"], ref["loss"]),
        "losses": models.rel_err(got["losses"], ref["losses"]),
    }
    assert set(got["grads"]) == set(ref["grads"]), set(got["grads"]) ^ set(ref["grads"])
    assert set(got["state"]) == set(ref["state"]), set(got["state"]) ^ set(ref["state"])
    for name, grad in ref["grads"].items():
        assert got["grads"][name].shape == grad.shape, (name, got["grads"][name].shape, grad.shape)
        errors[f"grad {name}"] = models.rel_err(got["grads"][name], grad)
    for name, value in ref["state"].items():
        errors[f"param {name}"] = models.rel_err(got["state"][name], value)
    return errors


@contextlib.contextmanager
def swapped(owner: Any, name: str, value: Any) -> Iterator[Any]:
    """``owner.name`` set to ``value`` inside the block (a negative control's broken part), the
    original back after; yields the original."""
    original = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield original
    finally:
        setattr(owner, name, original)


def no_carry(lightning: Any) -> Any:
    """:func:`swapped` of ``lightning._carry`` (:mod:`hp_lazy.runtime.cp.lightning`) for a zero carry:
    each chunk or piece of a lightning attention from a zero state."""
    original = lightning._carry
    return swapped(lightning, "_carry", lambda *args: original(*args) * 0)
