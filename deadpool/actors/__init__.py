"""The runtime thread: an asyncio loop whose actors (heartbeat, membership, snapshots) meet compute at the handoff."""
