"""The pin limit: at most engine.max_loras - 1 adapters pinned to GPU slots, everywhere.

vLLM serves unpinned adapters from the GPU slots its pins leave, so one slot stays free. The
limit is checked where a pin can be taken: by this replica's engine (`EngineTiers.pin`, under
its lock, so two pins at once cannot both pass), by a registration asking for a pin before it
fetches anything, and by the catalog, which counts every replica's pins (two replicas pinning at
once would each keep their own). All three ask this one object, and refuse in its one message.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from loraplex.adapters_registry.base import AdapterConflict


@dataclass(frozen=True)
class PinLimit:
    most: int  # engine.max_loras - 1

    @classmethod
    def for_max_loras(cls, max_loras: int) -> PinLimit:
        return cls(max(0, max_loras - 1))

    def check(self, name: str, holders: Collection[str], where: str) -> None:
        """Refuse (AdapterConflict, param `pinned`) to pin `name` beside `holders`, the names
        pinned `where` ("on this replica", "in the catalog")."""
        if len(holders) < self.most:
            return
        raise AdapterConflict(
            f"cannot pin `{name}`: {len(holders)} pinned already ("
            f"{', '.join(sorted(holders)) or 'none'} already pinned {where}), the most "
            f"engine.max_loras ({self.most + 1}) allows: one GPU slot stays free for unpinned "
            "adapters",
            param="pinned",
        )
