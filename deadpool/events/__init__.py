"""The events file: its schema (one typed record per event kind), the writer, and the summary readers share."""
