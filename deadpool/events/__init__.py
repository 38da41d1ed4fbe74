"""The events file: the one writer, the catalogue of event names, and the one reader."""
