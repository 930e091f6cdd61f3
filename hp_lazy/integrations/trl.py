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
any other weight goes to TRL's kernel untouched. Everything else TRL does (its data collation,
``gather_for_metrics``, ``get_tp_size``) already goes through hp_lazy's accelerate and Trainer
integrations.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from hp_lazy.names import PATCHED

KERNEL = "_ChunkedLogProbFunction"
"""The name ``trl.trainer.utils`` calls its fused-head kernel by (``add_fused_lm_head``'s forward
looks it up at each call)."""


def install(module: ModuleType) -> None:
    """Route ``module`` (``trl.trainer.utils``)'s fused-head kernel once."""
    stock = getattr(module, KERNEL, None)
    if stock is None or getattr(stock, PATCHED, False):
        return
    setattr(module, KERNEL, _dispatcher(stock))


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
