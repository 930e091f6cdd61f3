"""transformers' ``Transpose`` weight conversion under shard-on-read.

Some families store a checkpoint tensor transposed from the model's layout (Qwen3-VL-MoE's experts:
``[E, H, 2I]`` on disk, ``[E, 2I, H]`` in the model) and convert it on load with
``Transpose(d0, d1, check_dims=True)``, which transposes unless the tensor already has the model
parameter's shape. Under shard-on-read the tensor it sees is this rank's slice, read in the
model's placements before the conversion, while the parameter's shape is the DTensor's full one:
the comparison always differs, so a slice already in the model's layout is transposed (a load
error, or silently wrong values when the slice is square).

:func:`local_transpose` replaces the op's ``convert`` while hp_lazy's load runs. The stored layout
is read from the checkpoint's header (the full shape on disk), not guessed from the slice:

- stored as the model lays it out (``check_dims``): the slice is kept as read;
- stored transposed, cut only on dims the transpose leaves alone (experts cut ``S(0)`` on ep,
  transposed on dims 1 and 2): the slice is transposed, which is one process's result sliced;
- stored transposed and cut on a transposed dim: the slice was taken on the wrong dim of the
  stored tensor; refused, naming the parameter (never loaded wrong), when the load returns
  (raised inside the op, transformers would log it as a missing key and initialise the weight).
"""

from __future__ import annotations

import contextlib
import importlib
import re
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from hp_lazy.errors import ShardingError

SLICE_SAFE_OPS = frozenset({"MergeModulelist", "Concatenate", "Transpose"})
"""transformers conversion ops whose result a sliced read gives right: per-expert tensors stacked and
gate/up concatenated (transformers' sharding reads each piece's slice), and Transpose (decided
below by the stored layout). Any other op (``Chunk`` / ``Split`` of a fused tensor, ``PermuteForRope``,
``Interleave``, ...) builds its targets from whole source tensors, so a slice read before it is
not the target's slice (HRM's fused ``gqkv_proj`` chunked into gate/q/k/v loaded rows of the wrong
projection on each rank)."""


def rebuilt(mapping: Sequence[Any], names: Sequence[str]) -> set[str]:
    """The parameter ``names`` that a weight converter of ``mapping`` (``load_config.weight_mapping``)
    builds with an op outside :data:`SLICE_SAFE_OPS`: they are read whole and sliced after the load.
    A target pattern is matched as transformers matches it (a regular expression searched in the
    name), and also as plain text, so a pattern hp_lazy reads differently errs on the whole read."""
    patterns: list[str] = []
    for converter in mapping:
        ops = getattr(converter, "operations", None) or ()
        if any(type(op).__name__ not in SLICE_SAFE_OPS for op in ops):
            targets = getattr(converter, "target_patterns", ()) or ()
            patterns += [targets] if isinstance(targets, str) else list(targets)
    found = set()
    for name in names:
        for pattern in patterns:
            try:
                hit = re.search(pattern, name) is not None
            except re.error:
                hit = False
            if hit or pattern.replace("\\", "") in name:
                found.add(name)
                break
    return found


def stored_shapes(files: Sequence[Any]) -> dict[str, tuple[int, ...]]:
    """Every checkpoint key's full shape from the safetensors headers (no tensor is read)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - a safetensors handle, not a dict
                shapes[key] = tuple(f.get_slice(key).get_shape())
    return shapes


def _stored(shapes: dict[str, tuple[int, ...]], name: str) -> tuple[int, ...] | None:
    """The shape stored for model key ``name`` (a checkpoint may add or drop the base prefix)."""
    if name in shapes:
        return shapes[name]
    found = [shape for key, shape in shapes.items() if key.endswith("." + name) or name.endswith("." + key)]
    return found[0] if len(found) == 1 else None


@contextlib.contextmanager
def local_transpose(files: Sequence[Any]) -> Iterator[None]:
    """``Transpose.convert`` decided by the stored layout while the block runs (module docstring);
    the checkpoint headers of ``files`` are read once, at the first transpose of a sharded parameter."""
    try:
        ops = importlib.import_module("transformers.core_model_loading")
    except ImportError:
        yield
        return
    cls = getattr(ops, "Transpose", None)
    original = getattr(cls, "convert", None)
    if cls is None or original is None:
        yield
        return

    def convert(self: Any, input_dict: dict[str, Any], source_patterns: list[str], target_patterns: list[str],
                **kwargs: Any) -> dict[str, torch.Tensor]:
        from torch.distributed.tensor import DTensor

        model, name = kwargs.get("model"), kwargs.get("full_layer_name")
        param = model.get_parameter(name) if model is not None and isinstance(name, str) else None
        if not isinstance(param, DTensor) or not isinstance(name, str):
            return original(self, input_dict, source_patterns, target_patterns, **kwargs)
        full, local = tuple(param.shape), tuple(param.to_local().shape)
        swapped = {self.dim0 % len(full), self.dim1 % len(full)}
        cut = sorted(d for d in range(len(full)) if full[d] != local[d])
        if not shapes:
            shapes.update(stored_shapes(files))
        stored = _stored(shapes, name)
        if self.check_dims and stored == full:  # stored as the model lays it out
            tensors = next(iter(input_dict.values()))
            return {self.get_target_pattern(input_dict, source_patterns, target_patterns):
                    tensors[0] if isinstance(tensors, list) else tensors}
        if (stored is None and cut) or set(cut) & swapped:  # an uncut tensor is read whole: one process's case
            refused.append(ShardingError(
                f"{name}: transformers converts its checkpoint tensor (stored shape "
                f"{list(stored) if stored is not None else 'unknown'}) with Transpose({self.dim0}, {self.dim1}) into "
                f"the model's {list(full)}, and the plan cuts dim {cut} of it; hp_lazy reads this rank's slice before "
                "the conversion, on the model's dims, which are not the stored tensor's; save the checkpoint in the "
                "model's layout (load it once without hp_lazy and save_pretrained it), or leave this parameter out "
                "of the plan"
            ))
        return original(self, input_dict, source_patterns, target_patterns, **kwargs)

    refused: list[ShardingError] = []
    shapes: dict[str, tuple[int, ...]] = {}
    cls.convert = convert
    try:
        yield
    finally:
        cls.convert = original
    if refused:  # raised here: transformers reports an error inside a conversion as a missing key and goes on
        raise refused[0]
