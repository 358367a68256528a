"""What the trainer and the nemesis read of a simulation (so neither imports the runner).

:class:`~chaos_flwr.sim.runner.Simulation` satisfies both protocols.
"""

from __future__ import annotations

from typing import Protocol

from ..charter import Charter
from ..identity import Identity
from ..peer import Peer
from .engine import Engine
from .network import Network

__all__ = ["CrashHook", "NemesisWorld", "World"]


class World(Protocol):
    """The simulation as the training model sees it."""

    @property
    def engine(self) -> Engine: ...
    @property
    def net(self) -> Network: ...
    @property
    def charter(self) -> Charter: ...
    @property
    def founders(self) -> list[str]: ...
    @property
    def identities(self) -> dict[str, Identity]: ...
    @property
    def generation(self) -> dict[str, int]: ...
    @property
    def wants(self) -> set[str]: ...

    def live(self) -> list[str]:
        """Parties whose peer runs now."""
        ...

    def kill(self, pid: str, down_s: float, *, disk: bool) -> None:
        """Crash ``pid`` and restart it ``down_s`` later."""
        ...


class CrashHook(Protocol):
    """The training model's part in a crash."""

    def on_crash(self, pid: str) -> None:
        """``pid`` crashed."""
        ...


class NemesisWorld(Protocol):
    """The simulation as the nemesis sees it."""

    @property
    def engine(self) -> Engine: ...
    @property
    def net(self) -> Network: ...
    @property
    def identities(self) -> dict[str, Identity]: ...
    @property
    def generation(self) -> dict[str, int]: ...
    @property
    def peers(self) -> dict[str, Peer]: ...
    @property
    def pids(self) -> list[str]: ...
    @property
    def last_delivered(self) -> dict[str, bytes]: ...
    @property
    def trainer(self) -> CrashHook | None: ...

    def live(self) -> list[str]:
        """Parties whose peer runs now."""
        ...

    def restart_peer(self, pid: str, *, disk: bool) -> None:
        """Run a new peer for ``pid`` (with its records when ``disk``)."""
        ...
