"""The single-process oracle of the cluster tests: seeded prompts, and each prompt's tokens from
model.runner alone (one sequence at a time, its own cache)."""

import torch

from model.loader import load_model
from model.runner import ModelRunner, generate


def prompts(n, lo=3, hi=30, seed=0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 760, (int(k),), generator=g).tolist() for k in torch.randint(lo, hi, (n,), generator=g)]


def alone(path, prompts, params) -> list[list[int]]:
    net = load_model(path, progress=False)
    return [generate(ModelRunner(net, num_blocks=64, block_size=16, num_slots=2), [p], [params])[0].output_ids
            for p in prompts]
