"""Canonical numerics: DeepSeek-V4's forward pass computed so that a row's bits do not depend on its batch."""
