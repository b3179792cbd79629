"""Wiring of one mount's core: the control file's state, bound to the engine's streams,
losses and sample lists. The daemon and the core tests build it the same way, so that
control -> streams -> engine runs without FUSE exactly as it does mounted."""

from __future__ import annotations

import os

from dlcachefs.cache.engine import Engine
from dlcachefs.cache.namespace import is_dir
from dlcachefs.clairvoyance.control import ControlState
from dlcachefs.errors import DlcError


def build_control(engine: Engine) -> ControlState:
    """The :class:`ControlState` of a mount over ``engine``, attached to it (the engine
    reads jobs' datasets from it and notes dropped input in its error log)."""

    def resolve_dir(rel: str) -> int:
        e = engine.ns.resolve(os.fsencode(rel))
        if not is_dir(e):
            raise DlcError("not a directory")
        return e.ino

    control = ControlState(
        resolve_dir, engine.streams.on_stream, dataset_size=engine.dataset_size,
        on_loss=engine.on_loss, on_order=engine.streams.on_order,
        loss_room=engine.early_loss_room)
    engine.attach_control(control)
    return control
