"""Trainer and engine in one process, in a few lines each: the quickest way to see the API.

    python examples/in_process.py

A trainer publishes five AdamW steps of a tiny LLaMA; a rollout keeps a second, independently
built model at the head by applying each version in place, and checks after each one that both
models are bit-identical and generate the same tokens.
"""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path

import torch

from examples.hf_trainer import Policy, tiny_llama
from p2p_sync import Rollout, Trainer
from p2p_sync.trust.keys import SigningKey, write_keypair


def main(steps: int = 5) -> int:
    root = Path(tempfile.mkdtemp(prefix="p2psync-example-"))
    pub = write_keypair(SigningKey.generate(), root / "trainer.key")
    policy = Policy()
    engine = tiny_llama().to(torch.bfloat16).eval()
    prompt = torch.tensor([[3, 14, 15, 92, 65]])
    with (
        Trainer(
            key=root / "trainer.key", data_dir=root / "t", serve_dtype=torch.bfloat16
        ) as trainer,
        Rollout(
            trust=[str(pub)], peers=[trainer.url], data_dir=root / "r", model=engine
        ) as rollout,
    ):
        for step in range(steps):
            if step:
                policy.train_step()
            version = trainer.publish(policy.master.state_dict())  # as bf16, cast as read
            rollout.wait_for_version(version, timeout=60)  # applies held versions as they come
            served = copy.deepcopy(policy.master).to(torch.bfloat16)  # the reference, here only
            same = all(torch.equal(a, b) for a, b in zip(engine.parameters(), served.parameters()))
            with torch.no_grad():
                tokens = [
                    m.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
                    for m in (engine, served.eval())
                ]
            print(
                f"v{version}: engine bit-identical to trainer: {same}; "
                f"same generation: {torch.equal(*tokens)}"
            )
            if not (same and torch.equal(*tokens)):
                return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
