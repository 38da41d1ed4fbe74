"""The membership service: its state machine, records, pure decisions, process entry and metrics."""
