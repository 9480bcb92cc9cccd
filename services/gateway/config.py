"""Gateway configuration: the sections it reads (shared/sections/), composed once."""

from __future__ import annotations

from shared.config import compose
from shared.sections.gateway import (  # noqa: F401
    Gateway, Listen, ResponseStore, Routing, RoutingPolicy)
from shared.sections.media import MediaInput
from shared.sections.runtime import COMMON, Drain

GatewayConfig = compose(
    "GatewayConfig", "flotilla gateway: the OpenAI-compatible HTTP API.",
    (*COMMON, Listen, Gateway, Routing, ResponseStore, MediaInput, Drain), module=__name__)
