"""Transport implementations (installed as ``deadpool.transports``); see ``deadpool/protocol/transport.py``."""
