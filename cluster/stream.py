"""The seam between the front end and the engine (SGLang's ``io_struct``): what goes in, one
:class:`EngineRequest` per sequence, and what comes out, one :class:`StreamChunk` per sequence and
step. Token ids both ways; text never crosses into the engine (the Ingress's output processor,
deploy/output.py, makes it).

Owns: the two records. Never: behaviour.
"""

from __future__ import annotations

from dataclasses import dataclass

from actors.messages import SampledToken
from model.sampling import SamplingParams


@dataclass(frozen=True)
class EngineRequest:
    """One sequence to generate (a choice of a prompt): created by the front end (the Ingress, from an
    API request, or an offline caller), checked once (:meth:`~cluster.engine.Engine.validate`),
    admitted by the engine thread."""

    prompt_ids: tuple[int, ...]
    params: SamplingParams  # the actors sample with it; the scheduler stops at its limits
    cache_salt: str | None = None  # its cached blocks are shared only with requests of the same salt
    replica: int | None = None  # admitted on this attention replica (prefill/decode disaggregation sent its blocks there)


@dataclass(frozen=True)
class StreamChunk:
    """Engine → front end, one sequence after a step: its new token ids, their
    :class:`~actors.messages.SampledToken` s (logprobs), and the finish reason at the end (``stop``:
    the last id is a stop token; ``abort`` for a sequence aborted alone). Made by the engine
    (:meth:`~cluster.engine.Engine.pipelined`), carried to the sequence's stream by the async engine."""

    token_ids: tuple[int, ...]
    finish_reason: str | None
    sampled: tuple[SampledToken, ...] = ()
    cached_tokens: int = 0  # of the prompt, found in the prefix cache (OpenAI's usage.prompt_tokens_details)
    seq_id: int = -1  # the engine's sequence (-1: a chunk made outside the engine, e.g. a test's)
