"""What crosses a process boundary: the view, the wire messages, the codec and the transport interface."""
