"""Command-line entry points. Each command is a small module; heavy imports wait until it runs."""
