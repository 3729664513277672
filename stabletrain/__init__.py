"""stabletrain."""
