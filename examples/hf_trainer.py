"""A training loop that publishes every optimizer step to the swarm (run hf_engine.py beside it).

    python examples/hf_trainer.py --steps 20            # prints the trainer's URL and key file

A tiny LLaMA is built locally (no download); each step is a real AdamW step on fp32 master
weights, published as the bf16 that rollouts run (``serve_dtype``), as in RL post-training.
``publish`` is an ordinary synchronous call: the node's event loop runs in a background thread.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
import transformers

from p2p_sync import Trainer
from p2p_sync.trust.keys import SigningKey, write_keypair


def tiny_llama() -> transformers.LlamaForCausalLM:
    cfg = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


class Policy:
    """fp32 master weights trained by AdamW (the trainer publishes them as bf16, what the
    rollouts run: ``Trainer(serve_dtype=torch.bfloat16)``)."""

    def __init__(self) -> None:
        self.master = tiny_llama()
        self.opt = torch.optim.AdamW(self.master.parameters(), lr=1e-5)

    def train_step(self) -> None:
        tokens = torch.randint(0, 256, (4, 32))  # stands in for a batch of rollouts
        self.master(input_ids=tokens, labels=tokens).loss.backward()
        self.opt.step()
        self.opt.zero_grad()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--listen", default="127.0.0.1:8700")
    parser.add_argument("--dir", type=Path, default=Path(tempfile.mkdtemp(prefix="hf-trainer-")))
    args = parser.parse_args()
    key_file = args.dir / "trainer.key"
    if not key_file.exists():
        write_keypair(SigningKey.generate(), key_file)
    policy = Policy()
    with Trainer(
        key=key_file, data_dir=args.dir / "data", listen=args.listen, serve_dtype=torch.bfloat16
    ) as trainer:
        print(f"trainer {trainer.url}; rollouts trust {key_file}.pub", flush=True)
        for step in range(args.steps):
            if step:
                policy.train_step()
            version = trainer.publish(policy.master.state_dict())  # cast to bf16 as read
            t = trainer.last_publish or {}
            print(
                f"published v{version} ({t.get('patch_bytes', 0):,} B patch, "
                f"{t.get('total_s', 0):.3f} s)",
                flush=True,
            )
        input("press Enter to stop seeding ")


if __name__ == "__main__":
    main()
