"""TRL's trainers on a model hp_lazy makes tensor parallel.

TRL's ``SFTTrainer``, ``DPOTrainer``, ``GRPOTrainer``, ``RLOOTrainer`` and ``KTOTrainer`` take their
loss and metrics (entropy, token accuracy) through a fused LM head: ``add_fused_lm_head`` replaces
``model.forward`` and, with ``fused_lm_head=True``, runs the backbone and hands
``get_output_embeddings().weight`` to ``ChunkedLogProbFunction``, a softmax kernel of its own. The
lowered ``lm_head`` never runs, and under tp that weight is this rank's vocab rows: the stock stack
takes a softmax over ``V/tp`` words (a loss near ``ln(V/tp)``, silently).

Installed by ``activate`` when ``trl.trainer.utils`` is imported, this module puts a dispatcher in
place of that module's ``_ChunkedLogProbFunction``: handed a weight that hp_lazy registered as a
vocab shard (:func:`hp_lazy.runtime.tp.logprobs.shard_of`), it computes every requested per-token
field over the whole vocabulary from the shards (:func:`hp_lazy.runtime.tp.logprobs.per_token`);
any other weight goes to TRL's kernel untouched.

``add_fused_lm_head`` is wrapped (in ``trl.trainer.utils`` and in every TRL module that imported it
already); the forward it installs is marked for :mod:`hp_lazy.runtime.guard` and, on a fused call:

- under context parallel, runs through the model's context-parallel entry (this rank's zigzag
  rows, pre-shifted labels, the global label count, the loss summed over cp) and gathers the
  per-token outputs back whole and in sequence order;
- under expert parallel, points Mixtral's ``load_balancing_loss_func`` (which TRL calls for every
  MoE family) to the model module's global one (:mod:`hp_lazy.runtime.ep.aux`) for the call: on
  one rank's rows it is not one process's aux loss.

``GRPOTrainer`` and ``RLOOTrainer`` take every process for a data-parallel one:
:mod:`hp_lazy.integrations.trl_online` gives them the dp ranks as their processes. Everything else
TRL does (its data collation, ``gather_for_metrics``, ``get_tp_size``) already goes through
hp_lazy's accelerate and Trainer integrations.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import sys
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

from hp_lazy.names import PATCHED, ROUTED

ADD = "add_fused_lm_head"
KERNEL = "_ChunkedLogProbFunction"
"""The name ``trl.trainer.utils`` calls its fused-head kernel by (``add_fused_lm_head``'s forward
looks it up at each call)."""


def install(module: ModuleType) -> None:
    """Route ``module`` (``trl.trainer.utils``)'s fused-head kernel once."""
    stock = getattr(module, KERNEL, None)
    if stock is None or getattr(stock, PATCHED, False):
        return
    setattr(module, KERNEL, _dispatcher(stock))
    add = getattr(module, ADD, None)
    if add is None:
        return
    routed = _routed(add)
    module.add_fused_lm_head = routed  # type: ignore[attr-defined]
    for name, imported in list(sys.modules.items()):  # trainers imported before activate hold the stock one
        if name.startswith("trl.") and getattr(imported, ADD, None) is add:
            setattr(imported, ADD, routed)


def install_sft(module: ModuleType) -> None:
    """``SFTTrainer.compute_loss`` of ``module`` (``trl.trainer.sft_trainer``), once: the calls in it
    that read the logits (``return_outputs``: the predictions of its ``prediction_step``; a
    ``compute_loss_func``; label smoothing) run under :func:`hp_lazy.whole_outputs`; its fused call
    is unchanged (it gathers its own per-token fields)."""
    cls = getattr(module, "SFTTrainer", None)
    if cls is None or vars(cls).get(PATCHED, False):  # not the Trainer's mark, which it inherits
        return
    stock = cls.compute_loss

    @functools.wraps(stock)
    def compute_loss(self: Any, model: Any, inputs: Any, return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        from hp_lazy.runtime.outputs import whole

        reads_logits = return_outputs or self.compute_loss_func is not None or self.label_smoother is not None
        with whole() if reads_logits else contextlib.nullcontext():
            return stock(self, model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)

    cls.compute_loss = compute_loss
    setattr(cls, PATCHED, True)


AUX = "load_balancing_loss_func"
MIXTRAL = "transformers.models.mixtral.modeling_mixtral"
"""Where TRL's fused forward takes the MoE aux loss function from, for every family."""


def _routed(stock: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(stock)
    def add_fused_lm_head(model: Any, *args: Any, **kwargs: Any) -> None:
        stock(model, *args, **kwargs)
        fused = model.forward

        @functools.wraps(fused)
        def forward(*inner: Any, **named: Any) -> Any:
            if not named.get("fused_lm_head"):
                return fused(*inner, **named)
            with _global_aux(model):
                entry = _context_entry(model, inner, named)
                if entry is None:
                    return fused(*inner, **named)
                return _split_over_cp(entry, fused, model, named)

        setattr(forward, ROUTED, True)  # the replaced-forward guard (hp_lazy.runtime.guard) lets it be
        model.forward = forward

    return add_fused_lm_head


FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1", "label_mask")
"""The per-token fields of TRL's ``FusedCausalLMOutput``, ``[batch, seq - 1]``."""


def _context_entry(model: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
    """The context-parallel entry of ``model`` once bound (binding it now, as its lowered forward
    would), or None when it is not split over cp."""
    from hp_lazy.names import CP_ENTRY
    from hp_lazy.runtime import registry, rt

    if registry.lowered_for(type(model)) is None:
        return None
    rt.ensure_parallel(model, {"args": args, "kwargs": kwargs})
    entry = model.__dict__.get(CP_ENTRY)
    return entry if entry is not None and entry.group.size > 1 else None


def _split_over_cp(entry: Any, fused: Callable[..., Any], model: Any, kwargs: dict[str, Any]) -> Any:
    """TRL's fused forward on this rank's zigzag rows: the entry splits the batch and hands TRL
    pre-shifted local labels (``shift_labels``, scored without shifting) and the global label count,
    and sums the loss over cp; the per-token fields are gathered back into sequence order and cut to
    the ``seq - 1`` positions one process scores, so the outputs are one process's on every rank
    (their backward keeps this rank's rows)."""
    import torch

    from hp_lazy.runtime.cp.gather import gather_sequence

    def call(module: Any, **named: Any) -> Any:
        return fused(**named)

    out = entry(call, model, (), kwargs)
    present = [(n, v) for n in FIELDS if isinstance(v := getattr(out, n, None), torch.Tensor) and v.dim() == 2]
    if not present:
        return out
    # one all-gather for every field: flags (0/1) and float32 values travel exactly as float32
    stacked = torch.stack([v.to(torch.float32) for _, v in present])  # [fields, B, S/C]
    whole = gather_sequence(stacked, entry.group, dim=2)[:, :, :-1]
    for (name, value), field in zip(present, whole.unbind(0), strict=True):
        setattr(out, name, field.to(value.dtype))
    return out


@contextlib.contextmanager
def _global_aux(model: Any) -> Iterator[None]:
    """Mixtral's aux-loss function is the model module's global one (hp_lazy's, under ep) for the call."""
    own = getattr(sys.modules.get(type(model).__module__), AUX, None)
    if getattr(own, "hp_original", None) is None:
        yield
        return
    mixtral = importlib.import_module(MIXTRAL)
    before = getattr(mixtral, AUX)
    setattr(mixtral, AUX, own)
    try:
        yield
    finally:
        setattr(mixtral, AUX, before)


def _dispatcher(stock: Any) -> type:
    class VocabParallelAware:
        """``apply`` like TRL's kernel; vocab-parallel for an hp_lazy vocab shard."""

        __wrapped__ = stock

        @staticmethod
        def apply(hidden: Any, weight: Any, bias: Any, targets: Any, temperature: float, chunk_size: int,
                  final_logit_softcapping: float | None = None, logit_scale: float = 1.0,
                  outputs: tuple[str, ...] = ("log_probs",)) -> Any:
            from hp_lazy.runtime.tp import logprobs

            shard = logprobs.shard_of(weight)
            if shard is None:
                return stock.apply(hidden, weight, bias, targets, temperature, chunk_size,
                                   final_logit_softcapping, logit_scale, outputs)
            softcap = None if final_logit_softcapping is None else final_logit_softcapping or 1.0  # as TRL reads it
            transform = logprobs.Transform(scale=logit_scale, softcap=softcap, inv_t=1 / temperature)
            return logprobs.per_token(hidden, weight, bias, targets, shard, transform, tuple(outputs))

    setattr(VocabParallelAware, PATCHED, True)
    return VocabParallelAware
