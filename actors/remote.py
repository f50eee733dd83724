"""The one place that wraps the actor classes with ``ray.remote``."""

from __future__ import annotations

import ray

from .attention import AttentionWorker
from .expert import ExpertWorker
from .worker import ColocatedWorker

# `tier`: another node's actor reading this node's KV tier (tier_fetch, actors/tier.py fetch_from) runs beside
# the heartbeats and epoch calls, never holding them up for the length of a long read
RemoteAttention = ray.remote(max_restarts=0, concurrency_groups={"tier": 1})(AttentionWorker)
# `control`: epoch preparation (staging the next slots' weights) runs beside the steps
RemoteExpert = ray.remote(max_restarts=0, concurrency_groups={"control": 1})(ExpertWorker)
# `control`: staging the next epoch's expert shard runs beside the steps; `tier`: as the attention actor's
RemoteWorker = ray.remote(max_restarts=0, concurrency_groups={"control": 1, "tier": 1})(ColocatedWorker)
