"""Hub kernels never bypass a planned module (``hp_lazy/runtime/hub_kernels.py``).

transformers 5.25 kernelizes every model ``from_pretrained`` loads (``use_kernels`` defaults to on):
the ``kernels`` library swaps the forward of each module whose class names a hub kernel for the
kernel's. The mechanism, on the CPU, with a kernel mapping of our own: Llama's MLP class is given a
hub kernel name (what ``@use_kernel_forward_from_hub`` does) mapped to a "fused" MLP that reads its
projections' weights itself, and its RMSNorm one that computes the same norm. At tp=2 the planned
MLPs keep hp_lazy's forward (one notice), the norms between boundaries keep their kernel, and the
step matches one process, also after a later ``kernelize``; the fused kernel forced onto the sharded
MLPs (the bypass) is the negative control and must be wrong.
"""

from __future__ import annotations

from typing import Any

import models
import parity
import pytest
import torch
import torch.nn.functional as F
from dist import DistPool, pool_fixture
from torch import nn

pool2 = pool_fixture(2, timeout=120)


class FusedMLP(nn.Module):
    """A fused MLP kernel: the whole SwiGLU from the projections' weights, no Linear called."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = F.linear(x, self.gate_proj.weight)
        return F.linear(F.silu(gate) * F.linear(x, self.up_proj.weight), self.down_proj.weight)


class NormKernel(nn.Module):
    """An RMSNorm kernel: the same per-token norm."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


class _Repo:
    """A kernel repository that loads a local class (kernels' LayerRepository loads from the hub)."""

    def __init__(self, layer: type[nn.Module]) -> None:
        self.layer = layer
        self.layer_name = layer.__name__

    def load(self) -> type[nn.Module]:
        return self.layer

    def __repr__(self) -> str:
        return f"local {self.layer_name}"


def _map_kernels() -> None:
    """Once per process, as ``@use_kernel_forward_from_hub`` runs once, when the class is defined."""
    import kernels
    import transformers.models.llama.modeling_llama as llama

    if getattr(llama.LlamaMLP, "kernel_layer_name", None) == "HpLazyFusedMLP":
        return
    kernels.replace_kernel_forward_from_hub(llama.LlamaMLP, "HpLazyFusedMLP")
    kernels.replace_kernel_forward_from_hub(llama.LlamaRMSNorm, "HpLazyRMSNorm")
    modes = (kernels.Mode.TRAINING, kernels.Mode.INFERENCE)
    kernels.register_kernel_mapping({
        "HpLazyFusedMLP": {"cpu": dict.fromkeys(modes, _Repo(FusedMLP))},
        "HpLazyRMSNorm": {"cpu": dict.fromkeys(modes, _Repo(NormKernel))},
    })


def _run(rank: int, world: int, path: str, ids: Any, how: str) -> dict[str, Any]:
    """how: "load" (kernelized by from_pretrained), "kernelize" (a later kernelize too), "before bind"
    (kernelized while whole, then bound), "bypass"
    (the fused kernel forced onto the planned MLPs: what kernelize did before hp_lazy turned it off)."""
    import warnings
    from types import MethodType

    import kernels
    import transformers

    import hp_lazy
    from hp_lazy.runtime.hub_kernels import HubKernelWarning

    hp_lazy.activate(hp_lazy.Plan.auto(tp=world))
    _map_kernels()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if how == "before bind":  # kernelized while still whole: the bind at the first forward removes it
            from safetensors.torch import load_file

            config = transformers.AutoConfig.from_pretrained(path)
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            model.load_state_dict(load_file(f"{path}/model.safetensors"), strict=False)
            model.tie_weights()
            kernels.kernelize(model, device="cpu", mode=kernels.Mode.TRAINING)
            assert "forward" in model.model.layers[0].mlp.__dict__
            hp_lazy.parallelize(model)
        else:
            model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, use_kernels=True)
    notices = [str(w.message) for w in caught if issubclass(w.category, HubKernelWarning)]
    if how == "kernelize":
        kernels.kernelize(model, device="cpu", mode=kernels.Mode.TRAINING)
    if how == "bypass":
        for layer in model.model.layers:
            layer.mlp.forward = MethodType(FusedMLP.forward, layer.mlp)
    model.train()
    layer = model.model.layers[0]
    kernel_on = {"mlp": "forward" in layer.mlp.__dict__, "norm": "forward" in layer.input_layernorm.__dict__}
    result = models.run_training(model, ids, full_grads=hp_lazy.full_grads, full_state_dict=hp_lazy.full_state_dict)
    return {**result, "notices": notices, "kernel_on": kernel_on}


def _reference(path: str) -> dict[str, Any]:
    """One process, kernels on: the fused MLP and the norm kernel compute what transformers does."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, use_kernels=True)
    assert "forward" in model.model.layers[0].mlp.__dict__  # the kernel is in place in one process
    model.train()
    return models.run_training(model, models.batch())


@pytest.fixture(scope="module")
def ref(tmp_path_factory) -> tuple[str, dict[str, Any]]:
    import multiprocessing as mp

    path = models.build("llama", str(tmp_path_factory.mktemp("models")))
    with mp.get_context("spawn").Pool(1) as one:  # the kernel mapping stays out of this process
        return path, one.apply(_reference_in_child, (path,))


def _reference_in_child(path: str) -> dict[str, Any]:
    _map_kernels()
    return _reference(path)


@pytest.mark.parametrize("how", ["load", "kernelize", "before bind"])
def test_planned_modules_keep_their_forward(pool2: DistPool, ref, how: str) -> None:
    path, want = ref
    plain = models.reference(path, models.batch())
    parity.compare(want, plain)  # the kernels are faithful: one process with them is one process without
    got = pool2.run(_run, path, models.batch(), how)
    for result in got:
        assert result["kernel_on"] == {"mlp": False, "norm": True}, result["kernel_on"]
    parity.compare(got[0], want)
    notices = got[0]["notices"]
    if how != "load":  # the same workers: the class was announced once, when "load" ran
        return
    assert len(notices) == 1 and notices[0].startswith(
        "hp_lazy: model.layers.0.mlp (LlamaMLP) is planned or holds planned modules, so its hub kernel "
        "'HpLazyFusedMLP' is turned off for it"), notices


def test_a_kernel_on_a_sharded_module_is_wrong(pool2: DistPool, ref) -> None:
    """The negative control: the fused kernel on the sharded MLPs skips the exit all-reduce."""
    path, want = ref
    got = pool2.run(_run, path, models.batch(), "bypass")
    assert got[0]["kernel_on"]["mlp"]
    assert models.rel_err(got[0]["logits"], want["logits"]) > 1e-3
