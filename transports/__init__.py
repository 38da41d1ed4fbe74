"""Transport implementations (installed as ``deadpool.transports``); see ``deadpool/transport.py``."""
