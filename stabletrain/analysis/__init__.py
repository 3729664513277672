"""Offline analysis of run directories: figures, sweep tables, run comparison; reads files only."""
