"""The README's own examples, run as a reader would copy them: its explicit JSON plan, written to a
file and activated at tp=2 on the tiny bias-free Llama, trains like one process."""

from __future__ import annotations

import json
import os
import re

import parity
from dist import DistPool, pool_fixture

pool2 = pool_fixture(2, timeout=120)
README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def readme_plan() -> dict:
    """The JSON block after "An explicit plan is JSON" in the README."""
    with open(README, encoding="utf-8") as f:
        text = f.read()
    after = text[text.index("An explicit\nplan is JSON") if "An explicit\nplan is JSON" in text else text.index("plan is JSON"):]
    return json.loads(re.search(r"```json\n(.*?)```", after, re.S).group(1))


def _activate_file(rank: int, world: int, path: str) -> None:
    import hp_lazy

    hp_lazy.activate(path)


def test_the_readme_json_plan_trains_like_one_process(pool2: DistPool, refs, tmp_path) -> None:
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(readme_plan()))
    parity.once(pool2, _activate_file, str(plan))
    errors = parity.check_parity(pool2, refs, "llama")
    assert max(errors.values()) <= parity.TOL
