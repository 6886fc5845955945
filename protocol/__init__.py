"""The session protocol's decisions, sans I/O (docs/protocol.md): pure transitions that
say what to do next from what was seen, and the effects to perform. Production drives
them and performs their effects (Redis scripts, HTTP calls, slot work); the model checker
(tests/protocol/) runs the very same transitions against a model of everything else and
explores every interleaving of a small world. Nothing here reads a clock, a socket or
Redis: a layer below the fronts and the services, above the wire contract."""
