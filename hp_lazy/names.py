"""Every name hp_lazy generates into lowered code or attaches to modules, in one place.

Lowered code and the runtime meet only through these names. ``tests/test_architecture.py`` checks
that every runtime call the emitter can generate exists in :mod:`hp_lazy.runtime.rt`;
``tests/test_names.py`` that no other module spells a reserved-prefix name (``_hp_*``, ``__hp_*``)
as an identifier, an attribute or inside a string.
"""

from __future__ import annotations

RESERVED_PREFIXES: tuple[str, ...] = ("_hp_", "__hp_")
"""No plan name may start with these: they belong to hp_lazy."""

# -- in lowered code
RT = "__hp_rt__"
"""The runtime module (``hp_lazy.runtime.rt``) as lowered modules see it."""
RT_MODULE = "hp_lazy.runtime.rt"
INFO = "__hp_lazy__"
"""Module global: what the module was lowered under (plan hash, source sha256)."""
BINDING = "_hp_b"
"""Class default / instance attribute: the boundary's :class:`~hp_lazy.runtime.binding.Binding`."""
FORM = "_hp_form"
"""Class attribute: the form the lowerer chose (``identity`` classes have none)."""
OUT = "_hp_out"
"""Local of a lowered forward: the original body's return value."""
CALL = "_hp_call"
"""Local of a generic-form forward: the :class:`~hp_lazy.runtime.binding.CallContext` of this call."""
IMPL = "_forward_impl"
"""The original forward, kept verbatim."""

# -- attached at run time
BOUND = "_hp_bound"
"""Module ``__dict__`` key: the model (and each lowered module in it) is bound."""
OWNER = "_hp_owner"
"""Top-level model ``__dict__`` key: its :class:`~hp_lazy.runtime.record.BoundModel` (mesh, layout
table, roots, styles, gradient owner), once laid out or bound."""
LEAF_INPUTS = "_hp_inputs"
"""Leaf modules: (input name, position) pairs their entry ops apply to."""
VOCAB_RANGE = "_hp_vocab"
"""Vocab-parallel embedding: ``(start, end, vocab, padding_idx)``: its rows ``[start, end)``, the
whole vocabulary's size and padding id."""
VOCAB_SHARDED = "_hp_vocab_sharded"
"""Bound root's ``__dict__`` key under loss parallel: the tp group its logits stay cut over (the head's
vocab columns), for :mod:`hp_lazy.runtime.outputs`."""
CP_ENTRY = "_hp_cp_entry"
"""Bound root's ``__dict__`` key: its context-parallel :class:`~hp_lazy.runtime.cp.entry.ContextEntry`."""
EP_DISPATCH = "_hp_ep"
"""Experts module under expert parallel: its :class:`~hp_lazy.runtime.ep.dispatch.Dispatch` (group, expert counts)."""
EP_LOAD = "_hp_ep_load"
"""Experts module under expert parallel: this rank's per-expert (token, slot) counts ``[E]`` of its last forward."""
INPUT_CHECK = "_hp_input_check"
"""Bound root's ``__dict__`` key: its :class:`~hp_lazy.runtime.inputs.InputCheck`."""
PATCHED = "_hp_patched"
"""Class attribute on a training stack's class hp_lazy routed (accelerate's ``Accelerator``)."""
LEAF = "_hp_leaf"
"""Module ``__dict__`` key: the leaf binding of a torch module hp_lazy runs (kept when PEFT wraps it)."""
WATCH = "_hp_watch"
"""Module ``__dict__`` key on every module of a bound model: set dirty when a submodule is replaced."""
ADAPTER_HOOKS = "_hp_adapter_hooks"
"""PEFT tuner layer ``__dict__`` key: the handles of its full-adapter state-dict hooks."""
ROUTED = "hp_routed"
"""Function attribute: a replacement ``forward`` of a bound model that hp_lazy installed or
integrated (TRL's fused head): the replaced-forward guard does not read it."""
LAZY_HOOK = "_initialize_hook"
"""Lowered root classes: torch's lazy-module attribute (``torch.compile`` binds before tracing)."""
LAZY_INIT = "_infer_parameters"
"""Lowered root classes: torch's lazy-module initialiser, here ``parallelize``."""

DP_VIEW = "_hp_dp_view"
"""``Accelerator`` ``__dict__`` key: the dp group while one of an RL trainer's own methods runs
(:class:`hp_lazy.integrations.trl_online.DataParallelView`)."""
LAID_OUT = "_hp_laid_out"
"""Lowered submodule ``__dict__`` key: the name of the top-level model whose layout it is part of,
laid out before its weights were read (shard-on-read; :func:`hp_lazy.runtime.owner.lay_out_before_load`)."""
OPTIM_ADOPTED = "_hp_adopted"
"""Optimizer ``__dict__`` key: whether its state dict presents hp_lazy shards (set at its first step)."""

WRAPPED = "_hp_wrapped"
"""``__dict__`` key of a module that wraps lowered roots (``PeftModel``, DDP): those roots, which
``torch.compile`` of the wrapper binds before tracing (:func:`hp_lazy.runtime.rt.lazy_root`)."""
NO_HUB_KERNEL = "_hp_no_hub_kernel"
"""Module ``__dict__`` key: a planned module for which hub kernels are turned off
(:mod:`hp_lazy.runtime.hub_kernels`)."""
HUB_CONDITION = "_hp_kernel_condition"
"""Function attribute: a class's ``kernel_condition`` that hp_lazy wrapped to honour :data:`NO_HUB_KERNEL`."""

SPLIT = "_hp_split"
"""Module ``__dict__`` key: how a norm or a feature statistic over tp-split features runs on this
rank's slice (:mod:`hp_lazy.runtime.tp.norms`)."""
DROPOUT_CUTS = "_hp_cuts"
"""``__dict__`` key of a LoRA dropout on a feature-sharded input: the cuts that rebuild one process's mask."""
SEQUENCE_GATHERED = "_hp_sequence_gathered"
"""Module ``__dict__`` key: a token mixer outside the tp boundaries of a sequence-split stack that runs
on the whole sequence (:mod:`hp_lazy.runtime.sp.mixers`)."""
SEQUENCE_CARRIED = "_hp_sequence_carried"
"""Module ``__dict__`` key: a token mixer outside the tp boundaries of a sequence-split stack that runs
on this rank's piece, its recurrent state carried from the pieces before (a lightning attention:
:mod:`hp_lazy.runtime.cp.lightning`); value: the tp group. The layer hands it its inputs whole."""
SEQUENCE_INPUTS = "_hp_sequence_inputs"
"""Layer ``__dict__`` key: the per-layer inputs it reads outside its boundaries are cut along the
sequence with its hidden states (:mod:`hp_lazy.runtime.sp.inputs`)."""
SEQUENCE_CHECKED = "_hp_sequence_checked"
"""Boundary ``__dict__`` key: its sequence-cut input is checked to arrive as hidden states."""
SEQUENCE_TOKENS = "_hp_sequence_tokens"
"""Layer-stack ``__dict__`` key: the tokens (batch x sequence piece) this rank's hidden states hold
in the current forward, against which a boundary handed flattened rows checks their count."""
SEQUENCE_DIM = "_hp_sequence_dim"
"""Layer-stack ``__dict__`` key: the sequence dim of hidden states that stack several streams per
token, read at the stack's entry from the whole sequence (:mod:`hp_lazy.runtime.sp.stack`)."""
SEQUENCE_RUNNING = "_hp_sequence_running"
"""Layer-stack ``__dict__`` key: its forward is between its entry and its exit (this rank holds a
piece of the sequence), so a module planned outside it that a layer calls would get that piece."""
LOG_HANDLER = "_hp_lazy"
"""Attribute of the log handler ``HP_LAZY_DEBUG`` adds (so it is added once)."""

GENERATED: frozenset[str] = frozenset({RT, INFO, BINDING, FORM, OUT, CALL})
ATTACHED: frozenset[str] = frozenset(
    {BOUND, OWNER, LEAF_INPUTS, VOCAB_RANGE, INPUT_CHECK, CP_ENTRY, EP_DISPATCH, EP_LOAD, PATCHED,
     OPTIM_ADOPTED, LAID_OUT, LEAF, WATCH, ADAPTER_HOOKS, LAZY_HOOK, LAZY_INIT, ROUTED, NO_HUB_KERNEL,
     HUB_CONDITION, WRAPPED, DROPOUT_CUTS, LOG_HANDLER, SPLIT, SEQUENCE_GATHERED, SEQUENCE_CARRIED, SEQUENCE_INPUTS,
     SEQUENCE_CHECKED, SEQUENCE_DIM, SEQUENCE_TOKENS, SEQUENCE_RUNNING}
)
