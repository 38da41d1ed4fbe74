"""The seat's process groups: the communicators each view builds, torch's default group and the script's
own groups on them, the collectives of a step, and the waits that a Prepare can cut short."""
