"""Command-line entry points (thin: parse arguments, call the library, print one summary line)."""
