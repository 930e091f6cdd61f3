"""Mutation sweep of the plan check: every single change of every field of Plan.auto's own plans.

For each configuration below, Plan.auto's slice of the family's modeling module is written out as an
explicit JSON plan and changed in one place at a time (``tests/mutate.py``'s ``exhaustive``: every
placement entry of every side set to each of R, S(0), S(1), S(2), S(-1), P(sum) on every mesh axis
or dropped, list fields and their items dropped, flags toggled, inner ops and regions swapped or
dropped, boundary classes swapped, a contract dropped, an unknown parameter added). Each mutant is
activated afresh on 2 gloo ranks, the modeling module imported through it, the tiny model
``from_pretrained`` from a ``save_pretrained`` directory, one forward + backward run, and the result
compared with one process (relative max error <= 1e-5 on logits, loss and every gradient):

  refused   hp_lazy's error (PlanError / ShardingError) on every rank, before or at bind
  exact     one process's numbers (a change that does not matter, e.g. ``optional`` set)
  wrong     it trained and the numbers are off: a defect of the plan check (the sweep exits 1)
  unclear   it failed, but not with hp_lazy's error on every rank (torch's message, or a hang):
            the user is not told the fix

    python benchmarks/mutants.py                         # every configuration (~3,400 mutants, ~2 min)
    python benchmarks/mutants.py --configs llama_bias.tp2 --out /tmp/mutants.md
    python benchmarks/mutants.py --smoke                 # one configuration, 40 mutants
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass(frozen=True)
class Config:
    model: str  # a tiny model of tests/models.py
    family: str
    cls: str
    axes: dict[str, Any] = field(default_factory=dict)  # Plan.auto's arguments
    dtype: str = "float32"  # float64: a model whose float32 gradients one process cannot hold to 1e-5 of itself


CONFIGS = {
    "llama_bias.tp2": Config("llama_bias", "llama", "LlamaForCausalLM", {"tp": 2}),
    "llama_bias.tp2_sp": Config("llama_bias", "llama", "LlamaForCausalLM", {"tp": 2, "sequence_parallel": True}),
    "llama_bias.tp2_loss_parallel": Config("llama_bias", "llama", "LlamaForCausalLM", {"tp": 2, "loss_parallel": True}),
    "llama.tp2_replicated_embedding": Config("llama", "llama", "LlamaForCausalLM",
                                             {"tp": 2, "vocab_parallel_embedding": False}),
    "qwen3.tp2": Config("qwen3", "qwen3", "Qwen3ForCausalLM", {"tp": 2}),
    "gemma.tp2": Config("gemma", "gemma", "GemmaForCausalLM", {"tp": 2}),
    "phi3.tp2": Config("phi3", "phi3", "Phi3ForCausalLM", {"tp": 2}),
    # attention run on the whole sequence around its per-Linear gather/split; a Gated DeltaNet likewise
    "phi3.tp2_sp": Config("phi3", "phi3", "Phi3ForCausalLM", {"tp": 2, "sequence_parallel": True}),
    "qwen3_next.tp2_sp": Config("qwen3_next_dense", "qwen3_next", "Qwen3NextForCausalLM",
                                {"tp": 2, "sequence_parallel": True}, "float64"),
    "qwen3_moe.tp2": Config("qwen3_moe", "qwen3_moe", "Qwen3MoeForCausalLM", {"tp": 2}),
    "qwen2_moe.tp2": Config("qwen2_moe", "qwen2_moe", "Qwen2MoeForCausalLM", {"tp": 2}),
    "deepseek_v2.tp2": Config("deepseek_v2", "deepseek_v2", "DeepseekV2ForCausalLM", {"tp": 2}),
    "gpt_oss.tp2": Config("gpt_oss", "gpt_oss", "GptOssForCausalLM", {"tp": 2}),
    "qwen3_moe.ep2": Config("qwen3_moe", "qwen3_moe", "Qwen3MoeForCausalLM", {"tp": 1, "ep": 2}),
    "qwen2_moe.ep2": Config("qwen2_moe", "qwen2_moe", "Qwen2MoeForCausalLM", {"tp": 1, "ep": 2}),
    "llama.cp2": Config("llama", "llama", "LlamaForCausalLM", {"tp": 1, "cp": 2}),
    "qwen3.cp2_ulysses": Config("qwen3", "qwen3", "Qwen3ForCausalLM", {"tp": 1, "cp": 2, "cp_mode": "ulysses"}),
}
KINDS = ("refused", "exact", "wrong", "unclear")


def sweep(names: list[str], limit: int | None, timeout: float, log: bool) -> tuple[list[str], int]:
    """The markdown report and the number of wrong mutants."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import models
    import mutate
    import parity
    from dist import DistPool, WorkerError

    pool = DistPool(2, timeout=timeout)
    rows, details, wrong_total = [], [], 0
    with tempfile.TemporaryDirectory(prefix="hp_lazy_mutants_") as root:
        refs = parity.References(os.path.join(root, "models"))
        try:
            for name in names:
                config = CONFIGS[name]
                path, ref = refs(config.model)
                if config.dtype != "float32":
                    ref = models.run_training(models.load(path, config.dtype, experts_implementation="eager"),
                                              models.batch())
                plan = mutate.explicit_plan(config.family, **config.axes)
                found = mutate.exhaustive(plan)[:limit]
                start, counts = time.perf_counter(), collections.Counter()
                control = pool.run(mutate.run, config.family, config.cls, plan, path, models.batch(),
                                   os.path.join(root, "cache"), config.dtype)
                if mutate.verdict(control, ref) != "match":  # the plan itself must train right, or nothing is measured
                    why = control[0].get("refused") or control[0].get("crashed") or mutate.verdict(control, ref)
                    raise RuntimeError(f"{name}: Plan.auto's own plan, written out, does not match one process: {why}")
                for what, mutant in found:
                    try:
                        got = pool.run(mutate.run, config.family, config.cls, mutant, path, models.batch(),
                                       os.path.join(root, "cache"), config.dtype)
                        result = mutate.verdict(got, ref)
                    except WorkerError as error:  # a rank hung or died: the pool restarts on its next use
                        result = f"unclear: {str(error).splitlines()[-1][:160]}"
                    kind = {"refused": "refused", "match": "exact"}.get(result, result.split(":")[0])
                    counts[kind] += 1
                    if kind in ("wrong", "unclear"):
                        details.append(f"- {name}: `{what}`: {result}")
                    if log:
                        print(f"[mutants] {name}: {what}: {result[:200]}", file=sys.stderr, flush=True)
                wrong_total += counts["wrong"]
                rows.append(f"| {name} | {len(found)} | " + " | ".join(str(counts[k]) for k in KINDS)
                            + f" | {time.perf_counter() - start:.0f} |")
                print(f"[mutants] {rows[-1]}", file=sys.stderr, flush=True)  # the table is printed once, at the end
        finally:
            pool.close()
    total = [sum(int(r.split("|")[i]) for r in rows) for i in range(2, 7)]
    share = 100 * total[4] / max(total[0], 1)
    report = [
        f"## Plan mutants (torch {_version('torch')}, transformers {_version('transformers')}, 2 gloo ranks)\n",
        "| configuration | mutants | refused | exact | wrong | unclear | seconds |",
        "|---|---|---|---|---|---|---|",
        *rows,
        f"| **all** | **{total[0]}** | **{total[1]}** | **{total[2]}** | **{total[3]}** | **{total[4]}** "
        f"({share:.1f}%) | |",
    ]
    if details:
        report += ["", "Wrong and unclear mutants:", "", *details]
    return report, wrong_total


def _version(dist_name: str) -> str:
    from importlib.metadata import version

    return version(dist_name)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma list of {list(CONFIGS)}")
    ap.add_argument("--limit", type=int, help="the first N mutants of each configuration")
    ap.add_argument("--timeout", type=float, default=60, help="seconds a mutant may run before it counts as a hang")
    ap.add_argument("--out", help="also write the markdown table to this file")
    ap.add_argument("--log", action="store_true", help="every mutant's verdict on stderr")
    ap.add_argument("--smoke", action="store_true", help="llama_bias.tp2, its first 40 mutants")
    args = ap.parse_args(argv)
    if args.smoke:
        args.configs, args.limit = "llama_bias.tp2", 40
    names = [n for n in args.configs.split(",") if n]
    unknown = sorted(set(names) - set(CONFIGS))
    if unknown:
        ap.error(f"unknown configurations {unknown}; choose from {list(CONFIGS)}")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    report, wrong = sweep(names, args.limit, args.timeout, args.log)
    print("\n".join(report))
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(report) + "\n")
    return 1 if wrong else 0


if __name__ == "__main__":
    raise SystemExit(main())
