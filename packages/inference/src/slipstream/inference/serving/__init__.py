"""Serving: continuous (ragged) batching over a paged KV cache with Dynamic SplitFuse, prefix
caching, a Python pipeline and an OpenAI-compatible HTTP server."""

from __future__ import annotations

from slipstream.inference.serving.config import ServingConfig
from slipstream.inference.serving.deployment import Deployment, RequestStream
from slipstream.inference.serving.engine import RequestOutput, ServingEngine
from slipstream.inference.serving.pipeline import Pipeline, Response, pipeline, serve
from slipstream.inference.serving.request import Request, RequestStatus, SamplingParams
from slipstream.inference.serving.scheduler import Scheduler, SchedulerOutput

__all__ = [
    "Deployment",
    "Pipeline",
    "Request",
    "RequestOutput",
    "RequestStatus",
    "RequestStream",
    "Response",
    "SamplingParams",
    "Scheduler",
    "SchedulerOutput",
    "ServingConfig",
    "ServingEngine",
    "pipeline",
    "serve",
]
