"""Async GRPO in a plain loop: `AsyncRollouts` generates the next batches while the optimizer steps.

The loop itself is `rollout.demo.async_grpo.train` (the same code `rollout demo --async` runs), in short:

    producer = AsyncRollouts(generator, prompts, reward, groups_per_batch=16, n=8, max_staleness=1)
    for batch in producer:
        metrics = optimizer_step(model, optimizer, batch, temperature, pad_token_id)   # decoupled-PPO GRPO loss
        producer.update_weights(model)                                                # into the running engine

    python examples/async_grpo.py                     # the embedded policy, max_staleness=1, 2 CPU cores
    python examples/async_grpo.py --max-staleness 0   # the same loop, synchronous
"""

import argparse
import logging
import sys

from rollout.demo.async_grpo import main
from rollout.demo.run import add_arguments

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args()
    args.async_mode = True
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    main(args, sys.stdout)
