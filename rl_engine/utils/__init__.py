"""Small shared utilities: argument validation and raw-bit comparison."""
