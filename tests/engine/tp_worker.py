"""One rank of the tensor-parallel tests (tests/engine/test_tensor_parallel.py): loads the saved tiny models with
transformers' tensor parallelism over gloo, runs a scenario and writes what it saw to `<out>/rank<r>.json`.

Run as `python tp_worker.py SCENARIO MODELS_DIR OUT_DIR` with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, DistributedConfig, GenerationConfig

from rollout.config import ContinuousBatchingConfig
from rollout.engine.engine import LLMEngine
from rollout.generate import generate_batch
from rollout.manager import ContinuousBatchingManager, ManagerError
from rollout.rl.generator import RolloutGenerator
from rollout.sampling_params import SamplingParams

PROMPTS = [[(7 * i + 3 * j) % 256 for j in range(5 + 9 * i)] for i in range(4)]  # 5-32 tokens, pages of 8
NEW_TOKENS = 24
CONFIG = ContinuousBatchingConfig(page_size=8, num_blocks=64)


def load(models: Path, name: str):
    return AutoModelForCausalLM.from_pretrained(models / name, distributed_config=DistributedConfig(tp_size=2),
                                                dtype=torch.float32).eval()


def greedy_tokens(generator: RolloutGenerator) -> list[list[int]]:
    batch = generator.generate(PROMPTS, sampling_params=SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS))
    return [s.completion_ids for s in batch.samples]


def serve(models: Path, rank: int) -> dict:
    seen: dict = {}
    for arch in ("llama", "qwen3"):
        model = load(models, arch)
        outs = generate_batch(model, PROMPTS, GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False), CONFIG)
        seen[f"{arch}_generate_batch"] = [o.generated_tokens for o in outs.values()]
    # the manager and the RL layer, on the Qwen3 model: sampled groups, cancellation, weight updates
    try:
        RolloutGenerator(model)
    except ValueError as err:
        seen["copy"] = str(err)
    generator = RolloutGenerator(model, continuous_batching_config=CONFIG, share_weights=True)
    sampled = generator.generate(PROMPTS[:2], n=3, sampling_params=SamplingParams(temperature=1.0, max_new_tokens=12))
    seen["sampled"] = [s.completion_ids for s in sampled.samples]
    seen["sampled_logprobs"] = [s.logprobs for s in sampled.samples]
    manager = generator.manager
    unseeded = manager.add_request(PROMPTS[1], max_new_tokens=12, temperature=1.0)  # drawn by the engine's sampler
    seen["unseeded"] = manager.get_result(unseeded, timeout=120).generated_tokens
    rid = manager.add_request(PROMPTS[0], max_new_tokens=400, ignore_eos=True)
    time.sleep(0.2)
    manager.cancel_request(rid)
    cancelled = manager.get_result(rid, timeout=120)
    seen["cancelled"] = [cancelled.status.name, len(cancelled.generated_tokens)]
    generator.update_weights(load_file(models / "qwen3_new" / "model.safetensors"))  # full tensors, as a trainer has
    seen["after_full_update"] = greedy_tokens(generator)
    old = load(models, "qwen3")
    generator.update_weights(old, on_update="recompute")  # sharded tensors (DTensors) this time
    seen["after_sharded_update"] = greedy_tokens(generator)
    seen["weight_version"] = generator.weight_version
    generator.close()
    try:
        generate_batch(model, [[rank + 1] * 4], GenerationConfig(max_new_tokens=2, do_sample=False), CONFIG)
    except ValueError as err:
        seen["divergent_inputs"] = str(err)
    try:
        LLMEngine(load(models, "mqa"), config=CONFIG)
    except ValueError as err:
        seen["mqa"] = str(err)
    return seen


def kill(models: Path, rank: int) -> dict:
    model = load(models, "llama")
    manager = ContinuousBatchingManager(model, GenerationConfig(max_new_tokens=4, do_sample=False),
                                        ContinuousBatchingConfig(page_size=8, num_blocks=64, cpu_group_timeout=60))
    manager.start()
    first = manager.get_result(manager.add_request(PROMPTS[1]), timeout=120).generated_tokens
    if rank == 1:
        os._exit(0)  # a rank that dies without a word: the other's next collective must fail, not hang
    rid = manager.add_request(PROMPTS[2], max_new_tokens=50)
    try:
        manager.get_result(rid, timeout=240)
        return {"first": first, "error": None}
    except ManagerError as err:
        return {"first": first, "error": str(err)}


def main() -> None:
    scenario, models, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    seen = {"serve": serve, "kill": kill}[scenario](models, rank)
    (out / f"rank{rank}.json").write_text(json.dumps(seen))
    os._exit(0)  # skip the process group's teardown: a dead peer would make it wait


if __name__ == "__main__":
    main()
