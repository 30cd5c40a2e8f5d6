"""The installed evalgate's version (recorded in every run manifest and server description)."""

__version__ = "0.1.0"
