"""iCACHE's importance: per-sample scores from the training's losses, the H-list, and the
packer that builds substitution packages of L-samples."""
