"""Train a causal LM with the stock transformers ``Trainer``, tensor parallel with hp_lazy, under torchrun.

    torchrun --nproc-per-node 2 examples/trainer.py                        # tp=2, a tiny Llama built here
    torchrun --nproc-per-node 4 examples/trainer.py --tp 2                 # dp=2 x tp=2
    torchrun --nproc-per-node 4 examples/trainer.py --tp 2 --sequence-parallel

On CPU set GLOO_SOCKET_IFNAME=lo (and --master-addr 127.0.0.1). The one hp_lazy line is
``hp_lazy.activate`` before transformers is imported; the rest is a stock Trainer script. hp_lazy
makes accelerate (which the Trainer drives) shard the data over dp only (the ranks of a tp group
read the same rows), wrap no DDP across tp ranks (hp_lazy averages over dp itself), and clip with
one process's gradient norm (the default max_grad_norm=1.0 is on).
"""

from __future__ import annotations

import argparse
import os
import tempfile


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=int(os.environ.get("WORLD_SIZE", "1")))
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()

    import hp_lazy

    hp_lazy.activate("auto", tp=args.tp, sequence_parallel=args.sequence_parallel)

    import torch
    import transformers
    from transformers import Trainer, TrainingArguments

    out = os.path.join(tempfile.gettempdir(), "hp_lazy_example_trainer")
    training = TrainingArguments(
        output_dir=out, per_device_train_batch_size=2, max_steps=args.steps, logging_steps=1,
        learning_rate=1e-3, report_to=[], save_strategy="no", use_cpu=not torch.cuda.is_available(),
        disable_tqdm=True,
    )  # per_device_train_batch_size: rows per dp rank (the ranks of a tp group share them)
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    Trainer(model=model, args=training, train_dataset=_RandomRows(config.vocab_size)).train()


class _RandomRows:
    """64 rows of 64 random token ids (a map-style data set: input_ids = labels)."""

    def __init__(self, vocab: int) -> None:
        import torch

        self.ids = torch.randint(0, vocab, (64, 64), generator=torch.Generator().manual_seed(1234))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


if __name__ == "__main__":
    main()
