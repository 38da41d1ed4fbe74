"""The compute side (``rt.*``): the runtime the user's loop drives, recovery, collectives, ``rt.ddp``, ZeRO."""
