"""The composition root of one mount's core: policy, engine and control, wired once.

:func:`build` is how the daemon (:mod:`dlcachefs.mount.daemon`), the core tests
(:func:`dlcachefs.testing.fakes.run_engine`) and the simulator's engine mode
(:mod:`dlcachefs.sim.engine_replay`) make a mount's core, so that control -> streams ->
engine runs without FUSE exactly as it does mounted:

* the caching policy named by ``cfg.policy``, looked up in the registry
  (:func:`dlcachefs.policies.registry`: built-in and entry-point policies). This module is
  the one place of the core that imports :mod:`dlcachefs.policies` (DESIGN.md's layers:
  the plugins depend on the core's contract, :mod:`dlcachefs.cache.policy`, never the
  reverse); the engine receives a factory of its policy and never names one;
* the :class:`~dlcachefs.cache.engine.Engine` over ``cfg.source`` (or a given source);
* the :class:`~dlcachefs.clairvoyance.control.ControlState` of the control file, bound to
  the engine's streams, losses and sample lists, and attached to the engine.

Nothing here runs: the caller starts the engine (:meth:`Engine.start`, blocking) and runs
its background tasks (:meth:`Engine.run`) in a nursery it owns, or hands both to
:meth:`Session.run`.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import trio

from dlcachefs.cache.engine import Engine
from dlcachefs.cache.namespace import is_dir
from dlcachefs.cache.policy import CachingPolicy, PolicyContext
from dlcachefs.cache.source import Source
from dlcachefs.clairvoyance.control import ControlState
from dlcachefs.config import Config
from dlcachefs.errors import DlcError
from dlcachefs.policies import make_policy, registry

T = TypeVar("T")

#: what the engine takes: its policy, made from the engine's read-only views
PolicyFactory = Callable[[PolicyContext], CachingPolicy]


def policies() -> dict[str, type[CachingPolicy]]:
    """Every registered policy by name (built-in and entry points; see
    :func:`dlcachefs.policies.registry`)."""
    return registry()


def policy_factory(spec: str) -> PolicyFactory:
    """The factory of the policy ``NAME[:key=value,...]`` names. The spec is checked now
    (an unknown name, option or value raises ValueError before anything is opened)."""
    make_policy(spec)  # a throwaway instance: policies are cheap to make and do no I/O

    def make(ctx: PolicyContext) -> CachingPolicy:
        return make_policy(spec, ctx)

    return make


@dataclass
class Session:
    """One mount's core: the engine and the control file's state attached to it."""

    engine: Engine
    control: ControlState

    @property
    def policy(self) -> CachingPolicy:
        """The engine's caching policy (made by :func:`build` from ``cfg.policy``)."""
        return self.engine.policy

    def write(self, data: bytes, pid: int) -> int:
        """One ``write()`` of ``data`` to ``.dlcache/control`` by process ``pid``, as the
        FUSE layer hands it over: applied whole (returns ``len(data)``) or refused whole
        with :class:`~dlcachefs.errors.ControlError` (EINVAL; the reason is kept for
        ``.dlcache/errors``). Trio loop: the streams' tasks start in the engine's nursery."""
        return self.control.apply(data, pid)

    def run(self, body: Callable[[Session], Awaitable[T]]) -> T:
        """Blocking: start the engine (crash recovery, namespace scan), then run
        ``body(self)`` under trio with the engine's background tasks running, then close
        the engine as an unmount does (seal and commit what is pending). For cores
        without a kernel mount (tests, the simulator's engine mode). The index stays
        open (its state can be checked afterwards) until :meth:`close_files`."""
        eng = self.engine
        eng.start()

        async def main() -> T:
            async with trio.open_nursery() as nursery:
                await nursery.start(eng.run)
                result = await body(self)
                await eng.close()  # seals what is pending, as at unmount
                nursery.cancel_scope.cancel()  # the other background tasks, as the daemon
            return result

        return trio.run(main)

    def close_files(self) -> None:
        """Release the engine's descriptors and the index (after :meth:`run`)."""
        self.engine.close_files()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close_files()


def build(cfg: Config, source: Source | None = None) -> Session:
    """The core of a mount of ``cfg``: the policy of ``cfg.policy``, the engine over
    ``source`` (default: ``cfg.source`` on the local filesystem) and the control state,
    wired together. Opens the cache's index and logs; nothing starts yet."""
    factory = policy_factory(cfg.policy)  # a bad --policy fails before the index opens
    engine = Engine(cfg, source, policy=factory)
    return Session(engine, _control(engine))


def _control(engine: Engine) -> ControlState:
    """The :class:`ControlState` of a mount over ``engine``, attached to it (the engine
    reads jobs' datasets from it and notes dropped input in its error log)."""

    def resolve_dir(rel: str) -> int:
        e = engine.ns.resolve(os.fsencode(rel))
        if not is_dir(e):
            raise DlcError("not a directory")
        return e.ino

    control = ControlState(
        resolve_dir, engine.streams.on_stream, dataset_size=engine.streams.dataset_size,
        on_loss=engine.losses.on_loss, on_order=engine.streams.on_order,
        loss_room=engine.losses.room)
    control.on_job_dropped = engine.streams.drop_job
    control.job_reading = engine.streams.job_reading
    engine.losses.attach_control(control)
    return control
