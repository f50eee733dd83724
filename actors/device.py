"""Which device an actor computes on: the GPUs Ray assigned it, never torch's own view.

On a GPU node an actor that reserved no GPU sees ``CUDA_VISIBLE_DEVICES`` unset, i.e. every GPU,
so ``torch.cuda.is_available()`` says nothing about what the actor may use. Ray sets
``CUDA_VISIBLE_DEVICES`` of an actor that reserved GPUs to exactly its assigned ids (a
fractional reservation shares one id), so the actor's first visible device is its own.
Never: picks a GPU Ray did not assign, or falls back to the CPU when one was assigned.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


class DeviceError(RuntimeError):
    """An actor was assigned GPUs it cannot use."""


@dataclass(frozen=True)
class Placement:
    """The device an actor chose and the Ray assignment it followed."""

    actor: str
    node: str
    gpu_ids: tuple[str, ...]
    device: str


def _ray_assignment() -> tuple[tuple[str, ...], str]:
    try:
        import ray
    except ImportError:  # a worker in a process without Ray (the in-process executor): no GPUs assigned
        return (), "this process (no Ray)"
    if not ray.is_initialized():  # a worker built outside Ray (a benchmark): no GPUs assigned, and no
        return (), "this process (no Ray)"  # local Ray instance started just to ask
    ctx = ray.get_runtime_context()
    ids = tuple(str(i) for i in ctx.get_accelerator_ids().get("GPU", []))
    return ids, f"{ray.util.get_node_ip_address()} ({ctx.get_node_id()[:12]})"


def choose_device(actor: str, *, gpu_ids: Sequence[str] | None = None, node: str = "?",
                  cuda_available: Callable[[], bool] = torch.cuda.is_available) -> Placement:
    """CPU when the actor has no GPUs; ``cuda:0`` (its first assigned GPU, as Ray makes it visible)
    when it has; :class:`DeviceError` naming the actor and node when it has GPUs but torch has no
    CUDA. ``gpu_ids`` None asks Ray (inside an actor)."""
    if gpu_ids is None:
        gpu_ids, node = _ray_assignment()
    ids = tuple(str(i) for i in gpu_ids)
    if not ids:
        return Placement(actor, node, ids, "cpu")
    if not cuda_available():
        raise DeviceError(
            f"{actor} on node {node}: Ray assigned it GPU(s) {', '.join(ids)} but this torch has no CUDA "
            f"(torch {torch.__version__}, built for CUDA {torch.version.cuda}); install a CUDA build of torch "
            "on that node, or serve on CPUs with gpus_per_actor 0")
    return Placement(actor, node, ids, "cuda:0")
