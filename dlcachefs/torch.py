"""The public import of the torch hook: ``import dlcachefs.torch; dlcachefs.torch.install()``.

The code lives in :mod:`dlcachefs.data.hook`; this name is kept so scripts that import
it keep working. It is the same module object (not a copy), so state set through one name
is seen through the other."""

import sys

from dlcachefs.data import hook as _hook

sys.modules[__name__] = _hook
