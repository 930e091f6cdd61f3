"""``Plan.auto`` on a module with several stacks.

- One module config planning two stacks (T5Gemma's encoder and decoder): both are planned, and the
  decoder's embedding, tied to the head, is vocab-parallel with it (it was refused as a tie to a
  shard). T5Gemma at tp=2 against one process.
- Several TP plans, one of which Plan.auto cannot translate (Gemma 4: the text model's plan
  translates; the vision tower's, whose projections sit inside clippable-linear wrappers, does not).
  The text model is planned; a model that holds the tower is refused when bound, naming the tower
  and why, rather than running it whole on every rank. Text-only Gemma 4 at tp=2 against one
  process."""

from __future__ import annotations

import re

import models
import parity
import pytest
from dist import DistPool, pool_fixture
from test_plan_auto import source

from hp_lazy.errors import PlanError
from hp_lazy.plan import Plan

pool2 = pool_fixture(2, timeout=120)

WHY = "= 'colwise' has no rowwise sibling under 'encoder.layers.*.self_attn.q_proj'"


def test_the_untranslatable_plan_is_set_aside_with_its_reason() -> None:
    plan = Plan.auto(tp=2).slice(*source("gemma4"))
    assert set(plan.refused) == {"Gemma4VisionModel"} and WHY in plan.refused["Gemma4VisionModel"]
    assert "model.layers.*.self_attn" in {c.pattern for c in plan.contracts}
    assert "refused" in plan.to_dict()  # in the slice's hash: the cached lowering knows it
    # one plan only (llama): its error is raised as it is, nothing set aside
    assert not Plan.auto(tp=2).slice(*source("llama")).refused


def test_a_module_whose_every_plan_fails_is_refused_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two config plans (the vision tower's, under two config names), neither translating: nothing is
    set aside, the first error is raised as it is; a lone plan that fails is raised as it is too."""
    from hp_lazy.plan import auto as auto_mod

    plans = auto_mod.config_plans

    def vision(module, facts, attr="base_model_tp_plan", copies=2):
        if attr != "base_model_tp_plan":
            return plans(module, facts, attr)
        (plan,) = [p for name, p in plans(module, facts, attr) if name == "Gemma4VisionConfig"]
        return [("Gemma4VisionConfig", plan), ("Gemma4VisionConfigCopy", plan)][:copies]

    for copies in (2, 1):
        monkeypatch.setattr(auto_mod, "config_plans", lambda m, f, attr="base_model_tp_plan", c=copies: vision(m, f, attr, c))
        with pytest.raises(PlanError, match=re.escape(WHY)):
            Plan.auto(tp=2).slice(*source("gemma4"))
    name, src = source("gemma4")
    assert [owner for owner, _ in vision(name, auto_mod.analyze(name, src))] == [
        "Gemma4VisionConfig", "Gemma4VisionConfigCopy"]  # the first case really had two plans to translate


def _load_vl(rank: int, world: int, path: str) -> str:
    import transformers

    import hp_lazy

    try:
        hp_lazy.parallelize(transformers.AutoModelForImageTextToText.from_pretrained(path))
    except Exception as error:  # noqa: BLE001 - the text is the result
        return f"{type(error).__name__}: {error}"
    return "bound"


@pytest.fixture(scope="module")
def gemma4(refs) -> tuple[str, dict, dict[str, float]]:
    """The float32 reference and one process's own round-off floor: the largest distance of its
    float32 run from its float64 run over the gradients (6.2e-6, layer 0's k_proj), and over the
    parameters after the 3 SGD steps (the embedding: 6.7e-5 on one machine, 1.6e-4 on another, whose
    CPU's float32 kernels round otherwise). Gemma 4 computes its norms and softmax in float32 whatever
    the model's dtype, and the steps at lr 0.1 amplify that round-off, so an entry of either kind may
    reach twice its kind's floor where it is above 1e-5 (``parity.compare``); logits, loss and the
    steps' losses are held to 1e-5."""
    path, ref = refs("gemma4")
    wide = parity.float64_floor(path, ref)
    floor = {}
    for kind in ("grad ", "param "):
        worst = max(e for name, e in wide.items() if name.startswith(kind))
        assert worst < 1e-3, (kind, worst)  # the floor is the model's own, and it stays small
        floor.update({name: worst for name in wide if name.startswith(kind)})
    return path, ref, floor


def test_text_model_matches_one_process(gemma4, pool2: DistPool) -> None:
    path, ref, floor = gemma4
    results = parity.activated(pool2, sequence_parallel=False).run(parity.train, path, models.batch())
    errors = parity.compare(results[0], ref, floor)
    assert len(errors) > 10 and all(errors[name] <= parity.TOL for name in ("logits", "loss", "losses"))
    assert all(models.rel_err(r["loss"], ref["loss"]) <= parity.TOL for r in results)


def test_a_model_holding_the_tower_is_refused(tmp_path_factory, pool2: DistPool) -> None:
    path = models.build("gemma4_vl", str(tmp_path_factory.mktemp("models")))
    got = parity.activated(pool2, sequence_parallel=False).run(_load_vl, path)
    assert all(g.startswith("ShardingError: model.vision_tower (Gemma4VisionModel): Plan.auto planned this model's "
                            "other parts for tp=2 but not this one, which would run whole on every rank: ") for g in got)
    assert all(WHY in g for g in got), got


def _train_seq2seq(rank: int, world: int, path: str, ids) -> dict:
    import hp_lazy

    model = models.load(path)
    result = models.run_training(model, ids, full_grads=hp_lazy.full_grads, full_state_dict=hp_lazy.full_state_dict)
    local = {n: tuple(p.shape) for n, p in model.named_parameters() if "decoder.layers.0.self_attn.q_proj" in n}
    return {**result, "local": local}


def test_one_config_plans_the_encoder_and_the_decoder(refs, pool2: DistPool) -> None:
    """T5Gemma at tp=2 (the seq2seq loss, labels shifted into decoder inputs) against one process;
    the decoder's q_proj holds half its rows on each rank."""
    patterns = {c.pattern for c in Plan.auto(tp=2).slice(*source("t5gemma")).contracts}
    assert {"model.encoder.layers.*.self_attn", "model.decoder.layers.*.self_attn", "model.decoder.embed_tokens"} \
        <= patterns
    path, ref = refs("t5gemma")
    results = parity.activated(pool2, sequence_parallel=False).run(_train_seq2seq, path, models.batch())
    assert len(parity.compare(results[0], ref)) > 10
    assert all(r["local"] == {"model.decoder.layers.0.self_attn.q_proj.weight": (16, 32)} for r in results)
