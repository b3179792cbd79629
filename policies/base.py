"""The policy contract, under the name plugins written before the core's subpackages import.

It lives in :mod:`dlcachefs.cache.policy` (the engine calls it); new code imports it
from there or from :mod:`dlcachefs.policies`."""

from dlcachefs.cache.policy import *  # noqa: F403
