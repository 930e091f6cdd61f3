"""The model's entry under context parallel: every rank of a cp group passes the same full-sequence
batch, as to one process; the entry keeps this rank's zigzag rows and runs the forward on them.

Per call (:class:`ContextEntry`, run by the bound root's ``install_root`` wrapper):

- the sequence length ``S`` (dim 1 of ``input_ids`` / ``inputs_embeds``) must be a multiple of
  ``2 * cp``; the rows :mod:`.zigzag` gives this rank are taken of ``input_ids`` /
  ``inputs_embeds`` and of the position ids (given, or ``arange(S)``: the global positions);
- labels are shifted over the whole sequence *before* the split (``shift_labels``, as transformers'
  ``ForCausalLMLoss`` does), the number of valid labels is counted over the whole sequence
  (``num_items_in_batch``, unless the caller passes one), and each rank's loss is its own sum over
  that global count; ``out.loss`` is their sum (all-reduce forward, identity backward): the global
  loss on every rank, whose backward gives each rank its own part; ``out.aux_loss`` likewise (the
  load-balancing loss made global by :func:`hp_lazy.runtime.ep.aux.install`, each rank's ``1/cp``
  share of its value, summed);
- a 2-D ``attention_mask`` becomes the key padding of the masks; without one, and with
  ``use_cache`` off (transformers' condition: it detects packing only without a cache), position
  ids that restart mark packed documents (transformers' detection); the attention and RoPE read
  both from the call's :class:`~hp_lazy.runtime.cp.state.CallState`.

Refused, naming the option: a KV cache or ``use_cache=True`` (generation), ``output_attentions``,
``logits_to_keep`` other than 0, a 4-D mask, a tensor argument of the sequence's shape whose
split hp_lazy does not know, and, for a model with towers (vision or audio encoders run whole),
any tensor input beyond the text stack's (``pixel_values``, ``image_grid_thw``, ...).
"""

from __future__ import annotations

import inspect
import math
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hp_lazy.errors import ShardingError
from hp_lazy.runtime import outputs
from hp_lazy.runtime.comm import reduce_from
from hp_lazy.runtime.cp import state as cp_state
from hp_lazy.runtime.cp.zigzag import zigzag
from hp_lazy.runtime.ep import aux
from hp_lazy.runtime.mesh import Group

IGNORE = -100
_KNOWN = frozenset(
    {"input_ids", "inputs_embeds", "labels", "position_ids", "attention_mask", "shift_labels", "num_items_in_batch",
     "use_cache", "past_key_values", "output_attentions", "output_hidden_states", "logits_to_keep", "return_dict",
     "cache_position", "output_router_logits", "seq_idx"}
)
CAUSAL_LOSSES = (None, "ForCausalLM", "ForConditionalGeneration")
"""``loss_type`` of the heads whose labels the entry splits: a causal LM's, shifted over the whole
sequence before the split (None: a model without a head of transformers' losses)."""
POOLED_HEADS = frozenset({"ForSequenceClassification", "ForImageClassification", "ForVideoClassification",
                          "ForAudioClassification"})
"""``loss_type`` of heads that read one token per row: refused when the model binds."""
LABEL_ARGUMENTS = ("labels", "start_positions", "end_positions")
SPLIT_AS_TOKENS = ("seq_idx",)
"""Per-token ``[batch, seq]`` metadata kept for this rank's rows like the tokens (TRL's padding-free
packing passes the documents' ids; the attention reads the documents from the position ids)."""


def packed_documents(positions: torch.Tensor) -> torch.Tensor | None:
    """transformers' packed-sequence detection: a new document wherever the position does not step by 1."""
    step = torch.diff(positions, prepend=positions[:, :1] - 1, dim=-1)
    docs = (step != 1).cumsum(-1)
    return None if bool((docs[:, -1] == 0).all()) else docs


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return any(_holds_tensor(v) for v in value)
    return isinstance(value, torch.Tensor)


class ContextEntry:
    """Split one call's batch over the cp group (see the module doc)."""

    def __init__(self, owner: str, group: Group, mode: str = "cp_allgather_kv", towers: tuple[str, ...] = (),
                 pieces: int = 1, loss_type: str | None = None) -> None:
        self.owner = owner
        self.loss_type = loss_type
        """transformers' ``loss_type`` of the model: labels are split for :data:`CAUSAL_LOSSES` only."""
        self.group = group
        self.mode = mode
        self.towers = towers
        """Submodules (a vision or audio encoder) whose attention context parallel leaves whole:
        text-only batches split; a batch with their inputs is refused."""
        self.pieces = pieces
        """The pieces sequence parallel cuts this rank's rows into between the tp boundaries (tp; 1 without sp)."""
        self.multiple = math.lcm(2 * group.size, group.size * pieces)
        """What the sequence length must be a multiple of: the zigzag's 2 * cp chunks, and the pieces."""
        self._signatures: dict[Callable[..., Any], inspect.Signature] = {}

    def __call__(self, forward: Callable[..., Any], module: nn.Module, args: tuple, kwargs: dict,
                 whole: bool = False) -> Any:
        """``whole``: the per-token outputs gathered back into sequence order on every rank
        (:func:`hp_lazy.runtime.outputs.sequence_whole`); else they hold this rank's rows."""
        if cp_state.current() is not None:  # a nested root inside a cp forward: already split
            return forward(module, *args, **kwargs)
        values = self._arguments(forward, module, args, kwargs)
        call, state, has_labels = self._split(values, getattr(getattr(module, "config", None), "use_cache", False))
        token = cp_state.enter(state)
        try:
            out = forward(module, **call)
        finally:
            cp_state.leave(token)
        if has_labels and getattr(out, "loss", None) is not None:
            out.loss = reduce_from(out.loss, self.group)
        if isinstance(getattr(out, "aux_loss", None), torch.Tensor):
            out.aux_loss = self._global_aux(out.aux_loss, module)
        if whole:
            tokens = call["input_ids" if "input_ids" in call else "inputs_embeds"]
            out = outputs.sequence_whole(out, self.group, tokens.shape[0], tokens.shape[1], self.owner)
        return out

    def _global_aux(self, aux_loss: torch.Tensor, module: nn.Module) -> torch.Tensor:
        """Each rank's ``1/cp`` share of the global aux loss (:mod:`hp_lazy.runtime.ep.aux`), summed.
        An aux loss from anything else is this rank's tokens' alone: refused."""
        function = getattr(sys.modules.get(type(module).__module__), aux.NAME, None)
        if getattr(function, "hp_original", None) is None:
            raise self._refuse("an aux loss (out.aux_loss) not from transformers' load_balancing_loss_func",
                               "it is computed from this rank's tokens only", "drop output_router_logits")
        return reduce_from(aux_loss, self.group)

    def _arguments(self, forward: Callable[..., Any], module: nn.Module, args: tuple, kwargs: dict) -> dict[str, Any]:
        sig = self._signatures.get(forward)
        if sig is None:
            sig = self._signatures[forward] = inspect.signature(forward)
        bound = sig.bind(module, *args, **kwargs)
        values: dict[str, Any] = {}
        for name, value in list(bound.arguments.items())[1:]:
            kind = sig.parameters[name].kind
            if kind is inspect.Parameter.VAR_KEYWORD:
                values.update(value)
            elif kind is inspect.Parameter.VAR_POSITIONAL:
                if value:
                    raise ShardingError(
                        f"{self.owner}: {len(value)} extra positional arguments under context parallel; pass keywords"
                    )
            else:
                values[name] = value
        return values

    def _refuse(self, option: str, why: str, fix: str) -> ShardingError:
        return ShardingError(f"{self.owner}: {option} under context parallel (cp={self.group.size}): {why}; {fix}")

    def _split(self, values: dict[str, Any], use_cache: bool) -> tuple[dict[str, Any], cp_state.CallState, bool]:
        if values.get("past_key_values") is not None or values.get("use_cache") is True:
            raise self._refuse("a KV cache (use_cache=True / past_key_values)", "generation appends one token at a "
                               "time, which cannot be split over the sequence", "generate with a tp-only plan")
        given = [name for name in LABEL_ARGUMENTS if values.get(name) is not None]
        if given and self.loss_type not in CAUSAL_LOSSES:
            raise self._refuse(
                f"{given[0]!r} for a {self.loss_type} head", "context parallel splits the labels of a causal LM "
                "(shifted over the whole sequence before the split) only, and this head's loss would be taken over "
                "each rank's rows", "call the model without them under hp_lazy.whole_outputs() and compute the loss "
                "from the whole logits, or train without cp")
        if values.get("output_attentions"):
            raise self._refuse("output_attentions=True", "the attention weights are never built (each rank holds "
                               "its queries' rows only)", "drop the option")
        if values.get("logits_to_keep") not in (None, 0):
            raise self._refuse(f"logits_to_keep={values['logits_to_keep']!r}", "the last tokens live on other ranks",
                               "use logits_to_keep=0 and hp_lazy.gather_sequence(out.logits)")
        ids, embeds = values.get("input_ids"), values.get("inputs_embeds")
        tokens = ids if ids is not None else embeds
        if tokens is None or tokens.dim() < 2:
            raise self._refuse("a call without input_ids or inputs_embeds of [batch, seq, ...]",
                               "the sequence to split is not known", "pass input_ids or inputs_embeds")
        batch, seq = tokens.shape[0], tokens.shape[1]
        size = self.group.size
        multiple = self.multiple
        if seq % multiple:
            cut = f"the zigzag layout cuts it into 2*cp = {2 * size} equal chunks" + (
                f" and sequence parallel each rank's S/cp rows into tp = {self.pieces} equal pieces"
                if self.pieces > 1 else "")
            raise self._refuse(
                f"a sequence of {seq} tokens", cut,
                f"pad it to a multiple of {multiple} ({seq + (-seq) % multiple} tokens: pad ids with label "
                f"{IGNORE} and attention_mask 0 at the padding; a data collator's pad_to_multiple_of={multiple} "
                "does it: transformers' DataCollatorWithPadding, TRL's SFTConfig / DPOConfig)",
            )
        for name, value in values.items():
            along = isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[:2] == (batch, seq)
            if along and name not in _KNOWN:
                raise self._refuse(f"argument {name!r} of shape {list(value.shape)}", "hp_lazy does not know how to "
                                   "split it along the sequence", "leave it out, or report the model")
        if self.towers:
            for name, value in values.items():
                if name not in _KNOWN and _holds_tensor(value):
                    raise self._refuse(
                        f"argument {name!r} (an input of {', '.join(self.towers)})", "the encoder's features land at "
                        "their tokens' positions over the whole sequence, and each rank holds only its share of "
                        "those positions; context parallel splits this model's text stack only",
                        "train batches with these inputs without cp (text-only batches split)")
        zig = zigzag(seq, size, self.group.rank, tokens.device)
        positions = values.get("position_ids")
        given_positions = positions is not None
        if positions is None:
            positions = torch.arange(seq, device=tokens.device)
        if positions.dim() != 2 and not (positions.dim() == 1 and positions.shape[0] == seq):
            raise self._refuse(f"position_ids of shape {list(positions.shape)}", "only [batch, seq] position ids "
                               "can be split (multimodal RoPE is not supported yet)", "pass [batch, seq] position ids")
        positions = positions.reshape(-1, seq).expand(batch, seq)
        mask = values.get("attention_mask")
        padding = None
        if mask is not None:
            if mask.dim() != 2:
                raise self._refuse(f"a {mask.dim()}-D attention_mask", "only a 2-D padding mask is split",
                                   "pass a [batch, seq] mask of 0/1")
            padding = mask.to(torch.bool)
            if bool(padding.all()):
                padding = None
        # transformers looks for packed documents only without a mask and without a cache (use_cache
        # resolved from the config when not given): the same here, though no cache is ever built
        cached = use_cache if values.get("use_cache") is None else values["use_cache"]
        docs = packed_documents(positions) if given_positions and mask is None and not cached else None
        call = {k: v for k, v in values.items() if k not in ("input_ids", "inputs_embeds", "position_ids",
                                                               "attention_mask", "labels", "shift_labels")}
        call["input_ids" if ids is not None else "inputs_embeds"] = tokens.index_select(1, zig.local)
        call["position_ids"] = positions.index_select(1, zig.local)
        for name in SPLIT_AS_TOKENS:
            if isinstance(values.get(name), torch.Tensor) and values[name].shape[:2] == (batch, seq):
                call[name] = values[name].index_select(1, zig.local)
        call["use_cache"] = False
        labels, shifted = values.get("labels"), values.get("shift_labels")
        has_labels = labels is not None or shifted is not None
        if has_labels:
            if shifted is None:
                assert labels is not None
                shifted = F.pad(labels, (0, 1), value=IGNORE)[..., 1:]
            if values.get("num_items_in_batch") is None:
                call["num_items_in_batch"] = (shifted != IGNORE).sum()
            local = shifted.index_select(1, zig.local)
            call["labels"] = call["shift_labels"] = local
        state = cp_state.CallState(
            group=self.group, zig=zig, mode=self.mode, positions=positions, docs=docs, key_padding=padding
        )
        return call, state, has_labels
