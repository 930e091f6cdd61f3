"""Fine-tune LoRA adapters on a tensor-parallel transformers model with PEFT and hp_lazy, under torchrun.

    GLOO_SOCKET_IFNAME=lo torchrun --nproc-per-node 2 --master-addr 127.0.0.1 examples/peft_lora.py
    torchrun --nproc-per-node 4 examples/peft_lora.py --tp 4 --sequence-parallel --compile

A tiny random Llama is built here (CPU, no downloads). The stock PEFT calls are used unchanged:
``get_peft_model`` (before or after ``hp_lazy.parallelize``; here after), ``save_pretrained`` on
every rank (the adapter is gathered; rank 0 writes it) and ``merge_and_unload``.
"""

from __future__ import annotations

import argparse
import os
import tempfile


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=int(os.environ.get("WORLD_SIZE", "1")))
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model (backend eager)")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()

    import hp_lazy

    hp_lazy.activate("auto", tp=args.tp, sequence_parallel=args.sequence_parallel)

    import torch
    import torch.distributed as dist
    import transformers
    from peft import LoraConfig, get_peft_model

    from hp_lazy.runtime.mesh import ensure_process_group

    ensure_process_group(int(os.environ.get("WORLD_SIZE", "1")))
    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(_tiny_llama(rank), dtype=torch.float32)
    hp_lazy.parallelize(model)
    model = get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"]))
    step_model = torch.compile(model, backend="eager") if args.compile else model
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    dp = hp_lazy.mesh().group("dp")  # ranks beyond tp are data parallel
    generator = torch.Generator().manual_seed(1234)  # one global batch, the same on every rank
    for step in range(args.steps):
        ids = torch.randint(0, 256, (4 * dp.size, 64), generator=generator).chunk(dp.size)[dp.rank]
        loss = step_model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if rank == 0:
            print(f"step {step}: loss {loss.item():.4f}", flush=True)
    out = os.path.join(tempfile.gettempdir(), "hp_lazy_example_lora")
    model.save_pretrained(out, is_main_process=rank == 0)  # every rank: the adapter is gathered over tp
    merged = model.merge_and_unload()
    full = hp_lazy.full_state_dict(merged)  # full merged weights on every rank
    if rank == 0:
        print(f"adapter saved to {out}; merged model has {sum(t.numel() for t in full.values())} parameters")


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
