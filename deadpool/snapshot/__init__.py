"""One snapshot's bytes: the state tree, the arena and its store, shared-memory slots, ward copies, disk checkpoints."""
