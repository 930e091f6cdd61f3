"""Train a transformers causal LM tensor parallel with hp_lazy, under torchrun.

    torchrun --nproc-per-node 2 examples/train.py                      # tiny Llama built here
    torchrun --nproc-per-node 4 examples/train.py --tp 4 --sequence-parallel
    torchrun --nproc-per-node 4 examples/train.py --tp 2 --model-dir /path/to/checkpoint   # dp = 2

On CPU set GLOO_SOCKET_IFNAME=lo (and --master-addr 127.0.0.1). The only hp_lazy-specific lines
are the two at the top of main(): activate before transformers imports the modeling module.
"""

from __future__ import annotations

import argparse
import os
import tempfile


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", help="a save_pretrained checkpoint (default: a tiny random Llama)")
    parser.add_argument("--tp", type=int, default=int(os.environ.get("WORLD_SIZE", "1")))
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()

    import hp_lazy

    hp_lazy.activate("auto", tp=args.tp, sequence_parallel=args.sequence_parallel)

    import torch
    import torch.distributed as dist
    import transformers

    from hp_lazy.runtime.mesh import ensure_process_group

    ensure_process_group(int(os.environ.get("WORLD_SIZE", "1")))
    rank = dist.get_rank() if dist.is_initialized() else 0
    path = args.model_dir or _tiny_llama(rank)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    hp_lazy.parallelize(model)  # optional: the first forward would do it; do it before the optimizer
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    vocab = model.config.vocab_size
    dp = hp_lazy.mesh().group("dp")  # ranks beyond tp are data parallel; hp_lazy averages their gradients
    generator = torch.Generator().manual_seed(1234)  # one global batch, the same on every rank
    for step in range(args.steps):
        ids = torch.randint(0, vocab, (4 * dp.size, 64), generator=generator).chunk(dp.size)[dp.rank]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if rank == 0:
            print(f"step {step}: loss {loss.item():.4f}", flush=True)
    if args.model_dir is None and rank == 0:
        print(f"trained a tiny Llama at tp={args.tp}; checkpoint helper: hp_lazy.full_state_dict(model)")


def _tiny_llama(rank: int) -> str:
    import torch
    import torch.distributed as dist
    import transformers

    path = os.path.join(tempfile.gettempdir(), "hp_lazy_example_llama")
    if rank == 0 and not os.path.exists(os.path.join(path, "config.json")):
        config = transformers.LlamaConfig(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        )
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    if dist.is_initialized():
        dist.barrier()
    return path


if __name__ == "__main__":
    main()
