"""Gateway configuration: the sections it reads (shared/sections/), composed once."""

from __future__ import annotations

from shared.config import compose
from shared.sections.gateway import Gateway, Listen, Routing, RoutingPolicy  # noqa: F401
from shared.sections.media import MediaInput
from shared.sections.runtime import COMMON, Drain

GatewayConfig = compose(
    "GatewayConfig", "flotilla gateway: the OpenAI-compatible HTTP API.",
    (*COMMON, Listen, Gateway, Routing, MediaInput, Drain), module=__name__)
