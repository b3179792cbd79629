"""What runs in the training process: the torch hook (public as :mod:`dlcachefs.torch`),
dataset discovery behind wrappers, and the ``dlcachefs run`` launcher's sitecustomize.
Imports neither trio nor lmdb; torch only when the training imported it."""
