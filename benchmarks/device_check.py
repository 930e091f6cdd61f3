"""A device check in one command: hp_lazy at world 1 against plain transformers on one GPU (or the CPU).

One markdown table (printed, and written to ``--out``) with four sections, each of which reports its own
failure as a row (``error: ...``) or, past the ``--budget-s`` deadline, ``skipped: ...``:

  step time     forward (HF loss) + backward + SGD step of a Llama (``activate("auto", tp=1)`` and ``cp=1``)
                and of a Qwen3-MoE (``ep=1``) against plain transformers; every variant is a fresh process
                (hp_lazy rewrites modeling modules at import), all loaded at once and timed interleaved,
                round by round (order rotated); ratio = median of per-round hp_lazy / plain (target <= 1.02x)
  cp attention  hp_lazy's context-parallel attention function at world 1 (``cp_attention`` with a
                ``CallState``, K/V all-gathered over a 1-rank group, forward + backward of one call) over S;
                peak CUDA memory of the call, the largest tensor it allocates and whether an [S/C x S] one
                is among them (a TorchDispatchMode sees every op), against plain SDPA ``is_causal``
  parity        loss and logits of hp_lazy world 1 against plain, bf16 and fp32 weights
  graph breaks  ``torch._dynamo.explain`` of the training forward (with labels), hp_lazy and plain

Every model is built from a config (random weights, seed 0, ``save_pretrained`` into a temp dir; nothing is
downloaded). Every variant and the cp measurement run in their own process (``device_workers.py``, all
started at once), each on a 1-rank process group (nccl on CUDA when available, else gloo). Sizes: on CUDA
a Llama of hidden 1024, 8 layers, and a Qwen3-MoE of hidden 512, 8 layers, 16 experts top-2, both batch
4 x 2048 in bf16 weights, and S = 8k, 16k, 32k, 64k; on the CPU (and with ``--smoke``) tiny models, fp32.
The table goes to stdout at the end (and to ``--out`` after every row), progress to stderr, and each
process's stderr to ``<out>_logs/``.

    python benchmarks/device_check.py --smoke            # tiny, one round: about 20 s on 2 CPU cores
    python benchmarks/device_check.py --out /tmp/device_check.md --budget-s 420

On the GPU machine (its own torch; transformers 5.24 and regex carried as wheels in ``.whl/``, which git
ignores: carry it; hp_lazy from the repo root, not installed):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD && PYTHONUNBUFFERED=1 python3 benchmarks/device_check.py --out $OUT/device_check.md
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

from device_workers import PREFIX, ROOT, first_line

WORKERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "device_workers.py")
VARIANTS = {  # name: (model, hp_lazy axis or None for plain transformers)
    "plain llama": ("llama", None), "hp tp=1": ("llama", "tp"), "hp cp=1": ("llama", "cp"),
    "plain moe": ("moe", None), "hp ep=1": ("moe", "ep"),
}
PAIRS = (("tp=1", "hp tp=1", "plain llama"), ("cp=1", "hp cp=1", "plain llama"), ("ep=1", "hp ep=1", "plain moe"))
TARGET = 1.02


@dataclass(frozen=True)
class Sizes:
    llama: dict[str, Any]
    moe: dict[str, Any]
    batch: int
    seq: int
    warmup: int
    rounds: int
    steps: int
    cp_seqs: tuple[int, ...]
    cp_heads: tuple[int, int, int]  # query heads, K/V heads, head dim
    cp_steps: int
    parity_seq: int
    explain_seq: int
    timeouts: dict[str, float] = field(default_factory=dict)
    """Seconds one child may take per op."""
    reserve: dict[str, float] = field(default_factory=dict)
    """Seconds that must be left on the deadline to start (a round of) each section."""


_COMMON = dict(tie_word_embeddings=False, max_position_embeddings=4096, attention_dropout=0.0)
CUDA_SIZES = Sizes(
    llama=dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
               num_key_value_heads=8, **_COMMON),
    moe=dict(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=4, head_dim=64, num_experts=16, num_experts_per_tok=2, moe_intermediate_size=512,
             **_COMMON),
    batch=4, seq=2048, warmup=3, rounds=12, steps=5, cp_seqs=(8192, 16384, 32768, 65536), cp_heads=(16, 8, 128),
    cp_steps=2, parity_seq=256, explain_seq=256,
    timeouts=dict(start=150, time=60, parity=120, cp=150, explain=180),
    reserve=dict(steps=150, parity=110, cp=40, explain=60),
)
TINY_SIZES = Sizes(
    llama=dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, **_COMMON),
    moe=dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
             **_COMMON),
    batch=2, seq=32, warmup=1, rounds=5, steps=3, cp_seqs=(64, 128), cp_heads=(2, 1, 8), cp_steps=1,
    parity_seq=32, explain_seq=16,
    timeouts=dict(start=120, time=60, parity=60, cp=60, explain=120),
    reserve=dict(steps=20, parity=15, cp=8, explain=8),
)


# ================================================================================ the parent
class ChildError(Exception):
    """A child that failed, timed out or exited; the message is a table cell."""


class Child:
    """One child process: JSON commands on stdin, ``PREFIX``-tagged JSON answers on stdout."""

    def __init__(self, name: str, spec: dict[str, Any], root: str) -> None:
        self.name, self.err_path = name, os.path.join(root, name.replace(" ", "_").replace("=", "") + ".err")
        env = dict(os.environ, HP_LAZY_CACHE_DIR=os.path.join(root, "hp_cache"), TOKENIZERS_PARALLELISM="false",
                   HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONPATH=os.pathsep.join(
                       [ROOT, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]))
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        self._err = open(self.err_path, "w")
        self.proc = subprocess.Popen([sys.executable, WORKERS, json.dumps(spec)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err, text=True,
                                     env=env, cwd=ROOT)
        self._answers: queue.Queue[dict[str, Any] | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.info: dict[str, Any] | None = None
        self.broken: str | None = None

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(PREFIX):
                self._answers.put(json.loads(line[len(PREFIX):]))
        self._answers.put(None)

    def send(self, op: str, **args: Any) -> None:
        if self.broken:
            raise ChildError(self.broken)
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(dict(op=op, args=args)) + "\n")
            self.proc.stdin.flush()
        except OSError as error:
            self._break(f"error: {self.name} is gone ({error})")

    def receive(self, timeout: float) -> dict[str, Any]:
        if self.broken:
            raise ChildError(self.broken)
        try:
            answer = self._answers.get(timeout=max(timeout, 0.1))
        except queue.Empty:
            self._break(f"error: {self.name} timed out after {timeout:.0f} s")
        if answer is None:
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
            self._break(f"error: {self.name} exited rc={self.proc.returncode}: {self._last_err()}")
        if "error" in answer:
            raise ChildError(f"error: {answer['error']}")
        return answer

    def ask(self, op: str, timeout: float, **args: Any) -> dict[str, Any]:
        self.send(op, **args)
        return self.receive(timeout)

    def _break(self, why: str) -> None:
        self.broken = why
        self.proc.kill()
        raise ChildError(why)

    def _last_err(self) -> str:
        self._err.flush()
        with open(self.err_path) as f:
            lines = [x.strip() for x in f if x.strip()]
        return lines[-1][:300] if lines else "(no stderr)"

    def quit(self) -> None:
        if self.proc.poll() is None and not self.broken:
            try:
                self.send("quit")
            except ChildError:
                pass

    def close(self, wait: float) -> None:
        try:
            self.proc.wait(timeout=max(wait, 0.1))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._err.close()


def close_all(children: dict[str, Child], logs: str | None, wait: float = 15) -> None:
    """Ask every child to quit, give them ``wait`` seconds together, kill the rest; keep their stderr in ``logs``."""
    for child in children.values():
        child.quit()
    start = time.perf_counter()
    for child in children.values():
        child.close(wait - (time.perf_counter() - start))
    if logs:
        os.makedirs(logs, exist_ok=True)
        for child in children.values():
            shutil.copy(child.err_path, logs)


class Deadline:
    def __init__(self, budget_s: float) -> None:
        self.start, self.budget = time.perf_counter(), budget_s

    def left(self) -> float:
        return self.budget - (time.perf_counter() - self.start)

    def cap(self, timeout: float, keep: float = 0.0) -> float:
        """``timeout``, cut to what the deadline leaves once ``keep`` seconds are kept for later sections."""
        return max(1.0, min(timeout, self.left() - 5 - keep))

    def progress(self, text: str) -> None:
        print(f"[device_check +{time.perf_counter() - self.start:.0f}s] {text}", file=sys.stderr, flush=True)


class Report:
    """The table, rewritten to ``out`` after every row (the run may be cut short from outside)."""

    def __init__(self, out: str | None, header: str) -> None:
        self.out, self.header = out, header
        self.rows: list[tuple[str, str, str, str]] = []
        self.notes: list[str] = []

    def row(self, check: str, case: str, result: str, details: str = "") -> None:
        self.rows.append((check, case, result, details))
        print(f"| {check} | {case} | {result} | {details} |", file=sys.stderr, flush=True)
        self.write()

    def render(self) -> str:
        cell = lambda s: str(s).replace("|", "/").replace("\n", " ")  # noqa: E731
        lines = [self.header, "", "| check | case | result | details |", "|---|---|---|---|"]
        lines += [f"| {' | '.join(cell(c) for c in r)} |" for r in self.rows]
        return "\n".join(lines + [""] + [f"- {n}" for n in self.notes]) + "\n"

    def write(self) -> None:
        if not self.out:
            return
        try:
            os.makedirs(os.path.dirname(os.path.abspath(self.out)), exist_ok=True)
            with open(self.out, "w") as f:
                f.write(self.render())
        except OSError as error:  # the table is printed at the end all the same
            print(f"[device_check] cannot write {self.out}: {error}", file=sys.stderr, flush=True)


# -------------------------------------------------------------------------------- building and starting
def build_models(sizes: Sizes, root: str) -> dict[str, str]:
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    paths = {}
    for name, config in (("llama", transformers.LlamaConfig(**sizes.llama)),
                         ("moe", transformers.Qwen3MoeConfig(**sizes.moe))):
        torch.manual_seed(0)
        paths[name] = os.path.join(root, name)
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(paths[name])
    return paths


def start_children(sizes: Sizes, device: str, paths: dict[str, str] | None, root: str) -> dict[str, Child]:
    """The cp child, and one child per variant (all at once: their start-up runs in parallel)."""
    base = dict(device=device, batch=sizes.batch, seq=sizes.seq, warmup=sizes.warmup)
    children = {"cp": Child("cp", dict(base, role="cp"), root)}
    for name, (model, axis) in VARIANTS.items() if paths else ():
        spec = dict(base, role="model", axis=axis, path=paths[model], vocab=getattr(sizes, model)["vocab_size"])
        children[name] = Child(name, spec, root)
    return children


def wait_ready(children: dict[str, Child], deadline: Deadline, timeout: float) -> dict[str, str]:
    """Child name -> why it did not start (the others have ``info``); ``timeout`` for all of them together."""
    failed = {}
    until = time.perf_counter() + deadline.cap(timeout)
    for name, child in children.items():
        try:
            child.info = child.receive(until - time.perf_counter())["ready"]
        except ChildError as error:
            failed[name] = child.broken = child.broken or str(error)
    return failed


# -------------------------------------------------------------------------------- the sections
def ask_all(children: dict[str, Child], names: list[str], op: str, timeout: float,
            args: Any) -> dict[str, dict[str, Any] | str]:
    """``op`` sent to every child first (they run at once), then each answer: a dict, or the error cell."""
    got: dict[str, dict[str, Any] | str] = {}
    for name in names:
        try:
            children[name].send(op, **args(name))
        except ChildError as error:
            got[name] = str(error)
    start = time.perf_counter()
    for name in names:
        if name not in got:
            try:
                got[name] = children[name].receive(timeout - (time.perf_counter() - start))
            except ChildError as error:
                got[name] = str(error)
    return got


def section_steps(children: dict[str, Child], sizes: Sizes, rounds: int, report: Report, deadline: Deadline,
                  dtype: str) -> None:
    names = [n for n in VARIANTS if not children[n].broken]
    series: dict[str, list[float]] = {n: [] for n in VARIANTS}
    peaks: dict[str, Any] = {}
    done = 0
    for r in range(rounds):
        if deadline.left() < sizes.reserve["steps"]:
            report.notes.append(f"step time: stopped after {done} of {rounds} rounds ({deadline.left():.0f} s left)")
            break
        for name in names[r % len(names):] + names[:r % len(names)]:
            try:
                got = children[name].ask("time", deadline.cap(sizes.timeouts["time"]), steps=sizes.steps)
                series[name].append(got["s"])
                peaks[name] = got["peak"]
            except ChildError as error:
                children[name].broken = children[name].broken or str(error)
        names = [n for n in names if not children[n].broken]
        done += 1
        deadline.progress(f"step time: round {done} of {rounds}")
    for case, hp, plain in PAIRS:
        _step_row(report, case, hp, plain, children, series, peaks, done, sizes, dtype)


def _step_row(report: Report, case: str, hp: str, plain: str, children: dict[str, Child],
              series: dict[str, list[float]], peaks: dict[str, Any], done: int, sizes: Sizes, dtype: str) -> None:
    model = VARIANTS[hp][0]
    cfg = getattr(sizes, model)
    what = (f"{case} {'Llama' if model == 'llama' else 'Qwen3-MoE'} {cfg['num_hidden_layers']}L h{cfg['hidden_size']}"
            f" b{sizes.batch} s{sizes.seq}, {dtype}")
    broken = [children[n].broken for n in (hp, plain) if children[n].broken]
    pairs = list(zip(series[hp], series[plain], strict=False))  # both start at round 0: aligned
    if broken or not pairs:
        partial = f"{len(pairs)} of {done} rounds: median ratio {statistics.median(a / b for a, b in pairs):.3f}x" \
            if pairs else ""
        report.row("step time", what, broken[0] if broken else "skipped: deadline (no round run)", partial)
        return
    ratio = statistics.median(a / b for a, b in pairs)
    peak = " / ".join("-" if peaks.get(n) is None else f"{peaks[n] / 2**30:.2f}" for n in (hp, plain))
    info = children[hp].info or {}
    ms = {n: 1e3 * statistics.median(series[n]) for n in (hp, plain)}
    report.row("step time", what, f"{ratio:.3f}x ({'ok' if ratio <= TARGET else 'over'} vs <= {TARGET}x)",
               f"hp_lazy {ms[hp]:.1f} ms, plain {ms[plain]:.1f} ms; median of {len(pairs)} interleaved rounds x {sizes.steps} steps (per-round ratios "
               f"{min(a / b for a, b in pairs):.3f}..{max(a / b for a, b in pairs):.3f}); peak GiB hp/plain {peak}; "
               f"hp_lazy: {_bound_text(info)}")


def _bound_text(info: dict[str, Any]) -> str:
    lowered = ", ".join(info.get("lowered", [])) or "none"
    hooked = "through the hook" if info.get("hooked") else "NOT through the hook"
    return f"modeling module imported {hooked}, lowered classes: {lowered}, attention {info.get('attention')}"


def section_parity(children: dict[str, Child], sizes: Sizes, root: str, report: Report, deadline: Deadline) -> None:
    import torch

    for dtype in ("bfloat16", "float32"):
        live = [n for n in VARIANTS if not children[n].broken]
        if deadline.left() < sizes.reserve["parity"]:
            for case, _, _ in PAIRS:
                report.row(f"parity {dtype}", case, f"skipped: deadline ({deadline.left():.0f} s left)")
            continue
        got = ask_all(children, live, "parity", deadline.cap(sizes.timeouts["parity"]), lambda n, d=dtype: dict(
            dtype=d, seq=sizes.parity_seq, file=_logits_file(root, n, d)))
        for case, hp, plain in PAIRS:
            bad = [got.get(n, children[n].broken) for n in (hp, plain) if not isinstance(got.get(n), dict)]
            if bad:
                report.row(f"parity {dtype}", case, str(bad[0]))
                continue
            a, b = (torch.load(_logits_file(root, n, dtype)) for n in (hp, plain))
            la, lb = (got[n]["loss"] for n in (hp, plain))  # type: ignore[index]
            loss = abs(la - lb) / abs(lb)
            logits = float((a - b).abs().max() / b.abs().max())
            report.row(f"parity {dtype}", case, f"loss rel {loss:.1e}, logits max rel {logits:.1e}",
                       f"loss {la:.6f} vs {lb:.6f}; logits max abs(hp - plain) / max abs(plain) "
                       f"over batch 1 x {sizes.parity_seq}, fresh {dtype} loads, no_grad")
        deadline.progress(f"parity {dtype} done")


def _logits_file(root: str, name: str, dtype: str) -> str:
    return os.path.join(root, f"logits_{name.replace(' ', '_').replace('=', '')}_{dtype}.pt")


def section_cp(child: Child, model_info: dict[str, Any] | None, sizes: Sizes, report: Report,
               deadline: Deadline) -> None:
    heads, kv, dim = sizes.cp_heads
    for seq in sizes.cp_seqs:
        case = f"S={seq} (C=1, B=1, {heads} heads / {kv} K/V, d {dim})"
        if deadline.left() < sizes.reserve["cp"]:
            report.row("cp attention", case, f"skipped: deadline ({deadline.left():.0f} s left)")
            continue
        try:
            timeout = deadline.cap(sizes.timeouts["cp"], keep=sizes.reserve["explain"])
            got = child.ask("cp", timeout, seq=seq, heads=heads, kv=kv, dim=dim, steps=sizes.cp_steps)
        except ChildError as error:
            report.row("cp attention", case, str(error))
            continue
        cp, ref = got["cp"], got["sdpa"]
        result = f"error: {cp['error']}" if "error" in cp else (
            f"peak {_gib(cp['peak'])}, {1e3 * cp['s']:.1f} ms; [S/C x S] tensors: {cp['big']} "
            f"({cp['big_bytes'] / 2**30:.2f} GiB)")
        details = "" if "error" in cp else (f"fwd+bwd of one call; largest new tensor {_tensor_text(cp['largest'])}; "
                                           f"kernels {', '.join(cp['kernels']) or '-'}; ")
        details += f"plain SDPA is_causal: error: {ref['error']}" if "error" in ref else (
            f"plain SDPA is_causal: peak {_gib(ref['peak'])}, {1e3 * ref['s']:.1f} ms, [S x S] tensors {ref['big']}, "
            f"largest {_tensor_text(ref['largest'])}, kernels {', '.join(ref['kernels']) or '-'}")
        report.row("cp attention", case, result, details)
        deadline.progress(f"cp attention S={seq} done")
    info = model_info or {}
    if model_info is None:
        report.notes.append("cp attention: the cp=1 model did not start, so whether activate('auto', cp=1) binds the "
                            "cp path at world 1 is not shown here; the function is measured directly (see the rows)")
    elif info.get("attention") != "hp_lazy_cp":
        report.notes.append(
            f"cp attention: activate('auto', cp=1) leaves the model unbound ({_bound_text(info)}): every axis has "
            "degree 1, so a world-1 model never reaches the cp path. The function is measured directly: "
            "hp_lazy.runtime.cp.attention.cp_attention with a CallState at world 1 (a fresh one per step, as the "
            "entry builds per forward; K/V all-gathered over a 1-rank process group), one attention call's forward "
            "+ backward; peak = max_memory_allocated over the step minus the inputs; '[S/C x S] tensors' counts new "
            "tensors (not views) of at least S*S/C elements, forward and backward")


def _gib(x: Any) -> str:
    return "-" if x is None else f"{x / 2**30:.2f} GiB"


def _tensor_text(t: dict[str, Any] | None) -> str:
    if not t:
        return "-"
    return f"{t['dtype']}{t['shape']} {t['bytes'] / 2**20:.1f} MiB ({t['op']})"


def section_graph_breaks(children: dict[str, Child], sizes: Sizes, report: Report, deadline: Deadline) -> None:
    live = [n for n in VARIANTS if not children[n].broken]
    if deadline.left() < sizes.reserve["explain"]:
        for case, _, _ in PAIRS:
            report.row("graph breaks", case, f"skipped: deadline ({deadline.left():.0f} s left)")
        return
    got = ask_all(children, live, "explain", deadline.cap(sizes.timeouts["explain"]),  # concurrently: dynamo
                  lambda n: dict(seq=sizes.explain_seq))                                 # tracing is CPU-bound
    for case, hp, plain in PAIRS:
        bad = [got.get(n, children[n].broken) for n in (hp, plain) if not isinstance(got.get(n), dict)]
        if bad:
            report.row("graph breaks", case, str(bad[0]))
            continue
        a, b = got[hp], got[plain]
        assert isinstance(a, dict) and isinstance(b, dict)
        first = (a["reasons"] or b["reasons"] or ["-"])[0]
        report.row("graph breaks", case, f"hp_lazy {a['breaks']}, plain {b['breaks']}",
                   f"graphs {a['graphs']} / {b['graphs']}; torch._dynamo.explain of model(input_ids, labels), "
                   f"batch 1 x {sizes.explain_seq}; first reason: {first}")


# -------------------------------------------------------------------------------- the check
def run_check(args: argparse.Namespace) -> Report:
    import torch
    import transformers

    device = "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"
    sizes = CUDA_SIZES if device == "cuda" and not args.smoke else TINY_SIZES
    rounds = 1 if args.smoke else (args.rounds or sizes.rounds)
    dtype = "bf16 weights" if device == "cuda" else "fp32"
    name = "CUDA" if device == "cuda" else f"CPU ({os.cpu_count()} cores)"  # no CUDA context in this process
    report = Report(args.out, f"## hp_lazy device check: {name}, torch {torch.__version__}, transformers "
                              f"{transformers.__version__}, python {sys.version.split()[0]}"
                              f"{' (smoke)' if args.smoke else ''}, world 1")
    deadline = Deadline(args.budget_s)
    logs = os.path.splitext(args.out)[0] + "_logs" if args.out else None
    with tempfile.TemporaryDirectory(prefix="hp_lazy_device_check_") as root:
        deadline.progress(f"building the checkpoints ({device})")
        try:
            paths: dict[str, str] | None = build_models(sizes, root)
        except Exception as error:  # the cp section needs no checkpoint
            traceback.print_exc()
            paths = None
            report.notes.append(f"building the checkpoints failed: {first_line(error)}")
        children = start_children(sizes, device, paths, root)
        try:
            _sections(children, sizes, rounds, root, report, deadline, dtype)
        finally:
            close_all(children, logs)
    if logs:
        report.notes.append(f"each process's stderr: {logs}/")
    report.notes.append(f"wall time {time.perf_counter() - deadline.start:.0f} s of a {args.budget_s:.0f} s budget")
    report.write()
    return report


def _sections(children: dict[str, Child], sizes: Sizes, rounds: int, root: str, report: Report,
              deadline: Deadline, dtype: str) -> None:
    failed = wait_ready(children, deadline, sizes.timeouts["start"])
    if "cp" not in failed and children["cp"].info and children["cp"].info.get("device"):
        report.notes.append(f"device: {children['cp'].info['device']}")
    if len(children) == 1:  # no checkpoints: no model variants
        for check in ("step time", "parity", "graph breaks"):
            report.row(check, "(all)", "error: building the checkpoints failed (see the notes)")
        section_cp(children["cp"], None, sizes, report, deadline)
        return
    deadline.progress(f"children ready ({', '.join(f'{n}: {w}' for n, w in failed.items()) or 'all'})")
    backends = sorted({c.info["backend"] for c in children.values() if c.info})
    report.notes.append(f"every process: a 1-rank process group ({', '.join(backends) or '?'}); step: forward with "
                        f"labels + backward + SGD step, {dtype}")
    cp_model = children["hp cp=1"].info
    for check, run in (("step time", lambda: section_steps(children, sizes, rounds, report, deadline, dtype)),
                       ("parity", lambda: section_parity(children, sizes, root, report, deadline)),
                       ("cp attention", lambda: section_cp(children["cp"], cp_model, sizes, report, deadline)),
                       ("graph breaks", lambda: section_graph_breaks(children, sizes, report, deadline))):
        try:
            run()
        except Exception as error:  # a bug here must not cost the other sections
            traceback.print_exc()
            report.row(check, "(section)", f"error: {first_line(error)}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny models, one round (CPU: well under a minute)")
    ap.add_argument("--cpu", action="store_true", help="run on the CPU even where CUDA is available")
    ap.add_argument("--rounds", type=int, help="timed rounds of the step-time section (default: 12 CUDA, 5 CPU)")
    ap.add_argument("--budget-s", type=float, default=420.0, help="global deadline in seconds (default 420)")
    ap.add_argument("--out", help="also write the markdown table to this file")
    args = ap.parse_args(argv)
    report = run_check(args)
    print(report.render(), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
