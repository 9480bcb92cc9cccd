"""kvstore configuration: the sections it reads (shared/sections/), composed once."""

from __future__ import annotations

from shared.config import compose
from shared.sections.kvstore import KvNode, KvTiers
from shared.sections.runtime import COMMON, Drain

KvStoreConfig = compose(
    "KvStoreConfig",
    "flotilla kvstore: the node's KV tiers below the worker's cache (host RAM, disk).",
    (*COMMON, KvNode, KvTiers, Drain), module=__name__)

# cli/stack.py finds a service's config as services.<kind>.config.<Kind>Config
KvstoreConfig = KvStoreConfig
