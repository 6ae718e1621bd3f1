"""Continuous batching: an engine step over many requests that join and leave between rounds."""
