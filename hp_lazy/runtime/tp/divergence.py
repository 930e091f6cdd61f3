"""Per-token divergence between a student's and a teacher's next-token distributions, from heads
whose weights are cut over the vocabulary.

TRL's ``DistillationTrainer`` hands both models' ``lm_head`` weights to a fused kernel of its own
(``ChunkedDivergenceFunction``): under tp those are this rank's rows ``[V/tp, H]``, and a softmax
over them is a softmax over part of the vocabulary. :func:`per_token` returns what that kernel
returns, over the whole vocabulary, from the shards: for ``student_hidden [N, Hs]`` and
``teacher_hidden [N, Ht]`` (the same on every tp rank), per token

- the divergence: ``beta = 0`` forward KL(p_t || p_s), ``beta = 1`` reverse KL(p_s || p_t), else
  the generalized JSD ``beta KL(p_t || m) + (1 - beta) KL(p_s || m)``, ``m = (1 - beta) p_s + beta p_t``;
- the student's entropy (no gradient).

Both heads' logits go through a :class:`~hp_lazy.runtime.tp.logprobs.Transform` (scale, softcap,
temperature). Rows are taken in chunks of at most ``2**24`` elements of this rank's ``[N, V/tp]``
and recomputed (forward: three passes, the max, the sums against the global max, the divergence;
backward: one); the ``[N, V]`` logits are never built. Forward: all-reduces of ``[2, N]`` (max),
``[3, N]`` (the normalizers, the entropy's sum) and ``[2, N]`` (the divergence and, for the
generalized JSD, its backward's per-token term; ``[1, N]`` for either KL), fp32. Backward: one of
``[N, Hs]`` (the student hidden gradient). The gradient flows to the student only; its weight's
gradient stays this rank's rows.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from hp_lazy.runtime.comm import wire
from hp_lazy.runtime.tp.logprobs import HeadGrads, Transform, VocabShard, compute_dtype, head_logits, row_chunks


def per_token(
    student_hidden: torch.Tensor, student_weight: torch.Tensor, student_bias: torch.Tensor | None,
    teacher_hidden: torch.Tensor, teacher_weight: torch.Tensor, teacher_bias: torch.Tensor | None,
    shard: VocabShard, beta: float, student: Transform, teacher: Transform,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(divergence [N], student entropy [N])`` over the whole vocabulary; both weights are this
    rank's rows ``shard`` of ``[V, H]``."""
    teacher_hidden, teacher_weight = teacher_hidden.detach(), teacher_weight.detach()  # no edge to the teacher
    teacher_bias = None if teacher_bias is None else teacher_bias.detach()
    return _VocabParallelDivergence.apply(student_hidden, student_weight, student_bias, teacher_hidden,
                                          teacher_weight, teacher_bias, shard, beta, student, teacher)


def _log_probs(ctx_like: tuple, rows: slice, log_z_s: torch.Tensor, log_z_t: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's ``(raw student logits, log p_s, log p_t)`` of ``rows``."""
    hs, ws, bs, ht, wt, bt, student, teacher, dtypes = ctx_like
    xs = head_logits(hs[rows], ws, bs, dtypes[0])
    log_ps = student(xs) - log_z_s[rows].unsqueeze(-1)
    log_pt = teacher(head_logits(ht[rows], wt, bt, dtypes[1])) - log_z_t[rows].unsqueeze(-1)
    return xs, log_ps, log_pt


def _log_mixture(log_ps: torch.Tensor, log_pt: torch.Tensor, beta: float) -> torch.Tensor:
    return torch.logaddexp(log_ps + math.log(1 - beta), log_pt + math.log(beta))


class _VocabParallelDivergence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hs, ws, bs, ht, wt, bt, shard: VocabShard, beta: float, student: Transform, teacher: Transform):
        ctx.set_materialize_grads(False)
        n, cols, g = hs.shape[0], ws.shape[0], shard.group
        dtypes = compute_dtype(hs), compute_dtype(ht)
        maxima = torch.full((2, n), -math.inf, device=hs.device, dtype=torch.float32)
        for rows in row_chunks(n, cols):
            maxima[0, rows] = student(head_logits(hs[rows], ws, bs, dtypes[0])).amax(-1)
            maxima[1, rows] = teacher(head_logits(ht[rows], wt, bt, dtypes[1])).amax(-1)
        if g.size > 1:
            wire.all_reduce(maxima, g, "forward", dist.ReduceOp.MAX)
        sums = torch.zeros(3, n, device=hs.device, dtype=torch.float32)  # sum e_s, sum e_s z_s, sum e_t
        for rows in row_chunks(n, cols):
            zs = student(head_logits(hs[rows], ws, bs, dtypes[0]))
            es = torch.exp(zs - maxima[0, rows].unsqueeze(-1))
            sums[0, rows], sums[1, rows] = es.sum(-1), (es * zs).sum(-1)
            zt = teacher(head_logits(ht[rows], wt, bt, dtypes[1]))
            sums[2, rows] = torch.exp(zt - maxima[1, rows].unsqueeze(-1)).sum(-1)
        if g.size > 1:
            wire.all_reduce(sums, g, "forward")
        log_z_s, log_z_t = maxima[0] + sums[0].log(), maxima[1] + sums[2].log()
        entropy = log_z_s - sums[1] / sums[0]
        parts = torch.zeros(2, n, device=hs.device, dtype=torch.float32)  # the divergence, KL(p_s || m)
        inputs = (hs, ws, bs, ht, wt, bt, student, teacher, dtypes)
        for rows in row_chunks(n, cols):
            _, log_ps, log_pt = _log_probs(inputs, rows, log_z_s, log_z_t)
            if beta == 0.0:
                parts[0, rows] = (log_pt.exp() * (log_pt - log_ps)).sum(-1)
            elif beta == 1.0:
                parts[0, rows] = (log_ps.exp() * (log_ps - log_pt)).sum(-1)
            else:
                log_m = _log_mixture(log_ps, log_pt, beta)
                kl_s = (log_ps.exp() * (log_ps - log_m)).sum(-1)
                parts[0, rows] = beta * (log_pt.exp() * (log_pt - log_m)).sum(-1) + (1 - beta) * kl_s
                parts[1, rows] = kl_s
        if g.size > 1:  # KL(p_s || m) only for the generalized JSD's backward
            wire.all_reduce(parts if 0.0 < beta < 1.0 else parts[:1], g, "forward")
        divergence = parts[0]
        aux = parts[0] if beta in (0.0, 1.0) else parts[1]
        ctx.save_for_backward(hs, ws, bs, ht, wt, bt, log_z_s, log_z_t, aux)
        ctx.shard, ctx.beta, ctx.transforms, ctx.dtypes = shard, beta, (student, teacher), dtypes
        ctx.mark_non_differentiable(entropy)
        return divergence, entropy

    @staticmethod
    def backward(ctx, d_divergence, _):
        if d_divergence is None:
            return (None,) * 10
        hs, ws, bs, ht, wt, bt, log_z_s, log_z_t, aux = ctx.saved_tensors
        (student, teacher), beta, shard = ctx.transforms, ctx.beta, ctx.shard
        grads = HeadGrads(ctx.needs_input_grad[:3], hs, ws, bs)
        inputs = (hs, ws, bs, ht, wt, bt, student, teacher, ctx.dtypes)
        for rows in row_chunks(hs.shape[0], ws.shape[0]):
            xs, log_ps, log_pt = _log_probs(inputs, rows, log_z_s, log_z_t)
            ps = log_ps.exp()
            if beta == 0.0:
                dz = ps - log_pt.exp()
            elif beta == 1.0:
                dz = ps * (log_ps - log_pt - aux[rows].unsqueeze(-1))
            else:
                dz = (1 - beta) * ps * (log_ps - _log_mixture(log_ps, log_pt, beta) - aux[rows].unsqueeze(-1))
            grads.add(rows, student.backward(xs, dz * d_divergence[rows].float().unsqueeze(-1)))
        return (*grads.result(shard.group), *(None,) * 7)
