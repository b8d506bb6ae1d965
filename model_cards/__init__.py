"""Placeholder package; filled by later issues."""
