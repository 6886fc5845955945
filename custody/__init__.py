"""custody: stateful streaming sessions on hybrid Mamba/attention models, with device
state slots that are never lost, never double-freed and always visible."""
