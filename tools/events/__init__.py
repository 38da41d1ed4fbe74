"""``deadpool events FILE``: an events file read back as a plain-text timeline (``text``) and a plot (``plot``)."""
