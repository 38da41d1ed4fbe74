"""The operator side, installed as ``deadpool.tools``: the ``deadpool`` command, status, chaos, events, simulate."""
