"""build_engines package."""
