"""The one place that wraps the actor classes with ``ray.remote``."""

from __future__ import annotations

import ray

from .attention import AttentionWorker
from .expert import ExpertWorker
from .worker import ColocatedWorker

RemoteAttention = ray.remote(max_restarts=0)(AttentionWorker)
# `control`: epoch preparation (staging the next slots' weights) runs beside the steps
RemoteExpert = ray.remote(max_restarts=0, concurrency_groups={"control": 1})(ExpertWorker)
# `control`: staging the next epoch's expert shard runs beside the steps
RemoteWorker = ray.remote(max_restarts=0, concurrency_groups={"control": 1})(ColocatedWorker)
