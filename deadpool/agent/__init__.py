"""``deadpool launch``, the per-host agent: its workers, its progress line and the job file operator tools read."""
