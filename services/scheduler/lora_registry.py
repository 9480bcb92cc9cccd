"""This replica's LoRA adapters by name (docs/lora.md), pure: those of ``--lora-modules``
and those loaded or unloaded at run time. A request names its adapter; the registry gives
its identity (``LoraRef``: path and content hash), which the request keeps until it ends,
so an unload lets requests in flight finish and a reload never mixes versions. A version
unloaded or replaced is retired: once no request uses it, a plan tells the worker to forget
it (its host copy and slot), so adapters cycled at run time hold no memory.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from shared.errors import InvalidRequest, NotFound
from shared.lora_adapters import CONFIG_FILE, BaseShapes, LoraRef, content_hash, inspect_adapter

if TYPE_CHECKING:
    from services.scheduler.request import Request


class LoraRegistry:
    def __init__(self, enabled: bool = False, max_loras: int = 0,
                 modules: list[tuple[str, str]] = ()) -> None:
        """``modules``: (name, path) registered at start. Their files are only hashed
        here: the worker, started with the same list, checks them whole and refuses to
        start on a bad one."""
        self.enabled, self.max_loras = enabled, max_loras if enabled else 0
        self.adapters: dict[str, LoraRef] = {}
        self.retired: dict[str, LoraRef] = {}  # cache_key -> unloaded or replaced version
        for name, path in modules:
            self.adapters[name] = LoraRef(name=name, path=str(path),
                                          content_hash=content_hash(path),
                                          rank=_declared_rank(Path(path)))

    def resolve(self, lora_name: str) -> LoraRef | None:
        """The adapter a request names (None: the base model); NotFound when unknown."""
        if not lora_name:
            return None
        ref = self.adapters.get(lora_name)
        if ref is None:
            raise NotFound(f"The model `{lora_name}` does not exist.", param="model",
                           code="model_not_found")
        return ref

    def check_load(self, name: str, path: str, replace: bool,
                   base: BaseShapes | None) -> LoraRef:
        """The adapter at ``path`` checked whole against ``base`` (reads its files: run it
        off the event loop); InvalidRequest names what is wrong."""
        if not self.enabled:
            raise InvalidRequest("LoRA is not enabled on this server (start it with "
                                 "--enable-lora)", param="lora_name")
        if not name or not path:
            raise InvalidRequest("lora_name and lora_path are required", param="lora_name")
        if name in self.adapters and not replace:
            raise InvalidRequest(f"LoRA adapter {name!r} is registered already (set "
                                 "load_inplace to replace it)", param="lora_name")
        if base is None:
            raise InvalidRequest("the worker does not compute LoRA (it was started without "
                                 "--enable-lora)", param="lora_name")
        try:
            return inspect_adapter(name, path, base)
        except ValueError as exc:
            raise InvalidRequest(str(exc), param="lora_path") from None

    def add(self, ref: LoraRef) -> None:
        replaced = self.adapters.get(ref.name)
        if replaced is not None:
            self.retired[replaced.cache_key] = replaced
        self.retired.pop(ref.cache_key, None)  # (registered again: the worker keeps it)
        self.adapters[ref.name] = ref

    def remove(self, name: str) -> None:
        """Unregister ``name``: new requests for it get 404, those running finish."""
        ref = self.adapters.pop(name, None)
        if ref is None:
            raise NotFound(f"LoRA adapter {name!r} is not registered", param="lora_name",
                           code="model_not_found")
        self.retired[ref.cache_key] = ref

    def retired_unused(self, requests: Iterable[Request]) -> list[str]:
        """The retired versions (``cache_key``) no request uses and none registered is (a
        reload of the same files): the worker may forget them now. Each is given once."""
        if not self.retired:
            return []
        in_use = running_adapters(requests) | {ref.cache_key for ref in self.adapters.values()}
        unused = [key for key in self.retired if key not in in_use]
        for key in unused:
            del self.retired[key]
        return unused

    def refs(self) -> list[LoraRef]:
        return list(self.adapters.values())

    def admits(self, running: Iterable[Request]) -> Callable[[Request], bool]:
        """Whether a waiting request may join ``running``: each step computes every running
        request, so their adapters (two versions of a name count twice) must fit the
        worker's max_loras slots; base requests always may."""
        if not self.enabled:
            return lambda req: True
        in_use = running_adapters(running)
        return lambda req: (req.lora is None or req.lora.cache_key in in_use
                            or len(in_use) < self.max_loras)


def running_adapters(requests: Iterable[Request]) -> set[str]:
    """The adapters (by version: ``LoraRef.cache_key``) these requests use."""
    return {req.lora.cache_key for req in requests if req.lora is not None}


def _declared_rank(path: Path) -> int:
    """adapter_config.json's ``r`` where it reads, else 0 (the worker says what is wrong)."""
    try:
        rank = json.loads((path / CONFIG_FILE).read_text()).get("r", 0)
    except (OSError, ValueError, AttributeError):
        return 0
    return rank if isinstance(rank, int) else 0
