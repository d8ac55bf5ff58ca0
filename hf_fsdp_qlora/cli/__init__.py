"""Command-line entry points: each command is a `Command` (see `_command.py`) in its own module, registered in
`main.py`; heavy imports wait until a command runs."""
