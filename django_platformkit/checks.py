"""System checks (placeholder until the checks work lands)."""
