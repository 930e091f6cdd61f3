"""Context parallel's style: the sequence of every batch split over the ``cp`` ranks.

Bound per model (the walker calls it like every style, :mod:`hp_lazy.runtime.style`):

- ``validate``: each boundary whose contract carries the inner op ``cp_allgather_kv`` is an
  attention module that calls transformers' attention interface; what that attention cannot do
  split over the sequence is refused here (K/V compressed over the whole sequence, a mask of its
  own, dropout); attention sinks and logit softcapping run in the blockwise attention, DSA's
  top-k selection through :mod:`.indexed`;
- ``finish``: the model's layer types must all be attention (full, sliding, chunked, DSA's indexed) or recurrent layers
  :mod:`.recurrent` splits (Gated DeltaNet, KDA, Mamba2, Mamba1, short convolutions: state passed
  between ranks) or lightning attention :mod:`.lightning` splits (MiniMax's: its state passed too);
  others mix tokens outside attention and are refused,
  every attention module of the text stack must
  be one the plan names, the text stack's attention implementation becomes
  :data:`~hp_lazy.runtime.cp.attention.KEY` (a tower with a config of its own — a vision or
  audio encoder — keeps its own and runs whole; the entry refuses its inputs), RoPE
  modules compute on the global positions (:mod:`.rope`), MLA modules gather their compressed
  latent instead of K/V (:mod:`.latent`), DSA modules and their indexers see the whole sequence's
  indexer keys and their rows' mask over it (:mod:`.indexed`), and the bound root gets the
  :class:`~hp_lazy.runtime.cp.entry.ContextEntry` that splits each call's batch.

Gradients: every parameter is replicated over cp and each rank's backward gives its own tokens'
part, so the gradient owner sums every gradient over cp (:func:`hp_lazy.runtime.grads.rules_for`).
"""

from __future__ import annotations

import ast
import inspect
import sys
import textwrap
from typing import Any

from torch import nn

from hp_lazy.errors import ShardingError
from hp_lazy.names import CP_ENTRY, IMPL
from hp_lazy.plan.model import Contract
from hp_lazy.runtime.binding import Binding
from hp_lazy.runtime.cp import attention, indexed, latent, lightning, positions, recurrent, rope
from hp_lazy.runtime.cp.entry import POOLED_HEADS, ContextEntry
from hp_lazy.runtime.cp.state import padding_rows
from hp_lazy.runtime.ep import aux
from hp_lazy.runtime.leaves import calls_attention
from hp_lazy.runtime.mesh import Group
from hp_lazy.runtime.sp.mixers import split_stacks
from hp_lazy.runtime.style import BindContext, routes_own_tokens

ATTENTION_LAYERS = frozenset({"full_attention", "sliding_attention", positions.CHUNKED})
TOKENWISE_LAYERS = frozenset({"mlp", "moe"})
"""Layer kinds of models that list every block (Nemotron-H): feed-forward, mixing no tokens."""


class ContextParallelStyle:
    axis = "cp"

    def __init__(self) -> None:
        self.attention: dict[int, str] = {}
        self.kinds: set[str] = set()
        self.latent: list[nn.Module] = []
        self.indexed: list[nn.Module] = []

    def validate(self, fqn: str, module: nn.Module, contract: Contract, ctx: BindContext) -> None:
        if contract.inner is None or not contract.inner.kind.startswith("cp_"):
            return
        family = type(ctx.root).__qualname__
        config = getattr(module, "config", None)
        tree = _forward_tree(module)  # the forward's source, read once per module
        calls = _attention_calls(tree)
        keywords = {k.arg for call in calls for k in call.keywords if k.arg is not None}
        dsa = indexed.is_indexed(module, any(k.endswith("indices") for k in keywords))  # MiniMax-M3: block_indices
        dsa_refused = indexed.unsupported(module, contract.inner.kind) if dsa else None
        refusals = [
            (getattr(module, "compressor", None) is not None, "attends to K/V compressed over the whole sequence "
             "(a compressor, DeepSeek-V4's CSA/HCA)"),
            (dsa_refused is not None, dsa_refused or ""),
            (float(getattr(config, "attention_dropout", 0.0) or 0.0) > 0, "has attention dropout > 0 (set "
             "attention_dropout=0: ranks would draw different masks than one process)"),
        ]
        reads = positions.local_positions(tree) if tree is not None else None
        passed = keywords - attention.UNDERSTOOD - _SCALARS
        passed -= {"indices"} if dsa else set()  # DSA's top-k: read by the attention function under cp
        own = _own_mask(calls)
        refusals.append((own is not None, f"builds its own attention mask ({own}) rather than passing the model's, "
                         "which context parallel builds over the whole sequence"))
        refusals.append((bool(passed), f"passes {sorted(passed)} to the attention function, which context parallel "
                         "does not split (a bias or key selection over each rank's local rows and keys)"))
        refusals.append((reads is not None and not positions.corrected(module), f"counts token positions over the "
                         f"rows it holds ({reads}), which under context parallel are this rank's rows, not the "
                         "sequence's"))
        for refused, why in refusals:
            if refused:
                raise ShardingError(
                    f"{fqn} ({family}): context parallel cannot split this attention over the sequence: it {why}; "
                    "train this family without cp"
                )
        self.attention[id(module)] = fqn
        self.kinds.add(contract.inner.kind)
        if contract.inner.kind == latent.MODE and latent.is_latent_attention(module):
            self.latent.append(module)
        if dsa:
            self.indexed.append(module)

    def replicas(self, fqn: str, module: nn.Module, contract: Contract, ctx: BindContext) -> dict[str, int]:
        return {}

    def after_partition(
        self, fqn: str, module: nn.Module, contract: Contract, ctx: BindContext, replicas: dict[str, int]
    ) -> None:
        return None

    def attach(self, fqn: str, module: nn.Module, binding: Binding, ctx: BindContext) -> bool:
        return False

    def gradients(self, ctx: BindContext) -> None:
        return None

    def finish(self, ctx: BindContext) -> None:
        root, family = ctx.root, type(ctx.root).__qualname__
        config = getattr(root, "config", None)
        mixers = [m for m in root.modules() if recurrent.supports(m)]
        linear = [m for m in root.modules() if lightning.supports(m)]
        # DSA's: 'indexed_attention' layers
        split = {getattr(m, "layer_idx", None) for m in mixers + self.indexed + linear}
        for i, kind in enumerate(getattr(config, "layer_types", None) or ()):
            if kind not in ATTENTION_LAYERS | TOKENWISE_LAYERS and i not in split:
                raise ShardingError(
                    f"{family}: layer {i} is a {kind!r} layer, which mixes tokens along the sequence outside "
                    f"attention; context parallel splits only {sorted(ATTENTION_LAYERS)} layers and recurrent "
                    "layers on transformers' Gated DeltaNet, KDA, Mamba2, Mamba1, short-convolution kernels and "
                    "lightning attention; train without cp"
                )
        for modeling in {id(type(m)): sys.modules[type(m).__module__] for m in mixers + linear}.values():
            recurrent.install(modeling)  # and the recurrent layers' padding mask: this rank's rows
        for module in linear:
            lightning.wrap(module)
        unplanned = [
            (name, m) for name, m in root.named_modules()
            if getattr(m, "is_causal", None) is not None and hasattr(m, "config") and calls_attention(m)
            and id(m) not in self.attention
        ]
        planned = {id(m): m for m in root.modules() if id(m) in self.attention}
        configs: dict[int, Any] = {id(c): c for m in planned.values() if (c := getattr(m, "config", None)) is not None}
        # a tower (vision, audio) has its own config: it runs whole on every rank with its own attention
        towers = sorted({_tower(root, name, m.config) for name, m in unplanned if id(m.config) not in configs})
        unplanned = [(name, m) for name, m in unplanned if id(m.config) in configs]
        if not self.attention or unplanned:
            unplanned_names = [name for name, _ in unplanned]
            missing = f"{unplanned_names[:3]} do not" if unplanned else "no attention module carries it"
            raise ShardingError(
                f"{family}: context parallel needs every attention module to carry the plan's cp inner op, but "
                f"{missing} (planned: {sorted(self.attention.values())[:3]}); add \"inner\": {{\"call\": "
                "\"attention\", \"kind\": \"cp_allgather_kv\"} to their boundaries, or use Plan.auto(cp=...)"
            )
        attention.register()
        if config is None:
            raise ShardingError(f"{family}: context parallel needs a transformers model (one with a config)")
        if towers:  # the text stack's configs only: a tower keeps its own attention
            for text_config in configs.values():
                text_config._attn_implementation = attention.KEY
        else:
            config._attn_implementation = attention.KEY
        for name, module in root.named_modules():
            if rope.is_rotary(module):
                rope.wrap_rotary(module, f"{name} ({family})")
        for module in self.latent:  # MLA: gather the latent, not the expanded K/V
            latent.wrap_expand_kv(module)
        for module in self.indexed:  # DSA: the whole sequence's indexer keys, its rows' mask over them
            indexed.wrap(module)
        if len(self.kinds) > 1:
            raise ShardingError(
                f"{family}: its attention modules carry different cp inner ops {sorted(self.kinds)}; use one kind"
            )
        pieces = ctx.groups["tp"].size if split_stacks(ctx) else 1  # sequence parallel inside each cp rank's rows
        loss_type = getattr(root, "loss_type", None)
        if loss_type in POOLED_HEADS:
            raise ShardingError(
                f"{family}: a {loss_type} head under context parallel: it reads one token per row (the last one, "
                "which only one rank holds) and its labels are per row, while context parallel splits every row "
                "over the ranks; train it without cp (tp and sequence parallel keep each row whole)"
            )
        root.__dict__[CP_ENTRY] = ContextEntry(family, ctx.groups["cp"], next(iter(self.kinds)), tuple(towers), pieces,
                                               loss_type=loss_type)
        _global_aux(ctx)


def _global_aux(ctx: BindContext) -> None:
    """An MoE's load-balancing aux loss over every cp (and dp) rank's rows (:mod:`hp_lazy.runtime.ep.aux`):
    the router's gradients are summed over cp and averaged over dp. Under sequence parallel as well,
    experts split over tp route each tp rank's piece of this rank's rows: the counts are summed over
    tp too (the router's gradients are, as the norms')."""
    if not aux.routes(ctx.root):
        return
    cp, tp = ctx.groups["cp"], ctx.groups["tp"]
    pieces = tp.size > 1 and routes_own_tokens(ctx)
    over = [cp] + ([tp] if pieces else []) + ([ctx.mesh.group("dp")] if ctx.mesh.degree("dp") > 1 else [])
    rows = _pieces_of_rows(tp) if pieces else padding_rows
    aux.install(ctx.root, over, ctx.mesh.degree("dp"), rows, share=cp.size,
                under="context and sequence parallel" if pieces else "context parallel")


def _pieces_of_rows(tp: Group) -> aux.Rows:
    """This tp rank's piece of this cp rank's rows' padding mask (sequence parallel inside cp)."""
    piece = aux.pieces(tp)
    return lambda mask: piece(padding_rows(mask))


def _tower(root: nn.Module, fqn: str, config: Any) -> str:
    """The outermost module above ``fqn`` that holds ``config`` (a vision tower's root)."""
    parts = fqn.split(".")
    for cut in range(1, len(parts) + 1):
        if getattr(root.get_submodule(".".join(parts[:cut])), "config", None) is config:
            return ".".join(parts[:cut])
    return fqn


_SCALARS = frozenset({"dropout", "scaling", "sliding_window", "is_causal", "attention_mask", "query", "key", "value"})
"""Attention-function keywords that are the call's own arguments (:func:`attention.cp_attention`'s)."""


def _forward_tree(module: nn.Module) -> ast.AST | None:
    """The module's forward's source, parsed (None where it cannot be read: the per-call checks of
    :func:`attention.cp_attention` still hold)."""
    code = inspect.unwrap(getattr(type(module), IMPL, type(module).forward))
    try:
        return ast.parse(textwrap.dedent(inspect.getsource(code)))
    except (OSError, TypeError, SyntaxError):
        return None


def _attention_calls(tree: ast.AST | None) -> list[ast.Call]:
    """The forward's ``attention_interface(...)`` calls, statically."""
    return [node for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id == "attention_interface"] if tree is not None else []


def _own_mask(calls: list[ast.Call]) -> str | None:
    """The expression the forward passes as the attention mask where it is not the forward's own
    ``attention_mask`` argument (a mask the module builds itself, Doge's dynamic mask), else None."""
    for call in calls:
        given = [k.value for k in call.keywords if k.arg == "attention_mask"] + call.args[4:5]
        for mask in given:
            if not (isinstance(mask, ast.Name) and mask.id == "attention_mask") and not (
                    isinstance(mask, ast.Constant) and mask.value is None):
                return ast.unparse(mask)
    return None
