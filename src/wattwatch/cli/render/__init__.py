"""Terminal output for the command line: tables and progress."""
