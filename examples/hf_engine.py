"""An inference loop whose live model follows the swarm: patches applied in place between
generation batches, at moments the engine chooses.

    python examples/hf_engine.py --trust /tmp/hf-trainer-XXXX/trainer.key.pub \
        --peers http://127.0.0.1:8700

The node fetches and verifies new versions in the background; ``apply_updates()`` applies
every verified version in place to the model's own tensors (no second copy of the model) and
reports the pause it cost the engine.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from examples.hf_trainer import tiny_llama
from p2p_sync import Rollout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trust", required=True, help="the trainer's .pub file")
    parser.add_argument("--peers", required=True, help="http://host:port of a peer")
    parser.add_argument("--batches", type=int, default=50)
    parser.add_argument("--dir", type=Path, default=Path(tempfile.mkdtemp(prefix="hf-engine-")))
    args = parser.parse_args()
    model = tiny_llama().to(torch.bfloat16).eval()  # the engine's model; v0 overwrites it
    with Rollout(trust=[args.trust], peers=[args.peers], data_dir=args.dir, model=model) as rollout:
        rollout.wait_for_version(0, timeout=120)
        for batch in range(args.batches):
            prompt = torch.randint(0, 256, (1, 8))
            with torch.no_grad():
                out = model.generate(prompt, max_new_tokens=16, do_sample=False, pad_token_id=0)
            if rollout.wait_for_update(timeout=0.2):  # between batches: take what has arrived
                hand = rollout.apply_updates()
                print(f"batch {batch}: now at v{hand.version}, paused {hand.pause_s * 1e3:.1f} ms")
            print(f"batch {batch} (v{rollout.version}): {out[0, -16:].tolist()}")


if __name__ == "__main__":
    main()
